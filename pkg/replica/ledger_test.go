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
	"math"
	"slices"
	"testing"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// TestLedger: a replica's ledger keeps the chunks of the changes no mark
// has spoken for, and says it cannot tell until a connection's first
// mark is spoken for; a later connection that speaks for its first mark
// covers what the earlier ones left; ranges beyond the volume change
// nothing; a connection whose marks never speak for anything keeps a
// bounded number of buckets and loses no chunk.
func TestLedger(t *testing.T) {
	const size = 16 * Chunk
	l := NewLedger(size)
	want := func(what string, known bool, ranges ...nbd.Range) {
		t.Helper()
		got, ok := l.Unsettled()
		if ok != known || !slices.Equal(got, ranges) {
			t.Fatalf("%s: unsettled %v (known %v), want %v (known %v)", what, got, ok, ranges, known)
		}
	}
	want("new", false)
	a := l.Open(nbd.ConnInfo{})
	a.Changed(0, 4096)
	a.Settled(1, 0)
	a.Changed(Chunk, 1)
	want("before a first mark is spoken for", false)
	a.Settled(2, 1)
	want("the first mark spoken for", true, nbd.Range{Off: Chunk, Len: Chunk})
	a.Changed(size, 4096)
	a.Changed(size-4096, math.MaxUint64)
	want("beyond the volume, and a length past it", true, nbd.Range{Off: Chunk, Len: Chunk}, nbd.Range{Off: size - Chunk, Len: Chunk})
	a.Settled(3, 2)
	want("mark 3 speaks for mark 2", true, nbd.Range{Off: size - Chunk, Len: Chunk})

	// A goes (what it left stays); B's own first mark spoken for covers it.
	a.Close()
	b := l.Open(nbd.ConnInfo{})
	b.Changed(2*Chunk, Chunk)
	b.Settled(1, 0)
	want("B's first mark not spoken for", true, nbd.Range{Off: 2 * Chunk, Len: Chunk}, nbd.Range{Off: size - Chunk, Len: Chunk})
	b.Changed(3*Chunk, Chunk)
	b.Settled(2, 1)
	want("B's first mark spoken for", true, nbd.Range{Off: 3 * Chunk, Len: Chunk})

	// Marks that never speak for anything: bounded, nothing lost.
	for i := uint64(3); i < 3+4*maxSealed; i++ {
		b.Changed(4*Chunk+(i%8)*Chunk, 1)
		b.Settled(i, 2)
	}
	if n := len(b.(*ledgerConn).sealed); n > maxSealed {
		t.Errorf("%d sealed buckets, want at most %d", n, maxSealed)
	}
	want("marks that speak for nothing new", true, nbd.Range{Off: 4 * Chunk, Len: 8 * Chunk})
}

// TestLedgerFresh: the ledger of a replica created by this process knows
// from the start, before any mark is spoken for, and keeps what changed.
func TestLedgerFresh(t *testing.T) {
	l := NewLedger(16 * Chunk)
	l.Fresh()
	if got, known := l.Unsettled(); !known || len(got) != 0 {
		t.Fatalf("fresh: unsettled %v (known %v), want none, known", got, known)
	}
	c := l.Open(nbd.ConnInfo{})
	c.Changed(Chunk, 1)
	c.Settled(1, 0)
	if got, known := l.Unsettled(); !known || !slices.Equal(got, []nbd.Range{{Off: Chunk, Len: Chunk}}) {
		t.Fatalf("fresh, first mark not spoken for: unsettled %v (known %v), want [%d+%d], known", got, known, Chunk, Chunk)
	}
}

// TestUnsettledInfo: the answer a replica gives reads back as it was; an
// unknowing ledger says so; malformed answers are errors.
func TestUnsettledInfo(t *testing.T) {
	l := NewLedger(16 * Chunk)
	if r, known, err := DecodeUnsettled(l.Info()); err != nil || known || r != nil {
		t.Fatalf("a new ledger: %v %v %v", r, known, err)
	}
	c := l.Open(nbd.ConnInfo{})
	c.Settled(1, 0)
	c.Changed(3*Chunk, 1)
	c.Changed(7*Chunk, 2*Chunk)
	c.Settled(2, 1)
	want, _ := l.Unsettled()
	if r, known, err := DecodeUnsettled(l.Info()); err != nil || !known || !slices.Equal(r, want) || len(r) != 2 {
		t.Fatalf("decoded %v %v %v, want %v", r, known, err, want)
	}
	for _, bad := range [][]byte{nil, {2}, {0, 1}, {1, 0, 0}, append([]byte{1}, make([]byte, 16)...)} {
		if _, _, err := DecodeUnsettled(bad); err == nil {
			t.Errorf("%x decoded", bad)
		}
	}
}
