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
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// Silence, not resets: these tests make a storage host (or one of its
// paths) drop every packet with nftables, as a host that lost power does,
// and check that the relay notices within seconds (the kernel alone would
// retransmit for tcp_retries2, about 15 minutes).

// silentBound is how long a test waits for the relay to notice a silent
// server before it fails: far below tcp_retries2, above the default
// DeadPeerTimeout with room for a loaded machine.
const silentBound = 15 * time.Second

// serveIn serves backend as exportName on addr from namespace ns (MPTCP
// listener) and stops when the test ends.
func serveIn(t *testing.T, ns, addr string, backend nbd.Backend, inc nbd.Incarnation) {
	t.Helper()
	var ln net.Listener
	if err := topo.InNetns(ns, func() error {
		var err error
		ln, err = mptcp.Listen(context.Background(), "tcp", addr, true)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	srv := &nbd.Server{Logger: quietLogger(), Incarnation: inc}
	if err := srv.AddExport(&nbd.Export{Name: exportName, Backend: backend}); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(ln)
	}()
	t.Cleanup(func() {
		ln.Close()
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		srv.Shutdown(ctx)
		<-done
	})
}

// dialIn dials addr from namespace ns with MPTCP and negotiates.
func dialIn(ctx context.Context, ns, addr string) (c net.Conn, info nbd.ExportInfo, err error) {
	err = topo.InNetns(ns, func() error {
		var err error
		c, info, err = dialNegotiated(ctx, addr, true)
		return err
	})
	return c, info, err
}

// verifyLoad writes random blocks through cl from several goroutines, each
// over blocks of its own, reads one of its blocks back after every write
// and compares it with what it last wrote there, and FLUSHes now and
// then. It counts operations and errors until stop is closed.
type verifyLoad struct {
	cl         *nbd.Client
	block      int
	model      []byte // what every block must hold
	ops        atomic.Int64
	errs       atomic.Int64
	mu         sync.Mutex
	firstErr   error
	wg         sync.WaitGroup
	stop       chan struct{}
	lastOpNano atomic.Int64
}

func startVerifyLoad(cl *nbd.Client, size, block, workers int) *verifyLoad {
	l := &verifyLoad{cl: cl, block: block, model: make([]byte, size), stop: make(chan struct{})}
	per := size / block / workers
	for w := range workers {
		l.wg.Add(1)
		go l.worker(w*per, per, uint64(w))
	}
	return l
}

func (l *verifyLoad) fail(err error) {
	l.errs.Add(1)
	l.mu.Lock()
	if l.firstErr == nil {
		l.firstErr = err
	}
	l.mu.Unlock()
}

func (l *verifyLoad) worker(first, n int, seed uint64) {
	defer l.wg.Done()
	rng := rand.New(rand.NewPCG(seed, 7))
	buf := make([]byte, l.block)
	got := make([]byte, l.block)
	for i := 0; ; i++ {
		select {
		case <-l.stop:
			return
		default:
		}
		b := first + rng.IntN(n)
		off := b * l.block
		for j := range buf {
			buf[j] = byte(rng.Uint32())
		}
		if _, err := l.cl.WriteAt(buf, int64(off)); err != nil {
			l.fail(fmt.Errorf("write block %d: %w", b, err))
			return
		}
		copy(l.model[off:off+l.block], buf)
		c := first + rng.IntN(n)
		coff := c * l.block
		if _, err := l.cl.ReadAt(got, int64(coff)); err != nil {
			l.fail(fmt.Errorf("read block %d: %w", c, err))
			return
		}
		if string(got) != string(l.model[coff:coff+l.block]) {
			l.fail(fmt.Errorf("block %d differs from what was written", c))
		}
		if i%16 == 15 {
			if err := l.cl.Flush(); err != nil {
				l.fail(fmt.Errorf("flush: %w", err))
				return
			}
		}
		l.ops.Add(1)
		l.lastOpNano.Store(time.Now().UnixNano())
	}
}

// finish stops the load and returns the first error, if any.
func (l *verifyLoad) finish() error {
	close(l.stop)
	l.wg.Wait()
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.firstErr
}

// TestDeadPeerSilentServerDetected: under a continuous write+verify load
// the storage host falls silent (nftables drops everything in its
// namespace: no reset, no ICMP) and the export is served again by a
// reachable server. The relay must notice the silent connection within
// seconds, redial, replay, and every block must verify. Without a
// deadline of the relay's own the requests would wait for tcp_retries2
// (about 15 minutes); the test gives up after silentBound.
func TestDeadPeerSilentServerDetected(t *testing.T) {
	topo.RequireNft(t)
	if err := mptcp.Available(); err != nil {
		t.Skipf("skipping: MPTCP unavailable: %v", err)
	}
	checkGoroutines(t)
	tp := topo.NewForTest(t, topo.Default4(topo.UniqueName("dp")))
	const size, block = 32 << 20, 64 << 10
	backend := nbd.NewMemBackend(size)
	silentAddr := net.JoinHostPort(tp.ServerAddr(1).String(), "10809")
	serveIn(t, tp.ServerNS, silentAddr, backend, nbd.Incarnation{1})
	// The export's new home: reachable from the client, on its loopback.
	newAddr := "127.0.0.1:10810"
	serveIn(t, tp.ClientNS, newAddr, backend, nbd.Incarnation{2})

	var silenced atomic.Bool
	dial := func(ctx context.Context) (net.Conn, error) {
		if !silenced.Load() {
			c, _, err := dialIn(ctx, tp.ClientNS, silentAddr)
			return c, err
		}
		c, _, err := dialIn(ctx, tp.ClientNS, newAddr)
		return c, err
	}
	remote, info, err := dialIn(context.Background(), tp.ClientNS, silentAddr)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var dropAt, lostAt, backAt time.Time
	var lostErr error
	rg := newRig(t, remote, dial, &info, Options{OnEvent: func(e Event) {
		mu.Lock()
		defer mu.Unlock()
		now := time.Now()
		switch {
		case e.Kind == EventDisconnected && lostAt.IsZero():
			lostAt, lostErr = now, e.Err
		case e.Kind == EventReconnected && backAt.IsZero():
			backAt = now
		}
	}})
	load := startVerifyLoad(rg.client, size, block, 4)
	defer func() {
		if load != nil {
			rg.cancel() // unblocks the load's requests
			_ = load.finish()
		}
	}()
	time.Sleep(time.Second)
	before := load.ops.Load()
	if before == 0 {
		t.Fatal("no I/O completed before the fault")
	}

	if err := topo.Drop(tp.ServerNS, "silence", ""); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	dropAt = time.Now()
	mu.Unlock()
	silenced.Store(true)
	t.Cleanup(func() { _ = topo.Undrop(tp.ServerNS, "silence") })

	deadline := time.Now().Add(silentBound)
	for {
		mu.Lock()
		back := !backAt.IsZero()
		mu.Unlock()
		if back {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the relay did not notice the silent server within %v (stats %+v): requests would wait for tcp_retries2, about 15 minutes",
				silentBound, rg.relay.Stats())
		}
		time.Sleep(20 * time.Millisecond)
	}
	mu.Lock()
	detect, redial := lostAt.Sub(dropAt), backAt.Sub(dropAt)
	why := lostErr
	mu.Unlock()
	resumed := load.ops.Load()
	waitFor(t, 10*time.Second, "I/O to resume after the reconnect", func() bool { return load.ops.Load() > resumed+32 })
	l := load
	load = nil
	if err := l.finish(); err != nil {
		t.Fatalf("I/O across the silent server: %v", err)
	}
	// Everything written, read back whole.
	got := make([]byte, size)
	want := l.model
	if _, err := rg.client.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if sum(got) != sum(want) {
		t.Fatal("the volume differs from what was written")
	}
	st := rg.relay.Stats()
	t.Logf("silent server noticed %v after the drop (%v), reconnected to the new server after %v; %d operations verified, 0 errors; stats: reconnects %d, replayed %d, retained replays %d",
		detect.Round(time.Millisecond), why, redial.Round(time.Millisecond), l.ops.Load(), st.Reconnects, st.Replayed, st.RetainedReplays)
	if detect > silentBound {
		t.Fatalf("detection took %v, want under %v", detect, silentBound)
	}
}

// slowSync is a backend whose next Sync, once armed, takes delay: a
// FLUSH over a large dirty cache on a loaded disk.
type slowSync struct {
	nbd.Backend
	delay time.Duration
	armed *atomic.Bool
}

func (b slowSync) Sync() error {
	if b.armed.CompareAndSwap(true, false) {
		time.Sleep(b.delay)
	}
	return b.Backend.Sync()
}

// TestDeadPeerSlowServerKept: a server whose one outstanding request (a
// FLUSH) takes three times DeadPeerTimeout, with nothing else to send,
// is slow, not dead: its host answers the keepalive, so the relay keeps
// the connection and the FLUSH succeeds on it.
func TestDeadPeerSlowServerKept(t *testing.T) {
	if err := mptcp.Available(); err != nil {
		t.Skipf("skipping: MPTCP unavailable: %v", err)
	}
	checkGoroutines(t)
	const bound = MinDeadPeerTimeout
	armed := new(atomic.Bool)
	ts := &testServer{t: t, backend: slowSync{Backend: nbd.NewMemBackend(1 << 20), delay: 3 * bound, armed: armed}, mptcp: true}
	ts.start()
	t.Cleanup(ts.kill)
	rg := newServerRig(t, ts, Options{DeadPeerTimeout: bound})
	if _, err := rg.client.WriteAt(make([]byte, 4096), 0); err != nil {
		t.Fatal(err)
	}
	armed.Store(true)
	start := time.Now()
	if err := rg.client.Flush(); err != nil {
		t.Fatal(err)
	}
	took := time.Since(start)
	st := rg.relay.Stats()
	t.Logf("a FLUSH of %v with a DeadPeerTimeout of %v: reconnects %d, connections declared dead %d", took.Round(time.Millisecond), bound, st.Reconnects, st.DeadPeers)
	if st.Reconnects != 0 || st.DeadPeers != 0 || rg.eventCount(EventDisconnected) != 0 {
		t.Fatalf("a slow server was declared dead: stats %+v", st)
	}
}

// TestDeadPeerSilentPathKeepsConnection: one path of a 4-subflow MPTCP
// connection falls silent (nftables drops everything on that interface of
// the storage host) under a write+verify load for three times
// DeadPeerTimeout. MPTCP carries on over the other subflows, whose
// acknowledgements keep the server's host heard from: the relay must not
// replace the connection, and I/O goes on.
func TestDeadPeerSilentPathKeepsConnection(t *testing.T) {
	topo.RequireNft(t)
	if err := mptcp.Available(); err != nil {
		t.Skipf("skipping: MPTCP unavailable: %v", err)
	}
	checkGoroutines(t)
	tp := topo.NewForTest(t, topo.Default4(topo.UniqueName("dq")))
	const size, block = 32 << 20, 64 << 10
	const bound = MinDeadPeerTimeout
	addr := net.JoinHostPort(tp.ServerAddr(1).String(), "10809")
	serveIn(t, tp.ServerNS, addr, nbd.NewMemBackend(size), nbd.Incarnation{1})
	dial := func(ctx context.Context) (net.Conn, error) {
		c, _, err := dialIn(ctx, tp.ClientNS, addr)
		return c, err
	}
	remote, info, err := dialIn(context.Background(), tp.ClientNS, addr)
	if err != nil {
		t.Fatal(err)
	}
	rg := newRig(t, remote, dial, &info, Options{DeadPeerTimeout: bound})
	load := startVerifyLoad(rg.client, size, block, 4)
	defer func() {
		if load != nil {
			rg.cancel()
			_ = load.finish()
		}
	}()
	waitFor(t, 10*time.Second, "4 subflows", func() bool {
		subs, err := mptcp.GetSubflows(remote)
		return err == nil && len(subs) == 4
	})
	if err := topo.Drop(tp.ServerNS, "onepath", tp.Paths[1].ServerIf); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = topo.Undrop(tp.ServerNS, "onepath") })
	before := load.ops.Load()
	time.Sleep(3 * bound)
	during := load.ops.Load() - before
	if err := topo.Undrop(tp.ServerNS, "onepath"); err != nil {
		t.Fatal(err)
	}
	l := load
	load = nil
	if err := l.finish(); err != nil {
		t.Fatalf("I/O across a silent path: %v", err)
	}
	st := rg.relay.Stats()
	t.Logf("path 2 silent for %v: %d operations verified meanwhile; reconnects %d, connections declared dead %d", 3*bound, during, st.Reconnects, st.DeadPeers)
	if st.DeadPeers != 0 || st.Reconnects != 0 {
		t.Fatalf("one silent path of a live MPTCP connection made the relay replace it: stats %+v", st)
	}
	if during == 0 {
		t.Fatal("no I/O completed while one path was silent")
	}
}

// TestFaultSilentServerSoak (MPNBD_SOAK=1): rounds of a 4-path MPTCP
// connection whose storage host falls silent for 20 s and comes back,
// under the write+verify load. Each silence must be noticed within
// silentBound of its start (long before it ends), the relay must be back
// on the same server after it, and every block must verify at the end.
func TestFaultSilentServerSoak(t *testing.T) {
	if os.Getenv("MPNBD_SOAK") != "1" {
		t.Skip("skipping: a soak test (MPNBD_SOAK=1)")
	}
	topo.RequireNft(t)
	if err := mptcp.Available(); err != nil {
		t.Skipf("skipping: MPTCP unavailable: %v", err)
	}
	tp := topo.NewForTest(t, topo.Default4(topo.UniqueName("ds")))
	const size, block = 64 << 20, 64 << 10
	const rounds, silence = 5, 20 * time.Second
	addr := net.JoinHostPort(tp.ServerAddr(1).String(), "10809")
	serveIn(t, tp.ServerNS, addr, nbd.NewMemBackend(size), nbd.Incarnation{1})
	dial := func(ctx context.Context) (net.Conn, error) {
		// One attempt a couple of seconds long, as attach.Dial gives an
		// address: a SYN into the silence is not retried for long.
		ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		c, _, err := dialIn(ctx, tp.ClientNS, addr)
		return c, err
	}
	remote, info, err := dialIn(context.Background(), tp.ClientNS, addr)
	if err != nil {
		t.Fatal(err)
	}
	lost := make(chan time.Time, rounds+1)
	back := make(chan time.Time, rounds+1)
	rg := newRig(t, remote, dial, &info, Options{OnEvent: func(e Event) {
		switch e.Kind {
		case EventDisconnected:
			lost <- time.Now()
		case EventReconnected:
			back <- time.Now()
		}
	}})
	load := startVerifyLoad(rg.client, size, block, 4)
	defer func() {
		if load != nil {
			rg.cancel()
			_ = load.finish()
		}
	}()
	for r := 1; r <= rounds; r++ {
		time.Sleep(2 * time.Second)
		if err := topo.Drop(tp.ServerNS, "silence", ""); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		var detect time.Duration
		select {
		case at := <-lost:
			detect = at.Sub(start)
		case <-time.After(silentBound):
			_ = topo.Undrop(tp.ServerNS, "silence")
			t.Fatalf("round %d: the silence was not noticed within %v (stats %+v)", r, silentBound, rg.relay.Stats())
		}
		time.Sleep(time.Until(start.Add(silence)))
		if err := topo.Undrop(tp.ServerNS, "silence"); err != nil {
			t.Fatal(err)
		}
		var redial time.Duration
		select {
		case at := <-back:
			redial = at.Sub(start.Add(silence))
		case <-time.After(30 * time.Second):
			t.Fatalf("round %d: no reconnect within 30 s of the silence's end (stats %+v)", r, rg.relay.Stats())
		}
		t.Logf("round %d: silence noticed after %v, reconnected %v after it ended", r, detect.Round(time.Millisecond), redial.Round(time.Millisecond))
		if e := load.errs.Load(); e != 0 {
			break
		}
	}
	l := load
	load = nil
	if err := l.finish(); err != nil {
		t.Fatalf("I/O across the silences: %v", err)
	}
	got := make([]byte, size)
	if _, err := rg.client.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if sum(got) != sum(l.model) {
		t.Fatal("the volume differs from what was written")
	}
	t.Logf("%d silences of %v: %d operations verified, 0 errors; stats %+v", rounds, silence, l.ops.Load(), rg.relay.Stats())
}
