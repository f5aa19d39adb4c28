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
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"sync"
	"time"
)

// SlowPathInterval is how often the slow-path watch samples the subflows:
// with SlowPathPolicy's three samples in a row, a slow path is flagged
// about two seconds after data starts to flow.
const SlowPathInterval = 500 * time.Millisecond

// Keep keeps the endpoints d describes in the calling thread's network
// namespace until ctx ends, following address changes, and logs what it
// does. With slow not nil it also flags backup the endpoints of paths
// much slower than the others, and clears the flag once they recover
// (see SlowPaths), from the subflows of every connection of the
// namespace. With d.StaleLossCount it first raises the namespace's
// net.mptcp.stale_loss_cnt to at least that (a failure is logged, not
// returned). It returns nil when ctx ends, or an error when the path
// manager or the address watch is unavailable.
func Keep(ctx context.Context, d Desired, log *slog.Logger, slow *SlowPathPolicy) error {
	pm, err := DialPM()
	if err != nil {
		return fmt.Errorf("MPTCP path manager: %w", err)
	}
	defer pm.Close()
	addrs, err := DialAddrs()
	if err != nil {
		return fmt.Errorf("MPTCP endpoints: %w", err)
	}
	defer addrs.Close()
	changes, err := AddrChanges(ctx)
	if err != nil {
		// Periodic runs still catch address changes, only later.
		log.Warn("no address change notifications; endpoints follow changes at the next periodic run", "error", err)
		changes = nil
	}
	log = log.With("role", d.Role.String(), "nics", d.NICs)
	if d.StaleLossCount > 0 {
		switch old, err := RaiseStaleLossCount(d.StaleLossCount); {
		case err != nil:
			log.Warn("net.mptcp.stale_loss_cnt not raised: subflows that only queue may be taken for dead when many connections share the paths", "want", d.StaleLossCount, "error", err)
		case old < d.StaleLossCount:
			log.Info("net.mptcp.stale_loss_cnt raised", "from", old, "to", d.StaleLossCount)
		}
	}
	opt := WatchOptions{Changes: changes}
	var auto *slowPathWatch
	if slow != nil {
		diag, err := DialSocketDiag()
		if err != nil {
			log.Warn("slow paths are not flagged backup by themselves: no socket diagnostics", "error", err)
		} else {
			defer diag.Close()
			policy := *slow
			if policy.Measure == nil {
				policy.Measure, policy.MeasureMax = ProbePath, ProbeMaxRate
			}
			auto = newSlowPathWatch(NewSlowPaths(policy), diag, log)
			auto.onEvent = policy.OnEvent
			opt.Backup, opt.Kick = auto.flagged, auto.kick
		}
	}
	opt.OnResult = func(r Result, err error) {
		for _, w := range r.Warnings {
			log.Warn("MPTCP endpoints", "warning", w)
		}
		if err != nil {
			log.Warn("MPTCP endpoints not in step", "error", err)
			return
		}
		if auto != nil {
			auto.setManaged(r.Addrs)
		}
		if r.Changed() {
			log.Info("MPTCP endpoints updated", "added", len(r.Added), "removed", len(r.Removed),
				"updated", len(r.Updated), "subflows_limit", r.Limits.Subflows)
		}
	}
	if auto != nil {
		goInCallersNetns(func() { auto.run(ctx, SlowPathInterval) })
	}
	err = Watch(ctx, pm, addrs, d, opt)
	if errors.Is(err, context.Canceled) || ctx.Err() != nil {
		return nil
	}
	return fmt.Errorf("MPTCP endpoints: %w", err)
}

// slowPathWatch samples the namespace's subflows for a SlowPaths and
// tells Watch when the addresses to flag change.
type slowPathWatch struct {
	sp   *SlowPaths
	diag interface {
		Established() ([]TCPSocket, error)
	}
	log  *slog.Logger
	kick chan struct{}
	// onEvent hears of each decision (SlowPathPolicy.OnEvent).
	onEvent func(PathEvent)
	// failing: the last sample could not read the subflows (sampling
	// goroutine only).
	failing bool

	mu      sync.Mutex
	managed []netip.Addr
	backup  []netip.Addr
}

func newSlowPathWatch(sp *SlowPaths, diag interface{ Established() ([]TCPSocket, error) }, log *slog.Logger) *slowPathWatch {
	return &slowPathWatch{sp: sp, diag: diag, log: log, kick: make(chan struct{}, 1)}
}

func (w *slowPathWatch) setManaged(a []netip.Addr) {
	w.mu.Lock()
	w.managed = slices.Clone(a)
	w.mu.Unlock()
}

func (w *slowPathWatch) flagged() []netip.Addr {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.backup)
}

func (w *slowPathWatch) run(ctx context.Context, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			w.sample(now)
		}
	}
}

// sample reads the namespace's subflows and steps the SlowPaths with
// them. A failure to read them is logged once, until reading works again.
func (w *slowPathWatch) sample(now time.Time) {
	socks, err := w.diag.Established()
	if err != nil {
		if !w.failing {
			w.log.Warn("slow paths: cannot read the subflows", "error", err)
		}
		w.failing = true
		return
	}
	w.failing = false
	w.mu.Lock()
	managed := slices.Clone(w.managed)
	w.mu.Unlock()
	w.step(now, socks, managed)
}

// step feeds one sample to the SlowPaths, logs its decisions and kicks
// Watch when the flagged addresses change.
func (w *slowPathWatch) step(now time.Time, socks []TCPSocket, managed []netip.Addr) {
	events := w.sp.Observe(now, socks, managed)
	for _, e := range events {
		LogPathEvent(w.log, e)
		if w.onEvent != nil {
			w.onEvent(e)
		}
	}
	flagged := w.sp.Flagged()
	w.mu.Lock()
	changed := !slices.Equal(flagged, w.backup)
	w.backup = flagged
	w.mu.Unlock()
	if changed {
		select {
		case w.kick <- struct{}{}:
		default:
		}
	}
}

// FlagInPlace watches the subflows of the calling thread's network
// namespace for slow paths among addrs, as Keep does for the endpoints it
// keeps, and sets or clears the backup flag of whatever endpoint holds a
// flagged address, until ctx ends. It is for a host whose endpoints are
// not Keep's to own: a client that only joins the addresses its peer
// announces, for which the kernel records implicit endpoints. The flags
// are set again at every sample, so that an endpoint the kernel records
// anew (its subflow closed and came back) is flagged too.
func FlagInPlace(ctx context.Context, addrs []netip.Addr, policy SlowPathPolicy, log *slog.Logger) error {
	pm, err := DialPM()
	if err != nil {
		return fmt.Errorf("MPTCP path manager: %w", err)
	}
	defer pm.Close()
	diag, err := DialSocketDiag()
	if err != nil {
		return fmt.Errorf("socket diagnostics: %w", err)
	}
	defer diag.Close()
	if policy.Measure == nil {
		policy.Measure, policy.MeasureMax = ProbePath, ProbeMaxRate
	}
	w := newSlowPathWatch(NewSlowPaths(policy), diag, log)
	w.onEvent = policy.OnEvent
	w.setManaged(addrs)
	t := time.NewTicker(SlowPathInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case now := <-t.C:
			w.sample(now)
			if err := flagEndpoints(pm, addrs, w.flagged()); err != nil {
				return err
			}
		}
	}
}

// flagEndpoints sets the backup flag of the endpoints that hold an address
// of flagged and clears it on those that hold another address of addrs.
func flagEndpoints(pm *PM, addrs, flagged []netip.Addr) error {
	eps, err := pm.Endpoints()
	if err != nil {
		return err
	}
	for _, ep := range eps {
		if !slices.Contains(addrs, ep.Addr) {
			continue
		}
		want := slices.Contains(flagged, ep.Addr)
		if (ep.Flags&Backup != 0) == want {
			continue
		}
		ep.Flags ^= Backup
		if err := pm.SetEndpointFlags(ep); err != nil {
			return fmt.Errorf("flag %s: %w", ep.Addr, err)
		}
	}
	return nil
}

// LogPathEvent logs one slow-path decision.
func LogPathEvent(log *slog.Logger, e PathEvent) {
	mbps := func(r float64) string { return fmt.Sprintf("%.1f", r*8/1e6) }
	switch e.Kind {
	case PathSlow:
		log.Warn("path much slower than the others: its endpoint is flagged backup", "addr", e.Addr,
			"mbit_s", mbps(e.Rate), "best_mbit_s", mbps(e.Best), "probe_in", e.NextProbe)
	case PathStillSlow:
		// Measured aside every few seconds, a path that stays slow
		// would fill the log at Info.
		level := slog.LevelInfo
		if e.Measured {
			level = slog.LevelDebug
		}
		log.Log(context.Background(), level, "path still slow: flagged backup again", "addr", e.Addr,
			"mbit_s", mbps(e.Rate), "best_mbit_s", mbps(e.Best), "probe_in", e.NextProbe, "measured_aside", e.Measured)
	case PathProbe:
		if e.MeasureErr != nil {
			log.Info("probing a slow path: it cannot be measured aside, so its backup flag is cleared to measure it", "addr", e.Addr, "error", e.MeasureErr)
			return
		}
		log.Info("probing a slow path: backup flag cleared to measure it", "addr", e.Addr)
	case PathRecovered:
		log.Info("slow path recovered: in use again", "addr", e.Addr, "mbit_s", mbps(e.Rate), "best_mbit_s", mbps(e.Best), "measured_aside", e.Measured)
	case PathGone:
		log.Info("slow path's backup flag released", "addr", e.Addr)
	}
}
