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
	"bytes"
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

func TestRoundTrip(t *testing.T) {
	checkGoroutines(t)
	const size = 32 << 20
	ts := newTestServer(t, size, false)
	rg := newServerRig(t, ts, Options{})
	cl := rg.client

	// Many concurrent requests of mixed sizes over distinct ranges; the
	// server runs each in its own goroutine, so replies overtake each other.
	want := randomData(size, 1)
	type span struct{ off, n int }
	var spans []span
	rnd := rand.New(rand.NewPCG(1, 2))
	for off := 0; off < size; {
		n := min((1+rnd.IntN(256))*4096, size-off)
		spans = append(spans, span{off, n})
		off += n
	}
	var wg sync.WaitGroup
	errs := make(chan error, len(spans))
	sem := make(chan struct{}, 48)
	for i, s := range spans {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			var err error
			if i%5 == 0 {
				_, err = cl.WriteAtFlags(want[s.off:s.off+s.n], int64(s.off), nbd.CmdFlagFUA)
			} else {
				_, err = cl.WriteAt(want[s.off:s.off+s.n], int64(s.off))
			}
			if err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if err := cl.Flush(); err != nil {
		t.Fatal(err)
	}

	got := make([]byte, size)
	errs = make(chan error, len(spans))
	for _, s := range spans {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			if _, err := cl.ReadAt(got[s.off:s.off+s.n], int64(s.off)); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if sum(got) != sum(want) {
		t.Fatal("data read back through the relay differs from what was written")
	}

	// Errors pass through unchanged: a read beyond the end.
	var e *nbd.Error
	if _, err := cl.ReadAt(make([]byte, 4096), size); !errors.As(err, &e) || e.Errno != nbd.EINVAL {
		t.Fatalf("read past the end: %v, want EINVAL", err)
	}
	if err := cl.Trim(0, 1<<20); err != nil {
		t.Fatal(err)
	}
	if err := cl.WriteZeroes(1<<20, 1<<20, true); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.ReadAt(got[:2<<20], 0); err != nil || !bytes.Equal(got[:2<<20], make([]byte, 2<<20)) {
		t.Fatalf("trimmed/zeroed range does not read as zeroes (%v)", err)
	}

	st := rg.relay.Stats()
	if !st.Connected || st.Remote == nil || st.InFlight != 0 || st.InFlightBytes != 0 || st.Reconnects != 0 {
		t.Fatalf("stats after the run: %+v", st)
	}
	if st.BytesFromLocal < 2*size/2 || st.BytesToLocal < size {
		t.Fatalf("byte counters too small: %+v", st)
	}
	if rg.eventCount(EventConnected) != 1 {
		t.Fatalf("events: %+v", rg.events)
	}

	// The client's Close sends NBD_CMD_DISC: Run ends cleanly.
	cl.Close()
	if err := rg.wait(10 * time.Second); err != nil {
		t.Fatalf("Run after DISC: %v", err)
	}
	waitFor(t, 5*time.Second, "the server connection to close", func() bool { return ts.counter.live.Load() == 0 })
}

func TestOutOfOrderReplies(t *testing.T) {
	checkGoroutines(t)
	const size = 4 << 20
	fs := newFakeServer(t, size, func(int) fakeMode { return fakeReverse })
	remote, err := fs.dialer()(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	info := nbd.ExportInfo{Size: size, Flags: nbd.FlagHasFlags | nbd.FlagSendFlush}
	rg := newRig(t, remote, fs.dialer(), &info, Options{})
	cl := rg.client

	want := randomData(size, 7)
	for round := 0; round < 2; round++ {
		var wg sync.WaitGroup
		errs := make(chan error, 64)
		got := make([]byte, size)
		for i := 0; i < 64; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				off := i * (size / 64)
				b := want[off : off+size/64]
				var err error
				if round == 0 {
					_, err = cl.WriteAt(b, int64(off))
				} else {
					_, err = cl.ReadAt(got[off:off+size/64], int64(off))
				}
				if err != nil {
					errs <- err
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
		if round == 1 && !bytes.Equal(got, want) {
			t.Fatal("reads answered out of order came back wrong")
		}
	}
	if fs.reversed.Load() == 0 {
		t.Fatal("the fake server never answered out of order; the test proves nothing")
	}
	if st := rg.relay.Stats(); st.Reconnects != 0 || st.InFlight != 0 {
		t.Fatalf("stats: %+v", st)
	}
}

// A reply for a handle never sent is a broken remote: the relay must not
// pass it on, and must get the request answered by a new connection.
func TestUnknownHandleReconnects(t *testing.T) {
	checkGoroutines(t)
	fs := newFakeServer(t, 1<<20, func(n int) fakeMode {
		if n == 0 {
			return fakeBogus
		}
		return fakeReverse
	})
	remote, err := fs.dialer()(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	info := nbd.ExportInfo{Size: 1 << 20, Flags: nbd.FlagHasFlags}
	rg := newRig(t, remote, fs.dialer(), &info, Options{ReconnectBackoff: 5 * time.Millisecond})
	want := randomData(8192, 3)
	if _, err := rg.client.WriteAt(want, 4096); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(want))
	if _, err := rg.client.ReadAt(got, 4096); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("read back: %v", err)
	}
	dis := rg.eventsOf(EventDisconnected)
	if len(dis) != 1 || !errors.Is(dis[0].Err, nbd.ErrProtocol) {
		t.Fatalf("disconnect events %+v, want one protocol error", dis)
	}
	if rg.relay.Stats().Reconnects != 1 || rg.eventCount(EventReconnected) != 1 {
		t.Fatalf("stats %+v", rg.relay.Stats())
	}
}

// NBD_ESHUTDOWN means the server is going away: the request is retried on
// the next connection rather than failed.
func TestShutdownReplyIsRetried(t *testing.T) {
	checkGoroutines(t)
	fs := newFakeServer(t, 1<<20, func(n int) fakeMode {
		if n < 2 {
			return fakeShutdown
		}
		return fakeReverse
	})
	remote, err := fs.dialer()(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	info := nbd.ExportInfo{Size: 1 << 20, Flags: nbd.FlagHasFlags}
	rg := newRig(t, remote, fs.dialer(), &info, Options{ReconnectBackoff: 5 * time.Millisecond})
	want := randomData(4096, 4)
	if _, err := rg.client.WriteAt(want, 0); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(want))
	if _, err := rg.client.ReadAt(got, 0); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("read back: %v", err)
	}
	if n := rg.relay.Stats().Reconnects; n != 2 {
		t.Fatalf("reconnects = %d, want 2", n)
	}
}

func TestRunTwice(t *testing.T) {
	checkGoroutines(t)
	ts := newTestServer(t, 1<<20, false)
	rg := newServerRig(t, ts, Options{})
	waitFor(t, 5*time.Second, "connected", func() bool { return rg.relay.Stats().Connected })
	if err := rg.relay.Run(t.Context()); !errors.Is(err, ErrRunning) {
		t.Fatalf("second Run: %v", err)
	}
}

// Unanswered requests are replayed in the order they arrived, those that
// arrived during the outage after the others, and each is answered once.
func TestReplayOrder(t *testing.T) {
	checkGoroutines(t)
	fs := newFakeServer(t, 1<<20, func(n int) fakeMode {
		if n == 0 {
			return fakeHold
		}
		return fakeReverse
	})
	remote, err := fs.dialer()(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	gate := make(chan struct{})
	dial := func(ctx context.Context) (net.Conn, error) {
		select {
		case <-gate:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		return fs.dialer()(ctx)
	}
	rg := newRig(t, remote, dial, nil, Options{ReconnectBackoff: 5 * time.Millisecond})

	// Handles in arrival order: not sorted, mixed commands.
	handles := []uint64{40, 7, 300, 2, 99, 1 << 40, 5, 61}
	frame := func(i int) []byte {
		var hdr [reqHeaderSize]byte
		q := nbd.Request{Handle: handles[i], Offset: uint64(i) * 4096, Length: 4096}
		switch i % 3 {
		case 0:
			q.Type = nbd.CmdRead
		case 1:
			q.Type = nbd.CmdWrite
		case 2:
			q.Type, q.Length = nbd.CmdFlush, 0
		}
		q.Encode(hdr[:])
		if q.Type == nbd.CmdWrite {
			return append(hdr[:], randomData(4096, uint64(i))...)
		}
		return hdr[:]
	}
	for i := 0; i < 5; i++ {
		if _, err := rg.kernel.Write(frame(i)); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 5*time.Second, "the first connection to get 5 requests", func() bool { return len(fs.received(0)) == 5 })
	fs.drop(0)
	waitFor(t, 5*time.Second, "the relay to notice", func() bool { return !rg.relay.Stats().Connected })
	for i := 5; i < len(handles); i++ {
		if _, err := rg.kernel.Write(frame(i)); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 5*time.Second, "the outage arrivals to be queued", func() bool { return rg.relay.Stats().InFlight == len(handles) })
	close(gate)

	seen := map[uint64]bool{}
	var b [repHeaderSize]byte
	rg.kernel.SetReadDeadline(time.Now().Add(10 * time.Second))
	for range handles {
		if _, err := io.ReadFull(rg.kernel, b[:]); err != nil {
			t.Fatal(err)
		}
		rep, err := nbd.DecodeReply(b[:])
		if err != nil || rep.Errno != 0 || seen[rep.Handle] {
			t.Fatalf("reply %+v, %v", rep, err)
		}
		seen[rep.Handle] = true
		if i := slices.Index(handles, rep.Handle); i%3 == 0 {
			if _, err := io.ReadFull(rg.kernel, make([]byte, 4096)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if got := fs.received(1); !slices.Equal(got, handles) {
		t.Fatalf("the new connection got %v, want arrival order %v", got, handles)
	}
	if got := fs.received(0); !slices.Equal(got, handles[:5]) {
		t.Fatalf("the first connection got %v, want %v", got, handles[:5])
	}
	// The last replay is the one on the new connection (requests that
	// beat the first connection's setup may have been sent by a replay too).
	if ev := rg.eventsOf(EventReplayed); len(ev) == 0 || ev[len(ev)-1].Replayed != len(handles) {
		t.Fatalf("replayed events %+v, want the last of %d", ev, len(handles))
	}
}
