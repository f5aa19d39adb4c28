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
	"errors"
	"fmt"
	"io"
	"net"
	"sync/atomic"
	"time"

	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// A storage host that loses power, or a network that silently drops
// everything, sends no reset. Without a deadline of its own the relay
// would wait for the kernel to give up on the connection: tcp_retries2,
// about 15 minutes of stalled I/O, before the first redial. The relay
// therefore watches each remote connection itself:
//
//   - Progress, not age: the connection is suspect once requests sent on
//     it are unanswered and nothing at all has been received on it for
//     Options.DeadPeerTimeout. Any byte of any reply counts, so a loaded
//     server answering slowly but steadily is never suspect, however old
//     its oldest request; an age bound on the oldest request would
//     declare such a server dead exactly when it is busiest.
//   - The peer's kernel has the last word: a suspect connection is
//     declared dead only if the peer's kernel acknowledged nothing either
//     for that long (mptcp.LastHeard: on MPTCP the freshest subflow, on
//     TCP the socket). The relay arms a keepalive of a quarter of the
//     bound on its connections (mptcp.ArmDeadPeer), so a host that is up
//     answers a probe within the bound even while its server process
//     spends longer than that on one request (a FLUSH over a large dirty
//     cache). Only a silent host, or silent paths, fail both tests.
//   - A dead connection is closed and handled as one that was reset: a
//     redial over every storage address, then the replay.
//
// MPTCP sockets refuse TCP_USER_TIMEOUT, and they should: a dead subflow
// of a live connection is a lost path, not a lost server, and MPTCP
// reroutes its data to the other subflows (whose acknowledgements keep
// LastHeard short). Connections that give no kernel view of their peer
// (a test's pipe) are judged by progress alone.

// DefaultDeadPeerTimeout is the bound of Options.DeadPeerTimeout: a few
// seconds, longer than a path's retransmission backoff takes to try a few
// times and longer than the keepalive needs to hear from a live peer
// twice, far shorter than the kernel's 15 minutes.
const DefaultDeadPeerTimeout = 5 * time.Second

// MinDeadPeerTimeout is the least bound: the keepalive that tells a slow
// peer from a dead one counts in whole seconds.
const MinDeadPeerTimeout = 2 * time.Second

// ErrDeadPeer is why the relay closed a connection whose server went
// silent (Event.Err of the EventDisconnected that follows).
var ErrDeadPeer = errors.New("relay: server silent (no reply, no acknowledgement)")

// deadPeerTimeout is the bound in force; zero when the check is off.
func (o *Options) deadPeerTimeout() time.Duration {
	switch {
	case o.DeadPeerTimeout < 0:
		return 0
	case o.DeadPeerTimeout == 0:
		return DefaultDeadPeerTimeout
	}
	return max(o.DeadPeerTimeout, MinDeadPeerTimeout)
}

// watchdog watches one remote connection; it is also the reader the reply
// path reads through, so that every byte received counts as progress.
type watchdog struct {
	r     *Relay
	conn  net.Conn
	gen   uint64
	bound time.Duration
	// last is when something was last received (UnixNano).
	last atomic.Int64
	stop chan struct{}
}

// watch starts the watchdog of the connection of generation gen; the
// reply path reads through what it returns and calls end when it is done
// with the connection.
func (r *Relay) watch(conn net.Conn, gen uint64) (io.Reader, func()) {
	bound := r.o.deadPeerTimeout()
	if bound == 0 {
		return conn, func() {}
	}
	if err := mptcp.ArmDeadPeer(conn, bound); err != nil && !errors.Is(err, mptcp.ErrPeerUnknown) {
		r.log.Debug("cannot arm keepalive on the server connection", "error", err)
	}
	w := &watchdog{r: r, conn: conn, gen: gen, bound: bound, stop: make(chan struct{})}
	w.last.Store(time.Now().UnixNano())
	go w.run()
	return w, func() { close(w.stop) }
}

func (w *watchdog) Read(p []byte) (int, error) {
	n, err := w.conn.Read(p)
	if n > 0 {
		w.last.Store(time.Now().UnixNano())
	}
	return n, err
}

// watchTick is how often the watchdog looks, as a fraction of the bound.
const watchTick = 10

func (w *watchdog) run() {
	t := time.NewTicker(min(max(w.bound/watchTick, 50*time.Millisecond), 500*time.Millisecond))
	defer t.Stop()
	var busySince time.Time
	slowLogged := false
	for {
		select {
		case <-w.stop:
			return
		case now := <-t.C:
			busy, current := w.r.awaiting(w.gen)
			if !current {
				return
			}
			if !busy {
				busySince, slowLogged = time.Time{}, false
				continue
			}
			if busySince.IsZero() {
				busySince = now
			}
			since := time.Unix(0, w.last.Load())
			if busySince.After(since) {
				since = busySince
			}
			quiet := now.Sub(since)
			if quiet < w.bound {
				continue
			}
			heard, err := mptcp.LastHeard(w.conn)
			if err == nil && heard < w.bound {
				if !slowLogged {
					w.r.log.Warn("server slow: no reply for a while, but its host answers", "quiet", quiet.Round(time.Millisecond), "last_heard", heard)
					slowLogged = true
				}
				continue
			}
			why := fmt.Errorf("%w for %s", ErrDeadPeer, quiet.Round(time.Millisecond))
			if err == nil {
				why = fmt.Errorf("%w for %s (last acknowledgement %s ago)", ErrDeadPeer, quiet.Round(time.Millisecond), heard.Round(time.Millisecond))
			}
			w.r.log.Warn("server connection dead: closing it to redial", "error", why)
			w.r.mu.Lock()
			w.r.deadPeers++
			w.r.mu.Unlock()
			w.r.fail(w.gen, why)
			return
		}
	}
}

// awaiting reports whether requests sent on the connection of generation
// gen wait for their replies, and whether that connection is still the
// current one.
func (r *Relay) awaiting(gen uint64) (busy, current bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.gen != gen || r.state == stateDown || r.closing {
		return false, false
	}
	// Requests are sent in arrival order, so the oldest one tells.
	return len(r.rsent) > 0 || (r.head != nil && r.head.gen == gen), true
}
