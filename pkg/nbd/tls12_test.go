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
	"errors"
	"net"
	"slices"
	"sync"
	"testing"

	"github.com/mpnbd/mpnbd/internal/testenv/pki"
)

// TestStartTLS12: a client that speaks at most TLS 1.2 (as the NBD
// protocol requires every TLS implementation to accept) upgrades, reads
// and writes; the server sees TLS 1.2 with a forward-secret AEAD suite.
func TestStartTLS12(t *testing.T) {
	p := newTestPKI(t)
	s := newTestServer(t, &Export{Name: "disk", Backend: NewMemBackend(8 << 20)})
	s.TLSConfig, s.TLSRequired = p.server, true
	var mu sync.Mutex
	var seen []tls.ConnectionState
	s.Authorize = func(c ConnInfo, export string) error {
		mu.Lock()
		defer mu.Unlock()
		if c.TLS == nil {
			return errors.New("no TLS")
		}
		seen = append(seen, *c.TLS)
		return nil
	}
	addr := tcpServer(t, s)

	old := p.client.Clone()
	old.MaxVersion = tls.VersionTLS12
	cl, err := dialTLS(t, addr, "disk", old)
	if err != nil {
		t.Fatalf("dial with TLS 1.2 at most: %v", err)
	}
	roundTripTLS(t, cl, "TLS 1.2")
	mu.Lock()
	defer mu.Unlock()
	if len(seen) != 2 {
		t.Fatalf("the server saw %d TLS connections, want 2", len(seen))
	}
	for _, cs := range seen {
		if cs.Version != tls.VersionTLS12 || !forwardSecretAEAD(cs.CipherSuite) {
			t.Errorf("the server negotiated %s with %s, want TLS 1.2 with an ECDHE AEAD suite",
				tls.VersionName(cs.Version), tls.CipherSuiteName(cs.CipherSuite))
		}
		if len(cs.PeerCertificates) == 0 || cs.PeerCertificates[0].Subject.CommonName != "client" {
			t.Errorf("the server saw no client certificate over TLS 1.2")
		}
	}
}

// TestStartTLS12Suites: under TLS 1.2 the server agrees only to ECDHE key
// exchange with AES-GCM or ChaCha20-Poly1305, for an ECDSA and an RSA
// server key alike: a client that offers nothing else (CBC suites, RSA
// key exchange) is refused in the handshake, one that offers one of them
// gets exactly that one. TLS 1.3 stays the default.
func TestStartTLS12Suites(t *testing.T) {
	for _, kt := range []struct {
		name           string
		key            pki.KeyType
		accept, refuse []uint16
	}{
		{"ecdsa", pki.ECDSAP256,
			[]uint16{tls.TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256, tls.TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
				tls.TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256},
			[]uint16{tls.TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA, tls.TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA,
				tls.TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA256}},
		{"rsa", pki.RSA2048,
			[]uint16{tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, tls.TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
				tls.TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256},
			[]uint16{tls.TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA, tls.TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA,
				tls.TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA256,
				tls.TLS_RSA_WITH_AES_128_GCM_SHA256, tls.TLS_RSA_WITH_AES_256_GCM_SHA384,
				tls.TLS_RSA_WITH_AES_128_CBC_SHA, tls.TLS_RSA_WITH_AES_256_CBC_SHA}},
	} {
		t.Run(kt.name, func(t *testing.T) {
			p, err := pki.NewWith(pki.Options{ServerKey: kt.key})
			if err != nil {
				t.Fatal(err)
			}
			s := newTestServer(t, &Export{Name: "disk", Backend: NewMemBackend(1 << 20)})
			s.TLSConfig, s.TLSRequired = p.Server, true
			addr := tcpServer(t, s)

			for _, id := range kt.accept {
				tc, err := rawTLS(t, addr, p.Client, id)
				cs := tc.ConnectionState()
				if err != nil {
					t.Errorf("TLS 1.2 with %s: %v", tls.CipherSuiteName(id), err)
					continue
				}
				if cs.Version != tls.VersionTLS12 || cs.CipherSuite != id {
					t.Errorf("offering only %s got %s with %s", tls.CipherSuiteName(id),
						tls.VersionName(cs.Version), tls.CipherSuiteName(cs.CipherSuite))
				}
			}
			for _, id := range kt.refuse {
				if tc, err := rawTLS(t, addr, p.Client, id); err == nil {
					t.Errorf("a TLS 1.2 client offering only %s was served (%s)", tls.CipherSuiteName(id), tls.CipherSuiteName(tc.ConnectionState().CipherSuite))
				}
			}
			tc, err := rawTLS(t, addr, p.Client)
			if v := tc.ConnectionState().Version; err != nil || v != tls.VersionTLS13 {
				t.Errorf("a default client: %s, %v; want TLS 1.3", tls.VersionName(v), err)
			}
		})
	}
}

// rawTLS upgrades a new connection to addr with STARTTLS and runs a
// handshake of cfg as is (not through this package's client, which would
// drop the suites it does not offer itself): with suites given, TLS 1.2
// offering only those.
func rawTLS(t *testing.T, addr string, cfg *tls.Config, suites ...uint16) (*tls.Conn, error) {
	t.Helper()
	c := greeted(t, addr)
	o := option{Code: OptStartTLS}
	if _, err := c.Write(o.encode()); err != nil {
		t.Fatal(err)
	}
	if r, err := readOptReply(c); err != nil || r.Type != RepAck {
		t.Fatalf("STARTTLS reply %+v, %v", r, err)
	}
	cfg = cfg.Clone()
	if len(suites) > 0 {
		cfg.MaxVersion, cfg.CipherSuites = tls.VersionTLS12, suites
	}
	tc := tls.Client(c, cfg)
	return tc, tc.Handshake()
}

// rawOption sends option code with no data on c and reads the first
// reply.
func rawOption(c net.Conn, code uint32) (optReply, error) {
	if _, err := c.Write((&option{Code: code}).encode()); err != nil {
		return optReply{}, err
	}
	return readOptReply(c)
}

// forwardSecretAEAD reports whether id is an ECDHE suite with AES-GCM or
// ChaCha20-Poly1305 (the TLS 1.3 suites all are).
func forwardSecretAEAD(id uint16) bool {
	switch id {
	case tls.TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256, tls.TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
		tls.TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
		tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, tls.TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
		tls.TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
		tls.TLS_AES_128_GCM_SHA256, tls.TLS_AES_256_GCM_SHA384, tls.TLS_CHACHA20_POLY1305_SHA256:
		return true
	}
	return false
}

// TestTLSConfig: what the package makes of a caller's configuration,
// without changing the caller's.
func TestTLSConfig(t *testing.T) {
	cbc := tls.TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA
	gcm := tls.TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
	for _, tc := range []struct {
		name       string
		in         *tls.Config
		wantMin    uint16
		wantSuites []uint16
	}{
		{"defaults", &tls.Config{}, tls.VersionTLS12, tls12Suites},
		{"1.0 floor raised", &tls.Config{MinVersion: tls.VersionTLS10}, tls.VersionTLS12, tls12Suites},
		{"1.3 floor kept", &tls.Config{MinVersion: tls.VersionTLS13}, tls.VersionTLS13, tls12Suites},
		{"CBC dropped", &tls.Config{CipherSuites: []uint16{cbc, gcm}}, tls.VersionTLS12, []uint16{gcm}},
		{"nothing left", &tls.Config{CipherSuites: []uint16{cbc}}, tls.VersionTLS12, []uint16{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := tc.in.Clone()
			got := tlsConfig(in)
			if got.MinVersion != tc.wantMin || !slices.Equal(got.CipherSuites, tc.wantSuites) || !got.DynamicRecordSizingDisabled {
				t.Errorf("min %s, suites %v, dynamic records disabled %v; want %s, %v, true",
					tls.VersionName(got.MinVersion), got.CipherSuites, got.DynamicRecordSizingDisabled,
					tls.VersionName(tc.wantMin), tc.wantSuites)
			}
			if got.CipherSuites == nil {
				t.Error("no suite list: crypto/tls would take its defaults, CBC suites among them")
			}
			if in.MinVersion != tc.in.MinVersion || !slices.Equal(in.CipherSuites, tc.in.CipherSuites) || in.DynamicRecordSizingDisabled {
				t.Error("the caller's configuration was changed")
			}
			if again := tlsConfig(got); again != got {
				t.Error("a configuration already in shape was cloned again")
			}
		})
	}
}
