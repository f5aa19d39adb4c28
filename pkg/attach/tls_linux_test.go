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

package attach

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/pki"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
	"github.com/mpnbd/mpnbd/pkg/nodeid"
)

// issuePEM is a certificate of kind k for node from ca, with its key, in
// PEM (as nodeid.Identity keeps it).
func issuePEM(t *testing.T, ca *nodeid.CA, k nodeid.Kind, node string) []byte {
	t.Helper()
	b, err := pki.NodeIDPEM(ca, k, node)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestSessionOverTLS runs a volume's session over TLS with the node's
// certificate read from its identity directory: I/O works, the session
// redials over TLS when the server drops it, a renewed certificate is
// used from the next connection on with no I/O error, and a server that
// is not the storage node named, or no certificate, fails the attach.
func TestSessionOverTLS(t *testing.T) {
	ca, err := nodeid.NewCA(time.Now())
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca.Cert)
	serverPair := issuePEM(t, ca, nodeid.Storage, "store-1")
	serverCert, err := tls.X509KeyPair(serverPair, serverPair)
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(t.Output(), nil))
	srv := &nbd.Server{
		Logger:      log,
		TLSConfig:   nodeid.ServerTLS(func() (*tls.Certificate, error) { return &serverCert, nil }, func() *x509.CertPool { return roots }),
		TLSRequired: true,
	}
	backend := nbd.NewMemBackend(1 << 20)
	if err := srv.AddExport(&nbd.Export{Name: "vol", Backend: backend, RequireTLS: true}); err != nil {
		t.Fatal(err)
	}
	l, err := mptcp.Listen(context.Background(), "tcp", "127.0.0.1:0", mptcp.Available() == nil)
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
	})

	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "node.pem"), issuePEM(t, ca, nodeid.Node, "node-a"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, nodeid.BundleFile), ca.PEM, 0o644); err != nil {
		t.Fatal(err)
	}
	target := func(storageNode, identityDir string) Target {
		return Target{VolumeID: "vol-1", Export: "vol", Addrs: []string{l.Addr().String()},
			TLS: &TargetTLS{StorageNode: storageNode, IdentityDir: identityDir}}
	}
	open := func(tg Target) (*Session, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		return OpenSession(ctx, SessionConfig{Logger: log}, tg, Options{})
	}

	s, err := open(target("store-1", dir))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close(5 * time.Second)
	// conns counts the server's connections to the export, and those
	// that run TLS (a match that closes none).
	var tlsConns int
	conns := func() int {
		n := 0
		tlsConns = 0
		_, _ = srv.CloseConns(context.Background(), "vol", func(c nbd.ConnInfo) bool {
			n++
			if c.TLS != nil {
				tlsConns++
			}
			return false
		})
		return n
	}
	// The client is done negotiating once the server's last reply is
	// sent, a moment before the server files the connection under the
	// export.
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		n := conns()
		if n == 1 && tlsConns == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the server sees %d connections, %d of them TLS, 5 s after the session opened; want 1, 1", n, tlsConns)
		}
	}
	data := bytes.Repeat([]byte("over tls "), 7282)[:64<<10]
	if _, err := s.Client.WriteAt(data, 4096); err != nil {
		t.Fatal(err)
	}
	if err := s.Client.Flush(); err != nil {
		t.Fatal(err)
	}
	// The server drops the connection; the session redials, over TLS.
	if n, err := srv.CloseConns(context.Background(), "vol", func(nbd.ConnInfo) bool { return true }); n != 1 || err != nil {
		t.Fatalf("closing the server's connection: %d, %v", n, err)
	}
	more := bytes.Repeat([]byte("again "), 2000)
	if _, err := s.Client.WriteAt(more, 1<<19); err != nil {
		t.Fatalf("write after the server dropped the connection: %v", err)
	}
	got := make([]byte, len(data))
	if _, err := s.Client.ReadAt(got, 4096); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read back: %v (equal %v)", err, bytes.Equal(got, data))
	}
	if err := s.Client.Flush(); err != nil {
		t.Fatal(err)
	}
	stored := make([]byte, len(more))
	if _, err := backend.ReadAt(stored, 1<<19); err != nil || !bytes.Equal(stored, more) {
		t.Fatalf("the server's copy after the redial: %v (equal %v)", err, bytes.Equal(stored, more))
	}
	if n := conns(); n != 1 || tlsConns != 1 {
		t.Fatalf("after the redial the server sees %d connections, %d of them TLS; want 1, 1", n, tlsConns)
	}

	// The node's certificate is renewed (the file replaced, as the node
	// plugin does) while the session runs: the open connection goes on,
	// and the next one presents the new certificate; no I/O fails.
	serial := func() string {
		var sn string
		_, _ = srv.CloseConns(context.Background(), "vol", func(c nbd.ConnInfo) bool {
			if c.TLS != nil && len(c.TLS.PeerCertificates) > 0 {
				sn = c.TLS.PeerCertificates[0].SerialNumber.String()
			}
			return false
		})
		return sn
	}
	before := serial()
	renewed := issuePEM(t, ca, nodeid.Node, "node-a")
	if err := os.WriteFile(filepath.Join(dir, "node.pem.tmp"), renewed, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(dir, "node.pem.tmp"), filepath.Join(dir, "node.pem")); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Client.WriteAt(data, 1<<18); err != nil {
		t.Fatalf("write after the renewal: %v", err)
	}
	if serial() != before {
		t.Fatal("the open connection changed certificate")
	}
	if n, err := srv.CloseConns(context.Background(), "vol", func(nbd.ConnInfo) bool { return true }); n != 1 || err != nil {
		t.Fatalf("closing the server's connection: %d, %v", n, err)
	}
	if _, err := s.Client.ReadAt(got, 1<<18); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read after the renewal and a redial: %v (equal %v)", err, bytes.Equal(got, data))
	}
	renewedCert, err := tls.X509KeyPair(renewed, renewed)
	if err != nil {
		t.Fatal(err)
	}
	if after := serial(); after == before || after != renewedCert.Leaf.SerialNumber.String() {
		t.Fatalf("after the redial the server sees certificate %s; want the renewed %s (was %s)", after, renewedCert.Leaf.SerialNumber, before)
	}

	if _, err := open(target("store-2", dir)); err == nil || !strings.Contains(err.Error(), "not store-2") {
		t.Errorf("a server that is not the storage node named: %v", err)
	}
	if _, err := open(target("store-1", t.TempDir())); err == nil || !strings.Contains(err.Error(), "no CA") {
		t.Errorf("nothing in the identity directory: %v", err)
	}
	caOnly := t.TempDir()
	if err := os.WriteFile(filepath.Join(caOnly, nodeid.BundleFile), ca.PEM, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := open(target("store-1", caOnly)); err == nil || !strings.Contains(err.Error(), "no node certificate") {
		t.Errorf("no certificate in the identity directory: %v", err)
	}
	// Plaintext is refused by this server: the session's TLS is what
	// made the difference.
	plain := target("store-1", dir)
	plain.TLS = nil
	if _, err := open(plain); !errors.Is(err, ErrServerRefused) && !errors.Is(err, nbd.ErrTLSRequired) {
		t.Errorf("plaintext: %v, want a refusal", err)
	}
}
