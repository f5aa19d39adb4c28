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
	"time"

	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// A connection that ends under its requests ends them too. When a
// connection's read fails (the client shut it down, as the kernel does to
// a socket whose request timed out, or it died) or a reply cannot be
// written, every request of it not yet started is dropped: the client
// sends it again on another connection, where newer writes to the same
// blocks may follow, and running it late would overwrite them. Requests
// already executing finish (they cannot be recalled; the client's
// timeout is far longer than one request takes). NBD_CMD_DISC and a
// drain are orderly ends: the requests before them complete and get
// their replies.
//
// A session's superseded connections are fenced by their successor
// (takeOver); connections without a session, as the kernel's multiconn
// and tcp sockets are, have only this. With the dead-peer bound on both
// ends of a plain TCP connection (TCP_USER_TIMEOUT: the client's socket
// dies with its unsent data, the server's with its unread requests, and
// the kernel client requeues only after a request timeout at least twice
// the bound), a request reaches the backend over the connection it was
// sent on soon after it was sent, or never.

// DefaultDeadPeerTimeout is the Server's dead-peer bound: a client
// host silent this long (nothing acknowledged, keepalive unanswered)
// loses its plain TCP connections (TCP_USER_TIMEOUT), which drops the
// requests they had not started.
const DefaultDeadPeerTimeout = 5 * time.Second

// abandon marks the connection ended under its requests, unless the end
// is an orderly one (a drain).
func (c *serverConn) abandon() {
	if !c.draining.Load() {
		c.gone.Store(true)
	}
}

// armDeadPeer arms c's socket with the server's dead-peer bound.
func (s *Server) armDeadPeer(c *serverConn) {
	d := s.DeadPeerTimeout
	switch {
	case d < 0:
		return
	case d == 0:
		d = DefaultDeadPeerTimeout
	}
	if err := mptcp.ArmDeadPeer(c.conn, d); err != nil && !errors.Is(err, mptcp.ErrPeerUnknown) {
		c.log.Debug("cannot arm the connection against a silent client", "error", err)
	}
}
