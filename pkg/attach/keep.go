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

package attach

import (
	"context"
	"log/slog"
	"net"
	"time"

	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/relay"
)

// Defaults of KeepConfig.
const (
	DefaultKeepEvery    = 5 * time.Second
	DefaultKeepHold     = 20 * time.Second
	DefaultKeepMaxHold  = 10 * time.Minute
	DefaultKeepJoinWait = 5 * time.Second
)

// KeepConfig tunes KeepSubflows; zero durations mean the defaults.
type KeepConfig struct {
	// Want is how many subflows the connection should have: one per
	// storage address. KeepSubflows does nothing for Want < 2.
	Want int
	// Every is how often the connection's subflows are counted.
	Every time.Duration
	// Hold is how long a connection may stay short of Want before a new
	// one is tried; it doubles after every try that does not restore all
	// subflows, up to MaxHold, and is back to Hold once a connection has
	// them all. Short paths that stay short are tried rarely; a path that
	// comes back is used again within Hold.
	Hold, MaxHold time.Duration
	// JoinWait is how long a new connection gets for its subflows to join.
	JoinWait time.Duration
	Logger   *slog.Logger
}

func (c *KeepConfig) defaults() {
	if c.Every <= 0 {
		c.Every = DefaultKeepEvery
	}
	if c.Hold <= 0 {
		c.Hold = DefaultKeepHold
	}
	if c.MaxHold <= 0 {
		c.MaxHold = DefaultKeepMaxHold
	}
	c.MaxHold = max(c.MaxHold, c.Hold)
	if c.JoinWait <= 0 {
		c.JoinWait = DefaultKeepJoinWait
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// KeepSubflows keeps r's MPTCP connection at its subflows until ctx ends.
// The kernel's path manager opens a subflow to each address the server
// announces, once: a join that fails (a path down at that moment, a
// storage agent restarting) is never tried again, and the volume runs on
// fewer paths for the rest of the connection's life. KeepSubflows counts
// the subflows of r's connection; when they stay short of Want for Hold,
// it dials a new connection (dial, with the session's ID) and, if more
// subflows join it than the current one has, hands it to r.Replace, which
// swaps without losing or repeating a request. A connection that is not
// MPTCP is left alone. It returns when ctx or r ends.
func KeepSubflows(ctx context.Context, r *relay.Relay, dial relay.Dialer, cfg KeepConfig) {
	if cfg.Want < 2 {
		return
	}
	cfg.defaults()
	k := keeper{cfg: cfg, hold: cfg.Hold}
	t := time.NewTicker(cfg.Every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.Done():
			return
		case <-t.C:
		}
		st := r.Stats()
		if !st.Connected || st.Remote == nil {
			k.reset()
			continue
		}
		n, ok := subflows(st.Remote)
		if !ok || !k.due(st.Remote, n, time.Now()) {
			continue
		}
		k.try(ctx, r, dial, n)
	}
}

// keeper is KeepSubflows's state.
type keeper struct {
	cfg KeepConfig
	// short is the connection seen short of Want, since when.
	short      net.Conn
	shortSince time.Time
	hold       time.Duration
}

func (k *keeper) reset() { k.short, k.shortSince = nil, time.Time{} }

// due says whether the connection c, which has n subflows, has been short
// of Want for the hold time at now.
func (k *keeper) due(c net.Conn, n int, now time.Time) bool {
	if n >= k.cfg.Want {
		k.reset()
		k.hold = k.cfg.Hold
		return false
	}
	if c != k.short {
		k.short, k.shortSince = c, now
		return false
	}
	return now.Sub(k.shortSince) >= k.hold
}

// backoff doubles the hold (up to MaxHold) and starts it again.
func (k *keeper) backoff() {
	k.hold = min(2*k.hold, k.cfg.MaxHold)
	k.shortSince = time.Now()
}

// try dials a new connection and swaps it in if it has more subflows
// than the current one's n.
func (k *keeper) try(ctx context.Context, r *relay.Relay, dial relay.Dialer, n int) {
	log := k.cfg.Logger
	dctx, cancel := context.WithTimeout(ctx, SessionDialTimeout)
	c, err := dial(dctx)
	cancel()
	if err != nil {
		log.Debug("no new connection to restore missing subflows", "error", err)
		k.backoff()
		return
	}
	m := waitJoins(ctx, c, k.cfg.Want, k.cfg.JoinWait)
	if m <= n {
		c.Close()
		k.backoff()
		log.Warn("MPTCP subflows missing, and a new connection gets no more: keeping the current one",
			"subflows", n, "want", k.cfg.Want, "new_connection_subflows", m, "next_try_in", k.hold)
		return
	}
	if err := r.Replace(c); err != nil {
		log.Info("a connection with more subflows was not swapped in", "error", err)
		k.backoff()
		return
	}
	log.Info("swapped in a connection with more MPTCP subflows", "subflows_before", n, "subflows", m, "want", k.cfg.Want)
	if m < k.cfg.Want {
		k.backoff()
	}
}

// subflows counts the MPTCP subflows of c; false when it is not MPTCP.
func subflows(c net.Conn) (int, bool) {
	info, err := mptcp.GetInfo(c)
	if err != nil {
		return 0, false
	}
	return info.TotalSubflows(), true
}

// waitJoins waits up to d for c to have want subflows and returns how
// many it has.
func waitJoins(ctx context.Context, c net.Conn, want int, d time.Duration) int {
	deadline := time.Now().Add(d)
	for {
		n, _ := subflows(c)
		if n >= want || time.Now().After(deadline) || ctx.Err() != nil {
			return n
		}
		select {
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
}
