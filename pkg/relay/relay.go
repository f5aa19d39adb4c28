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

// Package relay moves NBD transmission-phase frames between a local
// connection (the kernel's end of a socket pair) and a connection to the NBD
// server, and hides failures of the latter.
//
// Current kernels accept only TCP and stream UNIX sockets in NBD, so an MPTCP
// connection cannot be handed to the kernel. Instead the kernel gets one end
// of an AF_UNIX socket pair and a Relay owns the MPTCP connection (the
// rbd-nbd model). Because the relay understands NBD framing it keeps every
// unanswered request; when the remote connection breaks it dials a new one,
// sends the unanswered requests again in the order they arrived and carries
// on. The kernel sees latency, not errors.
//
// What the relay guarantees:
//
//   - Every request read from the local side enters a table of unanswered
//     requests (with its payload, for a write) before it is forwarded.
//     After a reconnect the table is sent again in arrival order, followed
//     by what arrived during the outage; nothing is sent twice on one
//     connection.
//   - A reply leaves the table only once it is complete (header and, for a
//     successful read, the whole payload), so a connection that breaks in
//     the middle of a reply leaves the request to the replay. The local
//     side gets each reply exactly once, whole, and only for a request it
//     sent. A reply for a handle the relay did not send on that
//     connection, a bad magic or NBD_ESHUTDOWN count as a broken remote.
//   - Memory is bounded: once the unanswered requests hold
//     Options.MaxInflightBytes, the relay stops reading the local side.
//   - Replaying is safe because NBD commands are idempotent in effect: a
//     write whose reply was lost is written again with the same data, and
//     the kernel never depends on the order of requests it has in flight
//     together. A server that takes the session option (nbd.OptSession,
//     which the Dialer announces) guarantees that nothing of a replaced
//     connection runs after the new one's first request; with other
//     servers the relay assumes the old connection's server is gone.
//   - Acknowledged means kept: every write acknowledged and not yet
//     covered by a completed FLUSH is retained, and sent again, in order,
//     before anything else when a new connection reaches a server that is
//     not provably the incarnation that acknowledged it (retain.go). A
//     power loss of the storage host then loses nothing the kernel was
//     told is written. A FUA write is durable once answered, but is kept
//     behind older retained writes so that their replay cannot land over
//     it. What is retained is bounded by FLUSHes of the relay's own.
//   - A silent server is noticed in seconds, not after tcp_retries2: a
//     connection whose requests wait while nothing is received and the
//     server's host acknowledges nothing for Options.DeadPeerTimeout is
//     closed and replaced as if it had been reset. The bound is on
//     progress, not on the age of the oldest request, and the host's
//     kernel (keepalive) vetoes it, so a slow server under load is never
//     taken for a dead one (deadline.go; TestDeadPeerSilentServerDetected,
//     TestDeadPeerSlowServerKept, TestDeadPeerSilentPathKeepsConnection).
package relay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// Dialer returns a new connection to the same export, already negotiated
// (NBD_OPT_GO, simple replies only) and so in the transmission phase. The
// relay calls it after the remote connection fails; ctx bounds one attempt
// and ends when Run does, so the dialer must honour it.
type Dialer func(ctx context.Context) (net.Conn, error)

// Defaults for zero Options fields.
const (
	DefaultMaxInflightBytes = 64 << 20
	DefaultReconnectBackoff = 100 * time.Millisecond
	DefaultMaxBackoff       = 5 * time.Second
)

// Bounds that are not worth an option.
const (
	// dialTimeout bounds one dial + negotiation attempt.
	dialTimeout = 30 * time.Second
	// discDrainTimeout bounds how long NBD_CMD_DISC waits for the replies
	// of requests still in flight.
	discDrainTimeout = 30 * time.Second
	// discCloseTimeout bounds how long the relay waits, after forwarding
	// NBD_CMD_DISC, for the server to flush and close its end.
	discCloseTimeout = 10 * time.Second
)

// Options tune a Relay. Zero values mean the defaults.
type Options struct {
	// Logger receives structured logs; nil means slog.Default().
	Logger *slog.Logger
	// MaxInflightBytes bounds what unanswered and retained requests may
	// hold: each counts the memory it really holds, its bookkeeping (about
	// 200 bytes) plus the buffer of its data (the payload of a write, the
	// bytes a read will bring back; pooled, so its length rounded up to a
	// power of two). When the bound is reached
	// the relay stops reading from the local side until replies make room,
	// so an outage never makes it grow without bound. A single request
	// larger than the bound is admitted when nothing else is in flight.
	MaxInflightBytes int
	// ReconnectBackoff is the first pause between dial attempts; it doubles
	// up to MaxBackoff. The first attempt after a working connection fails
	// is made at once.
	ReconnectBackoff, MaxBackoff time.Duration
	// RetainBytes is how much the writes acknowledged since the last
	// completed FLUSH may hold before the relay sends a FLUSH of its own
	// (see Remote); zero means half of MaxInflightBytes, which is also the
	// most it may be.
	RetainBytes int
	// FailAfter bounds how long requests wait for a server: once no
	// connection could be made for that long, every request waiting is
	// answered with EIO, and so is every new one until a connection is made
	// again. The relay keeps redialing all the while, and the writes it
	// retains stay owed to the server. Zero means requests wait for as
	// long as it takes (a hard mount).
	FailAfter time.Duration
	// DeadPeerTimeout bounds how long requests may go unanswered with
	// nothing received from the server and no acknowledgement from its
	// host before the connection counts as dead and is replaced
	// (deadline.go); zero means DefaultDeadPeerTimeout, a negative value
	// turns the check off (the kernel then notices after tcp_retries2).
	DeadPeerTimeout time.Duration
	// OnEvent, when set, is called for connection events from the relay's
	// connection-management goroutine. It must not block.
	OnEvent func(Event)

	// Latency counts the requests answered to the local side (latency.go);
	// nil means one of the relay's own. A volume whose relay is replaced
	// passes the same one to each, so that its counts never go back.
	Latency *Latency

	// Pending are bytes of the local side a predecessor read and did not
	// take (Pause): the relay reads them before the local side.
	Pending []byte

	// noRetain turns retention off, for the benchmark that measures what
	// it costs.
	noRetain bool
}

// EventKind says what happened to the remote connection.
type EventKind int

const (
	// EventConnected: the first remote connection is in use.
	EventConnected EventKind = iota + 1
	// EventDisconnected: the remote connection failed (Err says why).
	EventDisconnected
	// EventReconnected: a new remote connection is in use.
	EventReconnected
	// EventReplayed: unanswered requests were sent on the new connection
	// (Replayed says how many).
	EventReplayed
	// EventFailing: no connection for FailAfter; requests fail with EIO
	// until the next connection (Failed says how many were waiting).
	EventFailing
	// EventReplaced: a better connection took over (Replace).
	EventReplaced
)

func (k EventKind) String() string {
	switch k {
	case EventConnected:
		return "connected"
	case EventDisconnected:
		return "disconnected"
	case EventReconnected:
		return "reconnected"
	case EventReplayed:
		return "replayed"
	case EventFailing:
		return "failing"
	case EventReplaced:
		return "replaced"
	}
	return fmt.Sprintf("event(%d)", int(k))
}

// Event reports a change of the remote connection.
type Event struct {
	Kind EventKind
	// Err is the failure (EventDisconnected) or the last dial error
	// (EventFailing).
	Err error
	// Replayed is the number of requests sent again (EventReplayed).
	Replayed int
	// Retained is the number of acknowledged, unflushed writes sent again
	// because the server is a new incarnation (EventReplayed).
	Retained int
	// Failed is the number of waiting requests answered with EIO
	// (EventFailing).
	Failed int
	// Attempts counts dial attempts of the outage (EventReconnected,
	// EventFailing).
	Attempts int
	// Outage is the time since the remote failed (EventReconnected,
	// EventFailing).
	Outage time.Duration
	// Remote is the new connection (EventConnected, EventReconnected,
	// EventReplaced).
	Remote net.Conn
}

// Stats is a snapshot of a relay.
type Stats struct {
	// Reconnects counts successful redials.
	Reconnects int
	// InFlight is the number of requests read from the local side and not
	// yet answered to it; InFlightBytes is what they count against
	// MaxInflightBytes.
	InFlight      int
	InFlightBytes int
	// Retained counts the acknowledged writes not yet covered by a
	// completed FLUSH (kept for a replay to a new server incarnation);
	// RetainedBytes is what they hold.
	Retained, RetainedBytes int
	// DownSince is when the current outage began (zero while connected);
	// Replayed counts unanswered requests sent again after reconnects.
	DownSince time.Time
	Replayed  int
	// RetainedReplays counts writes sent again to a new incarnation;
	// OwnFlushes the FLUSHes the relay sent to trim what it retains;
	// OwnFlushFailures those of them the server failed.
	RetainedReplays, OwnFlushes, OwnFlushFailures int
	// FlushErrorOwed: a FLUSH of the relay's own failed and the local
	// side was not told yet (its next FLUSH will fail).
	FlushErrorOwed bool
	// Bytes read from and written to the local side (frames and payloads).
	BytesFromLocal, BytesToLocal uint64
	// Failing reports that the outage outlasted FailAfter: requests are
	// answered with EIO until a connection is made. Failed counts the
	// requests so answered.
	Failing bool
	Failed  int
	// Replaced counts connections replaced by better ones (Replace).
	Replaced int
	// DeadPeers counts connections closed because the server went
	// silent (DeadPeerTimeout).
	DeadPeers int
	// Latency counts the requests answered so far (Latency.Requests).
	Latency *Latency
	// Remote is the current remote connection; nil while there is none.
	Remote net.Conn
	// Connected reports whether a remote connection is in use.
	Connected bool
}

// Sentinel errors.
var (
	// ErrGaveUp ends Run when the remote connection failed and there is no
	// dialer to make another.
	ErrGaveUp = errors.New("relay: gave up reconnecting to the server")
	// ErrUnsupported: the platform has no kernel side for a relay (only
	// Linux has).
	ErrUnsupported = errors.New("relay: not supported on this platform")
	// ErrRunning is returned by a second call to Run.
	ErrRunning = errors.New("relay: already started")
	// errServerShutdown marks an NBD_ESHUTDOWN reply: the server is going
	// away, so the request is retried on the next connection.
	errServerShutdown = errors.New("relay: server replied ESHUTDOWN")
	// errLocalGone stops the reply path when the local side is gone.
	errLocalGone = errors.New("relay: local side gone")
)

// Remote connection states.
const (
	stateDown      = iota // no connection
	stateReplaying        // connected; the connection manager sends what is unsent
	stateUp               // connected; the request path sends each request itself
)

// Relay moves frames between a local and a remote connection. Create one
// with New and call Run once.
type Relay struct {
	local   net.Conn
	initial net.Conn
	dial    Dialer
	o       Options
	log     *slog.Logger
	max     int
	latency *Latency

	started  atomic.Bool
	cancel   context.CancelFunc
	endOnce  sync.Once
	endErr   error
	ended    chan struct{}
	discDone chan struct{}

	fromLocal, toLocal atomic.Uint64

	// wmu serializes writes to the remote. rw is bound to the connection of
	// generation rwGen; a sender holding an older generation writes nothing.
	wmu   sync.Mutex
	rw    frameWriter
	rwGen uint64

	// lwmu serializes writes to the local side.
	lwmu sync.Mutex
	lw   frameWriter

	// mu guards everything below. cond wakes the request path when room is
	// made (backpressure, DISC drain) and when the relay closes.
	mu   sync.Mutex
	cond sync.Cond
	// table holds every request read from the local side and not yet
	// answered to it, by handle; head..tail links them in arrival order.
	// The unanswered ones that were not sent on the current connection are
	// a suffix of that list starting at unsent.
	table      map[uint64]*entry
	head, tail *entry
	unsent     *entry
	bytes      int
	waiting    bool
	remote     net.Conn
	gen        uint64
	state      int
	lastErr    error
	reconnects int
	closing    bool
	discSent   bool

	// Retention (retain.go): the answered writes no completed FLUSH covers
	// yet, in answer order; what they hold; the answer counter.
	retHead, retTail *entry
	retCount         int
	retBytes         int
	retainMax        int
	ackSeq           uint64
	flushing         bool // a FLUSH of our own is in flight
	internalSeq      uint64
	// rsent holds the handles of retained writes sent again on the current
	// connection and not yet answered.
	rsent map[uint64]struct{}
	// inc is the incarnation of the last server reached, if incKnown.
	inc             nbd.Incarnation
	incKnown        bool
	retainedReplays int
	ownFlushes      int
	// ownFlushFailed counts failed FLUSHes of the relay's own;
	// flushErrOwed is set by one and cleared when a local FLUSH fails
	// (flusherr.go).
	ownFlushFailed int
	flushErrOwed   bool
	callSeq        uint64 // handles of in-process calls (call.go)
	downSince      time.Time
	replayed       int
	// failing: the outage outlasted FailAfter (requests get EIO at once);
	// failed counts the requests so answered.
	failing bool
	failed  int
	// Pause (pause.go): pauseReq asks the request path to stop at a frame
	// boundary; paused says it has, keeping pending, what it read of the
	// local side and did not take.
	pauseReq, paused bool
	pending          []byte
	// spare is the connection Replace hands to the connection manager;
	// replaced counts the connections so replaced.
	spare    net.Conn
	replaced int
	// deadPeers counts connections the watchdog closed (deadline.go).
	deadPeers int
}

// New returns a relay between local (the kernel's end) and remote, a
// connection to the server already in the transmission phase. remote may
// be nil: Run then dials first. dial makes replacement connections; nil
// means a failed remote ends Run with ErrGaveUp.
func New(local, remote net.Conn, dial Dialer, o Options) *Relay {
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.MaxInflightBytes <= 0 {
		o.MaxInflightBytes = DefaultMaxInflightBytes
	}
	if o.ReconnectBackoff <= 0 {
		o.ReconnectBackoff = DefaultReconnectBackoff
	}
	if o.MaxBackoff <= 0 {
		o.MaxBackoff = DefaultMaxBackoff
	}
	o.MaxBackoff = max(o.MaxBackoff, o.ReconnectBackoff)
	if o.Latency == nil {
		o.Latency = NewLatency()
	}
	if o.RetainBytes <= 0 || o.RetainBytes > o.MaxInflightBytes/2 {
		o.RetainBytes = o.MaxInflightBytes / 2
	}
	r := &Relay{
		local:    local,
		initial:  remote,
		dial:     dial,
		o:        o,
		log:      o.Logger,
		max:      o.MaxInflightBytes,
		latency:  o.Latency,
		ended:    make(chan struct{}),
		discDone: make(chan struct{}),
		table:    make(map[uint64]*entry),
		rsent:    make(map[uint64]struct{}),
	}
	r.retainMax = o.RetainBytes
	r.cond.L = &r.mu
	r.lw.reset(local)
	return r
}

// Run relays until the local side sends NBD_CMD_DISC (forwarded once the
// requests in flight are answered; Run returns nil after the server closed
// its end), the local side closes (nil), ctx ends (ctx.Err()), the relay
// gives up reconnecting (ErrGaveUp) or the local side breaks the protocol.
// Both connections are closed when Run returns.
func (r *Relay) Run(ctx context.Context) error {
	if !r.started.CompareAndSwap(false, true) {
		return ErrRunning
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// Under mu: Close may end the relay from another goroutine at once.
	r.mu.Lock()
	r.cancel = cancel
	closing := r.closing
	r.mu.Unlock()
	if closing {
		cancel()
	}
	stop := context.AfterFunc(ctx, func() { r.end(ctx.Err()) })
	defer stop()

	var wg sync.WaitGroup
	if r.local != nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.upLoop()
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		r.remoteLoop(ctx)
	}()
	<-r.ended
	wg.Wait()
	return r.endErr
}

// Done is closed once the relay has ended (Run returns soon after).
func (r *Relay) Done() <-chan struct{} { return r.ended }

// Stats returns a snapshot; it is safe to call at any time.
func (r *Relay) Stats() Stats {
	r.mu.Lock()
	defer r.mu.Unlock()
	return Stats{
		Reconnects:       r.reconnects,
		InFlight:         len(r.table),
		InFlightBytes:    r.bytes - r.retBytes,
		BytesFromLocal:   r.fromLocal.Load(),
		BytesToLocal:     r.toLocal.Load(),
		Remote:           r.remote,
		Connected:        r.state != stateDown,
		Retained:         r.retCount,
		RetainedBytes:    r.retBytes,
		RetainedReplays:  r.retainedReplays,
		DownSince:        r.downSince,
		Replayed:         r.replayed,
		OwnFlushes:       r.ownFlushes,
		OwnFlushFailures: r.ownFlushFailed,
		FlushErrorOwed:   r.flushErrOwed,
		Failing:          r.failing,
		Failed:           r.failed,
		Replaced:         r.replaced,
		DeadPeers:        r.deadPeers,
		Latency:          r.latency,
	}
}

// end records why Run returns (the first reason wins) and closes both
// connections, which unblocks every goroutine of the relay.
func (r *Relay) end(err error) {
	r.endOnce.Do(func() {
		r.endErr = err
		r.mu.Lock()
		r.closing = true
		r.state = stateDown
		remote, spare, cancel := r.remote, r.spare, r.cancel
		r.remote, r.spare = nil, nil
		var calls []*call
		for _, e := range r.table {
			// Never to be answered: failed, as far as the local side
			// can tell.
			r.observe(e.cmd, claim(e), resultFailed)
			if e.call != nil {
				calls = append(calls, e.call)
			}
		}
		r.mu.Unlock()
		r.cond.Broadcast()
		for _, c := range calls {
			c.fail(err)
		}
		if cancel != nil {
			cancel()
		}
		if r.local != nil {
			r.local.Close()
		}
		if remote != nil {
			remote.Close()
		}
		if spare != nil {
			spare.Close()
		}
		if r.initial != nil {
			r.initial.Close()
		}
		close(r.ended)
	})
}

// localEnded ends the relay after a read or write on the local side failed:
// a closed local side is a normal end.
func (r *Relay) localEnded(err error) {
	if isClosed(err) {
		r.end(nil)
		return
	}
	r.end(fmt.Errorf("relay: local side: %w", err))
}

func isClosed(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, net.ErrClosed) || errors.Is(err, syscall.EPIPE) ||
		errors.Is(err, syscall.ECONNRESET)
}

func (r *Relay) emit(e Event) {
	if r.o.OnEvent != nil {
		r.o.OnEvent(e)
	}
}
