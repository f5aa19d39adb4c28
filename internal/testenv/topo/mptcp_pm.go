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

package topo

import (
	"fmt"
	"net"

	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// configureMPTCP sets up the in-kernel MPTCP path manager of both
// namespaces so that one connection from the client to the server's
// path-1 address gets exactly one subflow per path:
//
//   - server: one "signal" endpoint per address on paths 2..N (announced
//     to the client with ADD_ADDR), with the join port if any (the kernel
//     then listens for MP_JOINs on address:port) and "backup" where
//     configured; the subflows limit N-1 lets it accept the N-1 MP_JOINs.
//   - client: no endpoints at all (a "subflow" endpoint per address would
//     make the client join from each local address to each announced
//     address as well, giving more subflows than paths); it accepts N-1
//     ADD_ADDRs and creates N-1 additional subflows, one to each
//     announced address, with the source address chosen by routing,
//     i.e. the client address of the same path.
//
// Both namespaces get at least the stale_loss_cnt the driver's node plugin
// and storage agent leave on their hosts (mptcp.DefaultStaleLossCount).
//
// This is the only place that knows how MPTCP is configured; it speaks
// to the kernel through pkg/mptcp's mptcp_pm netlink client from inside
// each namespace.
func configureMPTCP(t *Topology) error {
	for _, ns := range []string{t.ClientNS, t.ServerNS} {
		if err := WriteSysctl(ns, "net.mptcp.enabled", "1"); err != nil {
			return err
		}
		err := InNetns(ns, func() error {
			_, err := mptcp.RaiseStaleLossCount(mptcp.DefaultStaleLossCount)
			return err
		})
		if err != nil {
			return fmt.Errorf("MPTCP stale_loss_cnt in %s: %w", ns, err)
		}
	}
	extra := uint32(len(t.Paths) - 1)
	if t.ClientInCaller {
		// Leftovers of an earlier topology with these addresses.
		if err := t.dropCallerEndpoints(); err != nil {
			return fmt.Errorf("client MPTCP: %w", err)
		}
	}
	err := InNetns(t.ClientNS, func() error {
		pm, err := mptcp.DialPM()
		if err != nil {
			return err
		}
		defer pm.Close()
		// A caller's namespace may hold other topologies' endpoints.
		if !t.ClientInCaller {
			if err := pm.Flush(); err != nil {
				return err
			}
		}
		return pm.SetLimits(mptcp.Limits{Subflows: extra, AddAddrAccepted: extra})
	})
	if err != nil {
		return fmt.Errorf("client MPTCP: %w", err)
	}
	err = InNetns(t.ServerNS, func() error {
		pm, err := mptcp.DialPM()
		if err != nil {
			return err
		}
		defer pm.Close()
		if err := pm.Flush(); err != nil {
			return err
		}
		if err := pm.SetLimits(mptcp.Limits{Subflows: extra}); err != nil {
			return err
		}
		for i, p := range t.Paths {
			if i == 0 {
				continue // the address the client connects to
			}
			ifi, err := net.InterfaceByName(p.ServerIf)
			if err != nil {
				return err
			}
			e := mptcp.Endpoint{ID: uint8(i + 1), Addr: p.ServerAddr, Flags: mptcp.Signal, IfIndex: int32(ifi.Index)}
			if t.JoinPort > 0 {
				e.Port = uint16(t.JoinPort)
			}
			if p.Backup {
				e.Flags |= mptcp.Backup
			}
			if err := pm.AddEndpoint(e); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("server MPTCP: %w", err)
	}
	return nil
}
