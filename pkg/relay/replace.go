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
	"net"
	"time"
)

// errReplaced is why a connection that Replace took out of service ended.
var errReplaced = errors.New("relay: connection replaced by a better one")

// ErrNotReplaced: Replace found the relay in no state to change its
// connection (not connected, closing, paused, or replacing already).
var ErrNotReplaced = errors.New("relay: connection not replaced")

// replaceDrain bounds how long Replace holds new requests back while the
// old connection answers what it has.
const replaceDrain = 10 * time.Second

// Replace makes c, a new connection to the same export already in the
// transmission phase, the remote connection in place of the current one,
// which works but is worse than it could be (fewer MPTCP subflows than
// the server has paths, say). It is make-before-break: new requests wait
// while the current connection answers every request sent on it, then c
// takes over and carries them, and the old connection is closed with
// nothing in flight. No request is sent twice and none waits on a dial,
// so the swap is safe with any server, with or without sessions.
//
// Should the old connection fail meanwhile, c takes over as a redial
// would have. Should it not answer within a bound, nothing changes and c
// is closed. Replace returns once c serves; an error says c was not
// taken (and is closed).
func (r *Relay) Replace(c net.Conn) error {
	r.mu.Lock()
	if r.closing || r.discSent || r.pauseReq || r.spare != nil || r.state != stateUp {
		why := "not connected"
		switch {
		case r.closing || r.discSent:
			why = "closing"
		case r.pauseReq:
			why = "paused"
		case r.spare != nil:
			why = "replacing already"
		}
		r.mu.Unlock()
		c.Close()
		return fmt.Errorf("%w: %s", ErrNotReplaced, why)
	}
	gen := r.gen
	// From here new requests stay unsent (enqueue sends only while up).
	r.state = stateReplaying
	r.spare = c
	timedOut := false
	t := time.AfterFunc(replaceDrain, func() {
		r.mu.Lock()
		timedOut = true
		r.mu.Unlock()
		r.cond.Broadcast()
	})
	defer t.Stop()
	// Everything before unsent went out on this connection; answered
	// requests leave the list.
	for r.gen == gen && r.state == stateReplaying && !r.closing && (r.head != r.unsent || len(r.rsent) > 0) && !timedOut {
		r.waiting = true
		r.cond.Wait()
	}
	switch {
	case r.closing:
		// end closes the spare.
		r.mu.Unlock()
		return fmt.Errorf("%w: the relay is closing", ErrNotReplaced)
	case r.gen != gen || r.state != stateReplaying:
		// The old connection failed meanwhile: the connection manager
		// takes the spare instead of dialing.
		r.mu.Unlock()
		return nil
	case timedOut:
		r.spare = nil
		r.mu.Unlock()
		c.Close()
		// Send what waited, on the connection we keep.
		if _, err := r.replay(gen); err != nil {
			r.fail(gen, err)
		}
		return fmt.Errorf("%w: the current connection did not answer its requests within %v", ErrNotReplaced, replaceDrain)
	}
	r.mu.Unlock()
	r.fail(gen, errReplaced)
	// Return once c serves (or failed in turn, or the relay closes).
	r.mu.Lock()
	for r.gen == gen || r.state == stateReplaying {
		if r.closing || timedOut {
			break
		}
		r.cond.Wait()
	}
	r.mu.Unlock()
	return nil
}

// takeSpare returns the connection Replace left for the connection
// manager, if any.
func (r *Relay) takeSpare() net.Conn {
	r.mu.Lock()
	defer r.mu.Unlock()
	c := r.spare
	r.spare = nil
	return c
}
