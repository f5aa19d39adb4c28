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
	"math/bits"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// Chunk is the granularity at which the changes a replica lacks are
// recorded: a change anywhere in a chunk marks the whole chunk, and a
// rebuild copies whole chunks. It is the export's change-tracking chunk
// (64 KiB): one bit per chunk, 2 MiB of bitmap per TiB of volume.
const Chunk = nbd.ChangeChunk

// chunks is a bitmap of Chunk-sized chunks of a volume.
type chunks struct {
	words []uint64 // bit i of word w: chunk 64*w+i
}

// chunkSpan returns the chunks [first, last] that the range [off, off+n)
// touches; ok is false for an empty or negative range.
func chunkSpan(off, n int64) (first, last int64, ok bool) {
	if n <= 0 || off < 0 {
		return 0, 0, false
	}
	return off / Chunk, (off + n - 1) / Chunk, true
}

// mark sets the chunks of [off, off+n) and reports the words it changed
// (their indexes), in order.
func (c *chunks) mark(off, n int64) (changed []int) {
	first, last, ok := chunkSpan(off, n)
	if !ok {
		return nil
	}
	if need := int(last/64) + 1; need > len(c.words) {
		c.words = append(c.words, make([]uint64, need-len(c.words))...)
	}
	for ch := first; ch <= last; ch++ {
		w, bit := int(ch/64), uint64(1)<<(ch%64)
		if c.words[w]&bit == 0 {
			c.words[w] |= bit
			if len(changed) == 0 || changed[len(changed)-1] != w {
				changed = append(changed, w)
			}
		}
	}
	return changed
}

// or sets every chunk that o has.
func (c *chunks) or(o *chunks) {
	if o == nil {
		return
	}
	if len(o.words) > len(c.words) {
		c.words = append(c.words, make([]uint64, len(o.words)-len(c.words))...)
	}
	for i, w := range o.words {
		c.words[i] |= w
	}
}

// count is how many chunks are set.
func (c *chunks) count() int64 {
	var n int64
	for _, w := range c.words {
		n += int64(bits.OnesCount64(w))
	}
	return n
}

// ranges lists the set chunks as byte ranges, adjacent chunks merged.
func (c *chunks) ranges() []nbd.Range {
	var out []nbd.Range
	for w, word := range c.words {
		for word != 0 {
			i := bits.TrailingZeros64(word)
			word &^= 1 << i
			off := (int64(w)*64 + int64(i)) * Chunk
			if k := len(out) - 1; k >= 0 && out[k].Off+out[k].Len == off {
				out[k].Len += Chunk
				continue
			}
			out = append(out, nbd.Range{Off: off, Len: Chunk})
		}
	}
	return out
}
