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
	"testing"

	"github.com/mpnbd/mpnbd/internal/testenv/pki"
)

// TestServerTLS: a server of ServerTLS with client CAs serves a client
// certificate of those CAs, ECDSA or RSA, over TLS 1.2 and 1.3, and
// refuses one of another CA, one for server authentication only and
// none; its CertificateRequest names no CA.
func TestServerTLS(t *testing.T) {
	ec, err := pki.New()
	if err != nil {
		t.Fatal(err)
	}
	rsa, err := pki.NewWith(pki.Options{ClientKey: pki.RSA2048})
	if err != nil {
		t.Fatal(err)
	}
	other, err := pki.New()
	if err != nil {
		t.Fatal(err)
	}
	cas := x509.NewCertPool()
	cas.AddCert(ec.CA)
	cas.AddCert(rsa.CA)
	s := newTestServer(t, &Export{Name: "disk", Backend: NewMemBackend(1 << 20)})
	s.TLSConfig, s.TLSRequired = ServerTLS(ec.Server.Certificates[0], cas), true
	addr := tcpServer(t, s)

	// asking is cfg at exactly version, presenting cert when asked and
	// counting in named the CAs the server's request names.
	var named int
	asking := func(cfg *tls.Config, version uint16, cert tls.Certificate) *tls.Config {
		cfg = cfg.Clone()
		cfg.RootCAs = ec.Client.RootCAs
		cfg.MinVersion, cfg.MaxVersion = version, version
		cfg.Certificates = nil
		cfg.GetClientCertificate = func(req *tls.CertificateRequestInfo) (*tls.Certificate, error) {
			named += len(req.AcceptableCAs)
			return &cert, nil
		}
		return cfg
	}
	for _, v := range []uint16{tls.VersionTLS12, tls.VersionTLS13} {
		for _, p := range []*pki.PKI{ec, rsa} {
			tc, err := rawTLS(t, addr, asking(p.Client, v, p.Client.Certificates[0]))
			if err == nil {
				// A TLS 1.3 client is done before the server has checked its
				// certificate: an option answered shows the server took it.
				_, err = rawOption(tc, OptList)
			}
			if err != nil {
				t.Errorf("%s, client key %T: %v", tls.VersionName(v), p.Client.Certificates[0].PrivateKey, err)
			}
		}
		for name, cert := range map[string]tls.Certificate{
			"another CA's client":  other.Client.Certificates[0],
			"a server certificate": ec.Server.Certificates[0],
			"no certificate":       {},
		} {
			tc, err := rawTLS(t, addr, asking(ec.Client, v, cert))
			if err == nil {
				_, err = rawOption(tc, OptList)
			}
			if err == nil {
				t.Errorf("%s: %s was served", tls.VersionName(v), name)
			}
		}
	}
	if named != 0 {
		t.Errorf("the CertificateRequests named %d CAs, want none", named)
	}
}
