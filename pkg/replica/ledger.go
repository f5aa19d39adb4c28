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

package replica

import (
	"encoding/binary"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// Ledger is a replica's record of the chunks its primary's forwards
// touched that may not have settled (docs/replication.md, "Unsettled
// writes"): the export's nbd.Ledger on the replica. Each connection's
// changes gather in a bucket until a settle mark seals it with the mark's
// number; a mark that says the changes before mark s settled drops the
// buckets sealed up to s. Across connections the primary's rule is that
// it sends a new connection's first mark only once it sends nothing more
// on the older ones, so a connection whose first mark is spoken for (by a
// later mark of its own) covers everything that came before it: the
// buckets of the connections opened before it go.
//
// The Ledger knows nothing of what came before it was made (an agent that
// restarted): Unsettled says so until a connection has spoken for its
// first mark, unless the replica was created after it (Fresh).
type Ledger struct {
	size  atomic.Int64
	mu    sync.Mutex
	opens uint64
	conns map[*ledgerConn]struct{}
	known bool
}

// ledgerConn is one connection's part of a Ledger.
type ledgerConn struct {
	l      *Ledger
	seq    uint64 // its place in the order of opening
	cur    *chunks
	sealed []sealedBucket
	first  uint64 // the number of its first mark (0 before one)
}

type sealedBucket struct {
	mark uint64
	c    *chunks
}

// maxSealed bounds a connection's sealed buckets: beyond it the oldest
// two merge (under the later mark, which only keeps them longer).
const maxSealed = 16

// NewLedger returns the Ledger of a replica of size bytes.
func NewLedger(size int64) *Ledger {
	l := &Ledger{conns: map[*ledgerConn]struct{}{}}
	l.size.Store(size)
	return l
}

// Fresh tells the Ledger that its replica was created by this process:
// nothing was forwarded to it before the Ledger was made, so the Ledger
// knows from the start (a primary promoted before any settle mark was
// spoken for need not drop the other replicas).
func (l *Ledger) Fresh() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.known = true
}

// SetSize tells the Ledger the replica's size now (it grew).
func (l *Ledger) SetSize(size int64) { l.size.Store(size) }

// Open starts a connection's part (nbd.Ledger).
func (l *Ledger) Open(nbd.ConnInfo) nbd.LedgerConn {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.opens++
	c := &ledgerConn{l: l, seq: l.opens, cur: &chunks{}}
	l.conns[c] = struct{}{}
	return c
}

// Unsettled returns the chunks that forwards may have left unsettled, as
// byte ranges, and whether the Ledger knows (false: it cannot tell what
// came before it).
func (l *Ledger) Unsettled() ([]nbd.Range, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.known {
		return nil, false
	}
	all := &chunks{}
	for c := range l.conns {
		all.or(c.cur)
		for _, b := range c.sealed {
			all.or(b.c)
		}
	}
	return all.ranges(), true
}

// Changed records a change, cut to the volume (a range beyond it changes
// nothing).
func (c *ledgerConn) Changed(off, n uint64) {
	size := uint64(max(c.l.size.Load(), 0))
	if off >= size || n == 0 {
		return
	}
	n = min(n, size-off)
	c.l.mu.Lock()
	defer c.l.mu.Unlock()
	c.cur.mark(int64(off), int64(n))
}

// Settled seals the changes since the last mark with mark, drops what
// the mark speaks for, and, once the connection's first mark is spoken
// for, what the connections opened before it held.
func (c *ledgerConn) Settled(mark, settled uint64) {
	l := c.l
	l.mu.Lock()
	defer l.mu.Unlock()
	if c.first == 0 {
		c.first = mark
	}
	c.sealed = append(c.sealed, sealedBucket{mark, c.cur})
	c.cur = &chunks{}
	keep := c.sealed[:0]
	for _, b := range c.sealed {
		if b.mark > settled {
			keep = append(keep, b)
		}
	}
	c.sealed = keep
	if len(c.sealed) > maxSealed {
		c.sealed[1].c.or(c.sealed[0].c)
		c.sealed = c.sealed[1:]
	}
	if settled >= c.first {
		for o := range l.conns {
			if o.seq < c.seq {
				delete(l.conns, o)
			}
		}
		l.known = true
	}
}

// Close keeps what the connection left: it is dropped when a later
// connection speaks for its own first mark.
func (c *ledgerConn) Close() {}

// InfoUnsettled is the information type of ours by which a replica's
// agent tells its primary, at the handshake, the chunks its Ledger holds:
// a byte (1: the Ledger knows, 0: it cannot tell), then each range as
// its offset and length (8 bytes each, big-endian). A new primary reads
// it before it serves (docs/replication.md, "Unsettled writes").
const InfoUnsettled uint16 = 0x4d51

// maxUnsettledRanges bounds the answer; a Ledger with more ranges says it
// cannot tell (its replica is then copied whole).
const maxUnsettledRanges = 4096

// Info is the Ledger's answer to InfoUnsettled.
func (l *Ledger) Info() []byte {
	ranges, known := l.Unsettled()
	if !known || len(ranges) > maxUnsettledRanges {
		return []byte{0}
	}
	b := make([]byte, 1, 1+16*len(ranges))
	b[0] = 1
	for _, r := range ranges {
		b = binary.BigEndian.AppendUint64(b, uint64(r.Off))
		b = binary.BigEndian.AppendUint64(b, uint64(r.Len))
	}
	return b
}

// DecodeUnsettled reads an answer to InfoUnsettled: the ranges, and
// whether the replica knows them. Anything malformed is an error.
func DecodeUnsettled(b []byte) ([]nbd.Range, bool, error) {
	switch {
	case len(b) == 0 || b[0] > 1 || (len(b)-1)%16 != 0 || (len(b)-1)/16 > maxUnsettledRanges:
		return nil, false, fmt.Errorf("replica: a malformed answer of %d bytes about the unsettled chunks", len(b))
	case b[0] == 0:
		if len(b) != 1 {
			return nil, false, fmt.Errorf("replica: an unknowing answer about the unsettled chunks with ranges")
		}
		return nil, false, nil
	}
	var out []nbd.Range
	for p := b[1:]; len(p) > 0; p = p[16:] {
		r := nbd.Range{Off: int64(binary.BigEndian.Uint64(p)), Len: int64(binary.BigEndian.Uint64(p[8:]))}
		if r.Off < 0 || r.Len <= 0 || r.Off+r.Len < r.Off {
			return nil, false, fmt.Errorf("replica: an unsettled range %d+%d", r.Off, r.Len)
		}
		out = append(out, r)
	}
	return out, true, nil
}
