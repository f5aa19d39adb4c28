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

// Package backoff is the pause between the attempts of something that keeps
// failing: a first pause, doubled after each attempt up to a cap, and the
// first one again once it works. The driver's retry loops (a kernel nbd
// device's reconnection, a ublk volume's process restarts, a replicated
// volume's decisions the arbiter has to record, a node's certificate) all
// pause this way.
package backoff

import (
	"context"
	"time"
)

// Backoff hands out the pauses. Its zero value pauses not at all; it is
// not safe for concurrent use (each retry loop has its own).
type Backoff struct {
	// First is the first pause and the one after Reset.
	First time.Duration
	// Max caps the pauses; below First it is First.
	Max  time.Duration
	next time.Duration
}

// New returns a Backoff from first to max.
func New(first, max time.Duration) *Backoff {
	return &Backoff{First: first, Max: max}
}

// Next returns the pause before the next attempt, and doubles the one
// after it, up to Max.
func (b *Backoff) Next() time.Duration {
	d := b.next
	if d <= 0 {
		d = b.First
	}
	b.next = min(2*d, max(b.Max, b.First))
	return min(d, max(b.Max, b.First))
}

// Reset makes the next pause First again: the operation worked.
func (b *Backoff) Reset() { b.next = 0 }

// Wait pauses for Next, or until ctx ends, and returns ctx's error then.
func (b *Backoff) Wait(ctx context.Context) error {
	return Sleep(ctx, b.Next())
}

// Sleep pauses for d, or until ctx ends, and returns ctx's error then.
func Sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
