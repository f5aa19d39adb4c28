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
	"errors"
	"sync"
)

// exportSyncs runs an export's syncs and keeps their failures until every
// client that could have lost data by them has been told.
//
// Why a failure must be kept: the export's one backend file is synced from
// several places (a client's FLUSH or FUA request, the end of any of its
// connections, Quiesce), and Linux reports a writeback error to one sync
// of an open file only: the next sync succeeds although the pages it
// failed to write are gone. A client whose writes were lost in a sync
// another path made would then see its own FLUSH succeed.
//
// The rule, the one Linux keeps per open file (errseq), kept here per
// connection: every failed sync raises errSeq; a connection's FLUSH fails
// while errSeq is above the connection's cursor, and then moves the cursor
// up, so each connection open when a sync failed is told once, by its next
// FLUSH, whichever path's sync failed. A FUA request fails when a sync
// failed after it began (its data may be among the lost), without moving
// the cursor: the next FLUSH still fails. A new connection starts at the
// highest failure some FLUSH reported, so a failure nobody was told of
// fails its first FLUSH too. A session's connection starts where the last
// connection of its lane that ended untold left off (owed), so a session
// that reconnects after its connection ended with a failed sync is told,
// even when another client was told first.
//
// Syncs are committed in groups: a request waits for a sync that started
// after it arrived, and one sync serves every request waiting meanwhile, so
// concurrent FUA writes do not queue one fdatasync each.
type exportSyncs struct {
	mu      sync.Mutex
	cond    sync.Cond
	running bool
	waiting int    // callers waiting for a sync to finish
	started uint64 // syncs started
	done    uint64 // the last sync finished (one runs at a time)
	errSeq  uint64 // syncs that failed
	lastErr error  // the latest failure
	seen    uint64 // the highest errSeq a FLUSH reported
	// owed: per session lane, the cursor of its last connection that
	// ended before a failure was reported to it.
	owed map[sessionKey]uint64
	// withheld: the backend withheld a sync (ErrWithheld); every later
	// sync returns ErrWithheld without calling it.
	withheld bool
}

// sync makes every write completed before the call durable: it returns
// once a sync that started after the call has finished. It fails when a
// sync failed meanwhile, the one that served the call or another.
func (s *exportSyncs) sync(b Backend) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cond.L == nil {
		s.cond.L = &s.mu
	}
	mark := s.errSeq
	target := s.started + 1
	for s.done < target && !s.withheld {
		if s.running {
			s.waiting++
			s.cond.Wait()
			s.waiting--
			continue
		}
		s.running = true
		s.started++
		n := s.started
		s.mu.Unlock()
		err := b.Sync()
		s.mu.Lock()
		s.running = false
		s.done = n
		switch {
		case errors.Is(err, ErrWithheld):
			s.withheld = true
		case err != nil:
			s.errSeq++
			s.lastErr = err
		}
		s.cond.Broadcast()
	}
	if s.withheld {
		return ErrWithheld
	}
	if s.errSeq > mark {
		return s.lastErr
	}
	return nil
}

// sample returns the failure count, for failedSince.
func (s *exportSyncs) sample() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.errSeq
}

// failedSince reports whether a sync failed after sample returned mark.
func (s *exportSyncs) failedSince(mark uint64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.errSeq > mark
}

// report is a FLUSH's verdict for c after its sync: true when a sync
// failed that c was not told of yet; c is told by this call.
func (s *exportSyncs) report(c *serverConn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.errSeq <= c.errCursor {
		return false
	}
	c.errCursor = s.errSeq
	s.seen = max(s.seen, s.errSeq)
	if c.session != nil {
		delete(s.owed, sessionKey{c.session.ID, c.session.Lane})
	}
	return true
}

// open sets the cursor of a connection that starts transmitting.
func (s *exportSyncs) open(c *serverConn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c.errCursor = s.seen
	if c.session != nil {
		if v, ok := s.owed[sessionKey{c.session.ID, c.session.Lane}]; ok {
			c.errCursor = min(c.errCursor, v)
		}
	}
}

// close records, for a session connection that ends untold of a failure,
// that its lane is owed it.
func (s *exportSyncs) close(c *serverConn) {
	if c.session == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.errSeq <= c.errCursor {
		return
	}
	k := sessionKey{c.session.ID, c.session.Lane}
	if v, ok := s.owed[k]; ok && v < c.errCursor {
		return
	}
	if s.owed == nil {
		s.owed = make(map[sessionKey]uint64)
	}
	s.owed[k] = c.errCursor
}

// Sync makes every write the export completed durable, as a FLUSH does.
// A failure is kept for the export's clients (see exportSyncs): their next
// FLUSH fails although this call reported it already.
func (e *Export) Sync() error {
	return e.syncs.sync(e.Backend)
}
