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
	"math/bits"
	"net"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// Frame sizes of the simple-reply transmission phase.
const (
	reqHeaderSize = 28
	repHeaderSize = 16
)

// I/O buffer sizes.
const (
	readBufSize = 256 << 10
	// batchSize is the buffer that gathers small frames into one write.
	batchSize = 64 << 10
	// copyMax is the largest frame copied into the batch; larger frames go
	// out with writev, together with whatever the batch holds.
	copyMax = 16 << 10
)

// An entry's st counts the writers using its header and payload, plus
// doneBit once its reply has gone to the local side. A request may still be
// being written when its reply arrives (the peer read it before the write
// call returned), and a sender holding a replaced connection may overlap
// with the replay of the same entry, so whichever of them finishes last
// recycles it.
const doneBit = 1 << 30

// What a request holds while the relay keeps it, and so what it counts
// against MaxInflightBytes and RetainBytes: its entry, its slot in the
// table, and the pooled buffer of its data, whose capacity is the length
// rounded up to a power of two. Counting only the header and the length
// let a run of trims or small writes hold several times the budget.
const (
	// tableSlot is a table entry's share of the map: key, value and
	// the bucket's bookkeeping, rounded up.
	tableSlot     = 32
	entryOverhead = int(unsafe.Sizeof(entry{})) + tableSlot
)

// requestCost is what a request of cmd with length bytes holds.
func requestCost(cmd uint16, length uint32) int {
	if (cmd == nbd.CmdRead || cmd == nbd.CmdWrite) && length > 0 {
		return entryOverhead + bufCap(int(length))
	}
	return entryOverhead
}

// bufCap is the capacity getBuf gives a buffer of n bytes.
func bufCap(n int) int {
	if n > 1<<maxPoolShift {
		return n
	}
	return 1 << (poolIndex(n) + minPoolShift)
}

// entry is one unanswered request.
type entry struct {
	hdr     [reqHeaderSize]byte // verbatim from the local side
	handle  uint64
	cmd     uint16
	length  uint32
	buf     *[]byte // pooled holder of payload
	payload []byte  // write data, kept for replay
	cost    int     // what it counts against MaxInflightBytes
	gen     uint64  // connection generation it was last sent on
	flags   uint16
	offset  uint64
	// ackSeq orders answered entries on the retained list; flushMark is,
	// for a FLUSH, the last ackSeq it covers (set when it arrives).
	ackSeq, flushMark uint64
	internal          bool         // the relay's own request: no reply goes local
	call              *call        // an in-process caller waiting for the reply
	st                atomic.Int32 // writers using it, plus doneBit once answered
	// start is when the request was read (startTime), for Latency; zero
	// for the relay's own and once its answer was counted (claim).
	start int64

	prev, next *entry
}

var entryPool = sync.Pool{New: func() any { return new(entry) }}

func getEntry() *entry { return entryPool.Get().(*entry) }

func recycle(e *entry) {
	putBuf(e.buf)
	e.buf, e.payload = nil, nil
	e.prev, e.next = nil, nil
	e.gen, e.cost, e.length, e.cmd, e.handle = 0, 0, 0, 0, 0
	e.flags, e.offset, e.ackSeq, e.flushMark, e.internal = 0, 0, 0, 0, false
	e.call = nil
	e.start = 0
	e.st.Store(0)
	entryPool.Put(e)
}

// sending marks a writer taking e. Called with the relay's mu held, while
// e is in the table.
func sending(e *entry) { e.st.Add(1) }

// sent is called by a writer when it is done with e.
func sent(e *entry) {
	if e.st.Add(-1) == doneBit {
		recycle(e) // answered meanwhile, and this was the last writer
	}
}

// answered is called by the reply path once e is out of the table.
func answered(e *entry) {
	if e.st.Add(doneBit) == doneBit {
		recycle(e) // no writer left
	}
}

// frameWriter writes whole frames to one connection. Small frames are
// gathered and go out on flush (or when the batch is full); large ones go
// out at once, in one writev with the batch before them, so frames keep
// their order. The caller serializes calls.
type frameWriter struct {
	conn  net.Conn
	batch []byte
	vec   [3][]byte
	bufs  net.Buffers
}

func (w *frameWriter) reset(c net.Conn) {
	w.conn = c
	w.batch = w.batch[:0]
}

func (w *frameWriter) writeFrame(hdr, payload []byte) error {
	if w.conn == nil {
		return net.ErrClosed
	}
	n := len(hdr) + len(payload)
	if n <= copyMax && len(w.batch)+n <= batchSize {
		if w.batch == nil {
			w.batch = make([]byte, 0, batchSize)
		}
		w.batch = append(w.batch, hdr...)
		w.batch = append(w.batch, payload...)
		return nil
	}
	w.vec = [3][]byte{w.batch, hdr, payload}
	w.bufs = w.vec[:]
	// Over TLS, the records of all three in as few system calls as
	// the transport's batch allows.
	err := nbd.Batched(w.conn, func() error {
		_, err := w.bufs.WriteTo(w.conn)
		return err
	})
	w.vec = [3][]byte{}
	w.bufs = nil
	w.batch = w.batch[:0]
	return err
}

func (w *frameWriter) flush() error {
	if len(w.batch) == 0 || w.conn == nil {
		return nil
	}
	err := nbd.Batched(w.conn, func() error {
		_, err := w.conn.Write(w.batch)
		return err
	})
	w.batch = w.batch[:0]
	return err
}

// Payload buffers come from power-of-two size classes between 4 KiB and
// 32 MiB (nbd.MaxRequestSize), so a steady stream allocates nothing.
const (
	minPoolShift = 12
	maxPoolShift = 25
)

var bufPools [maxPoolShift - minPoolShift + 1]sync.Pool

func poolIndex(n int) int {
	if n <= 1<<minPoolShift {
		return 0
	}
	return bits.Len(uint(n-1)) - minPoolShift
}

// getBuf returns a pooled buffer of length n (0 < n <= 32 MiB). The
// pointer goes back with putBuf, so recycling allocates nothing.
func getBuf(n int) *[]byte {
	i := poolIndex(n)
	if p, ok := bufPools[i].Get().(*[]byte); ok {
		*p = (*p)[:n]
		return p
	}
	b := make([]byte, n, 1<<(i+minPoolShift))
	return &b
}

// putBuf returns a buffer from getBuf; nil is ignored.
func putBuf(p *[]byte) {
	if p == nil {
		return
	}
	c := cap(*p)
	if c < 1<<minPoolShift || c > 1<<maxPoolShift || c&(c-1) != 0 {
		return
	}
	bufPools[poolIndex(c)].Put(p)
}
