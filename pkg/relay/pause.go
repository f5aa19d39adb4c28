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
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"time"
)

// ErrHandedOff is what Run returns after Release: the relay's local side
// went on to a successor.
var ErrHandedOff = errors.New("relay: handed off to a successor")

// pastDeadline makes every pending and future read of the local side
// return at once.
var pastDeadline = time.Unix(1, 0)

// Pause makes the relay ready to hand its local side to a successor
// without losing or repeating a byte of it: the request path stops at
// the next frame boundary (what it read of a frame it keeps, and hands
// out), every request it took is answered, and a FLUSH of its own covers
// every write it acknowledged, so that nothing of the volume exists only
// in this relay. It waits for that as long as ctx lets it (an outage
// makes it wait); on ctx's end it resumes and returns ctx's error.
//
// It returns the bytes read from the local side that belong to requests
// not yet taken: a successor reads them first (Options.Pending). It
// refuses (ErrFlushFailureOwed), resuming, while a failed flush is owed to
// the local side. A paused
// relay takes nothing more from the local side until Resume; Release
// ends it.
func (r *Relay) Pause(ctx context.Context) ([]byte, error) {
	if r.local == nil {
		return nil, errors.New("relay: Pause of a relay without a local side")
	}
	r.mu.Lock()
	if r.closing {
		r.mu.Unlock()
		return nil, r.closedErr()
	}
	if r.pauseReq {
		r.mu.Unlock()
		return nil, errors.New("relay: already paused")
	}
	r.pauseReq = true
	// Under mu, like every change of the deadline, so the request path
	// can tell a deadline of ours from a stale one.
	if err := r.local.SetReadDeadline(pastDeadline); err != nil {
		r.pauseReq = false
		r.mu.Unlock()
		return nil, fmt.Errorf("relay: pause: %w", err)
	}
	r.mu.Unlock()
	// Under mu: the loop below either waits already or sees ctx done
	// when it next holds mu, so the wake-up is never lost.
	stop := context.AfterFunc(ctx, func() {
		r.mu.Lock()
		r.cond.Broadcast()
		r.mu.Unlock()
	})
	defer stop()

	r.mu.Lock()
	for {
		if r.closing {
			r.mu.Unlock()
			return nil, r.closedErr()
		}
		if ctx.Err() != nil {
			r.mu.Unlock()
			r.Resume()
			return nil, fmt.Errorf("relay: pause: %w (unanswered %d, unflushed writes %d)", ctx.Err(), len(r.table), r.retCount)
		}
		if r.paused && len(r.table) == 0 {
			if r.retCount == 0 {
				break
			}
			if !r.flushing {
				r.flushing = true
				r.mu.Unlock()
				r.ownFlush()
				r.mu.Lock()
				continue
			}
		}
		r.waiting = true
		r.cond.Wait()
	}
	if r.flushErrOwed {
		// The successor would not know: the local side must hear of the
		// failed flush from this relay first.
		r.mu.Unlock()
		r.Resume()
		return nil, fmt.Errorf("%w: a flush failed and the local side was not told yet", ErrFlushFailureOwed)
	}
	pending := append([]byte(nil), r.pending...)
	r.mu.Unlock()
	return pending, nil
}

// ErrFlushFailureOwed is Pause's refusal while a failed FLUSH of the
// relay's own has not been reported to the local side (flusherr.go): a
// handover would lose the report. The local side's next FLUSH reports it;
// a later Pause can succeed.
var ErrFlushFailureOwed = errors.New("relay: a failed flush is owed to the local side")

// Resume undoes Pause: the request path reads on from where it stopped.
func (r *Relay) Resume() {
	r.mu.Lock()
	if r.pauseReq {
		r.pauseReq = false
		r.local.SetReadDeadline(time.Time{})
	}
	r.mu.Unlock()
	r.cond.Broadcast()
}

// Release ends a paused relay without a word to either side (no
// NBD_CMD_DISC: the connection to the server just closes); Run returns
// ErrHandedOff. The caller has taken a duplicate of the local side for
// the successor: closing the relay's own descriptor leaves the socket
// open.
func (r *Relay) Release() {
	r.end(ErrHandedOff)
}

// localReader reads the local side, after the bytes a predecessor (or an
// earlier pause) had read of it.
func (r *Relay) localReader(pending []byte) *bufio.Reader {
	var src io.Reader = r.local
	if len(pending) > 0 {
		src = io.MultiReader(bytes.NewReader(pending), r.local)
	}
	return bufio.NewReaderSize(src, readBufSize)
}

// parkIfPaused handles a failed read of the local side that read partial
// of a frame. A deadline of Pause parks the request path until Resume or
// the end, keeping what was read; it returns the reader to go on with,
// or nil if the relay ends (stop) or the error is real (neither).
func (r *Relay) parkIfPaused(err error, partial []byte, br *bufio.Reader) (next *bufio.Reader, stop bool) {
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		return nil, false
	}
	buffered, _ := br.Peek(br.Buffered())
	kept := append(append([]byte(nil), partial...), buffered...)
	r.mu.Lock()
	if !r.pauseReq {
		// A deadline Resume has already cleared: read on.
		r.mu.Unlock()
		return r.localReader(kept), false
	}
	r.pending, r.paused = kept, true
	r.mu.Unlock()
	r.cond.Broadcast()
	r.mu.Lock()
	for r.pauseReq && !r.closing {
		r.cond.Wait()
	}
	kept, closing := r.pending, r.closing
	r.pending, r.paused = nil, false
	r.mu.Unlock()
	if closing {
		return nil, true
	}
	return r.localReader(kept), false
}
