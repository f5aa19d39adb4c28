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

package relay

import (
	"context"
	"crypto/sha256"
	"errors"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

func quietLogger() *slog.Logger {
	if os.Getenv("RELAY_TEST_LOG") != "" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

// checkGoroutines fails the test if goroutines started during it are still
// running once everything else was cleaned up. Call it first.
func checkGoroutines(t *testing.T) {
	t.Helper()
	before := runtime.NumGoroutine()
	t.Cleanup(func() {
		deadline := time.Now().Add(10 * time.Second)
		for {
			n := runtime.NumGoroutine()
			if n <= before {
				return
			}
			if time.Now().After(deadline) {
				buf := make([]byte, 1<<20)
				buf = buf[:runtime.Stack(buf, true)]
				t.Errorf("goroutine leak: %d before, %d after\n%s", before, n, buf)
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
}

// randomData returns n pseudo-random bytes (seeded, fast).
func randomData(n int, seed uint64) []byte {
	b := make([]byte, n)
	var s [32]byte
	s[0], s[1] = byte(seed), byte(seed>>8)
	rand.NewChaCha8(s).Read(b)
	return b
}

func sum(b []byte) [32]byte { return sha256.Sum256(b) }

const exportName = "disk"

// connCounter counts transmission-phase connections of a server.
type connCounter struct{ live atomic.Int64 }

func (c *connCounter) ConnOpened(nbd.ConnInfo, string)                    { c.live.Add(1) }
func (c *connCounter) ConnClosed(nbd.ConnInfo, string)                    { c.live.Add(-1) }
func (c *connCounter) Request(string, uint16, int, time.Duration, uint32) {}

// testServer is an in-process NBD server on a fixed loopback address that
// can be killed hard and started again with the same backend.
type testServer struct {
	t       testing.TB
	backend nbd.Backend
	mptcp   bool
	// inc is the incarnation announced to sessions; zero means the
	// process's.
	inc     nbd.Incarnation
	addr    string
	counter connCounter

	mu    sync.Mutex
	srv   *nbd.Server
	ln    net.Listener
	conns []net.Conn
	serve chan struct{}
}

func newTestServer(t testing.TB, size int64, mp bool) *testServer {
	t.Helper()
	ts := &testServer{t: t, backend: nbd.NewMemBackend(size), mptcp: mp}
	ts.start()
	t.Cleanup(ts.kill)
	return ts
}

func (ts *testServer) start() {
	ts.t.Helper()
	addr := ts.addr
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	var ln net.Listener
	var err error
	for i := 0; i < 50; i++ {
		ln, err = mptcp.Listen(context.Background(), "tcp", addr, ts.mptcp)
		if err == nil || !errors.Is(err, syscall.EADDRINUSE) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		ts.t.Fatalf("listen %s: %v", addr, err)
	}
	if ts.addr == "" {
		ts.addr = ln.Addr().String()
	}
	srv := &nbd.Server{Logger: quietLogger(), Observer: &ts.counter, Incarnation: ts.inc}
	if err := srv.AddExport(&nbd.Export{Name: exportName, Backend: ts.backend}); err != nil {
		ts.t.Fatal(err)
	}
	done := make(chan struct{})
	ts.mu.Lock()
	ts.srv, ts.ln, ts.conns, ts.serve = srv, ln, nil, done
	ts.mu.Unlock()
	go func() {
		defer close(done)
		srv.Serve(&trackingListener{Listener: ln, ts: ts})
	}()
}

type trackingListener struct {
	net.Listener
	ts *testServer
}

func (l *trackingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.ts.mu.Lock()
		l.ts.conns = append(l.ts.conns, c)
		l.ts.mu.Unlock()
	}
	return c, err
}

// cut closes the listener and resets every connection, leaving the
// server's handlers to finish; kill then stops it.
func (ts *testServer) cut() {
	ts.mu.Lock()
	ln, conns := ts.ln, ts.conns
	ts.mu.Unlock()
	if ln != nil {
		ln.Close()
	}
	for _, c := range conns {
		if tc, ok := c.(*net.TCPConn); ok {
			_ = tc.SetLinger(0) // a reset, if it can: else a FIN
		}
		c.Close()
	}
}

// kill stops the server hard: listener closed, every connection reset, and
// it returns once no handler touches the backend any more.
func (ts *testServer) kill() {
	ts.mu.Lock()
	srv, ln, conns, done := ts.srv, ts.ln, ts.conns, ts.serve
	ts.srv, ts.ln, ts.conns = nil, nil, nil
	ts.mu.Unlock()
	if srv == nil {
		return
	}
	ln.Close()
	for _, c := range conns {
		if tc, ok := c.(*net.TCPConn); ok {
			_ = tc.SetLinger(0) // a reset, if it can: else a FIN
		}
		c.Close()
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	srv.Shutdown(ctx)
	<-done
}

// dialNegotiated dials the server (through addr, which may be a proxy)
// and negotiates the export.
func dialNegotiated(ctx context.Context, addr string, mp bool) (net.Conn, nbd.ExportInfo, error) {
	c, err := mptcp.Dialer(mp).DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, nbd.ExportInfo{}, err
	}
	info, err := nbd.NegotiateConn(ctx, c, exportName)
	if err != nil {
		c.Close()
		return nil, nbd.ExportInfo{}, err
	}
	return c, info, nil
}

func negotiatingDialer(addr string, mp bool) Dialer {
	return func(ctx context.Context) (net.Conn, error) {
		c, _, err := dialNegotiated(ctx, addr, mp)
		return c, err
	}
}

// rig is a relay between an emulated kernel (our NBD client on the other
// end of the socket pair) and a remote.
type rig struct {
	t      *testing.T
	relay  *Relay
	kernel net.Conn    // the kernel's end as a conn
	client *nbd.Client // speaking on kernel; nil for raw rigs
	cancel context.CancelFunc
	done   chan error

	evMu   sync.Mutex
	events []Event
}

// newRig dials the first remote with dial and starts a relay. With info
// nil the kernel end is left raw (no client).
func newRig(t *testing.T, remote net.Conn, dial Dialer, info *nbd.ExportInfo, o Options) *rig {
	t.Helper()
	kernel, local := kernelPair(t)
	rg := &rig{t: t, kernel: kernel, done: make(chan error, 1)}
	if o.Logger == nil {
		o.Logger = quietLogger()
	}
	user := o.OnEvent
	o.OnEvent = func(e Event) {
		rg.evMu.Lock()
		rg.events = append(rg.events, e)
		rg.evMu.Unlock()
		if user != nil {
			user(e)
		}
	}
	rg.relay = New(local, remote, dial, o)
	if info != nil {
		rg.client = nbd.NewClient(*info, []net.Conn{kernel}, quietLogger())
	}
	ctx, cancel := context.WithCancel(context.Background())
	rg.cancel = cancel
	go func() { rg.done <- rg.relay.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-rg.done:
		case <-time.After(10 * time.Second):
			t.Error("relay did not stop")
		}
		kernel.Close()
	})
	return rg
}

// newServerRig starts a relay to ts, with a client on the kernel end.
func newServerRig(t *testing.T, ts *testServer, o Options) *rig {
	t.Helper()
	remote, info, err := dialNegotiated(context.Background(), ts.addr, ts.mptcp)
	if err != nil {
		t.Fatal(err)
	}
	return newRig(t, remote, negotiatingDialer(ts.addr, ts.mptcp), &info, o)
}

// wait returns Run's result.
func (rg *rig) wait(d time.Duration) error {
	rg.t.Helper()
	select {
	case err := <-rg.done:
		rg.done <- err // keep it for the cleanup
		return err
	case <-time.After(d):
		rg.t.Fatalf("Run did not return within %v", d)
		return nil
	}
}

func (rg *rig) eventCount(k EventKind) int {
	rg.evMu.Lock()
	defer rg.evMu.Unlock()
	n := 0
	for _, e := range rg.events {
		if e.Kind == k {
			n++
		}
	}
	return n
}

func (rg *rig) eventsOf(k EventKind) []Event {
	rg.evMu.Lock()
	defer rg.evMu.Unlock()
	var out []Event
	for _, e := range rg.events {
		if e.Kind == k {
			out = append(out, e)
		}
	}
	return out
}

// waitFor polls cond until it holds or d passes.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// kernelPair returns the two ends of a relay's local socket pair: the
// kernel's (as a conn, for an emulated kernel) and the relay's.
func kernelPair(t *testing.T) (kernel, local net.Conn) {
	t.Helper()
	kf, local, err := NewSocketPair()
	if err != nil {
		t.Fatal(err)
	}
	kernel, err = net.FileConn(kf)
	kf.Close()
	if err != nil {
		t.Fatal(err)
	}
	return kernel, local
}
