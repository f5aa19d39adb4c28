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
	"net"
	"net/netip"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// TestListenersFollowSignalNICs: the storage agent's port listens on its
// storage address only, and its endpoint watch opens it on the signal
// NIC's address, which the kernel announces without a port: the client's
// connection gets its second subflow there, as it would with the port
// open on every address.
func TestListenersFollowSignalNICs(t *testing.T) {
	if err := mptcp.Available(); err != nil {
		t.Skipf("skipping: MPTCP unavailable: %v", err)
	}
	cfg := topo.Uniform(topo.UniqueName("lf"), 2, 1000)
	cfg.JoinPort = -1
	tp := topo.NewForTest(t, cfg)
	log := testLogger(t)
	srv := &nbd.Server{Logger: log}
	if err := srv.AddExport(&nbd.Export{Name: "d", Backend: nbd.NewMemBackend(1 << 20)}); err != nil {
		t.Fatal(err)
	}
	ls := NewListeners(srv, 0, true, log)
	if err := tp.InServer(func() error { return ls.Bind([]netip.Addr{tp.ServerAddr(1)}) }); err != nil {
		t.Fatal(err)
	}
	ls.Serve()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
		ls.Close()
	})
	port := strconv.Itoa(ls.Port())

	ctx, cancel := context.WithCancel(context.Background())
	a := &Agent{cfg: Config{SignalNICs: []mptcp.NICSpec{mptcp.NICSpec(topo.ServerIfName(cfg.Name, 2))}, Listeners: ls}, log: log}
	kept := make(chan error, 1)
	go func() { kept <- tp.InServer(func() error { return a.runEndpoints(ctx) }) }()
	t.Cleanup(func() {
		cancel()
		if err := <-kept; err != nil {
			t.Errorf("endpoints: %v", err)
		}
	})
	want := []string{net.JoinHostPort(tp.ServerAddr(1).String(), port), net.JoinHostPort(tp.ServerAddr(2).String(), port)}
	waitFor(t, "the port to open on the signal NIC's address", func() bool { return slices.Equal(ls.Addrs(), want) })

	var cl *nbd.Client
	if err := tp.InClient(func() error {
		dctx, dcancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer dcancel()
		var err error
		cl, err = nbd.Dial(dctx, nbd.DialOptions{Addr: want[0], Export: "d", MPTCP: true, Logger: log})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	waitFor(t, "a subflow to join on the signal NIC's address", func() bool {
		subs, err := mptcp.GetSubflows(cl.Conns()[0])
		if err != nil {
			return false
		}
		for _, s := range subs {
			if s.Remote.Addr() == tp.ServerAddr(2) {
				return true
			}
		}
		return false
	})

}

// waitFor polls cond for up to 10 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	end := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(end) {
			t.Fatalf("gave up after 10s waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
