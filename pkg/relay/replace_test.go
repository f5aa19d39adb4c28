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
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// TestReplaceUnderLoad: connections replaced again and again while
// writers and readers run lose nothing and fail nothing, count as
// replacements and not as reconnects, and leave one connection on the
// server; with a server that knows sessions and with one that is only
// told nothing (plain handshakes).
func TestReplaceUnderLoad(t *testing.T) {
	for _, tc := range []struct {
		name     string
		sessions bool
	}{{"sessions", true}, {"plain", false}} {
		t.Run(tc.name, func(t *testing.T) {
			checkGoroutines(t)
			const size, workers, region = 16 << 20, 4, 4 << 20
			ts := newTestServer(t, size, false)
			dial := sessionDialer(ts.addr, nbd.NewSessionID())
			if !tc.sessions {
				dial = func(ctx context.Context) (net.Conn, error) {
					c, info, err := dialNegotiated(ctx, ts.addr, false)
					if err != nil {
						return nil, err
					}
					return &Remote{Conn: c, Info: info}, nil
				}
			}
			remote, err := dial(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			r := startLocal(t, remote, dial, Options{})
			cl := nbd.NewClientOn(remote.(*Remote).Info, r, quietLogger())

			stop := make(chan struct{})
			wg, errs := verifyingWriters(cl, workers, region, 16, stop)
			const swaps = 8
			for i := range swaps {
				time.Sleep(30 * time.Millisecond)
				c, err := dial(context.Background())
				if err != nil {
					t.Fatal(err)
				}
				if err := r.Replace(c); err != nil {
					t.Fatalf("replace %d: %v (%+v)", i, err, r.Stats())
				}
			}
			time.Sleep(30 * time.Millisecond)
			close(stop)
			waitDone(t, wg, 30*time.Second, "workers")
			select {
			case err := <-errs:
				t.Fatal(err)
			default:
			}
			if err := cl.Flush(); err != nil {
				t.Fatal(err)
			}
			st := r.Stats()
			if st.Replaced != swaps || st.Reconnects != 0 || st.Replayed != 0 {
				t.Errorf("replaced %d, reconnects %d, replayed %d; want %d, 0, 0", st.Replaced, st.Reconnects, st.Replayed, swaps)
			}
			deadline := time.Now().Add(10 * time.Second)
			for ts.counter.live.Load() != 1 {
				if time.Now().After(deadline) {
					t.Fatalf("%d connections open on the server, want 1", ts.counter.live.Load())
				}
				time.Sleep(10 * time.Millisecond)
			}
			if err := cl.Close(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestReplaceRefused: a relay that is not connected, or closed, takes
// no connection, and closes the one offered.
func TestReplaceRefused(t *testing.T) {
	checkGoroutines(t)
	ts, r, cl := startCalls(t, 1<<20, Options{ReconnectBackoff: time.Hour, MaxBackoff: time.Hour})
	if _, err := cl.WriteAt(make([]byte, 4096), 0); err != nil {
		t.Fatal(err)
	}
	dial := sessionDialer(ts.addr, nbd.NewSessionID())
	spare, err := dial(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	ts.cut()
	deadline := time.Now().Add(10 * time.Second)
	for r.Stats().Connected {
		if time.Now().After(deadline) {
			t.Fatal("relay still connected after the server cut its connections")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := r.Replace(spare); !errors.Is(err, ErrNotReplaced) {
		t.Fatalf("Replace while down: %v, want ErrNotReplaced", err)
	}
	if _, err := spare.Write([]byte{0}); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("the refused connection is still open (write: %v)", err)
	}
}

// TestReplaceAcrossServerRestarts: swaps tried while the server is
// killed and restarted under the writers (a spare may die before, during
// or after it takes over) lose nothing and fail no request.
func TestReplaceAcrossServerRestarts(t *testing.T) {
	checkGoroutines(t)
	const size, workers, region = 8 << 20, 4, 2 << 20
	ts, r, cl := startCalls(t, size, Options{ReconnectBackoff: time.Millisecond})
	dial := sessionDialer(ts.addr, nbd.NewSessionID())
	stop := make(chan struct{})
	wg, errs := verifyingWriters(cl, workers, region, 8, stop)
	swapped := 0
	for i := range 40 {
		if i%5 == 2 {
			ts.kill()
			go func() { time.Sleep(20 * time.Millisecond); ts.start() }()
		}
		time.Sleep(10 * time.Millisecond)
		c, err := dial(context.Background())
		if err != nil {
			continue // the server is away
		}
		if r.Replace(c) == nil {
			swapped++
		}
	}
	close(stop)
	waitDone(t, wg, 60*time.Second, "workers")
	select {
	case err := <-errs:
		t.Fatal(err)
	default:
	}
	st := r.Stats()
	t.Logf("%d swaps tried through, %d counted as replacements, %d reconnects", swapped, st.Replaced, st.Reconnects)
	if st.Replaced == 0 || st.Reconnects == 0 {
		t.Errorf("replaced %d, reconnects %d: the test exercised one side only", st.Replaced, st.Reconnects)
	}
	if err := cl.Close(); err != nil {
		t.Fatal(err)
	}
}

// verifyingWriters starts workers goroutines, each writing random blocks
// (region/blocks bytes) in a region of its own, reading each back and
// comparing, until stop closes; the first failure of each is sent on
// errs.
func verifyingWriters(cl *nbd.Client, workers int, region int64, blocks int64, stop <-chan struct{}) (*sync.WaitGroup, <-chan error) {
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			base := int64(w) * region
			for i := uint64(1); ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				off := base + int64(i%uint64(blocks))*(region/blocks)
				data := randomData(int(region/blocks), uint64(w)<<32|i)
				if _, err := cl.WriteAt(data, off); err != nil {
					errs <- fmt.Errorf("worker %d write %d: %w", w, i, err)
					return
				}
				got := make([]byte, len(data))
				if _, err := cl.ReadAt(got, off); err != nil {
					errs <- fmt.Errorf("worker %d read %d: %w", w, i, err)
					return
				}
				if !bytes.Equal(got, data) {
					errs <- fmt.Errorf("worker %d round %d: read back differs from what was written", w, i)
					return
				}
			}
		}()
	}
	return &wg, errs
}
