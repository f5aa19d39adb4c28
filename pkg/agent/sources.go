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

package agent

import (
	"net/netip"
	"slices"
)

// updateKnownSourcesLocked tells the server the storage addresses of every
// node a volume is published to: their connections may take the
// handshake slots nbd.Limits.ReservedHandshakes keeps, which connections
// from anywhere else cannot exhaust. A publication that lists no
// addresses adds none (its node's connections share the other slots).
// a.mu must be held.
func (a *Agent) updateKnownSourcesLocked() {
	var addrs []netip.Addr
	for _, v := range a.vols {
		for _, g := range v.grants {
			addrs = append(addrs, g.addrs...)
		}
	}
	slices.SortFunc(addrs, netip.Addr.Compare)
	a.srv.SetKnownSources(slices.Compact(addrs))
}
