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
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// The session option is an extension of ours, negotiated before GO. It
// names the client-side session a connection belongs to, so that a server
// can fence the connections a new one replaces, and it tells the client
// which incarnation of the server it reached, so that the client knows
// when writes acknowledged but not yet flushed may have been lost.
//
//	C: option OptSession, data: session ID (16 bytes), lane (u32), generation (u64)
//	S: reply RepSession, data: incarnation (16 bytes)
//	S: reply NBD_REP_ACK
//
// Servers that do not know the option answer NBD_REP_ERR_UNSUP, as the
// protocol requires for every unknown option, and the client carries on
// without fencing or incarnation (see Negotiated.Fenced).
//
// Semantics on the server: a connection of session S and lane L that
// sends its first request supersedes every older connection of (S, L) on
// the same export. Before that request executes, each superseded one has
// stopped reading, dropped the requests it read but had not started and
// finished those it had started; their replies are not sent. A connection
// that sends nothing supersedes nothing: a client may dial one and drop it
// unused (the kernel keeps its own socket when it has no dead one to
// replace) without disturbing the connection in use. A connection whose
// generation is lower than that of a connection of (S, L) that sent
// requests is refused: it is a late arrival, already replaced.
const (
	// OptSession is the option code: "MPS" and a version byte, far from
	// the protocol's own numbers.
	OptSession uint32 = 0x4d505301
	// RepSession is the reply type carrying the server's incarnation.
	RepSession uint32 = 0x4d505301
)

const sessionOptLen = 16 + 4 + 8

// SessionID names a client-side session; random per attached volume.
type SessionID [16]byte

// Incarnation identifies one life of a server's volatile state: every
// write acknowledged by an incarnation and covered by a FLUSH it completed
// is durable; writes it acknowledged but did not flush are lost if the
// next connection reaches another incarnation.
type Incarnation [16]byte

// NewSessionID returns a random session ID.
func NewSessionID() SessionID {
	var id SessionID
	rand.Read(id[:])
	return id
}

// String returns the ID in hex.
func (id SessionID) String() string { return fmt.Sprintf("%x", id[:]) }

// String returns the incarnation in hex.
func (inc Incarnation) String() string { return fmt.Sprintf("%x", inc[:]) }

// Session is what a client says about itself in the session option.
type Session struct {
	ID SessionID
	// Lane tells apart the concurrent connections of one session (the
	// sockets of a multi-connection device); only a connection of the
	// same lane supersedes another.
	Lane uint32
	// Generation orders the connections of one lane; a later dial must
	// carry a larger one. NextGeneration gives such numbers.
	Generation uint64
}

var lastGeneration atomic.Uint64

// NextGeneration returns a generation larger than any this process gave
// before and, as it follows the clock, than any an earlier process on this
// host gave.
func NextGeneration() uint64 {
	for {
		prev := lastGeneration.Load()
		g := max(uint64(time.Now().UnixNano()), prev+1)
		if lastGeneration.CompareAndSwap(prev, g) {
			return g
		}
	}
}

func (s Session) encode() []byte {
	b := make([]byte, sessionOptLen)
	copy(b, s.ID[:])
	binary.BigEndian.PutUint32(b[16:], s.Lane)
	binary.BigEndian.PutUint64(b[20:], s.Generation)
	return b
}

func decodeSession(b []byte) (Session, error) {
	if len(b) != sessionOptLen {
		return Session{}, fmt.Errorf("%w: session option of %d bytes, want %d", ErrProtocol, len(b), sessionOptLen)
	}
	var s Session
	copy(s.ID[:], b)
	s.Lane = binary.BigEndian.Uint32(b[16:])
	s.Generation = binary.BigEndian.Uint64(b[20:])
	return s, nil
}

// sessionKey is what superseding matches on.
type sessionKey struct {
	id   SessionID
	lane uint32
}

// sessionSlot is one session lane on an export: its open connections and
// the highest generation that sent requests.
type sessionSlot struct {
	activeGen uint64
	conns     map[*serverConn]struct{}
}

// BootIncarnation derives an incarnation from the host's boot ID: it
// changes when the host reboots (or loses power), which is when writes
// that sat in its page cache are lost, and not when the server process
// restarts, which loses none of them. For servers whose backends write
// through to the kernel (files, block devices), with no cache of their own.
func BootIncarnation() (Incarnation, error) {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return Incarnation{}, err
	}
	id := strings.TrimSpace(string(b))
	if id == "" {
		return Incarnation{}, fmt.Errorf("empty boot ID")
	}
	sum := sha256.Sum256([]byte("mpnbd incarnation\x00" + id))
	var inc Incarnation
	copy(inc[:], sum[:])
	return inc, nil
}

// processIncarnation is the default incarnation of every Server in this
// process: a restart of the process counts as a new incarnation, which is
// the safe side (clients replay what they hold; nothing is lost).
var processIncarnation = sync.OnceValue(func() Incarnation {
	var inc Incarnation
	rand.Read(inc[:])
	return inc
})
