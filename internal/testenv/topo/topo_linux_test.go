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
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

func requireMPTCP(t *testing.T) {
	t.Helper()
	if err := mptcp.Available(); err != nil {
		t.Skipf("skipping: %v", err)
	}
}

// listen starts an MPTCP listener inside the server namespace and closes
// it when the test ends.
func listen(t *testing.T, topo *Topology, addr string) net.Listener {
	t.Helper()
	var ln net.Listener
	err := topo.InServer(func() error {
		var err error
		ln, err = mptcp.Listen(context.Background(), "tcp4", addr, true)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln
}

// dial connects from the client namespace with MPTCP.
func dial(t *testing.T, topo *Topology, addr string) net.Conn {
	t.Helper()
	var c net.Conn
	err := topo.InClient(func() error {
		var err error
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		c, err = mptcp.Dialer(true).DialContext(ctx, "tcp4", addr)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// acceptOne accepts a single connection in the background.
func acceptOne(t *testing.T, ln net.Listener) <-chan net.Conn {
	ch := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			t.Errorf("accept: %v", err)
			close(ch)
			return
		}
		t.Cleanup(func() { c.Close() })
		ch <- c
	}()
	return ch
}

// waitSubflows polls MPTCP_INFO of c until it reports want additional
// subflows or the timeout expires, and returns the last info.
func waitSubflows(t *testing.T, c net.Conn, want int, timeout time.Duration) mptcp.Info {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		info, err := mptcp.GetInfo(c)
		if err != nil {
			t.Fatalf("GetInfo: %v", err)
		}
		if int(info.Subflows) == want || time.Now().After(deadline) {
			return info
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// echoSum is the server side of the transfer check: it reads an 8-byte
// length, then that many bytes, and answers with their SHA-256.
func echoSum(c net.Conn) error {
	r := bufio.NewReaderSize(c, 1<<20)
	var n uint64
	if err := binary.Read(r, binary.BigEndian, &n); err != nil {
		return err
	}
	h := sha256.New()
	if _, err := io.CopyN(h, r, int64(n)); err != nil {
		return err
	}
	_, err := c.Write(h.Sum(nil))
	return err
}

// sendVerified writes size random bytes through c and checks the
// checksum echoed by echoSum.
func sendVerified(c net.Conn, size int) error {
	if err := binary.Write(c, binary.BigEndian, uint64(size)); err != nil {
		return err
	}
	rng := rand.NewChaCha8([32]byte{1, 2, 3})
	h := sha256.New()
	buf := make([]byte, 1<<20)
	for left := size; left > 0; {
		chunk := buf[:min(left, len(buf))]
		_, _ = rng.Read(chunk)
		h.Write(chunk)
		if _, err := c.Write(chunk); err != nil {
			return err
		}
		left -= len(chunk)
	}
	got := make([]byte, sha256.Size)
	if _, err := io.ReadFull(c, got); err != nil {
		return err
	}
	if want := h.Sum(nil); string(got) != string(want) {
		return fmt.Errorf("checksum mismatch: server %x, client %x", got, want)
	}
	return nil
}

// checkOnePerPath asserts that subs (the subflows of one connection)
// are exactly one established subflow per path, each using the client
// and server address of its own path.
func checkOnePerPath(t *testing.T, topo *Topology, subs []Subflow, clientSide bool) {
	t.Helper()
	perPath := make([]int, len(topo.Paths)+1)
	for _, s := range subs {
		local, remote := s.Local.Addr(), s.Remote.Addr()
		cli, srv := local, remote
		if !clientSide {
			cli, srv = remote, local
		}
		p := topo.PathOf(cli)
		if p == 0 || cli != topo.ClientAddr(p) || srv != topo.ServerAddr(p) {
			t.Errorf("subflow %v -> %v does not match a path", s.Local, s.Remote)
			continue
		}
		if !strings.Contains(s.Flags, "e") {
			t.Errorf("subflow on path %d not fully established: flags %q", p, s.Flags)
		}
		perPath[p]++
	}
	for p := 1; p <= len(topo.Paths); p++ {
		if perPath[p] != 1 {
			t.Errorf("path %d: %d subflows, want 1", p, perPath[p])
		}
	}
}

func connSubflows(t *testing.T, list func() ([]Subflow, error), token uint32) []Subflow {
	t.Helper()
	all, err := list()
	if err != nil {
		t.Fatal(err)
	}
	var subs []Subflow
	for _, s := range all {
		if s.Token == token {
			subs = append(subs, s)
		}
	}
	return subs
}

// TestFourSubflows checks the central promise of the topology: one MPTCP
// connection to the server's path-1 address gets exactly one subflow per
// path, and data sent through it arrives intact.
func TestFourSubflows(t *testing.T) {
	requireMPTCP(t)
	for _, tc := range []struct {
		name     string
		joinPort int
		listen   string // "" = ServerAddr(1)
	}{
		{"join-port", 0, ""},
		// Without a join port, a wildcard listener receives the joins.
		{"wildcard-listener", -1, "0.0.0.0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := Default4(UniqueName("mp"))
			cfg.JoinPort = tc.joinPort
			topo := NewForTest(t, cfg)
			host := tc.listen
			if host == "" {
				host = topo.ServerAddr(1).String()
			}
			ln := listen(t, topo, net.JoinHostPort(host, "0"))
			port := ln.Addr().(*net.TCPAddr).Port
			accepted := acceptOne(t, ln)
			c := dial(t, topo, netip.AddrPortFrom(topo.ServerAddr(1), uint16(port)).String())
			if !mptcp.IsMPTCP(c) {
				t.Fatal("client connection is not MPTCP")
			}
			sc := <-accepted
			if sc == nil {
				t.FailNow()
			}
			if !mptcp.IsMPTCP(sc) {
				t.Fatal("server connection is not MPTCP")
			}

			srvErr := make(chan error, 1)
			go func() { srvErr <- echoSum(sc) }()
			const size = 64 << 20
			start := time.Now()
			if err := sendVerified(c, size); err != nil {
				t.Fatal(err)
			}
			if err := <-srvErr; err != nil {
				t.Fatal(err)
			}
			elapsed := time.Since(start)
			t.Logf("64 MiB verified in %v (%.0f MB/s)", elapsed.Round(time.Millisecond), size/elapsed.Seconds()/1e6)

			info := waitSubflows(t, c, len(topo.Paths)-1, 5*time.Second)
			t.Logf("client MPTCP_INFO: %+v", info)
			// mptcpi_subflows counts the additional (MP_JOIN) subflows;
			// the initial subflow is only in mptcpi_subflows_total.
			if int(info.Subflows) != len(topo.Paths)-1 {
				t.Errorf("MPTCP_INFO subflows = %d, want %d additional", info.Subflows, len(topo.Paths)-1)
			}
			if info.HasSubflowsTotal() && int(info.SubflowsTotal) != len(topo.Paths) {
				t.Errorf("MPTCP_INFO subflows_total = %d, want %d", info.SubflowsTotal, len(topo.Paths))
			}
			if int(info.AddAddrAccepted) != len(topo.Paths)-1 {
				t.Errorf("add_addr_accepted = %d, want %d", info.AddAddrAccepted, len(topo.Paths)-1)
			}
			if info.HasCounters() && info.BytesSent < size {
				t.Errorf("bytes_sent = %d < %d", info.BytesSent, size)
			}
			sinfo, err := mptcp.GetInfo(sc)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("server MPTCP_INFO: %+v", sinfo)
			if int(sinfo.Subflows) != len(topo.Paths)-1 || int(sinfo.AddAddrSignal) != len(topo.Paths)-1 {
				t.Errorf("server: subflows %d, add_addr_signal %d", sinfo.Subflows, sinfo.AddAddrSignal)
			}

			// Prove one subflow per path from the kernel's socket list.
			csubs := connSubflows(t, topo.ClientSubflows, info.Token)
			for _, s := range csubs {
				t.Logf("client subflow %v -> %v flags %s ids %d/%d sent %d", s.Local, s.Remote, s.Flags, s.LocalID, s.RemoteID, s.BytesSent)
			}
			checkOnePerPath(t, topo, csubs, true)
			checkOnePerPath(t, topo, connSubflows(t, topo.ServerSubflows, sinfo.Token), false)
			if topo.JoinPort != 0 {
				for _, s := range csubs {
					if s.Join() && int(s.Remote.Port()) != topo.JoinPort {
						t.Errorf("join subflow %v -> %v not to join port %d", s.Local, s.Remote, topo.JoinPort)
					}
				}
			}
		})
	}
}

// TestJoinRefusedWithoutPort documents why Config.JoinPort exists: with
// addresses announced without a port, a server listening on one specific
// address refuses the MP_JOINs, and the connection keeps one subflow.
func TestJoinRefusedWithoutPort(t *testing.T) {
	requireMPTCP(t)
	cfg := Default4(UniqueName("mp"))
	cfg.JoinPort = -1
	topo := NewForTest(t, cfg)
	ln := listen(t, topo, netip.AddrPortFrom(topo.ServerAddr(1), 0).String())
	accepted := acceptOne(t, ln)
	c := dial(t, topo, ln.Addr().String())
	sc := <-accepted
	if sc == nil {
		t.FailNow()
	}
	go func() { _ = echoSum(sc) }()
	if err := sendVerified(c, 1<<20); err != nil {
		t.Fatal(err)
	}
	info := waitSubflows(t, c, 1, time.Second)
	t.Logf("client MPTCP_INFO: %+v", info)
	if info.Subflows != 0 {
		t.Errorf("subflows = %d, expected the joins to be refused", info.Subflows)
	}
	if int(info.AddAddrAccepted) != len(topo.Paths)-1 {
		t.Errorf("add_addr_accepted = %d, want %d", info.AddAddrAccepted, len(topo.Paths)-1)
	}
}

// TestBackupPath checks that Backup marks the subflow of that path.
func TestBackupPath(t *testing.T) {
	requireMPTCP(t)
	cfg := Asymmetric(UniqueName("mp"))
	cfg.Paths[3].Backup = true
	topo := NewForTest(t, cfg)
	out, err := output("ip", "-n", topo.ServerNS, "mptcp", "endpoint", "show")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("server endpoints:\n%s", out)
	ln := listen(t, topo, netip.AddrPortFrom(topo.ServerAddr(1), 0).String())
	accepted := acceptOne(t, ln)
	c := dial(t, topo, ln.Addr().String())
	sc := <-accepted
	if sc == nil {
		t.FailNow()
	}
	go func() { _ = echoSum(sc) }()
	if err := sendVerified(c, 8<<20); err != nil {
		t.Fatal(err)
	}
	info := waitSubflows(t, c, 3, 5*time.Second)
	subs := connSubflows(t, topo.ClientSubflows, info.Token)
	checkOnePerPath(t, topo, subs, true)
	for _, s := range subs {
		p := topo.PathOf(s.Local.Addr())
		t.Logf("path %d: flags %s sent %d", p, s.Flags, s.BytesSent)
		if s.Backup() != (p == 4) {
			t.Errorf("path %d: backup=%v (flags %q)", p, s.Backup(), s.Flags)
		}
	}
}

func listNetns(t *testing.T) []string {
	t.Helper()
	entries, err := os.ReadDir(netnsDir)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	return names
}

func rootLinks(t *testing.T, name string) []string {
	t.Helper()
	out, err := output("ip", "-o", "link", "show")
	if err != nil {
		t.Fatal(err)
	}
	return strayLinks(out, name)
}

func assertGone(t *testing.T, name string) {
	t.Helper()
	for _, ns := range listNetns(t) {
		if ns == ClientNSName(name) || ns == ServerNSName(name) {
			t.Errorf("namespace %s left behind", ns)
		}
	}
	if links := rootLinks(t, name); len(links) > 0 {
		t.Errorf("interfaces left behind: %q", links)
	}
}

func TestTeardown(t *testing.T) {
	RequireRoot(t)
	name := UniqueName("td")
	topo, err := Up(Default4(name))
	if err != nil {
		t.Fatal(err)
	}
	ns := listNetns(t)
	if !slices.Contains(ns, topo.ClientNS) || !slices.Contains(ns, topo.ServerNS) {
		t.Fatalf("namespaces missing after Up: %q", ns)
	}
	out, err := output("ip", "-n", topo.ClientNS, "-o", "link", "show")
	if err != nil {
		t.Fatal(err)
	}
	if got := strayLinks(out, name); len(got) != 4 {
		t.Errorf("client namespace links: %q", got)
	}
	if got := rootLinks(t, name); len(got) != 0 {
		t.Errorf("veths visible in the caller's namespace: %q", got)
	}
	if err := topo.Down(); err != nil {
		t.Fatal(err)
	}
	assertGone(t, name)
	// Idempotent.
	if err := topo.Down(); err != nil {
		t.Errorf("second Down: %v", err)
	}
	var nilTopo *Topology
	if err := nilTopo.Down(); err != nil {
		t.Errorf("nil Down: %v", err)
	}
}

// TestUpRemovesLeftovers: Up with the name of a topology that still
// exists replaces it.
func TestUpRemovesLeftovers(t *testing.T) {
	RequireRoot(t)
	name := UniqueName("lo")
	if _, err := Up(Uniform(name, 2, 100)); err != nil {
		t.Fatal(err)
	}
	topo, err := Up(Uniform(name, 3, 100))
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := topo.Down(); err != nil {
			t.Error(err)
		}
	}()
	out, err := output("ip", "-n", topo.ServerNS, "-o", "link", "show")
	if err != nil {
		t.Fatal(err)
	}
	if got := strayLinks(out, name); len(got) != 3 {
		t.Errorf("links after re-Up: %q", got)
	}
	if err := topo.Down(); err != nil {
		t.Fatal(err)
	}
	assertGone(t, name)
}

// TestUpFailureCleansUp injects a failure after each step of Up.
func TestUpFailureCleansUp(t *testing.T) {
	RequireRoot(t)
	for _, step := range []string{"netns", "links", "mptcp"} {
		t.Run(step, func(t *testing.T) {
			injected := errors.New("injected failure")
			failpoint = func(s string) error {
				if s == step {
					return injected
				}
				return nil
			}
			defer func() { failpoint = func(string) error { return nil } }()
			name := UniqueName("uf")
			topo, err := Up(Default4(name))
			if !errors.Is(err, injected) {
				t.Fatalf("Up = %v, %v; want injected error", topo, err)
			}
			assertGone(t, name)
		})
	}
}

func TestInNetns(t *testing.T) {
	RequireRoot(t)
	topo := NewForTest(t, Uniform(UniqueName("ns"), 2, 100))
	err := topo.InClient(func() error {
		if _, err := net.InterfaceByName(topo.Paths[0].ClientIf); err != nil {
			return fmt.Errorf("client interface not visible inside: %w", err)
		}
		if _, err := net.InterfaceByName(topo.Paths[0].ServerIf); err == nil {
			return errors.New("server interface visible in client namespace")
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	err = topo.InServer(func() error {
		_, err := net.InterfaceByName(topo.Paths[1].ServerIf)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	// The caller's namespace is untouched (and so are the threads
	// that ran fn, which were switched back).
	for range 20 {
		if _, err := net.InterfaceByName(topo.Paths[0].ClientIf); err == nil {
			t.Fatal("client interface visible outside InClient")
		}
	}
	wantErr := errors.New("from fn")
	if err := topo.InClient(func() error { return wantErr }); err != wantErr {
		t.Errorf("error not propagated: %v", err)
	}
	func() {
		defer func() {
			if r := recover(); r != "boom" {
				t.Errorf("recovered %v, want boom", r)
			}
		}()
		_ = topo.InClient(func() error { panic("boom") })
	}()
	if err := InNetns("does-not-exist-xyz", func() error { return nil }); err == nil {
		t.Error("InNetns on a missing namespace succeeded")
	}
}

// TestMeasureThroughput prints what 4 parallel TCP streams (one per
// path) and one MPTCP connection achieve. It asserts nothing about
// speed: the numbers depend on the machine (and on -race).
func TestMeasureThroughput(t *testing.T) {
	if testing.Short() {
		t.Skip("skipping throughput measurement in -short mode")
	}
	requireMPTCP(t)
	for _, cfg := range []Config{Default4(UniqueName("ms")), Asymmetric(UniqueName("ms"))} {
		topo := NewForTest(t, cfg)
		m, err := MeasureTCP(topo, 2*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s\n%s", cfg.Name, m)
		m, err = MeasureMPTCP(topo, 2*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s\n%s", cfg.Name, m)
		if err := topo.Down(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestClientInCaller builds two topologies whose client host is the
// caller's own namespace (a fresh one: the test re-runs itself under
// `unshare --net`), dials from the process itself without entering a
// namespace, and checks one subflow per path for each topology, each
// listing only its own, and that Down leaves the caller's namespace as
// it found it.
func TestClientInCaller(t *testing.T) {
	RequireRoot(t)
	requireMPTCP(t)
	if !InFreshNetns(t) {
		return
	}
	before, err := os.Readlink("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	var tops []*Topology
	var conns []net.Conn
	for range 2 {
		cfg := Default4(UniqueName("cc"))
		cfg.ClientInCaller = true
		tp, err := Up(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = tp.Down() }) // idempotent; the test checks its own Down
		tops = append(tops, tp)
		ln := listen(t, tp, net.JoinHostPort(tp.ServerAddr(1).String(), "0"))
		accepted := acceptOne(t, ln)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		c, err := mptcp.Dialer(true).DialContext(ctx, "tcp4", ln.Addr().String())
		cancel()
		if err != nil {
			t.Fatalf("dial from the caller's namespace: %v", err)
		}
		t.Cleanup(func() { c.Close() })
		sc := <-accepted
		if sc == nil {
			t.FailNow()
		}
		echoed := make(chan error, 1)
		go func() { echoed <- echoSum(sc) }()
		if err := sendVerified(c, 8<<20); err != nil {
			t.Fatal(err)
		}
		if err := <-echoed; err != nil {
			t.Fatalf("echo: %v", err)
		}
		waitSubflows(t, c, len(tp.Paths)-1, 5*time.Second)
		conns = append(conns, c)
	}
	if tops[0].ServerAddr(1) == tops[1].ServerAddr(1) {
		t.Errorf("both topologies use %v", tops[0].ServerAddr(1))
	}
	for i, tp := range tops {
		info, err := mptcp.GetInfo(conns[i])
		if err != nil {
			t.Fatal(err)
		}
		subs, err := tp.ClientSubflows()
		if err != nil {
			t.Fatal(err)
		}
		if len(subs) != len(tp.Paths) {
			t.Errorf("%s: %d client subflows listed, want %d (its own only)", tp.Name, len(subs), len(tp.Paths))
		}
		checkOnePerPath(t, tp, connSubflows(t, tp.ClientSubflows, info.Token), true)
	}
	for i, tp := range tops {
		conns[i].Close()
		if err := tp.Down(); err != nil {
			t.Fatal(err)
		}
		assertGone(t, tp.Name)
	}
	// The endpoints the kernel made for the client addresses go too:
	// they would count against the namespace's 8.
	pm, err := mptcp.DialPM()
	if err != nil {
		t.Fatal(err)
	}
	defer pm.Close()
	eps, err := pm.Endpoints()
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range eps {
		for _, tp := range tops {
			if tp.PathOf(e.Addr) > 0 {
				t.Errorf("endpoint %d (%v) of %s left in the caller's namespace", e.ID, e.Addr, tp.Name)
			}
		}
	}
	if callerBudget.used != 0 {
		t.Errorf("%d caller endpoints still reserved", callerBudget.used)
	}
	after, err := os.Readlink("/proc/self/ns/net")
	if err != nil || after != before {
		t.Errorf("caller's namespace %q before, %q (%v) after", before, after, err)
	}
	if _, err := net.InterfaceByName("lo"); err != nil {
		t.Errorf("caller's namespace lost lo: %v", err)
	}
}

// TestCallerEndpointBudget: topologies in the caller's namespace take
// turns for its 8 MPTCP endpoints; one too many waits for a release.
func TestCallerEndpointBudget(t *testing.T) {
	if err := takeCallerEndpoints(9); err == nil {
		t.Fatal("10 paths in the caller's namespace accepted")
	}
	for range 2 {
		if err := takeCallerEndpoints(3); err != nil {
			t.Fatal(err)
		}
	}
	got := make(chan error, 1)
	go func() { got <- takeCallerEndpoints(3) }()
	select {
	case err := <-got:
		t.Fatalf("a third 4-path topology did not wait (%v)", err)
	case <-time.After(200 * time.Millisecond):
	}
	releaseCallerEndpoints(3)
	select {
	case err := <-got:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the third topology still waits after a release")
	}
	releaseCallerEndpoints(6)
}

// TestFabric: on a fabric of three hosts and three paths, a connection
// from any host to another's path-1 address gets one subflow per path,
// and a host dropped from its peers (DropPeers) reaches none of them
// until undropped, while the third still does.
func TestFabric(t *testing.T) {
	requireMPTCP(t)
	RequireNft(t)
	f := NewFabricForTest(t, FabricConfig{Name: UniqueName("fb"), Hosts: []string{"a", "b", "c"}, Paths: 3, RateMbit: 1000})
	var l net.Listener
	if err := InNetns(f.NS("b"), func() error {
		var err error
		l, err = mptcp.Listen(context.Background(), "tcp", ":7000", true)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(c, c) }()
		}
	}()
	dial := func(from string) (net.Conn, error) {
		var c net.Conn
		err := InNetns(f.NS(from), func() error {
			var err error
			d := mptcp.Dialer(true)
			d.Timeout = 2 * time.Second
			c, err = d.Dial("tcp", net.JoinHostPort(f.Addr("b", 1).String(), "7000"))
			return err
		})
		return c, err
	}
	for _, from := range []string{"a", "c"} {
		c, err := dial(from)
		if err != nil {
			t.Fatalf("from %s: %v", from, err)
		}
		if info := waitSubflows(t, c, 2, 10*time.Second); info.Subflows != 2 {
			t.Errorf("from %s: %d additional subflows, want 2", from, info.Subflows)
		}
		c.Close()
	}
	if err := DropPeers(f.NS("a"), "cut", f.Addrs("b")); err != nil {
		t.Fatal(err)
	}
	if c, err := dial("a"); err == nil {
		c.Close()
		t.Error("a reached b through the drop")
	}
	if c, err := dial("c"); err != nil {
		t.Errorf("c, not dropped: %v", err)
	} else {
		c.Close()
	}
	if err := Undrop(f.NS("a"), "cut"); err != nil {
		t.Fatal(err)
	}
	if c, err := dial("a"); err != nil {
		t.Errorf("a after the drop was lifted: %v", err)
	} else {
		c.Close()
	}
}
