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
	"errors"
	"fmt"
	"log/slog"
	"net"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
	"github.com/mpnbd/mpnbd/pkg/relay"
)

// SessionDialTimeout bounds one dial + handshake round over a volume's
// storage addresses.
const SessionDialTimeout = 10 * time.Second

// Session is a volume's NBD session as the userspace transports that
// serve a device from the process itself (fuse, ublk) run it: a relay
// without a local connection (in-process calls), which dials the storage
// addresses in turn, redials while the volume is attached, replays what
// was unanswered and keeps what no FLUSH covers yet. The device's I/O goes
// through Client.
type Session struct {
	Relay  *relay.Relay
	Client *nbd.Client
	// Info is what the first handshake said; Multipath whether its
	// connection runs MPTCP.
	Info      nbd.ExportInfo
	Multipath bool
	// ID names the session to the server (fencing); a process taking a
	// device over continues its predecessor's ID.
	ID nbd.SessionID

	// FailAfter is the relay's bound on an outage (zero: a hard mount).
	FailAfter time.Duration

	target  Target
	servers ServerDialer
	stop    context.CancelFunc
	done    chan struct{}
}

// SessionConfig configures OpenSession.
type SessionConfig struct {
	// ID is the session's ID; zero means a new one.
	ID     nbd.SessionID
	Logger *slog.Logger
	// Keep tunes how the session keeps its MPTCP connection at one
	// subflow per storage address (KeepSubflows); Keep.Want defaults to
	// the target's number of addresses.
	Keep KeepConfig
}

// OpenSession connects the volume's first connection (ctx bounds it) and
// starts the session.
func OpenSession(ctx context.Context, cfg SessionConfig, t Target, o Options) (*Session, error) {
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	s := &Session{ID: cfg.ID, target: t, done: make(chan struct{})}
	if s.ID == (nbd.SessionID{}) {
		s.ID = nbd.NewSessionID()
	}
	if o.ServersFile != "" {
		if err := s.servers.KeepIn(o.ServersFile); err != nil {
			log.Warn("what an earlier process learned of the storage nodes that hold the volume is lost; dialling those it was published with", "error", err)
		}
	}
	dial := func(ctx context.Context) (*relay.Remote, error) {
		ctx, cancel := context.WithTimeout(ctx, SessionDialTimeout)
		defer cancel()
		rc, _, err := DialServers(ctx, &s.servers, s.servers.For(t), func(ctx context.Context, srv Server, addr string) (*relay.Remote, error) {
			// Asked of every server, replicated or not: a drain moves
			// an unreplicated volume to a storage node the node was not
			// given.
			x := ExportDialer{Logger: log, Servers: &s.servers}
			if t.TLS != nil {
				x.TLS = t.TLS.ConfigFor(srv)
			}
			c, info, err := x.DialExport(ctx, addr, "", t.Export, true, &nbd.Session{ID: s.ID, Generation: nbd.NextGeneration()})
			if err != nil {
				return nil, err
			}
			return &relay.Remote{Conn: c, Info: info}, nil
		}, func(rc *relay.Remote) { rc.Close() })
		return rc, err
	}
	first, err := dial(ctx)
	if err != nil {
		return nil, err
	}
	s.Info = first.Info
	s.Multipath = nbd.IsMultipathTCP(first.Conn)
	ro := relay.Options{Logger: log, FailAfter: FailAfter(o), DeadPeerTimeout: o.EffectiveDeadPeerTimeout(), MaxBackoff: t.MaxBackoff()}
	s.FailAfter = ro.FailAfter
	// A Dialer returns a net.Conn: no typed nil on failure.
	redial := func(ctx context.Context) (net.Conn, error) {
		rc, err := dial(ctx)
		if err != nil {
			return nil, err
		}
		return rc, nil
	}
	s.Relay = relay.New(nil, first, redial, ro)
	rctx, stop := context.WithCancel(context.Background())
	s.stop = stop
	go func() {
		defer close(s.done)
		if err := s.Relay.Run(rctx); err != nil && !errors.Is(err, context.Canceled) {
			log.Error("NBD session ended: I/O fails", "error", err)
		}
	}()
	if s.Multipath {
		keep := cfg.Keep
		if keep.Want == 0 {
			keep.Want = len(t.Addrs)
		}
		keep.Logger = log
		go KeepSubflows(rctx, s.Relay, redial, keep)
	}
	s.Client = nbd.NewClientOn(s.Info, s.Relay, log)
	return s, nil
}

// Servers lists the storage nodes the session dials when it dials again:
// for a replicated volume, those the last serving one listed, and the
// target's own.
func (s *Session) Servers() []Server { return s.servers.For(s.target) }

// Flush sends a FLUSH of the session's own, before a handoff, and waits
// up to timeout for its answer. It never takes from the device a failed
// flush the device must hear: with one owed already it fails without
// flushing (relay.ErrFlushFailureOwed), and a failure it hears itself is
// owed to the device's next FLUSH (the server reports a failed sync once
// per connection).
func (s *Session) Flush(timeout time.Duration) error {
	if s.Relay.Stats().FlushErrorOwed {
		return relay.ErrFlushFailureOwed
	}
	done := make(chan error, 1)
	go func() { done <- s.Client.Flush() }()
	select {
	case err := <-done:
		var nerr *nbd.Error
		if errors.As(err, &nerr) {
			s.Relay.OweFlushFailure()
		}
		return err
	case <-time.After(timeout):
		return fmt.Errorf("no answer from the storage node within %v", timeout)
	}
}

// FailAfter is how long a session with options o waits through an
// outage before it fails requests: DeadConnTimeout when it bounds the
// outage, zero (a hard mount: no bound) otherwise.
func FailAfter(o Options) time.Duration {
	if d := o.DeadConnTimeout; d > 0 && d < DefaultDeadConnTimeout {
		return d
	}
	return 0
}

// drainRetry is the pause between the FLUSHes of a Drain that fail.
var drainRetry = time.Second

// Drain makes what the session acknowledged durable before it ends: it
// sends FLUSHes until one succeeds, waiting through an outage (the relay
// redials, and replays what it retains to a new incarnation of the
// storage node) and past failed ones, until ctx ends. Its error then
// wraps ErrUnflushed: the writes stay retained in the session, which
// keeps redialing, and Close would drop them. A FLUSH still unanswered
// when ctx ends is left to the relay (it is answered, or replayed, later).
// A session that has ended (closed, or refused for good) holds nothing
// any more: Drain returns nil at once.
func (s *Session) Drain(ctx context.Context) error {
	var last error
	for {
		done := make(chan error, 1)
		go func() { done <- s.Client.Flush() }()
		select {
		case err := <-done:
			if err == nil {
				return nil
			}
			last = err
		case <-s.done:
			return nil
		case <-ctx.Done():
			return s.undrained(ctx, last)
		}
		select {
		case <-s.done:
			return nil
		case <-ctx.Done():
			return s.undrained(ctx, last)
		case <-time.After(drainRetry):
		}
	}
}

// undrained is Drain's error when ctx ended first.
func (s *Session) undrained(ctx context.Context, last error) error {
	st := s.Relay.Stats()
	msg := fmt.Sprintf("%d writes (%d bytes) acknowledged and not yet flushed (%v", st.Retained, st.RetainedBytes, ctx.Err())
	if last != nil {
		msg += fmt.Sprintf("; last flush: %v", last)
	}
	if !st.DownSince.IsZero() {
		msg += fmt.Sprintf("; storage node unreachable for %v", time.Since(st.DownSince).Round(time.Second))
	}
	return fmt.Errorf("%w: %s)", ErrUnflushed, msg)
}

// Close ends the session (NBD_CMD_DISC once the requests in flight are
// answered, if the server answers within timeout) and waits for it.
func (s *Session) Close(timeout time.Duration) {
	closed := make(chan struct{})
	go func() {
		s.Client.Close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(timeout):
	}
	s.stop()
	<-s.done
}

// ProbeSize asks the server for the export's size on a connection of its
// own (no session: it must not supersede the data connection).
func (s *Session) ProbeSize(ctx context.Context, t Target) (uint64, error) {
	return ProbeSize(ctx, t, &s.servers)
}

// ProbeSize asks a target's server for the export's size on a connection
// of its own, dialing each server's addresses in turn from the last good
// one.
func ProbeSize(ctx context.Context, t Target, servers *ServerDialer) (uint64, error) {
	ctx, cancel := context.WithTimeout(ctx, SessionDialTimeout)
	defer cancel()
	info, _, err := DialServers(ctx, servers, t.Servers(), func(ctx context.Context, srv Server, addr string) (nbd.ExportInfo, error) {
		var x ExportDialer
		if t.TLS != nil {
			x.TLS = t.TLS.ConfigFor(srv)
		}
		c, info, err := x.DialExport(ctx, addr, "", t.Export, true, nil)
		if err != nil {
			return nbd.ExportInfo{}, err
		}
		nbd.NewClient(info, []net.Conn{c}, nil).Close()
		return info, nil
	}, func(nbd.ExportInfo) {})
	return info.Size, err
}
