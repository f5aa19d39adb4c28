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

// Package datapath holds root integration tests of the NBD data path over
// real MPTCP subflows in network namespaces.
package datapath

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// startServer serves a memory export from the server namespace on the
// path-1 address and returns its address.
func startServer(t *testing.T, tp *topo.Topology, useMPTCP bool, size int64) (string, *nbd.Server) {
	t.Helper()
	s := &nbd.Server{}
	if err := s.AddExport(&nbd.Export{Name: "vol", Backend: nbd.NewMemBackend(size)}); err != nil {
		t.Fatal(err)
	}
	var l net.Listener
	err := tp.InServer(func() error {
		var err error
		l, err = mptcp.Listen(context.Background(), "tcp", net.JoinHostPort(tp.ServerAddr(1).String(), "0"), useMPTCP)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	go s.Serve(l)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		s.Shutdown(ctx)
	})
	return l.Addr().String(), s
}

func dialClient(t *testing.T, tp *topo.Topology, addr string, useMPTCP bool, conns int) *nbd.Client {
	t.Helper()
	var cl *nbd.Client
	err := tp.InClient(func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		var err error
		cl, err = nbd.Dial(ctx, nbd.DialOptions{Addr: addr, Export: "vol", MPTCP: useMPTCP, Conns: conns})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	return cl
}

// writeAndVerify writes size bytes of random data with qd writers, flushes,
// reads everything back and compares checksums.
func writeAndVerify(t *testing.T, cl *nbd.Client, size int64) {
	t.Helper()
	const bs = 1 << 20
	want := make([]byte, size)
	rand.Read(want)
	var wg sync.WaitGroup
	errs := make(chan error, size/bs)
	for off := int64(0); off < size; off += bs {
		wg.Add(1)
		go func(off int64) {
			defer wg.Done()
			if _, err := cl.WriteAt(want[off:off+bs], off); err != nil {
				errs <- err
			}
		}(off)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("write: %v", err)
	}
	if err := cl.Flush(); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, size)
	if _, err := cl.ReadAt(got, 0); err != nil {
		t.Fatalf("read: %v", err)
	}
	if sha256.Sum256(got) != sha256.Sum256(want) {
		i := 0
		for i < len(got) && got[i] == want[i] {
			i++
		}
		t.Fatalf("data read back differs from what was written (first difference at byte %d)", i)
	}
}

// TestNBDOverFourSubflows proves the product's premise on a real kernel:
// one NBD connection over MPTCP carries one subflow per path on 4 shaped
// paths, did not fall back, and moves data bit-exact.
func TestNBDOverFourSubflows(t *testing.T) {
	tp := topo.NewForTest(t, topo.Default4(topo.UniqueName("dp")))
	if err := mptcp.Available(); err != nil {
		t.Skipf("MPTCP unavailable: %v", err)
	}
	addr, _ := startServer(t, tp, true, 128<<20)
	cl := dialClient(t, tp, addr, true, 1)
	if mp := cl.MultipathTCP(); len(mp) != 1 || !mp[0] {
		t.Fatalf("connection is not MPTCP (fell back to TCP): %v", mp)
	}

	// Subflows join after the first data; move data while they come up.
	writeAndVerify(t, cl, 64<<20)

	deadline := time.Now().Add(10 * time.Second)
	var info mptcp.Info
	var subflows []topo.Subflow
	for {
		var err error
		info, err = mptcp.GetInfo(cl.Conns()[0])
		if err != nil {
			t.Fatalf("MPTCP_INFO: %v", err)
		}
		subflows, err = tp.ClientSubflows()
		if err != nil {
			t.Fatal(err)
		}
		if info.Subflows == 3 && len(subflows) == 4 || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if info.Fallback() {
		t.Fatal("MPTCP_INFO reports a fallback to TCP")
	}
	if info.Subflows != 3 {
		t.Fatalf("MPTCP_INFO: %d additional subflows, want 3 (one per extra path)", info.Subflows)
	}
	perPath := map[int]int{}
	for _, sf := range subflows {
		if sf.Token != info.Token {
			continue
		}
		p := tp.PathOf(sf.Local.Addr())
		if p == 0 || tp.PathOf(sf.Remote.Addr()) != p {
			t.Errorf("subflow %v -> %v does not stay on one path", sf.Local, sf.Remote)
		}
		perPath[p]++
	}
	for p := 1; p <= 4; p++ {
		if perPath[p] != 1 {
			t.Errorf("path %d carries %d subflows of the connection, want 1 (all: %+v)", p, perPath[p], subflows)
		}
	}

	// Every path carried data (the scheduler really uses them all).
	writeAndVerify(t, cl, 64<<20)
	subflows, _ = tp.ClientSubflows()
	for _, sf := range subflows {
		if sf.Token == info.Token && sf.BytesSent == 0 && sf.BytesReceived == 0 {
			t.Errorf("subflow %v -> %v moved no data", sf.Local, sf.Remote)
		}
	}
}

// TestNBDTCPBaseline checks the plain-TCP path through the same topology:
// no MPTCP, one path, data intact.
func TestNBDTCPBaseline(t *testing.T) {
	tp := topo.NewForTest(t, topo.Default4(topo.UniqueName("dt")))
	addr, _ := startServer(t, tp, false, 32<<20)
	cl := dialClient(t, tp, addr, false, 1)
	if mp := cl.MultipathTCP(); mp[0] {
		t.Fatal("plain TCP dial reports MPTCP")
	}
	writeAndVerify(t, cl, 16<<20)
}

// TestNBDMultiConnMPTCP runs several MPTCP connections to one export with
// concurrent writers; FLUSH on one connection covers writes on the others.
func TestNBDMultiConnMPTCP(t *testing.T) {
	tp := topo.NewForTest(t, topo.Default4(topo.UniqueName("dm")))
	if err := mptcp.Available(); err != nil {
		t.Skipf("MPTCP unavailable: %v", err)
	}
	addr, _ := startServer(t, tp, true, 64<<20)
	cl := dialClient(t, tp, addr, true, 4)
	for i, mp := range cl.MultipathTCP() {
		if !mp {
			t.Fatalf("connection %d fell back to TCP", i)
		}
	}
	writeAndVerify(t, cl, 32<<20)
}

// TestPathDownAndBack takes one path down in the middle of a transfer and
// brings it back: MPTCP keeps the connection, no request fails, data is
// intact.
func TestPathDownAndBack(t *testing.T) {
	tp := topo.NewForTest(t, topo.Default4(topo.UniqueName("dd")))
	if err := mptcp.Available(); err != nil {
		t.Skipf("MPTCP unavailable: %v", err)
	}
	addr, _ := startServer(t, tp, true, 128<<20)
	cl := dialClient(t, tp, addr, true, 1)
	writeAndVerify(t, cl, 16<<20) // let the subflows come up

	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; i < 4; i++ {
			t.Run(fmt.Sprintf("round%d", i), func(t *testing.T) { writeAndVerify(t, cl, 32<<20) })
		}
	}()
	time.Sleep(300 * time.Millisecond)
	link := tp.Paths[1].ClientIf
	if out, err := topo.Exec(tp.ClientNS, "ip", "link", "set", link, "down").CombinedOutput(); err != nil {
		t.Fatalf("link down: %v: %s", err, out)
	}
	time.Sleep(1 * time.Second)
	if out, err := topo.Exec(tp.ClientNS, "ip", "link", "set", link, "up").CombinedOutput(); err != nil {
		t.Fatalf("link up: %v: %s", err, out)
	}
	<-done
	got := make([]byte, 4096)
	if _, err := cl.ReadAt(got, 0); err != nil {
		t.Fatalf("connection unusable after the path came back: %v", err)
	}
	if bytes.Equal(got, make([]byte, 4096)) {
		t.Fatal("export reads as zeroes after the transfer")
	}
}
