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

package mptcp_test

import (
	"context"
	"errors"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

func mustAddr(s string) netip.Addr { return netip.MustParseAddr(s) }

func checkResult(t *testing.T, what string, res mptcp.Result, err error, added, removed, updated int) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	if len(res.Added) != added || len(res.Removed) != removed || len(res.Updated) != updated {
		t.Fatalf("%s: added %v removed %v updated %v; want %d, %d, %d",
			what, res.Added, res.Removed, res.Updated, added, removed, updated)
	}
	t.Logf("%s: %+v", what, res)
}

func TestReconcileNetns(t *testing.T) {
	ns := newTestNS(t)
	a0, b0 := ns.ifindex("a0"), ns.ifindex("b0")

	// An administrator's endpoint on an address no NIC selects.
	ns.ip("mptcp", "endpoint", "add", "10.201.9.9", "id", "42", "signal")
	admin := mptcp.Endpoint{ID: 42, Addr: mustAddr("10.201.9.9"), Flags: mptcp.Signal}

	// Server: signal endpoints with the join port, b0's backup.
	server := mptcp.Desired{
		NICs:   []mptcp.NICSpec{"a0", "10.201.2.0/24"},
		Role:   mptcp.RoleServer,
		Backup: []mptcp.NICSpec{"b0"},
		Port:   10300,
	}
	res, err := mptcp.Reconcile(ns.pm, ns.addr, server)
	checkResult(t, "server", res, err, 3, 0, 0)
	ns.checkEndpoints([]mptcp.Endpoint{
		admin,
		{Addr: mustAddr("10.201.1.1"), Port: 10300, Flags: mptcp.Signal, IfIndex: a0},
		{Addr: mustAddr("fd00:201:1::1"), Port: 10300, Flags: mptcp.Signal, IfIndex: a0},
		{Addr: mustAddr("10.201.2.1"), Port: 10300, Flags: mptcp.Signal | mptcp.Backup, IfIndex: b0},
	})
	if l := ns.ipLimits(); l != (mptcp.Limits{Subflows: 3}) || res.Limits != l {
		t.Fatalf("server limits: ip %+v, result %+v; want subflows 3 add_addr_accepted 0", l, res.Limits)
	}
	res, err = mptcp.Reconcile(ns.pm, ns.addr, server)
	checkResult(t, "server again", res, err, 0, 0, 0)
	if res.Changed() {
		t.Fatalf("second server run changed things: %+v", res)
	}

	// Client on the same NICs: every endpoint is replaced.
	client := server
	client.Role, client.Port = mptcp.RoleClient, 0
	res, err = mptcp.Reconcile(ns.pm, ns.addr, client)
	checkResult(t, "client", res, err, 3, 3, 0)
	ns.checkEndpoints([]mptcp.Endpoint{
		admin,
		{Addr: mustAddr("10.201.1.1"), Flags: mptcp.Subflow, IfIndex: a0},
		{Addr: mustAddr("fd00:201:1::1"), Flags: mptcp.Subflow, IfIndex: a0},
		{Addr: mustAddr("10.201.2.1"), Flags: mptcp.Subflow | mptcp.Backup, IfIndex: b0},
	})
	if l := ns.ipLimits(); l != (mptcp.Limits{Subflows: 3, AddAddrAccepted: 2}) {
		t.Fatalf("client limits %+v, want subflows 3 (kept) add_addr_accepted 2", l)
	}
	res, err = mptcp.Reconcile(ns.pm, ns.addr, client)
	checkResult(t, "client again", res, err, 0, 0, 0)
	if res.Changed() {
		t.Fatalf("second client run changed things: %+v", res)
	}

	// No backup NIC any more: SET_FLAGS, the endpoint keeps its ID.
	before := ns.checkEndpoints(nil)
	client.Backup = nil
	res, err = mptcp.Reconcile(ns.pm, ns.addr, client)
	checkResult(t, "backup off", res, err, 0, 0, 1)
	after := ns.checkEndpoints(nil)
	for i := range after {
		if after[i].ID != before[i].ID || after[i].Flags&mptcp.Backup != 0 {
			t.Fatalf("backup off: endpoints %v, before %v", after, before)
		}
	}

	// An address leaves a0: its endpoint goes.
	ns.ip("addr", "del", "fd00:201:1::1/64", "dev", "a0")
	res, err = mptcp.Reconcile(ns.pm, ns.addr, client)
	checkResult(t, "address removed", res, err, 0, 1, 0)
	if res.Removed[0].Addr != mustAddr("fd00:201:1::1") {
		t.Fatalf("removed %v", res.Removed)
	}

	// Six more addresses on b0 would make 9 endpoints: refused whole.
	for i := 2; i <= 7; i++ {
		ns.ip("addr", "add", netip.AddrFrom4([4]byte{10, 201, 2, byte(i)}).String()+"/24", "dev", "b0")
	}
	before = ns.checkEndpoints(nil)
	beforeLimits := ns.ipLimits()
	res, err = mptcp.Reconcile(ns.pm, ns.addr, client)
	if !errors.Is(err, mptcp.ErrTooManyEndpoints) || !strings.Contains(err.Error(), "9 endpoints needed (8 managed + 1 others)") {
		t.Fatalf("nine endpoints: %v, want ErrTooManyEndpoints", err)
	}
	t.Logf("nine endpoints: %v", err)
	if got := ns.checkEndpoints(nil); !slices.Equal(got, before) || res.Changed() || ns.ipLimits() != beforeLimits {
		t.Fatalf("refused reconcile changed the namespace: %v, was %v", got, before)
	}

	// One address fewer: eight fit.
	ns.ip("addr", "del", "10.201.2.7/24", "dev", "b0")
	res, err = mptcp.Reconcile(ns.pm, ns.addr, client)
	checkResult(t, "eight endpoints", res, err, 5, 0, 0)
	if got := ns.checkEndpoints(nil); len(got) != mptcp.MaxEndpoints || !slices.Contains(got, admin) {
		t.Fatalf("endpoints %v, want %d with the administrator's", got, mptcp.MaxEndpoints)
	}
	if l := ns.ipLimits(); l != (mptcp.Limits{Subflows: 6, AddAddrAccepted: 6}) {
		t.Fatalf("limits %+v, want 6 and 6 for 7 managed endpoints", l)
	}
}

func TestWatchNetns(t *testing.T) {
	ns := newTestNS(t)
	ctx, cancel := context.WithCancel(context.Background())
	var changes <-chan struct{}
	if err := topo.InNetns(ns.name, func() error {
		var err error
		changes, err = mptcp.AddrChanges(ctx)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	results := make(chan mptcp.Result, 64)
	done := make(chan error, 1)
	go func() {
		done <- mptcp.Watch(ctx, ns.pm, ns.addr, mptcp.Desired{NICs: []mptcp.NICSpec{"b0"}, Role: mptcp.RoleClient},
			mptcp.WatchOptions{
				Interval: time.Hour, // only address events trigger runs
				Changes:  changes,
				OnResult: func(r mptcp.Result, err error) {
					if err != nil {
						t.Errorf("watch run: %v", err)
					}
					results <- r
				},
			})
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Errorf("Watch returned %v, want context.Canceled", err)
		}
		for range changes { // closed once ctx is done
		}
	})

	// waitFor waits for a run whose result satisfies ok.
	waitFor := func(what string, ok func(mptcp.Result) bool) {
		t.Helper()
		timeout := time.After(10 * time.Second)
		for {
			select {
			case r := <-results:
				if ok(r) {
					t.Logf("%s: %+v", what, r)
					return
				}
			case <-timeout:
				t.Fatalf("%s: no such run within 10s; endpoints %v", what, ns.checkEndpoints(nil))
			}
		}
	}
	waitFor("first run", func(r mptcp.Result) bool { return len(r.Added) == 1 })

	ns.ip("addr", "add", "10.201.2.50/24", "dev", "b0")
	waitFor("address added", func(r mptcp.Result) bool {
		return len(r.Added) == 1 && r.Added[0].Addr == mustAddr("10.201.2.50")
	})

	// b0 disappears with its addresses: Watch remembers them.
	ns.ip("link", "del", "b0")
	waitFor("interface deleted", func(r mptcp.Result) bool { return len(r.Removed) == 2 })
	if eps := ns.checkEndpoints(nil); len(eps) != 0 {
		t.Fatalf("endpoints left: %v", eps)
	}
}

// TestKeepNetns runs Keep in a namespace: it adds the endpoint of the
// selected NIC, follows a new address on it, and leaves the endpoints in
// place when it stops (a restarted keeper finds them as they were).
func TestKeepNetns(t *testing.T) {
	ns := newTestNS(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- topo.InNetns(ns.name, func() error {
			return mptcp.Keep(ctx, mptcp.Desired{NICs: []mptcp.NICSpec{"b0"}, Role: mptcp.RoleClient}, slog.New(slog.DiscardHandler), nil)
		})
	}()
	waitEndpoints := func(what string, want ...string) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			var got []string
			for _, e := range ns.ipEndpoints() { // PM and ip may race while Keep runs
				got = append(got, e.Addr.String())
			}
			slices.Sort(got)
			if slices.Equal(got, want) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: endpoints %v, want %v", what, got, want)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	waitEndpoints("start", "10.201.2.1")
	ns.ip("addr", "add", "10.201.2.7/24", "dev", "b0")
	waitEndpoints("new address", "10.201.2.1", "10.201.2.7")
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Keep: %v", err)
	}
	waitEndpoints("after stop", "10.201.2.1", "10.201.2.7")
}
