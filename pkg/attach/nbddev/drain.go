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

package nbddev

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/relay"
)

// drainRelay readies a relay's volume for its disconnect: the relay
// pauses (takes nothing more from the kernel, answers what it took, and
// flushes every write it acknowledged, through an outage and a new
// incarnation of the storage node if need be), so that nothing of the
// volume exists only in the relay it ends. Without that, the writes the
// relay retains would go with it, lost for good should the storage node
// have lost its cache. If ctx ends first the relay serves on and the
// error wraps attach.ErrUnflushed. resume undoes the pause (for a
// disconnect that fails). Without a relay there is nothing to drain.
func (a *Attacher) drainRelay(ctx context.Context, v *volume) (resume func(), err error) {
	v.mu.Lock()
	r, done := v.relay, v.relayDone
	v.mu.Unlock()
	if r == nil {
		return func() {}, nil
	}
	if _, ok := ctx.Deadline(); !ok {
		// A call without a deadline of its own (the datapath runs them
		// with its own context) must still end, for the caller's retry.
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, drainTimeout)
		defer cancel()
	}
	_, err = r.Pause(ctx)
	switch {
	case err == nil:
		return r.Resume, nil
	case errors.Is(err, relay.ErrFlushFailureOwed):
		// Every write it retained is flushed; a failed FLUSH before that
		// was never heard by the kernel, and no one is left to hear it
		// but the log.
		a.log.Error("detaching a volume whose storage node failed a flush the kernel was not told of: acknowledged writes may be lost",
			"volume_id", v.target.VolumeID, "nbd_index", v.index)
		return func() {}, nil
	case ctx.Err() != nil:
		st := r.Stats()
		return nil, fmt.Errorf("%w: nbd%d of %s: %d writes (%d bytes) acknowledged and not yet flushed, %d requests unanswered (%v)",
			attach.ErrUnflushed, v.index, v.target.VolumeID, st.Retained, st.RetainedBytes, st.InFlight, ctx.Err())
	case ended(done):
		// What it retained is gone already.
		a.log.Warn("detach: the relay has ended", "volume_id", v.target.VolumeID, "nbd_index", v.index, "error", err)
		return func() {}, nil
	default:
		// Paused already: a drain (an earlier detach still waiting) or a
		// handoff is under way.
		return nil, fmt.Errorf("%w: nbd%d of %s: %v", attach.ErrUnflushed, v.index, v.target.VolumeID, err)
	}
}

// drainTimeout bounds a drain whose caller set no deadline.
const drainTimeout = 2 * time.Minute

// ended reports whether done, a relay's end, is closed.
func ended(done chan struct{}) bool {
	if done == nil {
		return true
	}
	select {
	case <-done:
		return true
	default:
		return false
	}
}
