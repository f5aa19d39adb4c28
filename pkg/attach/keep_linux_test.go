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

package attach

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"net"
	"os/exec"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// TestSessionRestoresSubflows: a session opened while one of four paths
// is down runs on three subflows, and so does a connection that nothing
// keeps (the kernel never retries a failed join); once the path is back,
// the session swaps in a connection with all four while a writer checks
// every byte it wrote, and no request fails. Real MPTCP on a 4-path
// topology whose client host is this test's own process (a network
// namespace of its own).
func TestSessionRestoresSubflows(t *testing.T) {
	topo.RequireRoot(t)
	if err := mptcp.Available(); err != nil {
		t.Skipf("skipping: %v", err)
	}
	if !topo.InFreshNetns(t) {
		return
	}
	cfg := topo.Default4(topo.UniqueName("ks"))
	cfg.ClientInCaller = true
	tp := topo.NewForTest(t, cfg)

	var l net.Listener
	err := tp.InServer(func() (err error) {
		l, err = mptcp.Listen(context.Background(), "tcp", net.JoinHostPort(tp.ServerAddr(1).String(), "0"), true)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	const size = 64 << 20
	serveExport(t, l, &nbd.Server{}, size)
	port := strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
	var addrs []string
	for i := range tp.Paths {
		addrs = append(addrs, net.JoinHostPort(tp.ServerAddr(i+1).String(), port))
	}

	link := func(state string) {
		t.Helper()
		if out, err := exec.Command("ip", "-n", tp.ClientNS, "link", "set", tp.Paths[3].ClientIf, state).CombinedOutput(); err != nil {
			t.Fatalf("ip link set %s %s: %v: %s", tp.Paths[3].ClientIf, state, err, out)
		}
	}
	link("down")
	ctx := context.Background()
	s, err := OpenSession(ctx, SessionConfig{Keep: KeepConfig{Every: 100 * time.Millisecond, Hold: 500 * time.Millisecond, MaxHold: 2 * time.Second, JoinWait: 2 * time.Second}},
		Target{VolumeID: "v", Export: "vol", Addrs: addrs}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close(5 * time.Second) })
	if !s.Multipath {
		t.Fatal("the session's connection is not MPTCP")
	}
	// An unkept connection opened alongside: the control.
	bare, _, err := ExportDialer{}.DialExport(ctx, addrs[0], "", "vol", true, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer bare.Close()

	// A writer that checks what it wrote, throughout.
	stop := make(chan struct{})
	werr := make(chan error, 1)
	var wg sync.WaitGroup
	var rounds int
	wg.Add(1)
	go func() {
		defer wg.Done()
		buf, got := make([]byte, 1<<20), make([]byte, 1<<20)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			rand.Read(buf)
			off := int64(i%(size>>20)) << 20
			if _, err := s.Client.WriteAt(buf, off); err != nil {
				werr <- fmt.Errorf("write %d: %w", i, err)
				return
			}
			if _, err := s.Client.ReadAt(got, off); err != nil {
				werr <- fmt.Errorf("read %d: %w", i, err)
				return
			}
			if !bytes.Equal(buf, got) {
				werr <- fmt.Errorf("round %d: read back differs from what was written", i)
				return
			}
			rounds = i + 1
		}
	}()

	current := func() int {
		n, _ := subflows(s.Relay.Stats().Remote)
		return n
	}
	time.Sleep(3 * time.Second)
	if n := current(); n != 3 {
		t.Fatalf("with path 4 down the session has %d subflows, want 3", n)
	}
	if st := s.Relay.Stats(); st.Replaced != 0 {
		t.Errorf("%d connections swapped in while no better one could be made", st.Replaced)
	}
	link("up")
	deadline := time.Now().Add(30 * time.Second)
	for current() != 4 {
		if time.Now().After(deadline) {
			t.Fatalf("the session has %d subflows 30 s after path 4 came back, want 4", current())
		}
		select {
		case err := <-werr:
			t.Fatal(err)
		case <-time.After(100 * time.Millisecond):
		}
	}
	took := time.Since(deadline.Add(-30 * time.Second))
	time.Sleep(time.Second) // I/O on the new connection
	close(stop)
	wg.Wait()
	select {
	case err := <-werr:
		t.Fatal(err)
	default:
	}
	if n, _ := subflows(bare); n != 3 {
		t.Errorf("the unkept connection has %d subflows, want 3: the kernel retried the join, and the premise of this test is gone", n)
	}
	st := s.Relay.Stats()
	if st.Replaced < 1 || st.Reconnects != 0 {
		t.Errorf("replaced %d, reconnects %d; want at least 1 and 0", st.Replaced, st.Reconnects)
	}
	info, err := mptcp.GetInfo(st.Remote)
	if err != nil {
		t.Fatal(err)
	}
	subs, err := tp.ClientSubflows()
	if err != nil {
		t.Fatal(err)
	}
	paths := map[int]bool{}
	for _, sf := range subs {
		if sf.Token == info.Token {
			paths[tp.PathOf(sf.Local.Addr())] = true
		}
	}
	if len(paths) != 4 {
		t.Errorf("the new connection's subflows use paths %v, want all 4", paths)
	}
	t.Logf("all 4 subflows %v after the path came back; %d verified MiB rounds; %d connection(s) swapped in", took.Round(time.Millisecond), rounds, st.Replaced)
}
