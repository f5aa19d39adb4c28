// Copyright 2026 The mpnbd Authors.
//
// Licensed under the Apache License, Version 2.0 (the "License");
// you may not use this file except in compliance with the License.
// You may obtain a copy of the License at
//
//     http://www.apache.org/licenses/LICENSE-2.0
//
// Unless required by applicable law or agreed to in writing, software
// distributed under the License is distributed on an "AS IS" BASIS,
// WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
// See the License for the specific language governing permissions and
// limitations under the License.

// Package pki makes the certificates of TLS tests and benchmarks: a CA, a
// server certificate for localhost and 127.0.0.1, and a client
// certificate, as Go TLS configurations and, for peers built on GnuTLS
// (libnbd's tls-certificates, qemu's tls-creds-x509), as a directory of
// PEM files.
package pki

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// PKI is a CA with one server and one client certificate.
type PKI struct {
	// Server requires and checks a client certificate of the CA;
	// Client trusts the CA, presents the client certificate and expects
	// the server name "localhost" (the certificate holds 127.0.0.1 too).
	Server, Client *tls.Config
	// CA is the CA's certificate.
	CA *x509.Certificate

	pem map[string][]byte // file name -> PEM
}

// The files WriteDir writes, in GnuTLS's layout.
const (
	CACert     = "ca-cert.pem"
	ServerCert = "server-cert.pem"
	ServerKey  = "server-key.pem"
	ClientCert = "client-cert.pem"
	ClientKey  = "client-key.pem"
)

// KeyType is the kind of key a certificate of NewWith is made for. Peers
// differ in which they can use (a GnuTLS client before 3.8.13 presents no
// RSA certificate under TLS 1.3 to a server that names its CAs), so TLS
// tests need both.
type KeyType int

const (
	// ECDSAP256 is an ECDSA key on P-256, the default.
	ECDSAP256 KeyType = iota
	// RSA2048 is a 2048-bit RSA key.
	RSA2048
)

func (k KeyType) generate() (crypto.Signer, error) {
	switch k {
	case ECDSAP256:
		return ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	case RSA2048:
		return rsa.GenerateKey(rand.Reader, 2048)
	}
	return nil, fmt.Errorf("pki: unknown key type %d", k)
}

// Options shape the certificates of NewWith.
type Options struct {
	// Hosts are names the server certificate holds besides localhost,
	// 127.0.0.1 and ::1 (IP addresses or DNS names).
	Hosts []string
	// ServerKey and ClientKey are the leaf certificates' key types (the
	// CA's key is ECDSA P-256 either way).
	ServerKey, ClientKey KeyType
}

// New makes a CA and its two certificates (ECDSA P-256), valid from an
// hour ago for a day. The server certificate names localhost, 127.0.0.1,
// ::1 and hosts (IP addresses or DNS names).
func New(hosts ...string) (*PKI, error) {
	return NewWith(Options{Hosts: hosts})
}

// NewWith is New with the leaf certificates' key types chosen.
func NewWith(o Options) (*PKI, error) {
	p := &PKI{pem: map[string][]byte{}}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "mpnbd test CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, err
	}
	if p.CA, err = x509.ParseCertificate(caDER); err != nil {
		return nil, err
	}
	p.pem[CACert] = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER})
	leaf := func(serial int64, cn string, kt KeyType, usage x509.ExtKeyUsage, certFile, keyFile string) (tls.Certificate, error) {
		key, err := kt.generate()
		if err != nil {
			return tls.Certificate{}, err
		}
		tmpl := &x509.Certificate{
			SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: cn},
			NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
			KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
			ExtKeyUsage: []x509.ExtKeyUsage{usage},
			DNSNames:    []string{"localhost"}, IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
		}
		for _, h := range o.Hosts {
			if ip := net.ParseIP(h); ip != nil {
				tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
			} else {
				tmpl.DNSNames = append(tmpl.DNSNames, h)
			}
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, p.CA, key.Public(), caKey)
		if err != nil {
			return tls.Certificate{}, err
		}
		pk, err := x509.MarshalPKCS8PrivateKey(key)
		if err != nil {
			return tls.Certificate{}, err
		}
		p.pem[certFile] = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
		p.pem[keyFile] = pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: pk})
		return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, nil
	}
	server, err := leaf(2, "server", o.ServerKey, x509.ExtKeyUsageServerAuth, ServerCert, ServerKey)
	if err != nil {
		return nil, err
	}
	client, err := leaf(3, "client", o.ClientKey, x509.ExtKeyUsageClientAuth, ClientCert, ClientKey)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	pool.AddCert(p.CA)
	p.Server = &tls.Config{Certificates: []tls.Certificate{server}, ClientCAs: pool, ClientAuth: tls.RequireAndVerifyClientCert}
	p.Client = &tls.Config{Certificates: []tls.Certificate{client}, RootCAs: pool, ServerName: "localhost"}
	return p, nil
}

// WriteDir writes the CA certificate, both certificates and their keys
// into dir under GnuTLS's names.
func (p *PKI) WriteDir(dir string) error {
	for name, b := range p.pem {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			return fmt.Errorf("pki: %w", err)
		}
	}
	return nil
}

// WriteCAOnly writes only the CA certificate into dir: a client that
// trusts the server but has no certificate of its own.
func (p *PKI) WriteCAOnly(dir string) error {
	if err := os.WriteFile(filepath.Join(dir, CACert), p.pem[CACert], 0o600); err != nil {
		return fmt.Errorf("pki: %w", err)
	}
	return nil
}

// LoadClientDir reads a GnuTLS-style directory as a client would: the CA
// certificate to trust, and the client certificate and key when present.
func LoadClientDir(dir, serverName string) (*tls.Config, error) {
	ca, err := os.ReadFile(filepath.Join(dir, CACert))
	if err != nil {
		return nil, fmt.Errorf("pki: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		return nil, fmt.Errorf("pki: %s: no PEM certificate", filepath.Join(dir, CACert))
	}
	cfg := &tls.Config{RootCAs: pool, ServerName: serverName}
	cert, err := tls.LoadX509KeyPair(filepath.Join(dir, ClientCert), filepath.Join(dir, ClientKey))
	switch {
	case err == nil:
		cfg.Certificates = []tls.Certificate{cert}
	case !os.IsNotExist(err):
		return nil, fmt.Errorf("pki: client certificate: %w", err)
	}
	return cfg, nil
}
