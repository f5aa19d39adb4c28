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

package interop

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/mpnbd/mpnbd/internal/testenv/pki"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// gnutlsMaxTLS12 is the environment under which GnuTLS peers (libnbd's
// tools, qemu) speak TLS 1.2 at most: a system priority file whose
// overrides disable TLS 1.3, which GnuTLS 3.6 and later (Debian 12 has
// 3.7) read from GNUTLS_SYSTEM_PRIORITY_FILE before any priority string,
// so that it holds whatever the tool asks for; an entry it does not
// understand is fatal instead of ignored.
func gnutlsMaxTLS12(t *testing.T) []string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "gnutls.config")
	if err := os.WriteFile(path, []byte("[overrides]\ndisabled-version = TLS1.3\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return []string{"GNUTLS_SYSTEM_PRIORITY_FILE=" + path, "GNUTLS_SYSTEM_PRIORITY_FAIL_ON_INVALID=1"}
}

// TestServerTLS12Interop: libnbd's tools (GnuTLS) against our server
// configured as the standalone server is with --tls require and --tls-ca
// (nbd.ServerTLS): over TLS 1.2 forced on the client with an ECDSA and an
// RSA client key, and over TLS 1.3 with an RSA client key (which a GnuTLS
// client before 3.8.13 withholds from a server naming its CAs), data both
// ways byte for byte; the server sees the version, a forward-secret AEAD
// suite and the client's certificate.
func TestServerTLS12Interop(t *testing.T) {
	needTools(t, "nbdinfo", "nbdcopy")
	for _, c := range []struct {
		name    string
		key     pki.KeyType
		version uint16
	}{
		{"tls1.2-ecdsa", pki.ECDSAP256, tls.VersionTLS12},
		{"tls1.2-rsa", pki.RSA2048, tls.VersionTLS12},
		{"tls1.3-rsa", pki.RSA2048, tls.VersionTLS13},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			p, err := pki.NewWith(pki.Options{ClientKey: c.key})
			if err != nil {
				t.Fatal(err)
			}
			if err := p.WriteDir(dir); err != nil {
				t.Fatal(err)
			}
			cas := x509.NewCertPool()
			cas.AddCert(p.CA)
			const size = 4 << 20
			data := randomBytes(43, size)
			ts := startServer(t, serverOptions{TLS: nbd.ServerTLS(p.Server.Certificates[0], cas), TLSRequired: true},
				exportSpec{Name: "disk", Size: size, Fill: data}, exportSpec{Name: "target", Size: size})
			nbds := func(export string) string {
				return "nbds://" + ts.Addr + "/" + export + "?tls-certificates=" + dir
			}
			var env []string
			if c.version == tls.VersionTLS12 {
				env = gnutlsMaxTLS12(t)
			}
			run := func(name string, args ...string) string {
				t.Helper()
				r := runCmdEnv(t, env, name, args...)
				if r.Err != nil || r.ExitCode != 0 || r.Stderr != "" {
					t.Fatalf("%s failed (exit %d): %v\nstderr:\n%s", name, r.ExitCode, r.Err, r.Stderr)
				}
				return r.Stdout
			}

			var info nbdinfoOutput
			if err := json.Unmarshal([]byte(run("nbdinfo", "--json", nbds("disk"))), &info); err != nil {
				t.Fatal(err)
			}
			if info.TLS == nil || !*info.TLS || len(info.Exports) != 1 || info.Exports[0].Size == nil || *info.Exports[0].Size != size {
				t.Fatalf("nbdinfo over TLS: %+v", info)
			}
			out := filepath.Join(t.TempDir(), "out.img")
			run("nbdcopy", nbds("disk"), out)
			if got := readFile(t, out); sum(got) != sum(data) {
				t.Fatalf("nbdcopy from nbds:// read other data: %s", firstDiff(got, data))
			}
			run("nbdcopy", out, nbds("target"))
			if got := readFile(t, ts.Paths["target"]); sum(got) != sum(data) {
				t.Fatalf("nbdcopy to nbds:// wrote other data: %s", firstDiff(got, data))
			}

			states := ts.tlsStates()
			if len(states) < 3 {
				t.Fatalf("the server saw %d TLS connections ask for an export, want 3 or more", len(states))
			}
			for _, cs := range states {
				if cs.Version != c.version || !forwardSecretAEAD(cs.CipherSuite) {
					t.Errorf("negotiated %s with %s, want %s with an ECDHE AEAD suite", tls.VersionName(cs.Version),
						tls.CipherSuiteName(cs.CipherSuite), tls.VersionName(c.version))
				}
				if len(cs.PeerCertificates) == 0 || cs.PeerCertificates[0].Subject.CommonName != "client" {
					t.Error("the client's certificate did not reach the server")
				}
			}
		})
	}
}

// forwardSecretAEAD reports whether id is an ECDHE suite with AES-GCM or
// ChaCha20-Poly1305, or a TLS 1.3 suite (all are).
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
