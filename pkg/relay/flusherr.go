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
	"encoding/binary"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// A FLUSH that fails means acknowledged writes may not have reached the
// storage host's disk. The server tells each connection so once (and
// Linux tells the server once): when the FLUSH that hears of it is one of
// the relay's own, sent to trim what it retains, nobody else will. The
// relay then owes the failure to the local side: the next local FLUSH
// fails even if the server answered it with success, so the filesystem or
// application above learns that writes it was told are written may be
// gone, as it would from a failing local disk. The retained writes stay
// until a FLUSH succeeds (the relay's next own flush), as ever; a Pause
// waits for no handover while a failure is owed (see Pause).

// flushVerdict records what a completed FLUSH means for the failure owed
// to the local side and returns the errno the local side gets for e.
// Called with mu held.
func (r *Relay) flushVerdict(e *entry, errno uint32) uint32 {
	if e.cmd != nbd.CmdFlush {
		return errno
	}
	switch {
	case e.internal && errno != 0:
		r.ownFlushFailed++
		if !r.flushErrOwed {
			r.flushErrOwed = true
			r.log.Error("a flush of the relay's own failed: acknowledged writes may be lost; the next flush of the local side will fail",
				"error", nbd.ErrnoName(errno))
		}
	case e.internal:
	case errno != 0:
		r.flushErrOwed = false
	case r.flushErrOwed:
		r.flushErrOwed = false
		return nbd.EIO
	}
	return errno
}

// setReplyErrno rewrites the error field of a simple reply header.
func setReplyErrno(hdr []byte, errno uint32) {
	binary.BigEndian.PutUint32(hdr[4:8], errno)
}

// OweFlushFailure records that a FLUSH failed which an in-process caller
// heard on the local side's behalf (a handoff's own flush): the local
// side's next FLUSH fails, as after a failed flush of the relay's own.
func (r *Relay) OweFlushFailure() {
	r.mu.Lock()
	r.flushErrOwed = true
	r.mu.Unlock()
}
