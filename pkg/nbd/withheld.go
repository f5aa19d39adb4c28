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

import "errors"

// ErrWithheld is a backend's refusal to answer: the request neither
// succeeded nor failed as far as the client may know. The server sends no
// reply to it; it closes the connection instead, so that the client's
// session replays the request, on this server or on another one. A
// backend returns it when answering would break a promise either way: a
// replicated volume's primary that can no longer prove the request reached
// every replica it must (pkg/replica) cannot acknowledge it, and an error
// would fail the application's I/O although another replica can still
// serve it.
//
// A backend's Sync that returns ErrWithheld is not a failed sync (no
// client's FLUSH fails for it); it makes every later sync of the export
// return ErrWithheld too: a backend that withholds once is fenced for good.
var ErrWithheld = errors.New("nbd: reply withheld by the backend")

// errnoWithheld is what execute returns for a request whose reply is
// withheld; it never reaches the wire.
const errnoWithheld = ^uint32(0)

// withhold ends c without answering the request of the given payload
// charge: the connection is closed as a superseded one is, so no later
// request of it runs and no reply of it is sent.
func (c *serverConn) withhold(payload int) {
	c.log.Warn("the backend withheld a reply: closing the connection so that the client replays its requests")
	c.fence()
	c.drop(payload)
}
