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
	"cmp"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"time"
)

// Slow paths and the backup flag.
//
// One MPTCP connection over paths of unequal speed is a lottery: the
// default scheduler keeps the slow subflow's window full, so data the
// receiver needs next waits behind it while the fast subflows idle, and a
// connection over 3 x 1 Gbit/s + 100 Mbit/s gets anywhere from half to all
// of the fast paths' sum. With the slow path's endpoint flagged backup it
// carries nothing while the others work, and the connection gets the fast
// paths' sum every time.
//
// SlowPaths decides which local addresses to flag, from what the kernel
// measures on every subflow: tcpi_delivery_rate, the rate at which the
// subflow's data reached the peer over its last round trips. A subflow
// whose window the scheduler keeps full (not app-limited) measures its
// path's capacity, and a subflow of a fast path measures at least its own
// share; so a path whose busy subflows deliver at under SlowRatio of what
// the other paths deliver, FlagAfter samples in a row, is slow. A path's
// rate is the median of its last busy samples and the others' is the
// median of theirs: a token bucket that filled while idle, or compressed
// ACKs, make single samples far above any line. The decision is
// the sender's: each host measures what it sends (the node its writes, the
// storage server its reads), and its flag reaches the peer by MP_PRIO, so
// either host's flag takes the path out of both directions.
//
// A flagged path carries no data, so nothing measures it any more. With
// a Measure in the policy (Keep uses ProbePath, ICMP echo at the other
// paths' rate), SlowPaths measures it beside the connection every
// ProbeAfter and clears the flag once it carries RecoverRatio of the
// other paths: the connection's data never goes near a path that is still
// slow. Without one, or when it fails, SlowPaths clears the flag after ProbeAfter and
// watches the path's next two busy samples (it starts from an idle
// window): at RecoverRatio of the others or more it stays in use; still
// under SlowRatio, it is flagged again and the next probe waits twice as
// long, up to ProbeMax. While nothing is sent, a probe waits: an unflagged path costs
// nothing without traffic. The gap between SlowRatio and RecoverRatio,
// the samples in a row and the growing wait between probes are the
// hysteresis that keeps a path from flapping.

// SlowPathPolicy tunes SlowPaths; zero fields take the defaults.
type SlowPathPolicy struct {
	// SlowRatio: a path whose busy subflows deliver at less than this
	// fraction of the other paths is slow. Default 0.3.
	SlowRatio float64
	// RecoverRatio: a probed path delivering at this fraction of the
	// other paths or more has recovered. Default 0.6.
	RecoverRatio float64
	// FlagAfter is how many slow samples in a row flag a path. Default 3.
	FlagAfter int
	// ProbeAfter is the wait before the first probe of a flagged path;
	// it doubles after each failed probe up to ProbeMax. Defaults 5 s
	// and 30 s: a recovered path is back within 30 s, and a path that
	// stays slow costs a second of probing every 30 s. A path measured
	// aside (Measure) is measured every ProbeAfter: it costs the
	// connection nothing, and a recovered path is back within it.
	ProbeAfter, ProbeMax time.Duration
	// ProbeSamples bounds a probe: after this many busy samples that were
	// neither slow nor recovered, the path counts as recovered (it is not
	// slow enough to flag). Default 10.
	ProbeSamples int
	// MinBytes is how many bytes a subflow must have delivered since the
	// previous sample for its rate to count. Default 256 KiB.
	MinBytes uint64
	// Measure, when set, measures a flagged path beside the connection:
	// the rate in bytes per second at which the path from local to
	// remote carries traffic sent at rate (ProbePath). A flagged path is
	// then measured every ProbeAfter while the other paths have a rate,
	// asked a quarter over RecoverRatio of their rate, and its flag
	// cleared once it carries RecoverRatio of it; a measure that fails
	// falls back to a probe that clears the flag.
	Measure func(local, remote netip.Addr, rate float64) (float64, error)
	// MeasureMax, when set, is the highest rate Measure can send
	// (ProbeMaxRate for ProbePath). A measure that needs more is sent at
	// MeasureMax: a path that carries clearly less is still slow, one that
	// carries it all cannot be told aside and is probed as when a
	// measure fails.
	MeasureMax float64
	// OnEvent, when set, hears of every decision (after it is logged),
	// on the sampling goroutine: it must return at once.
	OnEvent func(PathEvent)
}

func (p SlowPathPolicy) withDefaults() SlowPathPolicy {
	p.SlowRatio = cmp.Or(p.SlowRatio, 0.3)
	p.RecoverRatio = cmp.Or(p.RecoverRatio, 0.6)
	p.FlagAfter = cmp.Or(p.FlagAfter, 3)
	p.ProbeAfter = cmp.Or(p.ProbeAfter, 5*time.Second)
	p.ProbeMax = cmp.Or(p.ProbeMax, 30*time.Second)
	p.ProbeSamples = cmp.Or(p.ProbeSamples, 10)
	p.MinBytes = cmp.Or(p.MinBytes, 256<<10)
	return p
}

// PathEventKind names what SlowPaths decided about a path.
type PathEventKind string

// The decisions.
const (
	// PathSlow: the path is flagged backup.
	PathSlow PathEventKind = "slow"
	// PathProbe: the flag is cleared to measure the path again.
	PathProbe PathEventKind = "probe"
	// PathStillSlow: the probe found the path slow; flagged again.
	PathStillSlow PathEventKind = "still-slow"
	// PathRecovered: the probe found the path fast enough; it stays in use.
	PathRecovered PathEventKind = "recovered"
	// PathGone: a flagged or probed path is no longer managed (its
	// address went), or it was the last path in use.
	PathGone PathEventKind = "released"
)

// PathEvent is one decision, with the rates behind it in bytes per second.
type PathEvent struct {
	Addr netip.Addr
	Kind PathEventKind
	// Rate is the path's delivery rate, Best the other paths'; both
	// zero for probes and releases.
	Rate, Best float64
	// NextProbe is the wait before the next probe of a flagged path.
	NextProbe time.Duration
	// Measured: the verdict of a still-slow or recovered path came
	// from the policy's Measure, beside the connection.
	Measured bool
	// MeasureErr is why a probe cleared the flag instead of measuring.
	MeasureErr error
}

type pathPhase int

const (
	phaseInUse pathPhase = iota
	phaseFlagged
	phaseProbing
)

type pathState struct {
	phase     pathPhase
	slow      int           // slow samples in a row (in use)
	good      int           // recovered samples (probing)
	samples   int           // busy samples (probing)
	probeAt   time.Time     // flagged: when to probe
	probeWait time.Duration // the wait that set probeAt
	// measuredBack is when a measure aside last found the path
	// recovered, with the wait it had been measured at: a path slow
	// again soon after (one that passes short bursts, not a stream) is
	// measured half as often each time.
	measuredBack time.Time
	measuredWait time.Duration
	// recent are the rates of the last busy samples (at most
	// rateHistory; cleared when the path is flagged or probed): their
	// median is the path's rate, which one sample inflated by a burst
	// (a token bucket that filled while idle, compressed ACKs) does not
	// move.
	recent []float64
}

// rateHistory is how many busy samples make a path's rate.
const rateHistory = 3

// rate is the median of the path's recent busy samples, 0 without any.
func (st *pathState) rate() float64 {
	if len(st.recent) == 0 {
		return 0
	}
	s := slices.Clone(st.recent)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func (st *pathState) record(r float64) {
	st.recent = append(st.recent, r)
	if len(st.recent) > rateHistory {
		st.recent = st.recent[len(st.recent)-rateHistory:]
	}
}

// pathSample is one path's measurement in one Observe.
type pathSample struct {
	rate    float64 // best delivery rate of its busy subflows
	limited bool    // one of them was not app-limited
}

// SlowPaths turns the namespace's subflow measurements into backup flags.
// Call Observe at a steady interval (SlowPathInterval); it is not safe for
// concurrent use.
type SlowPaths struct {
	p      SlowPathPolicy
	acked  map[uint64]uint64 // cookie -> bytes acked at the previous sample
	at     time.Time         // the previous sample's time
	paths  map[netip.Addr]*pathState
	primed bool
}

// NewSlowPaths returns a SlowPaths with policy p.
func NewSlowPaths(p SlowPathPolicy) *SlowPaths {
	return &SlowPaths{p: p.withDefaults(), acked: map[uint64]uint64{}, paths: map[netip.Addr]*pathState{}}
}

// Flagged lists the addresses to flag backup now, sorted.
func (s *SlowPaths) Flagged() []netip.Addr {
	var out []netip.Addr
	for a, st := range s.paths {
		if st.phase == phaseFlagged {
			out = append(out, a)
		}
	}
	slices.SortFunc(out, netip.Addr.Compare)
	return out
}

// Observe takes one sample, socks being the namespace's established TCP
// sockets at now, and returns what changed. Only subflows whose local
// address is in managed count, and only managed addresses are flagged;
// a flag on an address that left managed is dropped.
func (s *SlowPaths) Observe(now time.Time, socks []TCPSocket, managed []netip.Addr) []PathEvent {
	inSet := map[netip.Addr]bool{}
	for _, a := range managed {
		inSet[a.Unmap()] = true
	}
	var events []PathEvent
	for a, st := range s.paths {
		if !inSet[a] {
			if st.phase != phaseInUse {
				events = append(events, PathEvent{Addr: a, Kind: PathGone})
			}
			delete(s.paths, a)
		}
	}
	for a := range inSet {
		if s.paths[a] == nil {
			s.paths[a] = &pathState{}
		}
	}

	samples := map[netip.Addr]pathSample{}
	peers := map[netip.Addr]netip.Addr{} // a subflow's remote address per local one
	acked := make(map[uint64]uint64, len(socks))
	elapsed := now.Sub(s.at).Seconds()
	for _, k := range socks {
		if !k.Subflow || !inSet[k.Local.Addr()] {
			continue
		}
		peers[k.Local.Addr()] = k.Remote.Addr()
		acked[k.Cookie] = k.BytesAcked
		prev, seen := s.acked[k.Cookie]
		if !seen || !s.primed || k.BytesAcked < prev || k.BytesAcked-prev < s.p.MinBytes {
			continue
		}
		if k.DeliveryRate == 0 {
			// No rate sample taken yet (a subflow just back from being
			// a backup): data moved, but nothing says how fast.
			continue
		}
		// What the subflow delivered since the last sample is a floor
		// under its rate: the kernel's delivery rate is its last rate
		// sample alone, which after a stretch as a backup (the probe of
		// a recovered path) can be tiny while data flows at full speed.
		r := float64(k.DeliveryRate)
		if elapsed > 0 {
			r = max(r, float64(k.BytesAcked-prev)/elapsed)
		}
		smp := samples[k.Local.Addr()]
		smp.rate = max(smp.rate, r)
		smp.limited = smp.limited || !k.AppLimited
		samples[k.Local.Addr()] = smp
	}
	s.acked, s.at, s.primed = acked, now, true

	for a, smp := range samples {
		s.paths[a].record(smp.rate)
	}
	// reference is what the paths other than a deliver: the median of
	// their rates, so that neither one burst nor one odd path decides.
	reference := func(a netip.Addr) float64 {
		var rates []float64
		for b, st := range s.paths {
			if b != a && st.phase != phaseFlagged {
				if r := st.rate(); r > 0 {
					rates = append(rates, r)
				}
			}
		}
		if len(rates) == 0 {
			return 0
		}
		return (&pathState{recent: rates}).rate()
	}
	inUse := func(except netip.Addr) int {
		n := 0
		for b, st := range s.paths {
			if b != except && st.phase != phaseFlagged {
				n++
			}
		}
		return n
	}

	for _, a := range slices.SortedFunc(maps.Keys(s.paths), netip.Addr.Compare) {
		st := s.paths[a]
		smp, busy := samples[a]
		best := reference(a)
		slow := busy && smp.limited && best > 0 && st.rate() < s.p.SlowRatio*best
		switch st.phase {
		case phaseInUse:
			switch {
			case slow:
				st.slow++
			case busy:
				st.slow = 0
			}
			if st.slow >= s.p.FlagAfter && inUse(a) > 0 {
				wait := s.p.ProbeAfter
				if !st.measuredBack.IsZero() && now.Sub(st.measuredBack) < s.p.ProbeMax {
					wait = min(2*st.measuredWait, s.p.ProbeMax)
				}
				s.flag(st, now, wait)
				events = append(events, PathEvent{Addr: a, Kind: PathSlow, Rate: smp.rate, Best: best, NextProbe: st.probeWait})
			}
		case phaseFlagged:
			if now.Before(st.probeAt) {
				continue
			}
			var measureErr error
			if s.p.Measure != nil {
				peer, ok := peers[a]
				if best == 0 || !ok {
					// Nothing to measure against, or no subflow
					// to learn the peer from: wait for one.
					continue
				}
				if busy {
					// A backup that carries data: the other
					// paths cannot. A probe would only flood the
					// one path left; measure once they are back.
					st.probeAt = now.Add(s.p.ProbeAfter)
					continue
				}
				// Asked a quarter over what recovery needs: a
				// path that carries it returns it whole.
				need := s.p.RecoverRatio * best
				ask := 1.25 * need
				capped := s.p.MeasureMax > 0 && ask > s.p.MeasureMax
				if capped {
					ask = s.p.MeasureMax
				}
				r, err := s.p.Measure(a, peer, ask)
				if err == nil && capped && r >= 0.9*ask && r < need {
					err = fmt.Errorf("mptcp: the path carried the whole measure (%.0f of %.0f bytes/s), under what recovery needs (%.0f): no verdict aside", r, ask, need)
				}
				if err == nil {
					if r >= need {
						events = append(events, PathEvent{Addr: a, Kind: PathRecovered, Rate: r, Best: best, Measured: true})
						*st = pathState{measuredBack: now, measuredWait: st.probeWait}
					} else {
						s.flag(st, now, st.probeWait)
						events = append(events, PathEvent{Addr: a, Kind: PathStillSlow, Rate: r, Best: best, NextProbe: st.probeWait, Measured: true})
					}
					continue
				}
				if errors.Is(err, ErrProbeStarved) {
					st.probeAt = now.Add(s.p.ProbeAfter) // no verdict: again later
					continue
				}
				measureErr = err
			}
			st.phase, st.good, st.samples, st.recent = phaseProbing, 0, 0, nil
			events = append(events, PathEvent{Addr: a, Kind: PathProbe, MeasureErr: measureErr})
		case phaseProbing:
			// A path just back in use starts from an idle window: its
			// verdict waits for two busy samples.
			if !busy {
				continue
			}
			st.samples++
			if st.samples < 2 {
				continue
			}
			switch {
			case slow:
				s.flag(st, now, min(2*st.probeWait, s.p.ProbeMax))
				events = append(events, PathEvent{Addr: a, Kind: PathStillSlow, Rate: st.rate(), Best: best, NextProbe: st.probeWait})
				continue
			case best == 0 || st.rate() >= s.p.RecoverRatio*best:
				st.good++
			}
			if st.good >= 1 || st.samples >= s.p.ProbeSamples {
				events = append(events, PathEvent{Addr: a, Kind: PathRecovered, Rate: st.rate(), Best: best})
				*st = pathState{}
			}
		}
	}
	// Never leave every path flagged: the kernel would use the backups
	// anyway, but a host's own flags should not be what decides that.
	if len(s.paths) > 0 && inUse(netip.Addr{}) == 0 {
		for _, a := range s.Flagged() {
			*s.paths[a] = pathState{}
			events = append(events, PathEvent{Addr: a, Kind: PathGone})
		}
	}
	return events
}

func (s *SlowPaths) flag(st *pathState, now time.Time, wait time.Duration) {
	st.phase, st.slow, st.recent = phaseFlagged, 0, nil
	st.probeWait = wait
	st.probeAt = now.Add(wait)
}
