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
	"strings"
)

// ErrSuperseded is a refusal that is final: the server says that what the
// client presented (for the storage agent, the publication its export
// name names) was replaced by a newer one, so no connection of this
// client will ever be served again. A client that keeps writes to replay
// must then drop them and fail its I/O instead of redialing: replayed,
// they would overwrite what a newer user of the export wrote meanwhile.
//
// On the wire it is NBD_REP_ERR_POLICY to NBD_OPT_GO or NBD_OPT_INFO whose
// message starts with SupersededMessage; other clients see an ordinary
// policy refusal. A server's Resolve hook returns an error wrapping
// ErrSuperseded to send it; on the client, errors.Is(err, ErrSuperseded)
// holds for such a refusal (and errors.Is(err, ErrAccessDenied) too).
// Every other refusal (an unknown export, access denied) may be passing:
// a server restarting, or one that has not yet seen a new publication,
// gives those, and a client may try again.
var ErrSuperseded = errors.New("nbd: superseded")

// SupersededMessage starts the message of a refusal that is ErrSuperseded.
const SupersededMessage = "superseded"

func isSupersededReply(reply uint32, msg string) bool {
	return reply == RepErrPolicy && strings.HasPrefix(msg, SupersededMessage)
}
