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
	"context"
	"net/netip"
	"slices"
	"time"

	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// joinCheckInterval is how often the agent looks at the subflows of the
// connections of nodes whose publications list their storage addresses.
const joinCheckInterval = time.Second

// The source-address check of resolve looks at the connection's first
// subflow only. MPTCP lets more subflows join it later, from any address
// (MP_JOIN carries a key derived from the handshake, not an address), so
// a node's connection could grow a subflow from elsewhere. runJoinGuard
// closes a connection of a node whose publication lists addresses as soon
// as one of its subflows comes from another address; the node's data path
// redials on its published addresses.
func (a *Agent) runJoinGuard(ctx context.Context) error {
	t := time.NewTicker(joinCheckInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			a.checkJoins(ctx)
		}
	}
}

// checkJoins closes the connections that have a subflow from outside
// their node's published addresses.
func (a *Agent) checkJoins(ctx context.Context) {
	type limit struct {
		vol   string
		addrs map[string][]netip.Addr // node ID -> published addresses
	}
	var limits []limit
	a.mu.RLock()
	for name, v := range a.vols {
		l := limit{vol: name, addrs: map[string][]netip.Addr{}}
		for _, g := range v.grants {
			if g.limited {
				l.addrs[g.nodeID] = g.addrs
			}
		}
		if len(l.addrs) > 0 {
			limits = append(limits, l)
		}
	}
	a.mu.RUnlock()
	for _, l := range limits {
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		n, _ := a.srv.CloseConns(cctx, l.vol, func(c nbd.ConnInfo) bool {
			addrs, ok := l.addrs[c.Tag]
			if !ok {
				return false
			}
			stray := strayJoin(c, addrs)
			if stray.IsValid() {
				a.log.Warn("closing a connection with a subflow from outside its node's storage addresses",
					"volume_id", l.vol, "node_id", c.Tag, "subflow_from", stray, "published", addrs)
				if a.cfg.Exports != nil {
					a.cfg.Exports.StrayJoin(l.vol)
				}
			}
			return stray.IsValid()
		})
		cancel()
		if n > 0 {
			a.log.Info("connections with stray subflows closed", "volume_id", l.vol, "connections", n)
		}
	}
}

// strayJoin returns the remote address of a subflow of c outside addrs,
// or the zero Addr. A connection that is not MPTCP has no other subflow.
func strayJoin(c nbd.ConnInfo, addrs []netip.Addr) netip.Addr {
	if c.Conn == nil || !nbd.IsMultipathTCP(c.Conn) {
		return netip.Addr{}
	}
	subs, err := mptcp.GetSubflows(c.Conn)
	if err != nil {
		return netip.Addr{}
	}
	for _, s := range subs {
		if r := s.Remote.Addr().Unmap(); r.IsValid() && !slices.Contains(addrs, r) {
			return r
		}
	}
	return netip.Addr{}
}
