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
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// outage tracks one period without a working remote connection.
type outage struct {
	start    time.Time
	backoff  time.Duration // next pause between attempts
	attempts int
	err      error // why the last connection or dial failed
}

// remoteLoop manages the remote connection: it runs the reply path on the
// current connection and, when that fails, dials a new one, replays the
// unanswered requests on it and starts over.
func (r *Relay) remoteLoop(ctx context.Context) {
	br := bufio.NewReaderSize(nil, readBufSize)
	conn := r.initial
	var out outage
	connected, replaced := false, false
	for {
		if conn == nil {
			if out.start.IsZero() {
				out = outage{start: time.Now()}
			}
			c, err := r.redial(ctx, &out)
			if errors.Is(err, ErrFenced) {
				r.fence(err, out.attempts)
				return
			}
			if err != nil {
				if ctx.Err() == nil {
					r.mu.Lock()
					left := len(r.table)
					r.mu.Unlock()
					r.log.Error("giving up on the server", "error", err, "attempts", out.attempts, "unanswered", left)
					r.end(err)
				}
				return
			}
			conn = c
		}
		gen, raw, resend, ok := r.attach(conn, connected, replaced)
		if !ok {
			conn.Close()
			return
		}
		conn = raw
		if replaced {
			r.log.Info("a better server connection took over", "remote", conn.RemoteAddr().String())
			r.emit(Event{Kind: EventReplaced, Remote: conn})
		} else if connected {
			r.log.Info("reconnected to the server", "remote", conn.RemoteAddr().String(), "attempts", out.attempts, "outage", time.Since(out.start))
			r.emit(Event{Kind: EventReconnected, Attempts: out.attempts, Outage: time.Since(out.start), Remote: conn})
		} else {
			r.emit(Event{Kind: EventConnected, Remote: conn})
		}
		since := time.Now()

		done := make(chan downResult, 1)
		go func(c net.Conn) {
			n, err := r.downLoop(c, gen, br)
			// Fail at once: a retained replay may be waiting for replies.
			r.fail(gen, err)
			done <- downResult{n, err}
		}(conn)
		var nret, n int
		var err error
		if resend {
			r.log.Warn("the server may have lost writes it acknowledged (a new incarnation, or one that cannot tell): sending them again")
			nret, err = r.replayRetained(ctx, gen)
			r.mu.Lock()
			r.retainedReplays += nret
			r.mu.Unlock()
			if err == nil {
				r.log.Info("sent acknowledged writes again", "writes", nret)
			}
		}
		if err == nil {
			n, err = r.replay(gen)
		}
		if err != nil {
			r.fail(gen, err)
		} else if replaced {
			// What waited for the swap went out for the first time.
		} else if connected {
			if n > 0 {
				r.log.Info("replayed unanswered requests", "requests", n)
				r.mu.Lock()
				r.replayed += n
				r.mu.Unlock()
			}
			r.emit(Event{Kind: EventReplayed, Replayed: n, Retained: nret})
		}
		res := <-done
		r.fail(gen, res.err)
		conn = nil
		connected = true

		r.mu.Lock()
		closing, discSent, cause := r.closing, r.discSent, r.lastErr
		r.mu.Unlock()
		if closing {
			return
		}
		if discSent {
			if c := r.takeSpare(); c != nil {
				c.Close()
			}
			close(r.discDone)
			return
		}
		// Replace left a connection: it takes over, with no outage, or
		// as a redial would have if the old one failed by itself first.
		if conn = r.takeSpare(); conn != nil {
			replaced = errors.Is(cause, errReplaced)
			if !replaced {
				out = outage{start: time.Now(), err: cause}
				r.log.Warn("server connection lost; the connection made to replace it takes over", "error", cause)
			}
			continue
		}
		replaced = false
		// A connection that answered something, or lived a while, ends the
		// outage; one that failed at once continues it, so a server that
		// accepts and drops connections meets a growing backoff and, in
		// the end, FailAfter.
		if res.delivered > 0 || time.Since(since) >= r.o.MaxBackoff || out.start.IsZero() {
			out = outage{start: time.Now()}
		}
		out.err = cause
		r.log.Warn("server connection lost", "error", cause)
		r.emit(Event{Kind: EventDisconnected, Err: cause})
	}
}

type downResult struct {
	delivered int
	err       error
}

// redial dials until it succeeds or ctx ends. Once the outage is older
// than FailAfter it fails the requests waiting, and the new ones until a
// connection is made, but it goes on dialing.
func (r *Relay) redial(ctx context.Context, out *outage) (net.Conn, error) {
	if r.dial == nil {
		if out.err == nil {
			return nil, fmt.Errorf("%w: no remote connection and no dialer", ErrGaveUp)
		}
		return nil, fmt.Errorf("%w: no dialer: %w", ErrGaveUp, out.err)
	}
	failAfter := r.o.FailAfter
	// untilFail is how long until the requests are to fail; -1 when that
	// is not to come (no bound, or they fail already).
	untilFail := func() time.Duration {
		if failAfter <= 0 || r.isFailing() {
			return -1
		}
		return max(time.Until(out.start.Add(failAfter)), 0)
	}
	for {
		if u := untilFail(); u == 0 {
			r.startFailing(out)
		}
		if wait := out.backoff; wait > 0 {
			// ±20 % so that many relays do not redial in step.
			wait = wait*4/5 + time.Duration(rand.Int64N(int64(wait*2/5)+1))
			if u := untilFail(); u >= 0 {
				wait = min(wait, u)
			}
			t := time.NewTimer(wait)
			select {
			case <-ctx.Done():
				t.Stop()
				return nil, ctx.Err()
			case <-t.C:
			}
			if untilFail() == 0 {
				r.startFailing(out)
			}
		}
		out.backoff = min(max(2*out.backoff, r.o.ReconnectBackoff), r.o.MaxBackoff)
		timeout := dialTimeout
		if u := untilFail(); u >= 0 {
			timeout = min(timeout, max(u, 100*time.Millisecond))
		}
		dctx, cancel := context.WithTimeout(ctx, timeout)
		c, err := r.dial(dctx)
		cancel()
		out.attempts++
		if err == nil {
			return c, nil
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if ferr := fencedDial(err); ferr != nil {
			return nil, ferr
		}
		out.err = err
		r.log.Debug("redial failed", "error", err, "attempt", out.attempts)
	}
}

func (r *Relay) isFailing() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.failing
}

// startFailing answers every request waiting for the server with EIO and
// makes the relay answer new ones so at once, until the next connection:
// the outage outlasted FailAfter. The relay's own flushes and the retained
// writes stay, since what they hold is still owed to the server.
func (r *Relay) startFailing(out *outage) {
	r.mu.Lock()
	if r.failing || r.closing {
		r.mu.Unlock()
		return
	}
	r.failing = true
	var failed []*entry
	for e := r.head; e != nil; {
		next := e.next
		if !e.internal {
			r.unlink(e)
			r.bytes -= e.cost
			failed = append(failed, e)
		}
		e = next
	}
	r.failed += len(failed)
	r.waiting = false
	r.mu.Unlock()
	r.cond.Broadcast()
	r.log.Error("no server connection for the bounded wait: I/O fails until one is made",
		"fail_after", r.o.FailAfter, "outage", time.Since(out.start).Round(time.Millisecond),
		"attempts", out.attempts, "failed", len(failed), "error", out.err)
	r.emit(Event{Kind: EventFailing, Err: out.err, Failed: len(failed), Attempts: out.attempts, Outage: time.Since(out.start)})
	r.answerAll(failed)
	if err := r.flushLocal(); err != nil {
		r.localEnded(err)
	}
}

// answerAll answers failed, out of the table, with EIO in order, until the
// local side is gone; the ones left count as failed all the same.
func (r *Relay) answerAll(failed []*entry) {
	for i, e := range failed {
		if !r.answerError(e, nbd.EIO) {
			for _, e := range failed[i+1:] {
				r.observe(e.cmd, claim(e), resultFailed)
			}
			return
		}
	}
}

// answerError answers e, already out of the table and its cost released,
// with errno. It returns false when the local side is gone.
func (r *Relay) answerError(e *entry, errno uint32) bool {
	defer answered(e)
	// Out of the table (or never in it): no other path can count e.
	r.observe(e.cmd, claim(e), resultFailed)
	if e.call != nil {
		e.call.finish(errno)
		return true
	}
	var hdr [repHeaderSize]byte
	(&nbd.Reply{Errno: errno, Handle: e.handle}).Encode(hdr[:])
	if err := r.deliver(hdr[:], nil); err != nil {
		r.localEnded(err)
		return false
	}
	return true
}

// attach makes conn the current remote connection, in the replaying state:
// every unanswered request is to be sent again, and the retained writes
// first when resend says so (the server is not provably the incarnation
// that acknowledged them). It returns the connection's generation and the
// connection itself (unwrapped from a Remote), or false when the relay is
// closing.
func (r *Relay) attach(c net.Conn, again, replaced bool) (gen uint64, conn net.Conn, resend, ok bool) {
	conn, info := unwrap(c)
	r.mu.Lock()
	if r.closing {
		r.mu.Unlock()
		return 0, conn, false, false
	}
	r.gen++
	gen = r.gen
	r.remote = conn
	r.state = stateReplaying
	r.unsent = r.head
	r.lastErr = nil
	r.downSince = time.Time{}
	r.failing = false
	clear(r.rsent)
	resend = !r.sameIncarnation(info, again) && r.retHead != nil
	switch {
	case replaced:
		r.replaced++
	case again:
		r.reconnects++
	}
	r.mu.Unlock()
	r.wmu.Lock()
	r.rw.reset(conn)
	r.rwGen = gen
	r.wmu.Unlock()
	return gen, conn, resend, true
}

// replay sends, in arrival order, every request not yet sent on the
// connection of generation gen, including those arriving meanwhile, then
// hands sending over to the request path.
func (r *Relay) replay(gen uint64) (int, error) {
	n := 0
	for {
		r.mu.Lock()
		if r.gen != gen || r.state != stateReplaying {
			r.mu.Unlock()
			return n, nil // failed meanwhile; the reply path reports why
		}
		e := r.unsent
		if e == nil {
			r.state = stateUp
			r.mu.Unlock()
			r.cond.Broadcast() // Replace waits for this
			r.flushRemote()
			return n, nil
		}
		r.unsent = e.next
		e.gen = gen
		sending(e)
		r.mu.Unlock()
		if err := r.send(gen, e); err != nil {
			return n, err
		}
		n++
	}
}

// fail marks the connection of generation gen broken and closes it. Later
// calls for the same generation do nothing.
func (r *Relay) fail(gen uint64, err error) {
	r.mu.Lock()
	if r.gen != gen || r.state == stateDown {
		r.mu.Unlock()
		return
	}
	r.state = stateDown
	c := r.remote
	r.remote = nil
	r.lastErr = err
	r.downSince = time.Now()
	r.mu.Unlock()
	r.cond.Broadcast() // a retained replay may wait on this connection
	if c != nil {
		c.Close()
	}
}

// downLoop is the reply path of one connection. It returns (with the
// replies it delivered) when the connection fails or breaks the protocol.
// A reply is taken out of the table only once it is complete, so a
// connection that dies in the middle of a read payload leaves the request
// to the replay, and each reply reaches the local side exactly once.
func (r *Relay) downLoop(conn net.Conn, gen uint64, br *bufio.Reader) (delivered int, err error) {
	src, unwatch := r.watch(conn, gen)
	defer unwatch()
	br.Reset(src)
	defer func() {
		// Replies taken out of the table must reach the local side even
		// though this connection is done.
		if ferr := r.flushLocal(); ferr != nil {
			r.localEnded(ferr)
		}
	}()
	var hdr [repHeaderSize]byte
	for {
		if br.Buffered() < repHeaderSize {
			if err := r.flushLocal(); err != nil {
				r.localEnded(err)
				return delivered, errLocalGone
			}
		}
		if _, err := io.ReadFull(br, hdr[:]); err != nil {
			return delivered, err
		}
		rep, err := nbd.DecodeReply(hdr[:])
		if err != nil {
			return delivered, err
		}
		r.mu.Lock()
		e := r.table[rep.Handle]
		// An entry of the current generation was taken for sending on this
		// connection; the unsent ones carry an older generation.
		known := e != nil && e.gen == gen
		_, resent := r.rsent[rep.Handle]
		if resent && rep.Errno == 0 {
			delete(r.rsent, rep.Handle)
		}
		r.mu.Unlock()
		if resent {
			if rep.Errno != 0 {
				// Retry on another connection: the write was acknowledged
				// once, and the data exists only here.
				return delivered, fmt.Errorf("server failed an acknowledged write sent again: %s", nbd.ErrnoName(rep.Errno))
			}
			r.cond.Broadcast()
			continue
		}
		if !known {
			return delivered, fmt.Errorf("%w: reply for unknown handle %#x", nbd.ErrProtocol, rep.Handle)
		}
		if rep.Errno == nbd.ESHUTDOWN {
			return delivered, errServerShutdown
		}
		var buf *[]byte
		var data []byte
		cl := e.call
		if e.cmd == nbd.CmdRead && rep.Errno == 0 && e.length > 0 {
			if cl != nil {
				// An in-process caller: straight into its buffer. A
				// connection dying halfway leaves the request to the
				// replay, which overwrites it all.
				data = cl.dst
			} else {
				buf = getBuf(int(e.length))
				data = *buf
			}
			if br.Buffered() < len(data) {
				if err := r.flushLocal(); err != nil {
					putBuf(buf)
					r.localEnded(err)
					return delivered, errLocalGone
				}
			}
			if _, err := io.ReadFull(br, data); err != nil {
				putBuf(buf)
				return delivered, fmt.Errorf("reading %d-byte read payload: %w", len(data), err)
			}
		}
		internal := e.internal
		errno := r.complete(e, rep.Errno)
		if internal {
			putBuf(buf)
			continue
		}
		if cl != nil {
			cl.finish(errno)
			delivered++
			continue
		}
		if errno != rep.Errno {
			setReplyErrno(hdr[:], errno)
		}
		werr := r.deliver(hdr[:], data)
		putBuf(buf)
		if werr != nil {
			r.localEnded(werr)
			return delivered, errLocalGone
		}
		delivered++
	}
}

// complete takes e out of the table, answered with errno, and wakes a
// request path waiting for room. A successful write stays, on the retained
// list; a successful FLUSH trims that list. It returns the errno the local
// side gets: a failed FLUSH of the relay's own is owed to the next local
// one (flusherr.go).
func (r *Relay) complete(e *entry, errno uint32) uint32 {
	r.mu.Lock()
	r.unlink(e)
	errno = r.flushVerdict(e, errno)
	cmd, start := e.cmd, claim(e)
	keep := errno == 0 && !e.internal && r.retains(e) && !r.o.noRetain
	if keep {
		r.retain(e)
	} else {
		r.bytes -= e.cost
	}
	var trimmed []*entry
	if e.cmd == nbd.CmdFlush && errno == 0 {
		trimmed = r.flushed(e.flushMark)
	}
	if e.internal {
		r.flushing = false
	}
	flush := r.needFlush()
	wake := r.waiting || len(trimmed) > 0
	r.waiting = false
	r.mu.Unlock()
	if wake {
		r.cond.Broadcast()
	}
	if !keep {
		answered(e)
	}
	r.observe(cmd, start, errnoResult(errno))
	for _, t := range trimmed {
		answered(t)
	}
	if flush {
		// Not on the reply path: sending may block until replies are read.
		go r.ownFlush()
	}
	return errno
}

// unlink takes e out of the table and the arrival list. Called with mu
// held.
func (r *Relay) unlink(e *entry) {
	delete(r.table, e.handle)
	if e.prev != nil {
		e.prev.next = e.next
	} else {
		r.head = e.next
	}
	if e.next != nil {
		e.next.prev = e.prev
	} else {
		r.tail = e.prev
	}
	if r.unsent == e {
		r.unsent = e.next
	}
	e.prev, e.next = nil, nil
}

// deliver passes one reply to the local side.
func (r *Relay) deliver(hdr, data []byte) error {
	r.lwmu.Lock()
	err := r.lw.writeFrame(hdr, data)
	r.lwmu.Unlock()
	if err == nil {
		r.toLocal.Add(uint64(len(hdr) + len(data)))
	}
	return err
}

func (r *Relay) flushLocal() error {
	r.lwmu.Lock()
	err := r.lw.flush()
	r.lwmu.Unlock()
	return err
}
