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

package nbd

import (
	"math/bits"
	"slices"
	"sync"
)

// ChangeChunk is the granularity at which a ChangeTracker records changes:
// a change anywhere in a chunk marks the whole chunk.
const ChangeChunk = 64 << 10

// Range is a byte range [Off, Off+Len) of an export.
type Range struct{ Off, Len int64 }

// ChangeTracker records the ranges of an export that change (writes, trims,
// write-zeroes) from the moment TrackChanges returns it until Stop. A copy
// of the backend made while writes flow is made whole by copying again
// what Take reports, last under Quiesce.
//
// Each change is recorded once it has reached the backend, while the
// change still holds the export's gate. So:
//   - a change that a Take does not report was already in the backend
//     when that Take returned: whatever reads the range after the Take
//     sees it;
//   - a Take under Quiesce reports every change not reported before, as
//     none is in flight then.
//
// Changes are kept as a bitmap of ChangeChunk-sized chunks, one bit per
// 64 KiB: 2 MiB per TiB of export at most, whatever the write pattern.
//
// The size of the backend is not tracked: Backend.Resize does not go
// through the export. A grown backend reads as zeroes beyond its old end,
// so a copy that takes the source's size under Quiesce stays exact.
type ChangeTracker struct {
	e *Export

	mu      sync.Mutex
	words   []uint64 // bit i of word w: chunk 64*w+i changed
	lo, hi  int      // words outside [lo, hi) are zero
	stopped bool
}

// TrackChanges starts recording the changes to e. It does not wait for
// the changes in flight: those that reach the backend after it returns are
// recorded, the others are in the backend already. Stop the tracker when
// done with it; several trackers may run at once, each sees every change.
func (e *Export) TrackChanges() *ChangeTracker {
	t := &ChangeTracker{e: e}
	e.trackMu.Lock()
	defer e.trackMu.Unlock()
	var list []*ChangeTracker
	if old := e.trackers.Load(); old != nil {
		list = slices.Clone(*old)
	}
	list = append(list, t)
	e.trackers.Store(&list)
	return t
}

// Stop ends the recording. It may be called more than once.
func (t *ChangeTracker) Stop() {
	e := t.e
	e.trackMu.Lock()
	defer e.trackMu.Unlock()
	t.mu.Lock()
	t.stopped = true
	t.mu.Unlock()
	old := e.trackers.Load()
	if old == nil {
		return
	}
	list := slices.DeleteFunc(slices.Clone(*old), func(o *ChangeTracker) bool { return o == t })
	if len(list) == 0 {
		e.trackers.Store(nil)
	} else {
		e.trackers.Store(&list)
	}
}

// Take returns the ranges changed since the tracker started or since the
// previous Take, sorted and merged, and forgets them. The ranges are whole
// chunks, so the last one may end past the end of the export.
func (t *ChangeTracker) Take() []Range {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []Range
	for w := t.lo; w < t.hi; w++ {
		word := t.words[w]
		for word != 0 {
			i := bits.TrailingZeros64(word)
			off := (int64(w)*64 + int64(i)) * ChangeChunk
			if n := len(out); n > 0 && out[n-1].Off+out[n-1].Len == off {
				out[n-1].Len += ChangeChunk
			} else {
				out = append(out, Range{Off: off, Len: ChangeChunk})
			}
			word &= word - 1
		}
		t.words[w] = 0
	}
	t.lo, t.hi = 0, 0
	return out
}

// mark records a change of n bytes at off.
func (t *ChangeTracker) mark(off, n int64) {
	if n <= 0 || off < 0 {
		return
	}
	first, last := off/ChangeChunk, (off+n-1)/ChangeChunk
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.stopped {
		return
	}
	fw, lw := int(first/64), int(last/64)
	if lw >= len(t.words) {
		t.words = append(t.words, make([]uint64, lw+1-len(t.words))...)
	}
	for w := fw; w <= lw; w++ {
		mask := ^uint64(0)
		if w == fw {
			mask &= ^uint64(0) << (first % 64)
		}
		if w == lw {
			mask &= ^uint64(0) >> (63 - last%64)
		}
		t.words[w] |= mask
	}
	if t.lo == t.hi {
		t.lo, t.hi = fw, lw+1
	} else {
		t.lo, t.hi = min(t.lo, fw), max(t.hi, lw+1)
	}
}

// changed records a change of n bytes at off in every tracker of e. The
// caller holds e.gate's read lock and has made the change. Without a
// tracker it costs one atomic load.
func (e *Export) changed(off, n int64) {
	ts := e.trackers.Load()
	if ts == nil {
		return
	}
	for _, t := range *ts {
		t.mark(off, n)
	}
}
