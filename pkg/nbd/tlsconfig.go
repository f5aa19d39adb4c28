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

package nbd

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
)

// ServerTLS is the TLS configuration of a server presenting cert that,
// with clientCAs, requires every client to present a certificate for
// client authentication issued by one of them (without, asks for none).
//
// The check is made in VerifyConnection, on every handshake (resumed
// ones too), instead of by ClientCAs, so that the CertificateRequest
// names no CA: a GnuTLS client before 3.8.13 asked under TLS 1.3 for a
// certificate of named CAs keeps only a certificate whose key type is
// among the request's signature algorithms, counts rsa_pss_rsae_* (all
// crypto/tls offers for RSA under 1.3) as RSA-PSS, not RSA, and so sends
// no certificate with an RSA key. Asked without names, a client holding
// one certificate (libnbd, qemu) sends it whatever its key.
func ServerTLS(cert tls.Certificate, clientCAs *x509.CertPool) *tls.Config {
	cfg := &tls.Config{Certificates: []tls.Certificate{cert}}
	if clientCAs == nil {
		return cfg
	}
	cfg.ClientAuth = tls.RequireAnyClientCert
	cfg.VerifyConnection = func(cs tls.ConnectionState) error {
		return verifyClientChain(clientCAs, cs.PeerCertificates)
	}
	return cfg
}

// errNoClientCert is a handshake without a client certificate where one
// is required (crypto/tls refuses it first under RequireAnyClientCert).
var errNoClientCert = errors.New("nbd: no client certificate")

// verifyClientChain checks what crypto/tls would with ClientCAs and
// RequireAndVerifyClientCert: chain[0] chains to roots through the rest
// of chain and may authenticate clients.
func verifyClientChain(roots *x509.CertPool, chain []*x509.Certificate) error {
	if len(chain) == 0 {
		return errNoClientCert
	}
	inter := x509.NewCertPool()
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	_, err := chain[0].Verify(x509.VerifyOptions{
		Roots: roots, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	})
	if err != nil {
		return fmt.Errorf("nbd: the client's certificate: %w", err)
	}
	return nil
}
