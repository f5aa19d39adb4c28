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
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// While the remote is down the relay queues requests, but stops reading
// the local side once MaxInflightBytes is reached.
func TestBackpressure(t *testing.T) {
	checkGoroutines(t)
	const (
		limit   = 8 << 20
		writers = 48
		reqCost = reqHeaderSize + chunk
	)
	ts := newTestServer(t, writers*chunk, false)
	rg := newServerRig(t, ts, Options{MaxInflightBytes: limit, ReconnectBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond})
	waitFor(t, 5*time.Second, "connected", func() bool { return rg.relay.Stats().Connected })
	ts.kill()
	waitFor(t, 5*time.Second, "the relay to notice the dead server", func() bool { return !rg.relay.Stats().Connected })

	src := randomData(writers*chunk, 21)
	var wg sync.WaitGroup
	var finished atomic.Int64
	errs := make(chan error, writers)
	for i := 0; i < writers; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			off := i * chunk
			if _, err := rg.client.WriteAt(src[off:off+chunk], int64(off)); err != nil {
				errs <- err
			}
			finished.Add(1)
		}()
	}

	// Watch the table fill up and stop growing.
	peak := 0
	var last Stats
	stableSince := time.Now()
	deadline := time.Now().Add(10 * time.Second)
	for time.Since(stableSince) < 300*time.Millisecond {
		if time.Now().After(deadline) {
			t.Fatalf("the relay never stopped taking requests: %+v", last)
		}
		st := rg.relay.Stats()
		peak = max(peak, st.InFlightBytes)
		if st.InFlightBytes != last.InFlightBytes || st.BytesFromLocal != last.BytesFromLocal {
			stableSince = time.Now()
		}
		last = st
		time.Sleep(time.Millisecond)
	}
	t.Logf("held %d requests, %d bytes (peak %d, limit %d); read %d bytes from the kernel of %d sent",
		last.InFlight, last.InFlightBytes, peak, limit, last.BytesFromLocal, writers*(reqCost))
	if peak > limit+reqCost {
		t.Fatalf("in-flight bytes peaked at %d, over the limit %d + one request", peak, limit)
	}
	if last.InFlightBytes < limit-reqCost {
		t.Fatalf("in-flight bytes %d: the table did not fill up to the limit %d", last.InFlightBytes, limit)
	}
	if last.BytesFromLocal > uint64(limit+reqCost) {
		t.Fatalf("read %d bytes from the kernel side with a %d-byte limit: no backpressure", last.BytesFromLocal, limit)
	}
	if n := finished.Load(); n != 0 {
		t.Fatalf("%d writes finished while the server was down", n)
	}

	ts.start()
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	got := make([]byte, len(src))
	if _, err := ts.backend.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if sum(got) != sum(src) {
		t.Fatal("queued writes did not all land after the restart")
	}
	if st := rg.relay.Stats(); st.InFlight != 0 || st.InFlightBytes != 0 {
		t.Fatalf("stats after the drain: %+v", st)
	}
}

// rawFrames builds WRITE requests with handles 1..n of 4 KiB each,
// followed by NBD_CMD_DISC with handle 99.
func rawFrames(n int, data []byte) []byte {
	var out []byte
	var hdr [reqHeaderSize]byte
	for h := 1; h <= n; h++ {
		(&nbd.Request{Type: nbd.CmdWrite, Handle: uint64(h), Offset: uint64(h * 4096), Length: 4096}).Encode(hdr[:])
		out = append(out, hdr[:]...)
		out = append(out, data[h*4096:(h+1)*4096]...)
	}
	(&nbd.Request{Type: nbd.CmdDisc, Handle: 99}).Encode(hdr[:])
	return append(out, hdr[:]...)
}

// readReplies reads n simple replies from c and checks they answer
// handles 1..n, each once, without error; then it expects EOF.
func readReplies(t *testing.T, c net.Conn, n int) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	seen := map[uint64]bool{}
	var b [repHeaderSize]byte
	for i := 0; i < n; i++ {
		if _, err := io.ReadFull(c, b[:]); err != nil {
			t.Fatalf("reply %d: %v", i, err)
		}
		rep, err := nbd.DecodeReply(b[:])
		if err != nil || rep.Errno != 0 || rep.Handle < 1 || rep.Handle > uint64(n) || seen[rep.Handle] {
			t.Fatalf("reply %d: %+v, %v", i, rep, err)
		}
		seen[rep.Handle] = true
	}
	if k, err := c.Read(b[:1]); err != io.EOF {
		t.Fatalf("after the last reply: read %d, %v; want EOF", k, err)
	}
}

// checkDiscForwarded checks that a client stream ends with NBD_CMD_DISC.
func checkDiscForwarded(t *testing.T, up []byte) {
	t.Helper()
	if len(up) < reqHeaderSize {
		t.Fatalf("the server got %d bytes", len(up))
	}
	req, err := nbd.DecodeRequest(up[len(up)-reqHeaderSize:])
	if err != nil || req.Type != nbd.CmdDisc || req.Handle != 99 {
		t.Fatalf("last frame the server got: %+v, %v; want DISC", req, err)
	}
}

func TestDisc(t *testing.T) {
	checkGoroutines(t)
	const n = 8
	ts := newTestServer(t, 1<<20, false)
	px := newProxy(t, ts.addr, nil)
	remote, _, err := dialNegotiated(t.Context(), px.addr(), false)
	if err != nil {
		t.Fatal(err)
	}
	rg := newRig(t, remote, negotiatingDialer(px.addr(), false), nil, Options{})
	data := randomData((n+1)*4096, 31)
	if _, err := rg.kernel.Write(rawFrames(n, data)); err != nil {
		t.Fatal(err)
	}
	readReplies(t, rg.kernel, n)
	if err := rg.wait(10 * time.Second); err != nil {
		t.Fatalf("Run after DISC: %v", err)
	}
	checkDiscForwarded(t, px.upstream(0))
	got := make([]byte, n*4096)
	if _, err := ts.backend.ReadAt(got, 4096); err != nil {
		t.Fatal(err)
	}
	if sum(got) != sum(data[4096:]) {
		t.Fatal("writes before DISC did not land")
	}
	waitFor(t, 5*time.Second, "the server connection to close", func() bool { return ts.counter.live.Load() == 0 })
}

// DISC while the server is down: the relay waits for the requests in
// flight to be replayed and answered, then forwards DISC.
func TestDiscDuringOutage(t *testing.T) {
	checkGoroutines(t)
	const n = 8
	ts := newTestServer(t, 1<<20, false)
	px := newProxy(t, ts.addr, nil)
	remote, _, err := dialNegotiated(t.Context(), px.addr(), false)
	if err != nil {
		t.Fatal(err)
	}
	rg := newRig(t, remote, negotiatingDialer(px.addr(), false), nil,
		Options{ReconnectBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond})
	ts.kill()
	waitFor(t, 5*time.Second, "the relay to notice the dead server", func() bool { return !rg.relay.Stats().Connected })
	data := randomData((n+1)*4096, 32)
	if _, err := rg.kernel.Write(rawFrames(n, data)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	if st := rg.relay.Stats(); st.InFlight != n {
		t.Fatalf("in flight during the outage: %d, want %d", st.InFlight, n)
	}
	ts.start()
	readReplies(t, rg.kernel, n)
	if err := rg.wait(10 * time.Second); err != nil {
		t.Fatalf("Run after DISC: %v", err)
	}
	checkDiscForwarded(t, px.upstream(px.accepted()-1))
	got := make([]byte, n*4096)
	if _, err := ts.backend.ReadAt(got, 4096); err != nil {
		t.Fatal(err)
	}
	if sum(got) != sum(data[4096:]) {
		t.Fatal("writes replayed before DISC did not land")
	}
}

func TestLocalClose(t *testing.T) {
	checkGoroutines(t)
	ts := newTestServer(t, 1<<20, false)
	rg := newServerRig(t, ts, Options{})
	if _, err := rg.client.WriteAt(randomData(4096, 41), 0); err != nil {
		t.Fatal(err)
	}
	rg.kernel.Close()
	if err := rg.wait(5 * time.Second); err != nil {
		t.Fatalf("Run after the local side closed: %v", err)
	}
	waitFor(t, 5*time.Second, "the server connection to close", func() bool { return ts.counter.live.Load() == 0 })
	if st := rg.relay.Stats(); st.Connected || st.Remote != nil {
		t.Fatalf("stats after the end: %+v", st)
	}
}

func TestContextCancel(t *testing.T) {
	t.Run("connected", func(t *testing.T) {
		checkGoroutines(t)
		ts := newTestServer(t, 1<<20, false)
		rg := newServerRig(t, ts, Options{})
		if _, err := rg.client.WriteAt(randomData(4096, 42), 0); err != nil {
			t.Fatal(err)
		}
		rg.cancel()
		if err := rg.wait(5 * time.Second); !errors.Is(err, context.Canceled) {
			t.Fatalf("Run after cancel: %v", err)
		}
		waitFor(t, 5*time.Second, "the server connection to close", func() bool { return ts.counter.live.Load() == 0 })
		if _, err := rg.client.WriteAt(make([]byte, 4096), 0); err == nil {
			t.Fatal("the kernel side still works after the relay ended")
		}
	})
	t.Run("during outage", func(t *testing.T) {
		checkGoroutines(t)
		ts := newTestServer(t, 1<<20, false)
		rg := newServerRig(t, ts, Options{ReconnectBackoff: time.Second, MaxBackoff: time.Minute})
		ts.kill()
		waitFor(t, 5*time.Second, "the relay to notice", func() bool { return !rg.relay.Stats().Connected })
		go func() { _, _ = rg.client.WriteAt(make([]byte, 4096), 0) }() // stays queued
		waitFor(t, 5*time.Second, "the write to be queued", func() bool { return rg.relay.Stats().InFlight == 1 })
		start := time.Now()
		rg.cancel()
		if err := rg.wait(5 * time.Second); !errors.Is(err, context.Canceled) {
			t.Fatalf("Run after cancel: %v", err)
		}
		if d := time.Since(start); d > time.Second {
			t.Fatalf("Run took %v to stop while backing off", d)
		}
	})
}

// TestFailAfter: with FailAfter set, a request waiting for a server that
// stays away fails with EIO once the bound passes, and so do new ones at
// once; the relay goes on dialing, and I/O works again, with the data
// written before the outage intact, once the server is back.
func TestFailAfter(t *testing.T) {
	checkGoroutines(t)
	ts := newTestServer(t, 1<<20, false)
	const failAfter = 300 * time.Millisecond
	rg := newServerRig(t, ts, Options{ReconnectBackoff: 20 * time.Millisecond, MaxBackoff: 50 * time.Millisecond, FailAfter: failAfter})
	before := randomData(64<<10, 71)
	if _, err := rg.client.WriteAt(before, 0); err != nil {
		t.Fatal(err)
	}
	if err := rg.client.Flush(); err != nil {
		t.Fatal(err)
	}
	ts.kill()
	start := time.Now()
	_, err := rg.client.WriteAt(make([]byte, 4096), 1<<19)
	var nerr *nbd.Error
	if !errors.As(err, &nerr) || nerr.Errno != nbd.EIO {
		t.Fatalf("write with the server gone: %v, want an EIO reply", err)
	}
	if d := time.Since(start); d < failAfter-50*time.Millisecond {
		t.Fatalf("failed after %v, before FailAfter %v", d, failAfter)
	}
	ev := rg.eventsOf(EventFailing)
	if len(ev) != 1 || ev[0].Err == nil || ev[0].Attempts < 2 || ev[0].Failed != 1 {
		t.Fatalf("failing events: %+v", ev)
	}
	// Failing now: the next request does not wait.
	start = time.Now()
	if err := rg.client.Flush(); !errors.As(err, &nerr) || nerr.Errno != nbd.EIO {
		t.Fatalf("flush while failing: %v, want an EIO reply", err)
	}
	if d := time.Since(start); d > failAfter/2 {
		t.Fatalf("a request while failing took %v", d)
	}
	st := rg.relay.Stats()
	if !st.Failing || st.Failed != 2 || st.Connected {
		t.Fatalf("stats while failing: %+v", st)
	}
	select {
	case err := <-rg.done:
		rg.done <- err
		t.Fatalf("Run ended while the server was away: %v", err)
	default:
	}
	ts.start()
	waitFor(t, 10*time.Second, "the relay to reconnect", func() bool { return rg.relay.Stats().Connected })
	got := make([]byte, len(before))
	if _, err := rg.client.ReadAt(got, 0); err != nil || sum(got) != sum(before) {
		t.Fatalf("read back after the outage: %v (equal: %v)", err, sum(got) == sum(before))
	}
	if _, err := rg.client.WriteAt(make([]byte, 4096), 1<<19); err != nil {
		t.Fatalf("write once the server is back: %v", err)
	}
	if st := rg.relay.Stats(); st.Failing || st.Reconnects != 1 {
		t.Fatalf("stats after the outage: %+v", st)
	}
}

// Without an initial remote the relay dials first; requests that arrive
// meanwhile wait in the table.
func TestDialsFirst(t *testing.T) {
	checkGoroutines(t)
	ts := newTestServer(t, 1<<20, false)
	c, info, err := dialNegotiated(t.Context(), ts.addr, false)
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	rg := newRig(t, nil, negotiatingDialer(ts.addr, false), &info, Options{})
	want := randomData(64<<10, 61)
	if _, err := rg.client.WriteAt(want, 0); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(want))
	if _, err := rg.client.ReadAt(got, 0); err != nil || sum(got) != sum(want) {
		t.Fatalf("read back: %v", err)
	}
	if rg.eventCount(EventConnected) != 1 || rg.relay.Stats().Reconnects != 0 {
		t.Fatalf("events %+v, stats %+v", rg.events, rg.relay.Stats())
	}
}

// With no dialer a failed remote ends Run at once.
func TestNoDialer(t *testing.T) {
	checkGoroutines(t)
	ts := newTestServer(t, 1<<20, false)
	remote, info, err := dialNegotiated(t.Context(), ts.addr, false)
	if err != nil {
		t.Fatal(err)
	}
	rg := newRig(t, remote, nil, &info, Options{})
	if _, err := rg.client.WriteAt(make([]byte, 4096), 0); err != nil {
		t.Fatal(err)
	}
	ts.kill()
	if err := rg.wait(5 * time.Second); !errors.Is(err, ErrGaveUp) {
		t.Fatalf("Run: %v, want ErrGaveUp", err)
	}
}
