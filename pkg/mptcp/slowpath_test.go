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

package mptcp

import (
	"errors"
	"io"
	"log/slog"
	"net/netip"
	"slices"
	"testing"
	"time"
)

// fakePaths feeds SlowPaths a namespace with one subflow per path whose
// counters advance as the test says.
type fakePaths struct {
	now   time.Time
	addrs []netip.Addr
	acked map[netip.Addr]uint64
}

func newFakePaths(n int) *fakePaths {
	f := &fakePaths{now: time.Unix(1000, 0), acked: map[netip.Addr]uint64{}}
	for i := range n {
		f.addrs = append(f.addrs, netip.AddrFrom4([4]byte{10, 0, byte(i + 1), 1}))
	}
	return f
}

// rate is what one path does during a sample: bytes delivered, the
// delivery rate the kernel reports, whether it was app-limited.
type rate struct {
	bytes   uint64
	mbit    float64
	limited bool // not app-limited: the path was full
}

func busy(mbit float64) rate { return rate{bytes: 4 << 20, mbit: mbit, limited: true} }

var idle = rate{}

// sample advances the clock a second and returns the sockets.
func (f *fakePaths) sample(rates ...rate) []TCPSocket {
	f.now = f.now.Add(time.Second)
	var socks []TCPSocket
	for i, a := range f.addrs {
		r := rates[i]
		f.acked[a] += r.bytes
		socks = append(socks, TCPSocket{
			Cookie: uint64(i + 1), Subflow: true,
			Local:        netip.AddrPortFrom(a, 40000),
			Remote:       netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 0, byte(i + 1), 2}), 10809),
			BytesAcked:   f.acked[a],
			DeliveryRate: uint64(r.mbit * 1e6 / 8),
			AppLimited:   !r.limited,
		})
	}
	// A plain TCP socket on a managed address never counts.
	socks = append(socks, TCPSocket{Cookie: 99, Local: netip.AddrPortFrom(f.addrs[0], 22), BytesAcked: f.acked[f.addrs[0]] * 3, DeliveryRate: 1})
	return socks
}

func kinds(ev []PathEvent) []PathEventKind {
	var k []PathEventKind
	for _, e := range ev {
		k = append(k, e.Kind)
	}
	return k
}

func TestSlowPathsFlagProbeRecover(t *testing.T) {
	f := newFakePaths(4)
	sp := NewSlowPaths(SlowPathPolicy{ProbeAfter: 3 * time.Second, ProbeMax: 10 * time.Second})
	fast, slow := busy(950), busy(95)
	step := func(r ...rate) []PathEvent {
		t.Helper()
		return sp.Observe(f.now.Add(time.Second), f.sample(r...), f.addrs)
	}
	// The first sample only primes the counters.
	if ev := step(fast, fast, fast, slow); len(ev) != 0 {
		t.Fatalf("first sample: %v", kinds(ev))
	}
	// Two slow samples are not enough; the third flags.
	for i := range 2 {
		if ev := step(fast, fast, fast, slow); len(ev) != 0 {
			t.Fatalf("slow sample %d: %v", i+1, kinds(ev))
		}
	}
	ev := step(fast, fast, fast, slow)
	if len(ev) != 1 || ev[0].Kind != PathSlow || ev[0].Addr != f.addrs[3] {
		t.Fatalf("third slow sample: %+v, want path 4 slow", ev)
	}
	if got := sp.Flagged(); !slices.Equal(got, f.addrs[3:]) {
		t.Fatalf("flagged %v", got)
	}
	// Flagged, the path carries nothing; no probe before ProbeAfter.
	for range 2 {
		if ev := step(fast, fast, fast, idle); len(ev) != 0 {
			t.Fatalf("while flagged: %v", kinds(ev))
		}
	}
	if ev := step(fast, fast, fast, idle); len(ev) != 1 || ev[0].Kind != PathProbe {
		t.Fatalf("at ProbeAfter: %v, want probe", kinds(ev))
	}
	if len(sp.Flagged()) != 0 {
		t.Fatal("a probed path stays flagged")
	}
	// Idle samples leave the probe open; two slow busy samples (a path
	// back in use starts from an idle window) flag it again, the next
	// probe waits twice as long.
	step(idle, idle, idle, idle)
	if ev := step(fast, fast, fast, slow); len(ev) != 0 {
		t.Fatalf("first slow probe sample: %v", kinds(ev))
	}
	ev = step(fast, fast, fast, slow)
	if len(ev) != 1 || ev[0].Kind != PathStillSlow || ev[0].NextProbe != 6*time.Second {
		t.Fatalf("probe of a slow path: %+v, want still-slow with the next probe in 6s", ev)
	}
	for range 5 {
		if ev := step(fast, fast, fast, idle); len(ev) != 0 {
			t.Fatalf("while flagged again: %v", kinds(ev))
		}
	}
	if ev := step(fast, fast, fast, idle); len(ev) != 1 || ev[0].Kind != PathProbe {
		t.Fatalf("after 6s: %v, want probe", kinds(ev))
	}
	// Recovered: two samples at the others' rate.
	if ev := step(fast, fast, fast, busy(900)); len(ev) != 0 {
		t.Fatalf("first good probe sample: %v", kinds(ev))
	}
	if ev := step(fast, fast, fast, busy(900)); len(ev) != 1 || ev[0].Kind != PathRecovered {
		t.Fatalf("second good probe sample: %v, want recovered", kinds(ev))
	}
	// In use again, with the first probe wait restored: slow again means
	// three samples and a 3 s probe.
	step(fast, fast, fast, slow)
	step(fast, fast, fast, slow)
	if ev := step(fast, fast, fast, slow); len(ev) != 1 || ev[0].NextProbe != 3*time.Second {
		t.Fatalf("slow after recovery: %+v", ev)
	}
}

// TestSlowPathsMeasureAside: with a Measure, a flagged path is measured
// beside the connection and never unflagged to be probed while it is
// slow: each ProbeAfter a measure against the other paths' rate, the flag
// kept while the path measures under RecoverRatio of it, cleared once it
// measures over; a measure that fails falls back to clearing the flag.
func TestSlowPathsMeasureAside(t *testing.T) {
	f := newFakePaths(4)
	type call struct {
		local, remote netip.Addr
		rate          float64
	}
	var calls []call
	measured, measureErr := 11e6, error(nil)
	sp := NewSlowPaths(SlowPathPolicy{ProbeAfter: 3 * time.Second, ProbeMax: 10 * time.Second,
		Measure: func(local, remote netip.Addr, rate float64) (float64, error) {
			calls = append(calls, call{local, remote, rate})
			return measured, measureErr
		}})
	fast, slow := busy(950), busy(95)
	step := flagFourth(t, sp, f)
	var seen []PathEventKind
	for range 12 {
		ev := step(fast, fast, fast, idle)
		seen = append(seen, kinds(ev)...)
		for _, e := range ev {
			if e.Kind != PathStillSlow || !e.Measured || e.NextProbe != 3*time.Second || e.Rate != measured {
				t.Fatalf("while slow: %+v, want still-slow, measured aside, next in 3s", e)
			}
		}
		if !slices.Equal(sp.Flagged(), f.addrs[3:]) {
			t.Fatal("the flag of a path measured slow was cleared")
		}
	}
	if len(calls) != 4 {
		t.Fatalf("%d measures in 12 s with ProbeAfter 3s (events %v), want 4", len(calls), seen)
	}
	want := call{f.addrs[3], netip.AddrFrom4([4]byte{10, 0, 4, 2}), 1.25 * 0.6 * 950e6 / 8}
	if calls[0] != want {
		t.Fatalf("measure %+v, want %+v (the subflow's peer, at a quarter over RecoverRatio of the other paths' rate)", calls[0], want)
	}
	// While the flagged path carries data (the others cannot), it is not
	// measured: a probe would flood the one path left.
	before := len(calls)
	for range 4 {
		if ev := step(idle, idle, idle, slow); len(ev) != 0 {
			t.Fatalf("flagged path carrying data: %+v", ev)
		}
	}
	if len(calls) != before {
		t.Fatalf("%d measures of a flagged path that carried the data", len(calls)-before)
	}
	// Measured at RecoverRatio of the others or more: the flag goes.
	measured = 0.7 * 950e6 / 8
	var ev []PathEvent
	for range 3 {
		ev = append(ev, step(fast, fast, fast, idle)...)
	}
	if len(ev) != 1 || ev[0].Kind != PathRecovered || !ev[0].Measured || len(sp.Flagged()) != 0 {
		t.Fatalf("measured at 0.7 of the others: %+v, flagged %v; want recovered", ev, sp.Flagged())
	}
	// Slow again; a starved measure has no verdict (measured again
	// ProbeAfter later), a failing one clears the flag to probe.
	measureErr = ErrProbeStarved
	ev = nil
	for range 6 {
		ev = append(ev, step(fast, fast, fast, slow)...)
	}
	if len(ev) != 1 || ev[0].Kind != PathSlow || !slices.Equal(sp.Flagged(), f.addrs[3:]) {
		t.Fatalf("starved measures: %+v, flagged %v; want slow, flagged throughout", ev, sp.Flagged())
	}
	// Slow again within ProbeMax of a measured recovery (a path that
	// carries a probe's burst but not a stream): measured half as often.
	if ev[0].NextProbe != 6*time.Second {
		t.Fatalf("flagged again 3 s after a measured recovery: next measure in %v, want 6s", ev[0].NextProbe)
	}
	*sp.paths[f.addrs[3]] = pathState{}
	measureErr = errors.New("no echo reply")
	ev = nil
	for range 3 {
		ev = append(ev, step(fast, fast, fast, slow)...)
	}
	for range 3 {
		ev = append(ev, step(fast, fast, fast, idle)...)
	}
	if len(ev) != 2 || ev[1].Kind != PathProbe || ev[1].MeasureErr == nil || len(sp.Flagged()) != 0 {
		t.Fatalf("failing measure: %+v, flagged %v; want slow, then a probe that clears the flag", ev, sp.Flagged())
	}
}

// TestSlowPathsIgnoreSamplesWithoutRate: data that moved with no
// delivery rate measured (the kernel reports 0 until it has one) says
// nothing about the path: it neither flags a path nor fails a probe.
func TestSlowPathsIgnoreSamplesWithoutRate(t *testing.T) {
	f := newFakePaths(4)
	sp := NewSlowPaths(SlowPathPolicy{ProbeAfter: 3 * time.Second, ProbeMax: 10 * time.Second})
	fast, slow, unmeasured := busy(950), busy(95), busy(0)
	step := func(r ...rate) []PathEvent {
		t.Helper()
		return sp.Observe(f.now.Add(time.Second), f.sample(r...), f.addrs)
	}
	step(fast, fast, fast, fast) // primes the counters
	for i := range 6 {
		if ev := step(fast, fast, fast, unmeasured); len(ev) != 0 {
			t.Fatalf("sample %d without a rate: events %v", i, kinds(ev))
		}
	}
	// until steps with rates, at most n samples, until an event of kind
	// comes.
	until := func(kind PathEventKind, n int, r ...rate) {
		t.Helper()
		for range n {
			if slices.Contains(kinds(step(r...)), kind) {
				return
			}
		}
		t.Fatalf("no %v event in %d samples of %v", kind, n, r)
	}
	// Flag the path for real, then probe it with unmeasured samples
	// first: only measured ones decide.
	until(PathSlow, 5, fast, fast, fast, slow)
	until(PathProbe, 5, fast, fast, fast, idle)
	for i := range 4 {
		if ev := step(fast, fast, fast, unmeasured); len(ev) != 0 {
			t.Fatalf("probe sample %d without a rate: events %v", i, kinds(ev))
		}
	}
	until(PathRecovered, 6, fast, fast, fast, fast)
}

// TestSlowPathsProbeCountsDeliveredBytes: a probed path whose kernel
// delivery rate is a stale, tiny sample while it carries data at full
// speed is judged by what it delivered, not flagged again.
func TestSlowPathsProbeCountsDeliveredBytes(t *testing.T) {
	f := newFakePaths(4)
	sp := NewSlowPaths(SlowPathPolicy{ProbeAfter: 3 * time.Second, ProbeMax: 10 * time.Second})
	fast, slow := busy(950), busy(95)
	// 100 MB in the second (800 Mbit/s) with a delivery rate of 10 kbit/s.
	staleRate := rate{bytes: 100e6, mbit: 0.01, limited: true}
	step := func(r ...rate) []PathEvent {
		t.Helper()
		return sp.Observe(f.now.Add(time.Second), f.sample(r...), f.addrs)
	}
	var got []PathEventKind
	for range 12 {
		got = append(got, kinds(step(fast, fast, fast, slow))...)
		if slices.Contains(got, PathSlow) {
			break
		}
	}
	if !slices.Contains(got, PathSlow) {
		t.Fatalf("the slow path was not flagged: %v", got)
	}
	got = nil
	for range 8 {
		ev := step(fast, fast, fast, staleRate)
		got = append(got, kinds(ev)...)
		if slices.Contains(got, PathRecovered) {
			break
		}
	}
	if slices.Contains(got, PathStillSlow) || !slices.Contains(got, PathRecovered) {
		t.Fatalf("probe of a path delivering 800 Mbit/s with a stale rate sample: events %v, want a recovery", got)
	}
}

func TestSlowPathsHysteresis(t *testing.T) {
	f := newFakePaths(2)
	sp := NewSlowPaths(SlowPathPolicy{})
	step := func(r ...rate) []PathEvent { return sp.Observe(f.now.Add(time.Second), f.sample(r...), f.addrs) }
	step(busy(900), busy(100))
	// Slow one sample in three: its rate (the median of its last
	// samples) is not slow.
	for range 10 {
		for _, r := range []rate{busy(100), busy(500), busy(500)} {
			if ev := step(busy(900), r); len(ev) != 0 {
				t.Fatalf("slow one sample in three: %v", kinds(ev))
			}
		}
	}
	// Bursts on one path (a token bucket that filled while idle,
	// measured at the wire's speed), several samples in a row, make no
	// other path slow: they are compared with what the others deliver
	// as a whole, not with the best one.
	f4 := newFakePaths(4)
	sp4 := NewSlowPaths(SlowPathPolicy{})
	for i := range 10 {
		first := busy(950)
		if i >= 4 && i < 8 {
			first = busy(7500)
		}
		if ev := sp4.Observe(f4.now.Add(time.Second), f4.sample(first, busy(950), busy(900), busy(1000)), f4.addrs); len(ev) != 0 {
			t.Fatalf("sample %d with a burst on path 1: %v", i, kinds(ev))
		}
	}
	// App-limited samples never flag: the path was not full.
	for range 5 {
		if ev := step(busy(900), rate{bytes: 1 << 20, mbit: 10}); len(ev) != 0 {
			t.Fatalf("app-limited: %v", kinds(ev))
		}
	}
	// Nor do samples with too few bytes, nor idle ones.
	for range 5 {
		if ev := step(busy(900), rate{bytes: 1000, mbit: 10, limited: true}); len(ev) != 0 {
			t.Fatalf("few bytes: %v", kinds(ev))
		}
	}
	// Both paths equally slow: neither is slower than the other.
	for range 5 {
		if ev := step(busy(50), busy(50)); len(ev) != 0 {
			t.Fatalf("equal: %v", kinds(ev))
		}
	}
}

func TestSlowPathsKeepsOnePathInUse(t *testing.T) {
	f := newFakePaths(2)
	sp := NewSlowPaths(SlowPathPolicy{})
	step := func(managed []netip.Addr, r ...rate) []PathEvent {
		return sp.Observe(f.now.Add(time.Second), f.sample(r...), managed)
	}
	for range 4 {
		step(f.addrs, busy(900), busy(90))
	}
	if got := sp.Flagged(); !slices.Equal(got, f.addrs[1:]) {
		t.Fatalf("flagged %v, want path 2", got)
	}
	// The fast path's address goes: the slow one is all there is.
	ev := step(f.addrs[1:], idle, idle)
	if len(ev) != 1 || ev[0].Kind != PathGone || ev[0].Addr != f.addrs[1] {
		t.Fatalf("last path: %+v, want path 2 released", ev)
	}
	if len(sp.Flagged()) != 0 {
		t.Fatal("the only path left stays flagged")
	}
	// The slow path's address goes: its state goes with it.
	for range 4 {
		step(f.addrs, busy(900), busy(90))
	}
	ev = step(f.addrs[:1], busy(900), idle)
	if len(ev) != 1 || ev[0].Kind != PathGone || len(sp.Flagged()) != 0 {
		t.Fatalf("address gone: %+v, flagged %v", ev, sp.Flagged())
	}
}

func TestSlowPathsProbeBoundedAndBackoffCapped(t *testing.T) {
	f := newFakePaths(2)
	sp := NewSlowPaths(SlowPathPolicy{ProbeAfter: time.Second, ProbeMax: 4 * time.Second, ProbeSamples: 3})
	step := func(r ...rate) []PathEvent { return sp.Observe(f.now.Add(time.Second), f.sample(r...), f.addrs) }
	for range 4 {
		step(busy(900), busy(90))
	}
	var waits []time.Duration
	for range 30 {
		for _, e := range step(busy(900), busy(90)) {
			if e.Kind == PathStillSlow {
				waits = append(waits, e.NextProbe)
			}
		}
	}
	if len(waits) < 4 || waits[0] != 2*time.Second || waits[1] != 4*time.Second || waits[len(waits)-1] != 4*time.Second {
		t.Fatalf("probe waits %v, want 2s, 4s, then 4s", waits)
	}
	// A probed path between the two ratios is not slow enough to flag:
	// after ProbeSamples busy samples it stays in use.
	var got []PathEventKind
	for range 10 {
		got = append(got, kinds(step(busy(900), busy(400)))...)
	}
	if !slices.Contains(got, PathRecovered) || len(sp.Flagged()) != 0 {
		t.Fatalf("path at 0.44 of the best: events %v, flagged %v", got, sp.Flagged())
	}
}

func TestSlowPathWatchKicks(t *testing.T) {
	f := newFakePaths(2)
	w := newSlowPathWatch(NewSlowPaths(SlowPathPolicy{}), nil, slog.New(slog.NewTextHandler(io.Discard, nil)))
	var heard []PathEvent
	w.onEvent = func(e PathEvent) { heard = append(heard, e) }
	for range 4 {
		w.step(f.now.Add(time.Second), f.sample(busy(900), busy(90)), f.addrs)
	}
	select {
	case <-w.kick:
	default:
		t.Fatal("no kick after the flag")
	}
	// The decision is heard, as it is logged.
	if len(heard) != 1 || heard[0].Kind != PathSlow || heard[0].Addr != f.addrs[1] {
		t.Fatalf("heard %+v, want the second path flagged slow", heard)
	}
	if got := w.flagged(); !slices.Equal(got, f.addrs[1:]) {
		t.Fatalf("flagged %v", got)
	}
	w.step(f.now.Add(time.Second), f.sample(busy(900), idle), f.addrs)
	select {
	case <-w.kick:
		t.Fatal("kick without a change")
	default:
	}
}

// TestSlowPathsMeasureAsideCapped: when the rate a measure needs is over
// what Measure can send (MeasureMax; the other paths' rate sampled high),
// the path is measured at MeasureMax: one that carries clearly less stays
// flagged with no probe by data, and only one that carries it all (no
// verdict aside) is probed by clearing its flag.
func TestSlowPathsMeasureAsideCapped(t *testing.T) {
	f := newFakePaths(4)
	var rates []float64
	carried := 0.1 // of what is sent
	sp := NewSlowPaths(SlowPathPolicy{ProbeAfter: 3 * time.Second, ProbeMax: 10 * time.Second, MeasureMax: 40e6,
		Measure: func(_, _ netip.Addr, rate float64) (float64, error) {
			rates = append(rates, rate)
			return carried * rate, nil
		}})
	fast := busy(950)
	step := flagFourth(t, sp, f)
	for range 6 {
		for _, e := range step(fast, fast, fast, idle) {
			if e.Kind != PathStillSlow || !e.Measured {
				t.Fatalf("a path carrying a tenth of the capped measure: %+v, want still slow, measured aside", e)
			}
		}
	}
	if len(rates) == 0 || slices.ContainsFunc(rates, func(r float64) bool { return r != 40e6 }) {
		t.Fatalf("measured at %v, want each at MeasureMax", rates)
	}
	if !slices.Equal(sp.Flagged(), f.addrs[3:]) {
		t.Fatal("the flag of a path measured slow was cleared")
	}
	// Carrying all of the capped measure tells nothing aside: probed.
	carried = 1
	var ev []PathEvent
	for range 4 {
		ev = append(ev, step(fast, fast, fast, idle)...)
	}
	if !slices.ContainsFunc(ev, func(e PathEvent) bool { return e.Kind == PathProbe && e.MeasureErr != nil }) {
		t.Fatalf("a path carrying all of the capped measure: %+v, want a probe by data", ev)
	}
}

// flagFourth observes four paths of f, the fourth slow, until sp flags
// it, and returns the step that observes the next second's rates.
func flagFourth(t *testing.T, sp *SlowPaths, f *fakePaths) func(r ...rate) []PathEvent {
	t.Helper()
	step := func(r ...rate) []PathEvent {
		t.Helper()
		return sp.Observe(f.now.Add(time.Second), f.sample(r...), f.addrs)
	}
	fast, slow := busy(950), busy(95)
	for range 4 {
		step(fast, fast, fast, slow)
	}
	if got := sp.Flagged(); !slices.Equal(got, f.addrs[3:]) {
		t.Fatalf("flagged %v", got)
	}
	return step
}
