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
	"fmt"
	"io"
	"net"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// upLoop is the request path: it reads requests from the local side, puts
// each in the table and, while the remote is up, sends it.
func (r *Relay) upLoop() {
	br := r.localReader(r.o.Pending)
	var hdr [reqHeaderSize]byte
	for {
		if br.Buffered() < reqHeaderSize {
			// The next read may block: what was gathered goes out first.
			r.flushRemote()
		}
		if n, err := io.ReadFull(br, hdr[:]); err != nil {
			next, stop := r.parkIfPaused(err, hdr[:n], br)
			if next != nil {
				br = next
				continue
			}
			if !stop {
				r.localEnded(err)
			}
			return
		}
		req, err := nbd.DecodeRequest(hdr[:])
		if err != nil {
			r.end(fmt.Errorf("relay: local side: %w", err))
			return
		}
		r.fromLocal.Add(reqHeaderSize)
		start := startTime()
		if req.Type == nbd.CmdDisc {
			r.disconnect(hdr)
			return
		}
		var data int
		if req.Type == nbd.CmdRead || req.Type == nbd.CmdWrite {
			if req.Length > nbd.MaxRequestSize {
				// A write this big cannot be held for replay, and the kernel
				// never sends one: the framing is not to be trusted.
				r.end(fmt.Errorf("relay: local side: %w: %s of %d bytes", nbd.ErrTooBig, nbd.CmdName(req.Type), req.Length))
				return
			}
			data = int(req.Length)
		}
		cost := requestCost(req.Type, uint32(data))
		if !r.admit(cost) {
			return
		}
		e := getEntry()
		e.hdr = hdr
		e.handle, e.cmd, e.length, e.cost = req.Handle, req.Type, req.Length, cost
		e.flags, e.offset = req.Flags, req.Offset
		e.start = start
		if req.Type == nbd.CmdWrite && data > 0 {
			e.buf = getBuf(data)
			e.payload = *e.buf
			if br.Buffered() < data {
				r.flushRemote()
			}
			if n, err := io.ReadFull(br, e.payload); err != nil {
				partial := append(hdr[:], e.payload[:n]...)
				recycle(e)
				r.mu.Lock()
				r.bytes -= cost
				r.mu.Unlock()
				r.fromLocal.Add(^uint64(reqHeaderSize - 1))
				next, stop := r.parkIfPaused(err, partial, br)
				if next != nil {
					br = next
					continue
				}
				if !stop {
					r.localEnded(err)
				}
				return
			}
			r.fromLocal.Add(uint64(data))
		}
		if err := r.enqueue(e); err != nil {
			r.end(err)
			return
		}
	}
}

// admit reserves cost bytes of the in-flight budget, waiting (and so not
// reading from the local side) while the budget is spent. It returns false
// when the relay is closing.
func (r *Relay) admit(cost int) bool {
	r.mu.Lock()
	if r.mustWait(cost) {
		// Requests gathered but not yet written may be what the budget
		// waits for; so may retained writes that a flush would free.
		flush := r.retBytes > 0 && !r.flushing && !r.closing
		if flush {
			r.flushing = true
		}
		r.mu.Unlock()
		if flush {
			r.ownFlush()
		}
		r.flushRemote()
		r.mu.Lock()
		for r.mustWait(cost) {
			r.waiting = true
			r.cond.Wait()
		}
	}
	ok := !r.closing
	if ok {
		r.bytes += cost
	}
	r.mu.Unlock()
	return ok
}

func (r *Relay) mustWait(cost int) bool {
	// While failing, a request is answered at once and holds nothing.
	return !r.closing && !r.failing && r.bytes > 0 && r.bytes+cost > r.max
}

// enqueue puts e in the table, then sends it when the remote is up and
// nothing older is waiting; otherwise the replay after the next connect
// sends it.
func (r *Relay) enqueue(e *entry) error {
	r.mu.Lock()
	if _, dup := r.table[e.handle]; dup {
		r.mu.Unlock()
		h := e.handle
		recycle(e)
		return fmt.Errorf("relay: local side: %w: handle %#x already in flight", nbd.ErrProtocol, h)
	}
	if r.failing && !e.internal {
		// The outage outlasted FailAfter: no waiting.
		r.bytes -= e.cost
		r.failed++
		r.mu.Unlock()
		if r.answerError(e, nbd.EIO) {
			if err := r.flushLocal(); err != nil {
				r.localEnded(err)
			}
		}
		return nil
	}
	r.table[e.handle] = e
	if r.closing {
		// After the end: never answered, and not in the table end saw.
		r.observe(e.cmd, claim(e), resultFailed)
	}
	if e.cmd == nbd.CmdFlush {
		e.flushMark = r.ackSeq
	}
	e.prev = r.tail
	if r.tail != nil {
		r.tail.next = e
	} else {
		r.head = e
	}
	r.tail = e
	if r.unsent == nil {
		r.unsent = e
	}
	if r.state != stateUp || r.unsent != e {
		r.mu.Unlock()
		return nil
	}
	r.unsent = nil
	gen := r.gen
	e.gen = gen
	sending(e)
	r.mu.Unlock()
	if err := r.send(gen, e); err != nil {
		r.fail(gen, err)
	}
	return nil
}

// send writes e to the connection of generation gen. If that connection is
// already replaced, it writes nothing: the replay on the new one covers e.
func (r *Relay) send(gen uint64, e *entry) error {
	var err error
	r.wmu.Lock()
	if r.rwGen == gen {
		err = r.rw.writeFrame(e.hdr[:], e.payload)
	}
	r.wmu.Unlock()
	sent(e)
	return err
}

// flushRemote writes the gathered requests.
func (r *Relay) flushRemote() {
	r.wmu.Lock()
	gen := r.rwGen
	err := r.rw.flush()
	r.wmu.Unlock()
	if err != nil {
		r.fail(gen, err)
	}
}

// disconnect handles NBD_CMD_DISC from the local side: wait (bounded) for
// the replies still due, forward DISC, wait for the server to flush and
// close, then end.
func (r *Relay) disconnect(hdr [reqHeaderSize]byte) {
	r.flushRemote()
	timedOut := false
	t := time.AfterFunc(discDrainTimeout, func() {
		r.mu.Lock()
		timedOut = true
		r.mu.Unlock()
		r.cond.Broadcast()
	})
	r.mu.Lock()
	for len(r.table) > 0 && !r.closing && !timedOut {
		r.waiting = true
		r.cond.Wait()
	}
	t.Stop()
	left := len(r.table)
	up := r.state == stateUp && !r.closing
	gen := r.gen
	if up {
		r.discSent = true
	}
	r.mu.Unlock()
	if left > 0 {
		r.log.Warn("disconnecting with requests unanswered", "unanswered", left, "waited", discDrainTimeout)
	}
	if !up {
		r.end(nil)
		return
	}
	r.wmu.Lock()
	err := net.ErrClosed
	if r.rwGen == gen {
		if err = r.rw.writeFrame(hdr[:], nil); err == nil {
			err = r.rw.flush()
		}
		if cw, ok := r.rw.conn.(interface{ CloseWrite() error }); ok && err == nil {
			// Only early news of our end: the server closes after the
			// DISC all the same, and its EOF is waited for below.
			_ = cw.CloseWrite()
		}
	}
	r.wmu.Unlock()
	if err == nil {
		// The server answers DISC by flushing and closing: wait for its EOF
		// so that Run returns only once the data is safe.
		select {
		case <-r.discDone:
		case <-r.ended:
		case <-time.After(discCloseTimeout):
			r.log.Warn("server did not close after NBD_CMD_DISC", "waited", discCloseTimeout)
		}
	}
	r.end(nil)
}
