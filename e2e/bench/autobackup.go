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

package bench

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/netip"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// startAutoBackup runs the slow-path watch on both hosts of t until the
// returned stop is called. The server host runs mptcp.Keep over its signal
// endpoints (paths 2..N), exactly as the storage agent does. The client
// host of the topology has no endpoints of its own (it joins the announced
// addresses, and the kernel records implicit endpoints for them): its
// watch flags those in place instead of keeping subflow endpoints, which
// would add subflows the topology does not expect. Decisions are logged to
// w.
func startAutoBackup(t *topo.Topology, w io.Writer) (stop func() error) {
	ctx, cancel := context.WithCancel(context.Background())
	log := slog.New(slog.NewTextHandler(w, nil))
	d := mptcp.Desired{Role: mptcp.RoleServer, Port: uint16(t.JoinPort)}
	for i := 2; i <= len(t.Paths); i++ {
		d.NICs = append(d.NICs, mptcp.NICSpec(netip.PrefixFrom(t.ServerAddr(i), 32).String()))
	}
	var clientAddrs []netip.Addr
	for i := range t.Paths {
		clientAddrs = append(clientAddrs, t.ClientAddr(i+1))
	}
	errs := make(chan error, 2)
	go func() {
		errs <- topo.InNetns(t.ServerNS, func() error {
			return mptcp.Keep(ctx, d, log.With("host", "server"), &mptcp.SlowPathPolicy{})
		})
	}()
	go func() {
		errs <- topo.InNetns(t.ClientNS, func() error {
			return mptcp.FlagInPlace(ctx, clientAddrs, mptcp.SlowPathPolicy{}, log.With("host", "client"))
		})
	}()
	return func() error {
		cancel()
		var all []error
		for range 2 {
			select {
			case err := <-errs:
				all = append(all, err)
			case <-time.After(10 * time.Second):
				all = append(all, errors.New("slow-path watch did not stop in 10 s"))
			}
		}
		return errors.Join(all...)
	}
}
