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

package access

import (
	"strconv"
	"strings"
)

// epochSeparator puts a publication's epoch at the end of an export name.
// Volume names are DNS subdomains and tokens hex, so it occurs in neither.
const epochSeparator = "@"

// ExportName is the export a node opens for its publication of volume:
// the volume's name, then "/" and the node's token unless the volume is
// encrypted (token empty), then "@" and the publication's epoch unless it
// has none (0, a publication made before epochs existed).
//
// The epoch ties every connection to one publication. The storage agent
// serves a connection only when its epoch is that of the node's current
// publication. One presenting an older epoch comes from a data path of a
// publication since replaced (a node fenced, force-detached and published
// again later, whose old session kept redialing), and one presenting the
// epoch of a publication withdrawn since (the node has none now, and the
// epoch is older than the volume generation the agent applied: a node
// force-detached, the volume moved to another) too: the agent refuses it
// as superseded (nbd.ErrSuperseded), and such a refusal alone is final,
// so the old session fails its I/O and drops the writes it kept instead
// of replaying them over what was written since (or waiting for ever).
// Every other refusal (the volume unknown to an agent that just
// restarted, no publication to the node yet, an epoch newer than the
// agent has applied) only makes the data path dial again. A connection
// without an epoch matches only a publication without one.
func ExportName(volume, token string, epoch int64) string {
	name := volume
	if token != "" {
		name = NodeExport(volume, token)
	}
	if epoch > 0 {
		name += epochSeparator + strconv.FormatInt(epoch, 10)
	}
	return name
}

// ParseExport undoes ExportName. ok is false for names it does not make
// (an empty volume, a malformed token or epoch).
func ParseExport(name string) (volume, token string, epoch int64, ok bool) {
	if base, e, found := strings.Cut(name, epochSeparator); found {
		n, err := strconv.ParseInt(e, 10, 64)
		if err != nil || n <= 0 || strconv.FormatInt(n, 10) != e {
			return "", "", 0, false
		}
		name, epoch = base, n
	}
	if strings.Contains(name, separator) {
		volume, token, ok = SplitExport(name)
		if !ok {
			return "", "", 0, false
		}
		return volume, token, epoch, true
	}
	if name == "" {
		return "", "", 0, false
	}
	return name, "", epoch, true
}
