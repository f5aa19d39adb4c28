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
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

const (
	chunk      = 1 << 20
	queueDepth = 16
)

// restartSize is the amount moved by the restart tests: 256 MiB, less
// under the race detector or -short, where it would not fit in a few
// seconds.
func restartSize() int {
	if raceEnabled || testing.Short() {
		return 64 << 20
	}
	return 256 << 20
}

// pump runs queueDepth workers over every 1 MiB chunk of size bytes and
// calls midway once half of them are done. It returns the errors seen.
func pump(size int, do func(off int) error, midway func()) []error {
	n := size / chunk
	var next, done atomic.Int64
	var once sync.Once
	var mu sync.Mutex
	var errs []error
	var wg sync.WaitGroup
	for w := 0; w < queueDepth; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= int64(n) {
					return
				}
				if err := do(int(i) * chunk); err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
				}
				if done.Add(1) >= int64(n/2) {
					once.Do(func() { go midway() })
				}
			}
		}()
	}
	wg.Wait()
	return errs
}

// restartServer kills ts hard and starts a new server on the same address
// and backend after 300 ms.
func restartServer(ts *testServer, restarted chan<- struct{}) func() {
	return func() {
		ts.kill()
		time.Sleep(300 * time.Millisecond)
		ts.start()
		close(restarted)
	}
}

func checkRecovered(t *testing.T, rg *rig) {
	t.Helper()
	st := rg.relay.Stats()
	if st.Reconnects < 1 || st.InFlight != 0 || st.InFlightBytes != 0 {
		t.Fatalf("stats after the restart: %+v", st)
	}
	if rg.eventCount(EventDisconnected) < 1 || rg.eventCount(EventReconnected) < 1 || rg.eventCount(EventReplayed) < 1 {
		t.Fatalf("events: %+v", rg.events)
	}
	replayed := 0
	for _, e := range rg.eventsOf(EventReplayed) {
		replayed += e.Replayed
	}
	t.Logf("reconnects %d, requests replayed %d, outage %v", st.Reconnects, replayed, rg.eventsOf(EventReconnected)[0].Outage)
}

func TestServerRestartMidWrite(t *testing.T) {
	checkGoroutines(t)
	size := restartSize()
	ts := newTestServer(t, int64(size), false)
	rg := newServerRig(t, ts, Options{ReconnectBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond})
	src := randomData(size, 11)

	restarted := make(chan struct{})
	start := time.Now()
	errs := pump(size, func(off int) error {
		_, err := rg.client.WriteAt(src[off:off+chunk], int64(off))
		return err
	}, restartServer(ts, restarted))
	<-restarted
	if len(errs) > 0 {
		t.Fatalf("%d write errors through the restart, first: %v", len(errs), errs[0])
	}
	t.Logf("wrote %d MiB in %v across a server restart", size>>20, time.Since(start).Round(time.Millisecond))
	if err := rg.client.Flush(); err != nil {
		t.Fatal(err)
	}
	checkRecovered(t, rg)

	got := make([]byte, size)
	if errs := pump(size, func(off int) error {
		_, err := rg.client.ReadAt(got[off:off+chunk], int64(off))
		return err
	}, func() {}); len(errs) > 0 {
		t.Fatal(errs[0])
	}
	if sum(got) != sum(src) {
		t.Fatal("sha256 of the data read back differs from what was written")
	}
	backend := make([]byte, size)
	if _, err := ts.backend.ReadAt(backend, 0); err != nil {
		t.Fatal(err)
	}
	if sum(backend) != sum(src) {
		t.Fatal("sha256 of the backend differs from what was written")
	}
}

func TestServerRestartMidRead(t *testing.T) {
	checkGoroutines(t)
	size := restartSize()
	ts := newTestServer(t, int64(size), false)
	src := randomData(size, 12)
	if _, err := ts.backend.WriteAt(src, 0); err != nil {
		t.Fatal(err)
	}
	rg := newServerRig(t, ts, Options{ReconnectBackoff: 20 * time.Millisecond, MaxBackoff: 200 * time.Millisecond})

	got := make([]byte, size)
	restarted := make(chan struct{})
	start := time.Now()
	errs := pump(size, func(off int) error {
		_, err := rg.client.ReadAt(got[off:off+chunk], int64(off))
		return err
	}, restartServer(ts, restarted))
	<-restarted
	if len(errs) > 0 {
		t.Fatalf("%d read errors through the restart, first: %v", len(errs), errs[0])
	}
	t.Logf("read %d MiB in %v across a server restart", size>>20, time.Since(start).Round(time.Millisecond))
	if sum(got) != sum(src) {
		t.Fatal("sha256 of the data read differs from the backend")
	}
	checkRecovered(t, rg)
}

// The remote dies by connection reset in the middle of read payloads,
// three times; the kernel must see complete, correct replies only.
func TestResetMidReadPayload(t *testing.T) {
	checkGoroutines(t)
	size := restartSize()
	ts := newTestServer(t, int64(size), false)
	src := randomData(size, 13)
	if _, err := ts.backend.WriteAt(src, 0); err != nil {
		t.Fatal(err)
	}
	// Cut points land inside a payload: replies are 16 + 1 MiB bytes long
	// and the handshake is a few hundred bytes.
	cuts := []int64{3*chunk/2 + 777, 3*chunk + 12345, 700_000}
	px := newProxy(t, ts.addr, func(n int) int64 {
		if n < len(cuts) {
			return cuts[n]
		}
		return -1
	})
	remote, info, err := dialNegotiated(t.Context(), px.addr(), false)
	if err != nil {
		t.Fatal(err)
	}
	rg := newRig(t, remote, negotiatingDialer(px.addr(), false), &info,
		Options{ReconnectBackoff: 5 * time.Millisecond, MaxBackoff: 50 * time.Millisecond})

	got := make([]byte, size)
	errs := pump(size, func(off int) error {
		_, err := rg.client.ReadAt(got[off:off+chunk], int64(off))
		return err
	}, func() {})
	if len(errs) > 0 {
		t.Fatalf("%d read errors, first: %v", len(errs), errs[0])
	}
	if sum(got) != sum(src) {
		t.Fatal("sha256 of the data read differs from the backend")
	}
	if c := px.cuts.Load(); c != int64(len(cuts)) {
		t.Fatalf("proxy cut %d connections, want %d", c, len(cuts))
	}
	if st := rg.relay.Stats(); st.Reconnects != len(cuts) {
		t.Fatalf("reconnects = %d, want %d", st.Reconnects, len(cuts))
	}
	inPayload := 0
	for _, e := range rg.eventsOf(EventDisconnected) {
		// The cut points lie inside read payloads; the relay notices the
		// reset there, or, when a request goes out first, on that write.
		switch {
		case e.Err != nil && strings.Contains(e.Err.Error(), "read payload"):
			inPayload++
		case e.Err != nil && strings.Contains(e.Err.Error(), "write"):
			t.Logf("reset noticed while sending a request: %v", e.Err)
		default:
			t.Errorf("disconnect neither inside a read payload nor on a write: %v", e.Err)
		}
	}
	if inPayload == 0 {
		t.Error("no reset was noticed inside a read payload, the case this test is about")
	}

	// Writes take the same road.
	want := randomData(8*chunk, 14)
	if _, err := rg.client.WriteAt(want, 0); err != nil {
		t.Fatal(err)
	}
	back := make([]byte, len(want))
	if _, err := ts.backend.ReadAt(back, 0); err != nil {
		t.Fatal(err)
	}
	if sum(back) != sum(want) {
		t.Fatal("write through the proxy did not land")
	}
}
