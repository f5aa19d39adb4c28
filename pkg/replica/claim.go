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

import "slices"

// claim is a byte range [off, end) that one change, or one copy of a
// rebuild, has to itself while it runs.
//
// Overlapping changes under way at once are ordered by nobody: the
// primary's copy and a replica's could apply them in different orders and
// end up holding different data, each of them acknowledged, so that a
// failover would show a read a different block than before. Claims order
// them: a change waits for the changes under way that overlap it. Changes
// that do not overlap, nearly all of them, run in parallel as before.
type claim struct {
	off, end int64
	done     chan struct{}
}

// claim waits until no claim under way overlaps [off, off+n), takes the
// range and returns its release.
func (m *Mirror) claim(off, n int64) func() {
	end := off + max(n, 1)
	for {
		m.claimMu.Lock()
		var wait chan struct{}
		for _, c := range m.claims {
			if c.off < end && off < c.end {
				wait = c.done
				break
			}
		}
		if wait == nil {
			c := &claim{off: off, end: end, done: make(chan struct{})}
			m.claims = append(m.claims, c)
			m.claimMu.Unlock()
			return func() {
				m.claimMu.Lock()
				m.claims = slices.DeleteFunc(m.claims, func(o *claim) bool { return o == c })
				m.claimMu.Unlock()
				close(c.done)
			}
		}
		m.claimMu.Unlock()
		<-wait
	}
}
