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

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// ErrFenced ends Run when the server refused the relay's export as
// superseded (nbd.ErrSuperseded): the grant the relay's connections were
// made under was replaced, so no connection of this relay will be served
// again. Every request waiting is answered with EIO and the writes kept
// for replay are dropped: sent again, they would overwrite what the
// export's newer user wrote since. Every other refusal, and every failed
// dial, only makes the relay dial again: a server restarting, or one that
// has not yet seen a new grant, refuses for a moment.
var ErrFenced = errors.New("relay: fenced: the server says this connection's grant was replaced")

// fencedDial returns the error that ends the relay when err, a dial's,
// is a refusal as superseded, or nil.
func fencedDial(err error) error {
	if !errors.Is(err, nbd.ErrSuperseded) {
		return nil
	}
	return fmt.Errorf("%w: %w", ErrFenced, err)
}

// fence answers every request waiting with EIO, drops what the relay kept
// for replay and ends the relay with err (an ErrFenced).
func (r *Relay) fence(err error, attempts int) {
	r.mu.Lock()
	if r.closing {
		r.mu.Unlock()
		return
	}
	// New requests are answered at once until the end.
	r.failing = true
	var failed []*entry
	for e := r.head; e != nil; {
		next := e.next
		r.unlink(e)
		r.bytes -= e.cost
		if !e.internal {
			failed = append(failed, e)
		}
		e = next
	}
	r.failed += len(failed)
	retained := r.retCount
	r.waiting = false
	r.mu.Unlock()
	r.cond.Broadcast()
	r.log.Error("the server refused this volume's connection as superseded (the volume was published again since): I/O fails, retained writes are dropped",
		"error", err, "failed", len(failed), "retained_dropped", retained)
	r.emit(Event{Kind: EventFailing, Err: err, Failed: len(failed), Attempts: attempts})
	r.answerAll(failed)
	_ = r.flushLocal()
	r.end(err)
}
