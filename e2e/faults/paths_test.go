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

package faults

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/attach/fuse"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// fourPaths is our storage server (a real process) on the server side of
// a 4-path topology whose client side is this test's process (a network
// namespace of its own), with a fuse attacher to reach it.
type fourPaths struct {
	tp    *topo.Topology
	srv   *ourServer
	a     *fuse.Attacher
	addrs []string // the server's address on every path
}

// newFourPaths builds the topology and starts the server on an image of
// size bytes; ok is false in the parent of the fresh network namespace
// the test reruns in (the caller then returns).
func newFourPaths(t *testing.T, size int64) (fp *fourPaths, ok bool) {
	t.Helper()
	need(t, "fio", "unshare")
	if err := mptcp.Available(); err != nil {
		t.Skipf("skipping: %v", err)
	}
	if !topo.InFreshNetns(t) {
		return nil, false
	}
	cfg := topo.Default4(topo.UniqueName("fk"))
	cfg.ClientInCaller = true
	tp := topo.NewForTest(t, cfg)

	bin, err := buildOnce()
	if err != nil {
		t.Fatalf("build the commands: %v", err)
	}
	image := filepath.Join(t.TempDir(), "disk.img")
	if err := os.WriteFile(image, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(image, size); err != nil {
		t.Fatal(err)
	}
	const port = 10809
	s := &ourServer{bin: filepath.Join(bin, "nbd-server"), image: image, port: port, ns: tp.ServerNS, host: tp.ServerAddr(1).String()}
	s.start(t)
	t.Cleanup(func() { s.kill(t) })
	fp = &fourPaths{tp: tp, srv: s, a: fuse.New(fuse.Config{StateDir: t.TempDir()})}
	for i := range tp.Paths {
		fp.addrs = append(fp.addrs, net.JoinHostPort(tp.ServerAddr(i+1).String(), strconv.Itoa(port)))
	}
	return fp, true
}

// link sets the client side of path (1-based) up or down.
func (fp *fourPaths) link(t *testing.T, path int, state string) {
	t.Helper()
	ifc := fp.tp.Paths[path-1].ClientIf
	if out, err := exec.Command("ip", "-n", fp.tp.ClientNS, "link", "set", ifc, state).CombinedOutput(); err != nil {
		t.Fatalf("ip link set %s %s: %v: %s", ifc, state, err, out)
	}
}

// attach attaches volume id over all four paths and detaches it when the
// test ends.
func (fp *fourPaths) attach(t *testing.T, id string) *attach.Attachment {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	att, err := fp.a.Attach(ctx, attach.Target{VolumeID: id, Export: "disk", Addrs: fp.addrs}, attach.Options{})
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := fp.a.Detach(context.Background(), id); err != nil {
			t.Errorf("detach: %v", err)
		}
	})
	return att
}

// TestFusePathCutsUnderLargeWrites: 1 MiB sequential writes, verified,
// on a fuse volume over 4 MPTCP paths to our server, while one path after
// another is cut for two seconds and the server is SIGKILLed and
// restarted. The server waits for most of each 1 MiB payload before it
// reads (a low-water mark on the socket); a cut path holds part of a
// payload back until MPTCP sends it again on another path, the case where
// a mark the socket cannot reach would stall the connection. Every round
// must end within its bound, with no I/O error and every block verified.
func TestFusePathCutsUnderLargeWrites(t *testing.T) {
	fp, ok := newFourPaths(t, 256<<20)
	if !ok {
		return
	}
	att := fp.attach(t, "pv-cuts")
	finish, failed := fioRounds(t, 3*time.Minute, func(ctx context.Context, n int) (string, error) {
		return fioVerifyCtx(ctx, att.Device, 128<<20, n, "write", "1M")
	})

	p := faultPlan()
	killStop := make(chan struct{})
	kills := killer(t, fp.srv, p, killStop)
	cuts := 0
	for end := time.Now().Add(p.duration); time.Now().Before(end); cuts++ {
		path := 1 + cuts%len(fp.tp.Paths)
		fp.link(t, path, "down")
		time.Sleep(2 * time.Second)
		fp.link(t, path, "up")
		select {
		case f := <-failed:
			close(killStop)
			<-kills
			t.Fatalf("fio with path %d just cut and back: %s", path, f)
		case <-time.After(time.Second):
		}
	}
	close(killStop)
	nk := <-kills
	n := finish()
	if n == 0 || nk == 0 {
		t.Fatalf("%d fio rounds, %d SIGKILLs: the run proves nothing", n, nk)
	}
	h, err := fp.a.Health("pv-cuts")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d rounds of 128 MiB written in 1 MiB requests and verified across %d two-second path cuts and %d SIGKILLs of the server: 0 I/O errors, 0 verify failures; %d reconnects",
		n, cuts, nk, h.Reconnects)
}
