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
	"sync/atomic"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// An in-process local side: a Relay made with a nil local connection
// takes its requests as calls (RoundTrip) instead of frames, with the same
// guarantees (redial, replay, retention, bounded memory). nbd.NewClientOn
// puts the block-level API (ReadAt, WriteAt, Flush, ...) on top, so that a
// userspace transport (FUSE, ublk) serves its device from the one session
// the kernel's relay also uses.

// ErrClosed fails calls made after the relay ended or pending when it did.
var ErrClosed = errors.New("relay: closed")

// call is one in-process request waiting for its reply: a caller waits
// on done (RoundTrip), or fn is called with the outcome (Start).
type call struct {
	dst  []byte
	cmd  uint16
	done chan error
	fn   func(error)
	once atomic.Bool
}

// finish and fail may race (a reply against the relay's end); the first
// wins. Calls are not pooled, so a late loser writes to nobody's call.
func (c *call) finish(errno uint32) {
	var err error
	if errno != 0 {
		err = &nbd.Error{Cmd: c.cmd, Errno: errno}
	}
	c.deliver(err)
}

func (c *call) fail(err error) {
	if err == nil {
		err = ErrClosed
	} else {
		err = fmt.Errorf("%w: %w", ErrClosed, err)
	}
	c.deliver(err)
}

func (c *call) deliver(err error) {
	if c.fn != nil {
		if c.once.CompareAndSwap(false, true) {
			c.fn(err)
		}
		return
	}
	select {
	case c.done <- err:
	default:
	}
}

// Call handles have zero low bits, so they never meet the relay's own
// (internalTag) and stay unique however long the relay runs.
func (r *Relay) nextCallHandle() uint64 {
	r.callSeq++
	return r.callSeq << 32
}

// RoundTrip sends one request (payload for a write; dst receives a read's
// data) and waits for its reply; an error reply is an *nbd.Error. It is
// only for a relay without a local connection, and safe for concurrent
// use: requests travel together.
func (r *Relay) RoundTrip(req nbd.Request, payload, dst []byte) error {
	return r.roundTrip(req, payload, nil, dst)
}

// Buffer returns a buffer of n bytes from the relay's pool (its capacity
// is n rounded up to a power of two), for WriteOwned.
func Buffer(n int) *[]byte { return getBuf(n) }

// WriteOwned is RoundTrip for a write whose payload, the first req.Length
// bytes of *buf, the relay takes instead of copying: it keeps buf until a
// FLUSH covers the write and then recycles it, so the caller must not
// touch buf once it called, whatever the outcome. The write counts against
// the in-flight budget by its length, as every write does: a caller hands
// over buffers less than twice that long (Buffer's rounding), or the relay
// holds more memory than its budget says.
func (r *Relay) WriteOwned(req nbd.Request, buf *[]byte) error {
	if req.Type != nbd.CmdWrite || int(req.Length) > len(*buf) {
		putBuf(buf)
		return fmt.Errorf("relay: WriteOwned of %s with %d bytes for %d", nbd.CmdName(req.Type), len(*buf), req.Length)
	}
	return r.roundTrip(req, nil, buf, nil)
}

func (r *Relay) roundTrip(req nbd.Request, payload []byte, owned *[]byte, dst []byte) error {
	c := &call{dst: dst, cmd: req.Type, done: make(chan error, 1)}
	if err := r.start(req, payload, owned, c); err != nil {
		return err
	}
	r.flushRemote()
	var err error
	select {
	case err = <-c.done:
	case <-r.ended:
		// Entries enqueued after the end are never answered.
		select {
		case err = <-c.done:
		default:
			err = r.closedErr()
		}
	}
	if err == nil && req.Type == nbd.CmdRead {
		r.toLocal.Add(uint64(req.Length))
	}
	return err
}

// Start is RoundTrip without the wait, and without the write to the
// server: the requests started one after another go out together with
// the next Push (or with any request written before it). done is called
// once with what RoundTrip would return: from the goroutine that reads
// the replies, so it must be quick and must not call the relay, or from
// Start itself if the request fails at once. owned, when not nil, is a
// write's payload buffer the relay takes, as in WriteOwned (payload is
// then ignored). Start may wait while the in-flight budget is spent (it
// writes what was started first).
func (r *Relay) Start(req nbd.Request, payload []byte, owned *[]byte, dst []byte, done func(error)) {
	if owned != nil && (req.Type != nbd.CmdWrite || int(req.Length) > len(*owned)) {
		putBuf(owned)
		done(fmt.Errorf("relay: Start of %s with an owned buffer of %d bytes for %d", nbd.CmdName(req.Type), len(*owned), req.Length))
		return
	}
	c := &call{dst: dst, cmd: req.Type}
	read := req.Type == nbd.CmdRead
	n := uint64(req.Length)
	c.fn = func(err error) {
		if err == nil && read {
			r.toLocal.Add(n)
		}
		done(err)
	}
	if err := r.start(req, payload, owned, c); err != nil {
		c.deliver(err)
		return
	}
	select {
	case <-r.ended:
		// Entries enqueued after the end are never answered.
		c.deliver(r.closedErr())
	default:
	}
}

// Push writes the requests Start queued to the server.
func (r *Relay) Push() { r.flushRemote() }

// start admits and queues one in-process request (its reply goes to c);
// an error says it was not queued.
func (r *Relay) start(req nbd.Request, payload []byte, owned *[]byte, c *call) error {
	if r.local != nil {
		putBuf(owned)
		return fmt.Errorf("relay: RoundTrip on a relay with a local connection")
	}
	switch req.Type {
	case nbd.CmdRead, nbd.CmdWrite:
		if req.Length > nbd.MaxRequestSize {
			putBuf(owned)
			return fmt.Errorf("%w: %s of %d bytes", nbd.ErrTooBig, nbd.CmdName(req.Type), req.Length)
		}
	case nbd.CmdDisc:
		return fmt.Errorf("relay: NBD_CMD_DISC goes through Close")
	}
	start := startTime()
	data := 0
	if req.Type == nbd.CmdRead || req.Type == nbd.CmdWrite {
		data = int(req.Length)
	}
	cost := requestCost(req.Type, uint32(data))
	if owned != nil {
		// The caller's buffer is what is held.
		cost = entryOverhead + cap(*owned)
	}
	if !r.admit(cost) {
		putBuf(owned)
		return r.closedErr()
	}
	e := getEntry()
	r.mu.Lock()
	closing := r.closing
	req.Handle = r.nextCallHandle()
	r.mu.Unlock()
	if closing {
		r.mu.Lock()
		r.bytes -= cost
		r.mu.Unlock()
		recycle(e)
		putBuf(owned)
		return r.closedErr()
	}
	req.Encode(e.hdr[:])
	e.handle, e.cmd, e.length, e.cost = req.Handle, req.Type, req.Length, cost
	e.flags, e.offset = req.Flags, req.Offset
	e.call = c
	e.start = start
	switch {
	case owned != nil:
		e.buf = owned
		e.payload = (*owned)[:data]
	case req.Type == nbd.CmdWrite && data > 0:
		// Kept for replays and retention, so it must be ours.
		e.buf = getBuf(data)
		e.payload = *e.buf
		copy(e.payload, payload)
	}
	if err := r.enqueue(e); err != nil {
		r.end(err)
	}
	r.fromLocal.Add(uint64(reqHeaderSize + data))
	return nil
}

func (r *Relay) closedErr() error {
	select {
	case <-r.ended:
		if r.endErr != nil {
			return fmt.Errorf("%w: %w", ErrClosed, r.endErr)
		}
	default:
	}
	return ErrClosed
}

// Close ends a relay without a local connection as NBD_CMD_DISC from the
// local side would: it waits (bounded) for the requests in flight, sends
// DISC, waits for the server to close, and ends Run.
func (r *Relay) Close() error {
	if r.local != nil {
		return fmt.Errorf("relay: Close on a relay with a local connection")
	}
	select {
	case <-r.ended:
		return nil
	default:
	}
	var hdr [reqHeaderSize]byte
	(&nbd.Request{Type: nbd.CmdDisc, Handle: r.nextDiscHandle()}).Encode(hdr[:])
	r.disconnect(hdr)
	<-r.ended
	return nil
}

func (r *Relay) nextDiscHandle() uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.nextCallHandle()
}
