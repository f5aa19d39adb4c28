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
	"fmt"
	"net"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// Retention: a write the server acknowledged is durable only once a FLUSH
// sent after that acknowledgement completes (or if it carried FUA). Until
// then it lives in the server's page cache, and a crash of the storage
// host loses it although the kernel was told it is done. So the relay
// keeps every acknowledged write, trim and write-zeroes, with its data,
// until a completed FLUSH covers it: the "retained" list, in the order the
// acknowledgements arrived.
//
// When a new connection reaches a server that is not provably the same
// incarnation as the one before (a different Incarnation in the session
// reply, or a server without the session option, where nothing can be
// proved), the retained writes are sent again before anything else, in
// their order: a write overlapping one still in flight waits for it, so
// the server cannot reorder them. Their replies go nowhere: the kernel had
// its answer already. Only then are the unanswered requests replayed.
//
// Retained bytes count against MaxInflightBytes; past RetainBytes the relay
// sends a FLUSH of its own, whose completion trims the list.

// Remote is a connection to the server together with what its handshake
// said. A Dialer (or New's remote) may return one so that the relay knows
// the server's incarnation; a plain net.Conn counts as an unknown one.
type Remote struct {
	net.Conn
	Info nbd.ExportInfo
}

// NetConn returns the connection itself, so that what inspects sockets
// (pkg/mptcp) sees through a Remote.
func (r *Remote) NetConn() net.Conn { return r.Conn }

// unwrap returns the connection itself and what is known of its server.
func unwrap(c net.Conn) (net.Conn, nbd.ExportInfo) {
	if rc, ok := c.(*Remote); ok {
		return rc.Conn, rc.Info
	}
	return c, nbd.ExportInfo{}
}

// Handles of the relay's own requests have the low 32 bits all ones; the
// kernel's handles carry a tag there (a small number), so they never meet.
const internalTag = 0xffffffff

func (r *Relay) nextInternalHandle() uint64 {
	r.internalSeq++
	return r.internalSeq<<32 | internalTag
}

// retains reports whether e, answered with success, must be kept until a
// flush covers it. Called with mu held.
//
// A plain write, trim or write-zeroes is kept because the server's cache
// may lose it. One with FUA is durable once answered, but it is kept too
// when anything acknowledged before it is retained: a replay of those
// older writes to a new incarnation would otherwise land over it (plain
// write A to a block, FUA write B to it, power loss, replay of A: the
// block holds A although B was acknowledged as durable after it). Kept in
// the acknowledgement order, it is sent again after them and wins, as it
// did the first time.
func (r *Relay) retains(e *entry) bool {
	switch e.cmd {
	case nbd.CmdWrite, nbd.CmdTrim, nbd.CmdWriteZeroes:
		return e.flags&nbd.CmdFlagFUA == 0 || r.retHead != nil
	}
	return false
}

// retain appends an answered entry to the retained list. Called with mu
// held; e stays charged to the in-flight budget.
func (r *Relay) retain(e *entry) {
	r.ackSeq++
	e.ackSeq = r.ackSeq
	e.prev, e.next = r.retTail, nil
	if r.retTail != nil {
		r.retTail.next = e
	} else {
		r.retHead = e
	}
	r.retTail = e
	r.retCount++
	r.retBytes += e.cost
}

// flushed drops the retained entries a completed FLUSH covers: those
// acknowledged before the FLUSH arrived (mark). Called with mu held; it
// returns the entries to recycle once mu is released.
func (r *Relay) flushed(mark uint64) []*entry {
	var out []*entry
	for e := r.retHead; e != nil && e.ackSeq <= mark; e = r.retHead {
		r.retHead = e.next
		if r.retHead == nil {
			r.retTail = nil
		} else {
			r.retHead.prev = nil
		}
		e.prev, e.next = nil, nil
		r.retCount--
		r.retBytes -= e.cost
		r.bytes -= e.cost
		out = append(out, e)
	}
	return out
}

// needFlush reports whether the relay should send a FLUSH of its own now,
// and claims it. Called with mu held.
func (r *Relay) needFlush() bool {
	if r.flushing || r.closing || r.retBytes < r.retainMax {
		return false
	}
	r.flushing = true
	return true
}

// ownFlush sends a FLUSH of the relay's own; its completion trims the
// retained list. It goes through the table like any request, so it is
// replayed if the connection breaks.
func (r *Relay) ownFlush() {
	e := getEntry()
	r.mu.Lock()
	e.handle = r.nextInternalHandle()
	r.mu.Unlock()
	(&nbd.Request{Type: nbd.CmdFlush, Handle: e.handle}).Encode(e.hdr[:])
	e.cmd, e.cost, e.internal = nbd.CmdFlush, requestCost(nbd.CmdFlush, 0), true
	r.mu.Lock()
	r.bytes += e.cost
	r.ownFlushes++
	r.mu.Unlock()
	if err := r.enqueue(e); err != nil {
		r.end(err)
		return
	}
	r.flushRemote()
}

// sameIncarnation decides, for a new connection, whether the server is
// provably the one that acknowledged the retained writes. Called with mu
// held; it records the new connection's incarnation.
func (r *Relay) sameIncarnation(info nbd.ExportInfo, again bool) bool {
	same := again && r.incKnown && info.Fenced && info.Incarnation == r.inc
	r.inc, r.incKnown = info.Incarnation, info.Fenced
	return same || !again
}

// overlaps reports whether [off, off+n) meets any range in rs.
func overlaps(rs [][2]uint64, off, n uint64) bool {
	for _, x := range rs {
		if off < x[1] && x[0] < off+n {
			return true
		}
	}
	return false
}

// maxRetainBatch bounds the retained writes in flight together during a
// retained replay.
const maxRetainBatch = 64

// replayRetained sends the retained writes again on the connection of
// generation gen, in order, never two overlapping ones in flight together,
// and waits until the server answered them all.
func (r *Relay) replayRetained(ctx context.Context, gen uint64) (int, error) {
	r.mu.Lock()
	var list []*entry
	for e := r.retHead; e != nil; e = e.next {
		sending(e) // its payload must outlive a trim meanwhile
		list = append(list, e)
	}
	r.mu.Unlock()
	defer func() {
		for _, e := range list {
			sent(e)
		}
	}()
	var batch [][2]uint64
	n := 0
	for _, e := range list {
		off, length := e.offset, uint64(e.length)
		if len(batch) >= maxRetainBatch || overlaps(batch, off, length) {
			if err := r.awaitRetained(gen); err != nil {
				return n, err
			}
			batch = batch[:0]
		}
		hdr := e.hdr
		r.mu.Lock()
		if r.gen != gen || r.state == stateDown {
			r.mu.Unlock()
			return n, net.ErrClosed
		}
		h := r.nextInternalHandle()
		r.rsent[h] = struct{}{}
		r.mu.Unlock()
		(&nbd.Request{Type: e.cmd, Flags: e.flags, Handle: h, Offset: e.offset, Length: e.length}).Encode(hdr[:])
		var err error
		r.wmu.Lock()
		if r.rwGen == gen {
			err = r.rw.writeFrame(hdr[:], e.payload)
		} else {
			err = net.ErrClosed
		}
		r.wmu.Unlock()
		if err != nil {
			return n, err
		}
		batch = append(batch, [2]uint64{off, off + length})
		n++
		if ctx.Err() != nil {
			return n, ctx.Err()
		}
	}
	return n, r.awaitRetained(gen)
}

// awaitRetained flushes what was written and waits until every retained
// write sent again on gen is answered, or the connection fails.
func (r *Relay) awaitRetained(gen uint64) error {
	r.flushRemote()
	r.mu.Lock()
	defer r.mu.Unlock()
	for len(r.rsent) > 0 && r.gen == gen && r.state != stateDown && !r.closing {
		r.cond.Wait()
	}
	if r.gen != gen || r.state == stateDown || r.closing {
		return fmt.Errorf("connection lost while sending retained writes again: %w", net.ErrClosed)
	}
	return nil
}
