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
	"errors"
	"sync"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// Settle marks, the primary's side (docs/replication.md, "Unsettled
// writes"): every MarkInterval the Mirror sends each replica's connection
// a mark saying which of the forwards it sent there have settled, so that
// the replica's Ledger keeps only the chunks that may not have.

// DefaultMarkInterval is how often a Mirror sends settle marks.
const DefaultMarkInterval = time.Second

// Settler is a replica connection that takes settle marks (nbd.Client).
type Settler interface {
	Settle(mark uint64, settled uint32) error
}

// marks numbers the settle marks sent on one peer's connection and counts,
// per interval between them, the changes forwarded there that have not
// settled. A forward holds gate (read) from its counting until it is
// answered, and a mark is numbered and sent under gate: so a change
// counted after mark k is on the wire after mark k, and one counted before
// it, before it.
type marks struct {
	gate sync.RWMutex

	mu   sync.Mutex
	conn Peer
	sent uint64
	// pending[i] counts the changes forwarded after mark i (i=0: before
	// the first) that have not settled; zero counts are deleted.
	pending map[uint64]int64
	// off: the replica took no mark (an agent of an older release).
	off bool
	// last is when the last mark was sent.
	last time.Time
}

// due reports whether a mark should go on c now: the first two of a
// connection at once (the second speaks for the first, and the replica's
// ledger knows from then on), then one every interval.
func (k *marks) due(c Peer, now time.Time, every time.Duration) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.conn != c || k.sent < 2 || now.Sub(k.last) >= every
}

// markToken is one counted forward.
type markToken struct {
	conn Peer
	iv   uint64
}

// resetLocked starts counting for connection c (mu held).
func (k *marks) resetLocked(c Peer) {
	if k.conn != c {
		k.conn, k.sent, k.pending, k.off = c, 0, map[uint64]int64{}, false
	}
}

// begin counts a forward about to go on c; the caller calls sent once it
// is answered, and end once the change has settled.
func (k *marks) begin(c Peer) markToken {
	k.gate.RLock()
	k.mu.Lock()
	defer k.mu.Unlock()
	k.resetLocked(c)
	k.pending[k.sent]++
	return markToken{c, k.sent}
}

// answered releases what begin took.
func (k *marks) answered() { k.gate.RUnlock() }

// end: the change counted by t has settled.
func (k *marks) end(t markToken) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.conn != t.conn {
		return
	}
	if k.pending[t.iv]--; k.pending[t.iv] <= 0 {
		delete(k.pending, t.iv)
	}
}

// mark sends the next mark on c (through send) with what has settled:
// the forwards of every interval before the first with a change pending.
func (k *marks) mark(c Peer, send func(mark, settled uint64) error) error {
	k.gate.Lock()
	defer k.gate.Unlock()
	k.mu.Lock()
	k.resetLocked(c)
	if k.off {
		k.mu.Unlock()
		return nil
	}
	settled := k.sent
	for iv := range k.pending {
		settled = min(settled, iv)
	}
	n := k.sent + 1
	k.mu.Unlock()
	err := send(n, settled)
	k.mu.Lock()
	defer k.mu.Unlock()
	var ne *nbd.Error
	switch {
	case k.conn != c:
	case errors.As(err, &ne) && ne.Errno == nbd.EINVAL:
		k.off = true
	case err == nil:
		k.sent, k.last = n, time.Now()
	}
	return err
}
