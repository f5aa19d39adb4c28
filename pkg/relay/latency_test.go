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
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// requestsOf is the snapshot of op in l, zero when it has none.
func requestsOf(l *Latency, op string) RequestStats {
	for _, s := range l.Requests() {
		if s.Op == op {
			return s
		}
	}
	return RequestStats{Op: op}
}

// checkRequests fails unless l counted want requests of op, with the
// given replies of the server (ok, errors) and failures of the relay's
// own.
func checkRequests(t *testing.T, l *Latency, op string, want, ok, errs, failed uint64) RequestStats {
	t.Helper()
	s := requestsOf(l, op)
	if s.Count() != want || s.OK != ok || s.Errors != errs || s.Failed != failed {
		t.Errorf("%s: %d requests (%d ok, %d errors, %d failed), want %d (%d, %d, %d)",
			op, s.Count(), s.OK, s.Errors, s.Failed, want, ok, errs, failed)
	}
	return s
}

func TestBucketIndex(t *testing.T) {
	for _, c := range []struct {
		d    time.Duration
		want int
	}{
		{-time.Second, 0}, {0, 0}, {time.Microsecond, 0}, {100 * time.Microsecond, 0},
		{100*time.Microsecond + 1, 1}, {200 * time.Microsecond, 1}, {250 * time.Microsecond, 2},
		{time.Second, 14}, {time.Hour, len(LatencyBounds)},
	} {
		i := bucketIndex(c.d)
		if i != c.want {
			t.Errorf("bucketIndex(%v) = %d, want %d", c.d, i, c.want)
		}
		// The bucket's bound is the first the duration does not exceed.
		s := c.d.Seconds()
		if i < len(LatencyBounds) && s > LatencyBounds[i] || i > 0 && s <= LatencyBounds[i-1] {
			t.Errorf("%v in the bucket of bound %d, out of (%v, %v]", c.d, i, LatencyBounds[max(i-1, 0)], LatencyBounds[min(i, len(LatencyBounds)-1)])
		}
	}
}

// TestLatencyCountsEveryAnswer: every request of the local side is
// counted once, by command and outcome, when the relay answers it: the
// server's replies, an error reply, and a write that waits through a
// server kill and is replayed on the next connection, whose time
// includes the outage.
func TestLatencyCountsEveryAnswer(t *testing.T) {
	ts := newTestServer(t, 1<<20, false)
	lat := NewLatency()
	rg := newServerRig(t, ts, Options{Latency: lat, ReconnectBackoff: time.Millisecond, MaxBackoff: 20 * time.Millisecond})
	const reads, writes, flushes, zeroes = 7, 5, 3, 2
	buf := make([]byte, 4096)
	for i := range writes {
		if _, err := rg.client.WriteAt(buf, int64(i)*4096); err != nil {
			t.Fatal(err)
		}
	}
	for i := range reads {
		if _, err := rg.client.ReadAt(buf, int64(i)*4096); err != nil {
			t.Fatal(err)
		}
	}
	for range flushes {
		if err := rg.client.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	for i := range zeroes {
		if err := rg.client.WriteZeroes(int64(i)*4096, 4096, false); err != nil {
			t.Fatal(err)
		}
	}
	// Past the end: the server's error reply.
	var ne *nbd.Error
	if _, err := rg.client.ReadAt(buf, 1<<20); !errors.As(err, &ne) || ne.Errno != nbd.EINVAL {
		t.Fatalf("read past the end: %v, want EINVAL", err)
	}
	checkRequests(t, lat, "read", reads+1, reads, 1, 0)
	checkRequests(t, lat, "write", writes, writes, 0, 0)
	checkRequests(t, lat, "flush", flushes, flushes, 0, 0)
	checkRequests(t, lat, "write_zeroes", zeroes, zeroes, 0, 0)
	if s := requestsOf(lat, "trim"); s.Count() != 0 {
		t.Errorf("%d trims counted, none sent", s.Count())
	}
	before := requestsOf(lat, "write")

	// A write waiting through an outage.
	ts.kill()
	done := make(chan error, 1)
	go func() {
		_, err := rg.client.WriteAt(buf, 0)
		done <- err
	}()
	waitFor(t, 10*time.Second, "the write to wait", func() bool { return rg.relay.Stats().InFlight == 1 })
	waited := time.Now()
	time.Sleep(200 * time.Millisecond)
	outage := time.Since(waited)
	ts.start()
	if err := <-done; err != nil {
		t.Fatalf("write through the outage: %v", err)
	}
	after := checkRequests(t, lat, "write", writes+1, writes+1, 0, 0)
	if d := after.Sum - before.Sum; d < outage {
		t.Errorf("the write through the outage took %v, less than the outage (%v)", d, outage)
	}
	// It is in a bucket of at least the outage.
	var slow uint64
	for i, n := range after.Buckets {
		if i == len(LatencyBounds) || LatencyBounds[i] >= outage.Seconds() {
			slow += n - before.Buckets[i]
		}
	}
	if slow != 1 {
		t.Errorf("%d writes in buckets of the outage or longer, want 1", slow)
	}
	if rg.relay.Stats().Latency != lat {
		t.Error("Stats does not give the relay's Latency")
	}
}

// TestLatencyCountsFailures: requests the relay fails itself count as
// failed, once: EIO once the outage outlasts FailAfter, and the end of
// the relay while a request waits.
func TestLatencyCountsFailures(t *testing.T) {
	lat := NewLatency()
	ts, _, cl := startCalls(t, 1<<20, Options{Latency: lat, ReconnectBackoff: time.Millisecond, MaxBackoff: 20 * time.Millisecond, FailAfter: 200 * time.Millisecond})
	ts.kill()
	var ne *nbd.Error
	if _, err := cl.WriteAt(make([]byte, 4096), 0); !errors.As(err, &ne) || ne.Errno != nbd.EIO {
		t.Fatalf("write with the server gone: %v, want EIO", err)
	}
	s := checkRequests(t, lat, "write", 1, 0, 0, 1)
	if s.Sum < 200*time.Millisecond {
		t.Errorf("the failed write took %v, less than FailAfter", s.Sum)
	}

	// No FailAfter: the read waits until the relay ends.
	ts2 := newTestServer(t, 1<<20, false)
	dial := sessionDialer(ts2.addr, nbd.NewSessionID())
	remote, err := dial(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	lat2 := NewLatency()
	r := New(nil, remote, dial, Options{Logger: quietLogger(), Latency: lat2, ReconnectBackoff: time.Millisecond, MaxBackoff: 20 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- r.Run(ctx) }()
	ts2.kill()
	got := make(chan error, 1)
	r.Start(nbd.Request{Type: nbd.CmdRead, Length: 4096}, nil, nil, make([]byte, 4096), func(err error) { got <- err })
	waitFor(t, 10*time.Second, "the read to wait", func() bool { return r.Stats().InFlight == 1 })
	cancel()
	<-ran
	if err := <-got; !errors.Is(err, ErrClosed) {
		t.Fatalf("read at the end: %v, want ErrClosed", err)
	}
	checkRequests(t, lat2, "read", 1, 0, 0, 1)
	// After the end a request is refused, not taken: not counted.
	r.Start(nbd.Request{Type: nbd.CmdFlush}, nil, nil, nil, func(err error) { got <- err })
	if err := <-got; !errors.Is(err, ErrClosed) {
		t.Fatalf("flush after the end: %v, want ErrClosed", err)
	}
	checkRequests(t, lat2, "flush", 0, 0, 0, 0)
	checkRequests(t, lat2, "read", 1, 0, 0, 1)
}
