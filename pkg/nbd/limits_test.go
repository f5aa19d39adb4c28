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
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// limitObserver records refusals and counts for the limit tests.
type limitObserver struct {
	mu                 sync.Mutex
	refused            map[string]int
	conns, handshakes  int
	opened, closedConn int
}

func (o *limitObserver) ConnOpened(ConnInfo, string) {
	o.mu.Lock()
	o.opened++
	o.mu.Unlock()
}

func (o *limitObserver) ConnClosed(ConnInfo, string) {
	o.mu.Lock()
	o.closedConn++
	o.mu.Unlock()
}

func (o *limitObserver) Request(string, uint16, int, time.Duration, uint32) {}

func (o *limitObserver) ConnRefused(_ ConnInfo, reason string) {
	o.mu.Lock()
	if o.refused == nil {
		o.refused = map[string]int{}
	}
	o.refused[reason]++
	o.mu.Unlock()
}

func (o *limitObserver) ConnCounts(conns, handshakes int) {
	o.mu.Lock()
	o.conns, o.handshakes = conns, handshakes
	o.mu.Unlock()
}

func (o *limitObserver) refusals(reason string) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.refused[reason]
}

// limitEnv is a server with limits listening on 127.0.0.1, over MPTCP or
// plain TCP.
type limitEnv struct {
	t     *testing.T
	srv   *Server
	obs   *limitObserver
	addr  string
	mptcp bool
}

// forTransports runs f over plain TCP and, when the kernel has it, MPTCP.
func forTransports(t *testing.T, f func(t *testing.T, useMPTCP bool)) {
	t.Run("tcp", func(t *testing.T) { f(t, false) })
	t.Run("mptcp", func(t *testing.T) {
		if err := mptcp.Available(); err != nil {
			t.Skipf("MPTCP unavailable: %v", err)
		}
		f(t, true)
	})
}

func newLimitEnv(t *testing.T, lim Limits, useMPTCP bool, exports ...string) *limitEnv {
	t.Helper()
	if len(exports) == 0 {
		exports = []string{"d"}
	}
	obs := &limitObserver{}
	s := &Server{Logger: quietLogger(), Limits: lim, Observer: obs}
	for _, name := range exports {
		if err := s.AddExport(&Export{Name: name, Backend: NewMemBackend(1 << 20)}); err != nil {
			t.Fatal(err)
		}
	}
	l, err := mptcp.Listen(context.Background(), "tcp", "127.0.0.1:0", useMPTCP)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- s.Serve(l) }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		s.Shutdown(ctx)
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return &limitEnv{t: t, srv: s, obs: obs, addr: l.Addr().String(), mptcp: useMPTCP}
}

// dial connects from the loopback address src without sending anything.
func (e *limitEnv) dial(src string) net.Conn {
	e.t.Helper()
	d := mptcp.Dialer(e.mptcp)
	d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(src)}
	d.Timeout = 5 * time.Second
	c, err := d.Dial("tcp", e.addr)
	if err != nil {
		e.t.Fatalf("dial from %s: %v", src, err)
	}
	e.t.Cleanup(func() { c.Close() })
	if e.mptcp && !mptcp.IsMPTCP(c) {
		e.t.Fatal("the connection fell back to plain TCP")
	}
	return c
}

// idle opens n connections from src that never send anything and waits
// until the server holds want connections in the handshake.
func (e *limitEnv) idle(src string, n, want int) []net.Conn {
	e.t.Helper()
	var cs []net.Conn
	for range n {
		cs = append(cs, e.dial(src))
	}
	e.waitFor("idle connections counted as handshakes", func() bool { return e.srv.ConnStats().Handshakes == want })
	return cs
}

// client negotiates an export over n connections from src.
func (e *limitEnv) client(src, export string, n int) (*Client, error) {
	e.t.Helper()
	e.obs.mu.Lock()
	opened := e.obs.opened
	e.obs.mu.Unlock()
	var conns []net.Conn
	var info ExportInfo
	for range n {
		c := e.dial(src)
		c.SetDeadline(time.Now().Add(5 * time.Second))
		ci, err := NegotiateConn(context.Background(), c, export)
		if err != nil {
			for _, c := range conns {
				c.Close()
			}
			c.Close()
			return nil, err
		}
		c.SetDeadline(time.Time{})
		info = ci
		conns = append(conns, c)
	}
	// The server ends the handshake just after its last reply: wait for
	// it, so that the handshake counts are settled.
	e.waitFor("the server to end the handshakes", func() bool {
		e.obs.mu.Lock()
		defer e.obs.mu.Unlock()
		return e.obs.opened >= opened+n
	})
	cl := NewClient(info, conns, quietLogger())
	e.t.Cleanup(func() { cl.Close() })
	return cl, nil
}

// roundTrip writes and reads back a block through cl.
func (e *limitEnv) roundTrip(cl *Client, what string) {
	e.t.Helper()
	data := bytes.Repeat([]byte(what[:1]), 4096)
	if _, err := cl.WriteAt(data, 8192); err != nil {
		e.t.Fatalf("%s: write: %v", what, err)
	}
	got := make([]byte, len(data))
	if _, err := cl.ReadAt(got, 8192); err != nil {
		e.t.Fatalf("%s: read: %v", what, err)
	}
	if !bytes.Equal(got, data) {
		e.t.Fatalf("%s: read back different data", what)
	}
}

// serves checks that a new client from src completes the handshake and
// a write/read round trip, and closes it.
func (e *limitEnv) serves(src, export, what string) {
	e.t.Helper()
	cl, err := e.client(src, export, 1)
	if err != nil {
		e.t.Fatalf("%s: negotiate from %s: %v", what, src, err)
	}
	e.roundTrip(cl, what)
	cl.Close()
}

// refusedAtOnce checks that the server closed c without sending the
// greeting.
func (e *limitEnv) refusedAtOnce(c net.Conn, what string) {
	e.t.Helper()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	n, err := io.ReadFull(c, make([]byte, 18))
	var ne net.Error
	switch {
	case errors.As(err, &ne) && ne.Timeout():
		e.t.Fatalf("%s: the connection is still open after 5s", what)
	case n != 0 || err == nil:
		e.t.Fatalf("%s: the server sent %d bytes (%v), want the connection closed at once", what, n, err)
	}
}

// waitRefused waits for the count of refusals for reason to reach want.
func (e *limitEnv) waitRefused(reason string, want int) {
	e.t.Helper()
	e.waitFor("refusals for "+reason+" to be counted", func() bool { return e.obs.refusals(reason) == want })
}

func (e *limitEnv) waitFor(what string, cond func() bool) {
	e.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			e.t.Fatalf("gave up after 10s waiting for %s (stats %+v)", what, e.srv.ConnStats())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// closeAll closes cs and clients and checks that every count went back
// to zero, in the server and as reported to the observer.
func (e *limitEnv) closeAll(cs []net.Conn, clients ...*Client) {
	e.t.Helper()
	for _, c := range cs {
		c.Close()
	}
	for _, cl := range clients {
		cl.Close()
	}
	e.waitFor("every count back to zero", func() bool {
		if e.srv.ConnStats() != (ConnStats{}) {
			return false
		}
		for _, name := range e.srv.Exports() {
			if x, _ := e.srv.Export(name); x.Reserved() != 0 {
				return false
			}
		}
		e.obs.mu.Lock()
		defer e.obs.mu.Unlock()
		return e.obs.conns == 0 && e.obs.handshakes == 0
	})
}

func TestLimitsDefaults(t *testing.T) {
	r := Limits{}.resolve()
	if r.perExport != DefaultMaxConnsPerExport || r.perSource != DefaultMaxConnsPerSource || r.total != DefaultMaxConns ||
		r.hsPerSource != DefaultMaxHandshakesPerSource || r.hsTotal != DefaultMaxHandshakes || r.hsTimeout != DefaultHandshakeTimeout {
		t.Errorf("zero Limits resolve to %+v", r)
	}
	off := Limits{-1, -1, -1, -1, -1, -1, -1}.resolve()
	if off != (resolvedLimits{}) {
		t.Errorf("negative Limits resolve to %+v, want every limit off", off)
	}
}

func TestSourceAddr(t *testing.T) {
	for _, tc := range []struct {
		addr net.Addr
		want string
	}{
		{&net.TCPAddr{IP: net.ParseIP("127.0.0.2"), Port: 1}, "127.0.0.2"},
		{&net.TCPAddr{IP: net.ParseIP("::ffff:10.0.0.1"), Port: 1}, "10.0.0.1"},
		{&net.TCPAddr{IP: net.ParseIP("fd00::1"), Port: 1}, "fd00::1"},
		{&net.UnixAddr{Name: "@", Net: "unix"}, ""},
		{nil, ""},
	} {
		ip, ok := sourceAddr(tc.addr)
		got := ""
		if ok {
			got = ip.String()
		}
		if got != tc.want {
			t.Errorf("sourceAddr(%v) = %q, want %q", tc.addr, got, tc.want)
		}
	}
}

// A flood of half-open handshakes from one address is refused there, and
// other addresses (and then the same one) are served.
func TestLimitHandshakesPerSource(t *testing.T) {
	forTransports(t, func(t *testing.T, useMPTCP bool) {
		e := newLimitEnv(t, Limits{MaxHandshakesPerSource: 3, HandshakeTimeout: -1}, useMPTCP)
		busy, err := e.client("127.0.0.1", "d", 2)
		if err != nil {
			t.Fatal(err)
		}
		flood := e.idle("127.0.0.1", 3, 3)
		e.refusedAtOnce(e.dial("127.0.0.1"), "fourth handshake from 127.0.0.1")
		e.waitRefused(RefusedHandshakesPerSource, 1)
		e.roundTrip(busy, "client connected before the flood")
		e.serves("127.0.0.2", "d", "client from 127.0.0.2 during the flood")

		flood[0].Close()
		e.waitFor("a handshake slot to free up", func() bool { return e.srv.ConnStats().Handshakes == 2 })
		e.serves("127.0.0.1", "d", "client from 127.0.0.1 once a slot is free")
		e.closeAll(flood, busy)
		if n := e.obs.refusals(RefusedHandshakesPerSource); n != 1 {
			t.Errorf("%d refusals counted, want 1", n)
		}
	})
}

func TestLimitHandshakesTotal(t *testing.T) {
	forTransports(t, func(t *testing.T, useMPTCP bool) {
		e := newLimitEnv(t, Limits{MaxHandshakes: 4, HandshakeTimeout: -1}, useMPTCP)
		busy, err := e.client("127.0.0.3", "d", 1)
		if err != nil {
			t.Fatal(err)
		}
		flood := append(e.idle("127.0.0.1", 2, 2), e.idle("127.0.0.2", 2, 4)...)
		e.refusedAtOnce(e.dial("127.0.0.3"), "fifth handshake")
		e.waitRefused(RefusedHandshakesTotal, 1)
		e.roundTrip(busy, "client connected before the flood")

		flood[0].Close()
		e.waitFor("a handshake slot to free up", func() bool { return e.srv.ConnStats().Handshakes == 3 })
		e.serves("127.0.0.3", "d", "client once a slot is free")
		e.closeAll(flood, busy)
	})
}

func TestLimitConnsPerSource(t *testing.T) {
	forTransports(t, func(t *testing.T, useMPTCP bool) {
		e := newLimitEnv(t, Limits{MaxConnsPerSource: 2}, useMPTCP)
		busy, err := e.client("127.0.0.1", "d", 2)
		if err != nil {
			t.Fatal(err)
		}
		e.refusedAtOnce(e.dial("127.0.0.1"), "third connection from 127.0.0.1")
		e.waitRefused(RefusedPerSource, 1)
		e.roundTrip(busy, "client holding the source's connections")
		other, err := e.client("127.0.0.2", "d", 2)
		if err != nil {
			t.Fatalf("client from 127.0.0.2: %v", err)
		}
		e.roundTrip(other, "client from 127.0.0.2")
		busy.Close()
		e.waitFor("127.0.0.1's connections to be released", func() bool { return e.srv.ConnStats().Conns == 2 })
		e.serves("127.0.0.1", "d", "client from 127.0.0.1 after the first closed")
		e.closeAll(nil, other)
	})
}

func TestLimitConnsTotal(t *testing.T) {
	forTransports(t, func(t *testing.T, useMPTCP bool) {
		e := newLimitEnv(t, Limits{MaxConns: 3, HandshakeTimeout: -1}, useMPTCP)
		busy, err := e.client("127.0.0.1", "d", 2)
		if err != nil {
			t.Fatal(err)
		}
		flood := e.idle("127.0.0.2", 1, 1)
		e.refusedAtOnce(e.dial("127.0.0.3"), "fourth connection")
		e.waitRefused(RefusedTotal, 1)
		e.roundTrip(busy, "client connected before the limit was reached")
		flood[0].Close()
		e.waitFor("the idle connection to be released", func() bool { return e.srv.ConnStats().Conns == 2 })
		e.serves("127.0.0.3", "d", "client once a connection closed")
		e.closeAll(flood, busy)
	})
}

func TestLimitConnsPerExport(t *testing.T) {
	forTransports(t, func(t *testing.T, useMPTCP bool) {
		e := newLimitEnv(t, Limits{MaxConnsPerExport: 2}, useMPTCP, "d", "other")
		busy, err := e.client("127.0.0.1", "d", 2)
		if err != nil {
			t.Fatal(err)
		}

		// NBD_OPT_GO is answered with NBD_REP_ERR_POLICY, then the server
		// hangs up.
		c := e.dial("127.0.0.2")
		c.SetDeadline(time.Now().Add(5 * time.Second))
		_, err = NegotiateConn(context.Background(), c, "d")
		var oe *OptionError
		if !errors.As(err, &oe) || oe.Option != OptGo || oe.Reply != RepErrPolicy {
			t.Fatalf("GO over the export's limit: %v, want NBD_REP_ERR_POLICY", err)
		}
		if n, err := c.Read(make([]byte, 1)); n != 0 || err == nil {
			t.Fatalf("after the refusal: read %d bytes, %v; want the connection closed", n, err)
		}
		e.waitRefused(RefusedPerExport, 1)

		// NBD_OPT_EXPORT_NAME has no error reply: the server hangs up.
		c = e.dial("127.0.0.2")
		c.SetDeadline(time.Now().Add(5 * time.Second))
		noZeroes, err := clientHello(c)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := exportNameFallback(c, "d", noZeroes); err == nil {
			t.Fatal("EXPORT_NAME over the export's limit succeeded")
		}
		e.waitRefused(RefusedPerExport, 2)

		e.roundTrip(busy, "client holding the export's connections")
		e.serves("127.0.0.2", "other", "client of another export")
		busy.Close()
		e.waitFor("the export's slots to be released", func() bool {
			x, _ := e.srv.Export("d")
			return x.Reserved() == 0
		})
		e.serves("127.0.0.2", "d", "client once the export's connections closed")
		e.closeAll(nil)
	})
}

// A connection that does not finish the handshake in time is closed,
// whether it sends nothing or stalls half-way.
func TestHandshakeTimeout(t *testing.T) {
	forTransports(t, func(t *testing.T, useMPTCP bool) {
		e := newLimitEnv(t, Limits{HandshakeTimeout: 300 * time.Millisecond}, useMPTCP)
		silent := e.dial("127.0.0.1")
		stalled := e.dial("127.0.0.1")
		if _, err := clientHello(stalled); err != nil {
			t.Fatal(err)
		}
		// Half an option header, then nothing.
		if _, err := stalled.Write([]byte("IHAVEOPT")); err != nil {
			t.Fatal(err)
		}
		for _, c := range []net.Conn{silent, stalled} {
			c.SetReadDeadline(time.Now().Add(10 * time.Second))
			_, err := io.Copy(io.Discard, c)
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				t.Fatal("an idle handshake was still open after 10s")
			}
		}
		e.waitRefused(RefusedHandshakeTimeout, 2)
		e.serves("127.0.0.1", "d", "client after the timeouts")
		e.closeAll([]net.Conn{silent, stalled})
		if n := e.obs.refusals(RefusedHandshakeTimeout); n != 2 {
			t.Errorf("%d handshake timeouts counted, want 2 (a client that finished in time is none)", n)
		}
	})
}

// ServeConn, used without a listener, applies the limits too.
func TestLimitServeConn(t *testing.T) {
	obs := &limitObserver{}
	s := &Server{Logger: quietLogger(), Limits: Limits{MaxHandshakes: 1}, Observer: obs}
	if err := s.AddExport(&Export{Name: "d", Backend: NewMemBackend(4096)}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		s.Shutdown(ctx)
	})
	first := pipeConn(t, s)
	a, b := net.Pipe()
	defer a.Close()
	done := make(chan struct{})
	deadline := time.Now().Add(10 * time.Second)
	for s.ConnStats().Handshakes != 1 {
		if time.Now().After(deadline) {
			t.Fatal("the first connection was not counted within 10s")
		}
		time.Sleep(5 * time.Millisecond)
	}
	go func() { s.ServeConn(b); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("ServeConn over the handshake limit did not return within 10s")
	}
	if obs.refusals(RefusedHandshakesTotal) != 1 {
		t.Errorf("refusals: %v", obs.refused)
	}
	first.Close()
}
