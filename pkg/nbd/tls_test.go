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
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/pki"
)

// testPKI is a CA with a server and a client certificate.
type testPKI struct {
	server, client *tls.Config
}

// newTestPKI makes one; the server verifies client certificates only
// when given (the checks on them are the tests' own).
func newTestPKI(t testing.TB) testPKI {
	t.Helper()
	p, err := pki.New()
	if err != nil {
		t.Fatal(err)
	}
	server := p.Server.Clone()
	server.ClientAuth = tls.VerifyClientCertIfGiven
	return testPKI{server: server, client: p.Client}
}

// tcpServer serves s on a loopback TCP listener and returns its address.
func tcpServer(t testing.TB, s *Server) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go s.Serve(l)
	t.Cleanup(func() { l.Close() })
	return l.Addr().String()
}

func dialTLS(t *testing.T, addr, export string, cfg *tls.Config) (*Client, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cl, err := Dial(ctx, DialOptions{Addr: addr, Export: export, TLS: cfg, Conns: 2, Logger: quietLogger()})
	if err == nil {
		t.Cleanup(func() { cl.Close() })
	}
	return cl, err
}

func wantOptionError(t *testing.T, err error, reply uint32) {
	t.Helper()
	var oe *OptionError
	if !errors.As(err, &oe) || oe.Reply != reply {
		t.Fatalf("error %v, want the reply %s", err, RepName(reply))
	}
}

// TestStartTLS: with TLS required, a client that upgrades reads and
// writes through TLS 1.3 and the server sees its certificate; plaintext
// clients are refused whichever way they choose an export.
func TestStartTLS(t *testing.T) {
	pki := newTestPKI(t)
	const size = 8 << 20
	s := newTestServer(t, &Export{Name: "disk", Backend: NewMemBackend(size)})
	s.TLSConfig, s.TLSRequired = pki.server, true
	var mu sync.Mutex
	var seen []string
	s.Authorize = func(c ConnInfo, export string) error {
		mu.Lock()
		defer mu.Unlock()
		if c.TLS == nil || len(c.TLS.PeerCertificates) == 0 {
			seen = append(seen, "no TLS")
			return nil
		}
		seen = append(seen, c.TLS.PeerCertificates[0].Subject.CommonName)
		if c.TLS.Version != tls.VersionTLS13 {
			return errors.New("not TLS 1.3")
		}
		return nil
	}
	addr := tcpServer(t, s)

	cl, err := dialTLS(t, addr, "disk", pki.client)
	if err != nil {
		t.Fatalf("dial over TLS: %v", err)
	}
	roundTripTLS(t, cl, "TLS")
	for _, c := range cl.Conns() {
		if _, ok := c.(*tls.Conn); !ok {
			t.Fatalf("client connection %T is not TLS", c)
		}
	}
	mu.Lock()
	if len(seen) != 2 || seen[0] != "client" || seen[1] != "client" {
		t.Errorf("the server saw %v, want the client certificate's name on both connections", seen)
	}
	mu.Unlock()

	// Plaintext GO: ERR_TLS_REQD.
	_, err = Dial(context.Background(), DialOptions{Addr: addr, Export: "disk", Logger: quietLogger()})
	wantOptionError(t, err, RepErrTLSReqd)
	// Plaintext LIST: ERR_TLS_REQD.
	_, err = ListExports(dialRaw(t, addr))
	wantOptionError(t, err, RepErrTLSReqd)
	// Plaintext EXPORT_NAME: the server hangs up.
	c2 := dialRaw(t, addr)
	noZeroes, err := clientHello(c2)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := exportNameFallback(c2, "disk", noZeroes); err == nil {
		t.Fatal("EXPORT_NAME without TLS was served")
	}
	mu.Lock()
	defer mu.Unlock()
	if len(seen) != 2 {
		t.Errorf("plaintext clients reached the export check: %v", seen)
	}
}

// TestStartTLSPerExport: without TLSRequired, only exports that require
// TLS refuse plaintext; TLS reaches both.
func TestStartTLSPerExport(t *testing.T) {
	pki := newTestPKI(t)
	s := newTestServer(t,
		&Export{Name: "secret", Backend: NewMemBackend(1 << 20), RequireTLS: true},
		&Export{Name: "open", Backend: NewMemBackend(1 << 20)})
	s.TLSConfig = pki.server
	// A grant may require TLS too.
	s.Resolve = func(c ConnInfo, name string) (Grant, error) {
		if name == "granted" {
			return Grant{Export: "open", RequireTLS: true}, nil
		}
		return Grant{Export: name}, nil
	}
	addr := tcpServer(t, s)
	if _, err := Dial(context.Background(), DialOptions{Addr: addr, Export: "open", Logger: quietLogger()}); err != nil {
		t.Fatalf("plaintext to an export without TLS: %v", err)
	}
	for _, name := range []string{"secret", "granted"} {
		_, err := Dial(context.Background(), DialOptions{Addr: addr, Export: name, Logger: quietLogger()})
		wantOptionError(t, err, RepErrTLSReqd)
		if _, err := dialTLS(t, addr, name, pki.client); err != nil {
			t.Fatalf("TLS to %s: %v", name, err)
		}
	}
	// Without a client certificate the server (VerifyClientCertIfGiven)
	// still talks TLS; the certificate check is Resolve's to make.
	anon := pki.client.Clone()
	anon.Certificates = nil
	if _, err := dialTLS(t, addr, "open", anon); err != nil {
		t.Fatalf("TLS without a client certificate: %v", err)
	}
}

// TestStartTLSRefusals: what a server does with STARTTLS it cannot or
// will not honour, and with TLS it cannot trust.
func TestStartTLSRefusals(t *testing.T) {
	pki := newTestPKI(t)

	// No TLSConfig: ERR_UNSUP, and the client says so.
	plain := newTestServer(t, &Export{Name: "disk", Backend: NewMemBackend(1 << 20)})
	_, err := dialTLS(t, tcpServer(t, plain), "disk", pki.client)
	wantOptionError(t, err, RepErrUnsup)

	s := newTestServer(t, &Export{Name: "disk", Backend: NewMemBackend(1 << 20)})
	s.TLSConfig, s.TLSRequired = pki.server, true
	addr := tcpServer(t, s)

	// A client that does not trust the server's CA.
	untrusting := pki.client.Clone()
	untrusting.RootCAs = x509.NewCertPool()
	if _, err := dialTLS(t, addr, "disk", untrusting); !errors.Is(err, ErrTLSHandshake) {
		t.Fatalf("dial with an unknown CA: %v, want a handshake failure", err)
	}
	// TLS 1.2 clients with suites the server does not agree to:
	// TestStartTLS12Suites.

	// STARTTLS with data, then twice, then data behind it.
	c2 := greeted(t, addr)
	bad := option{Code: OptStartTLS, Data: []byte("x")}
	if _, err := c2.Write(bad.encode()); err != nil {
		t.Fatal(err)
	}
	if r, err := readOptReply(c2); err != nil || r.Type != RepErrInvalid {
		t.Fatalf("STARTTLS with data: reply %+v, %v, want ERR_INVALID", r, err)
	}
	tc, err := startTLS(c2, pki.client)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := startTLS(tc, pki.client); err == nil {
		t.Fatal("a second STARTTLS inside TLS succeeded")
	} else {
		wantOptionError(t, err, RepErrInvalid)
	}

	c3 := greeted(t, addr)
	q := InfoRequest{Name: "disk"}
	msg := append((&option{Code: OptStartTLS}).encode(), (&option{Code: OptGo, Data: q.encode()}).encode()...)
	if _, err := c3.Write(msg); err != nil {
		t.Fatal(err)
	}
	if r, err := readOptReply(c3); err != nil || r.Type != RepAck {
		t.Fatalf("STARTTLS reply %+v, %v", r, err)
	}
	// The server hangs up instead of reading plaintext as TLS.
	if _, err := io.Copy(io.Discard, c3); err != nil && !errors.Is(err, net.ErrClosed) && !isReset(err) {
		t.Fatalf("after data behind STARTTLS: %v, want the server to hang up", err)
	}

	// The server is still serving.
	if _, err := dialTLS(t, addr, "disk", pki.client); err != nil {
		t.Fatalf("after the refusals: %v", err)
	}
}

// dialRaw connects to addr with a 10 s deadline on everything.
func dialRaw(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(10 * time.Second))
	return c
}

// greeted is dialRaw past the server's greeting.
func greeted(t *testing.T, addr string) net.Conn {
	t.Helper()
	c := dialRaw(t, addr)
	if _, err := clientHello(c); err != nil {
		t.Fatal(err)
	}
	return c
}

func isReset(err error) bool {
	var ne *net.OpError
	return errors.As(err, &ne) && !ne.Timeout()
}

// TestShutdownAfterStartTLS: a server shut down while a connection is
// still negotiating inside TLS stops it through the socket it accepted
// (the race detector's view: STARTTLS replaces the connection the
// handler reads while Shutdown drains it).
func TestShutdownAfterStartTLS(t *testing.T) {
	pki := newTestPKI(t)
	s := newTestServer(t, &Export{Name: "disk", Backend: NewMemBackend(1 << 20)})
	s.TLSConfig = pki.server
	addr := tcpServer(t, s)
	c := greeted(t, addr)
	tc, err := startTLS(c, pki.client)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.Shutdown(ctx); err != nil {
		t.Fatalf("shutdown with a connection negotiating inside TLS: %v", err)
	}
	if _, err := io.Copy(io.Discard, tc); err != nil && !errors.Is(err, net.ErrClosed) && !isReset(err) {
		t.Fatalf("after shutdown: %v, want the server to hang up", err)
	}
}

// roundTripTLS writes 3 MiB and a 4 KiB write (which travels with its
// header in one record), flushes and reads both back over cl, a client
// over TLS (version names it in the failures).
func roundTripTLS(t *testing.T, cl *Client, version string) {
	t.Helper()
	data := randBytes(3 << 20)
	if _, err := cl.WriteAt(data, 1<<20); err != nil {
		t.Fatal(err)
	}
	if err := cl.Flush(); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(data))
	if _, err := cl.ReadAt(got, 1<<20); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data) {
		t.Fatalf("data read back over %s differs from what was written", version)
	}
	small := randBytes(4096)
	if _, err := cl.WriteAt(small, 0); err != nil {
		t.Fatal(err)
	}
	back := make([]byte, len(small))
	if _, err := cl.ReadAt(back, 0); err != nil || !bytes.Equal(back, small) {
		t.Fatalf("a 4 KiB write over %s read back wrong (%v)", version, err)
	}
}
