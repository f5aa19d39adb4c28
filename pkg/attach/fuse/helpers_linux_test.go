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

package fuse

import (
	"bytes"
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/blockdev"
	"github.com/mpnbd/mpnbd/pkg/mountinfo"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// requireFUSE skips unless FUSE and loop devices can be used.
func requireFUSE(t testing.TB) {
	t.Helper()
	if err := Available(); err != nil {
		t.Skipf("skipping: %v", err)
	}
}

func requireTool(t testing.TB, name string) {
	t.Helper()
	if _, err := exec.LookPath(name); err != nil {
		t.Skipf("skipping: %s not found: %v", name, err)
	}
}

// connCounter is a server Observer counting open connections per export,
// and every connection ever opened.
type connCounter struct {
	mu    sync.Mutex
	open  map[string]int
	total map[string]int
}

func (c *connCounter) ConnOpened(_ nbd.ConnInfo, export string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.open == nil {
		c.open = map[string]int{}
		c.total = map[string]int{}
	}
	c.open[export]++
	c.total[export]++
}

// opened is the number of connections to export opened so far.
func (c *connCounter) opened(export string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.total[export]
}

func (c *connCounter) ConnClosed(_ nbd.ConnInfo, export string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.open[export]--
}

func (c *connCounter) Request(string, uint16, int, time.Duration, uint32) {}

func (c *connCounter) count(export string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.open[export]
}

// waitConns waits for the server to report want connections to export.
func (c *connCounter) waitConns(t testing.TB, export string, want int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for c.count(export) != want {
		if time.Now().After(deadline) {
			t.Fatalf("server has %d connections to %q, want %d", c.count(export), export, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

type testServer struct {
	srv     *nbd.Server
	addr    string
	conns   *connCounter
	backend *nbd.MemBackend
}

// serveMem serves a memory export named "vol" on l.
func serveMem(t testing.TB, l net.Listener, size int64) *testServer {
	t.Helper()
	ts := &testServer{conns: &connCounter{}, backend: nbd.NewMemBackend(size), addr: l.Addr().String()}
	ts.srv = &nbd.Server{Observer: ts.conns}
	if err := ts.srv.AddExport(&nbd.Export{Name: "vol", Backend: ts.backend}); err != nil {
		t.Fatal(err)
	}
	go ts.srv.Serve(l)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		ts.srv.Shutdown(ctx) // the last one, after a restart
	})
	return ts
}

// stop shuts the server down hard: its connections close at once.
func (ts *testServer) stop() {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	ts.srv.Shutdown(ctx)
}

// restart serves the same backend again on the same address.
func (ts *testServer) restart(t testing.TB) {
	t.Helper()
	var l net.Listener
	var err error
	for i := 0; i < 100; i++ {
		if l, err = mptcp.Listen(context.Background(), "tcp", ts.addr, mptcp.Available() == nil); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("listen again on %s: %v", ts.addr, err)
	}
	ts.srv = &nbd.Server{Observer: ts.conns}
	if err := ts.srv.AddExport(&nbd.Export{Name: "vol", Backend: ts.backend}); err != nil {
		t.Fatal(err)
	}
	go ts.srv.Serve(l)
}

// localServer serves on the loopback address, with MPTCP when the host
// has it.
func localServer(t testing.TB, size int64) *testServer {
	t.Helper()
	l, err := mptcp.Listen(context.Background(), "tcp", "127.0.0.1:0", mptcp.Available() == nil)
	if err != nil {
		t.Fatal(err)
	}
	return serveMem(t, l, size)
}

// newAttacher returns an attacher with a fresh state directory (unless c
// names one) that detaches everything it still holds, or finds in its
// state directory, when the test ends.
func newAttacher(t testing.TB, c Config) *Attacher {
	t.Helper()
	if c.StateDir == "" {
		c.StateDir = filepath.Join(t.TempDir(), "state")
	}
	a := New(c)
	t.Cleanup(func() {
		ids := map[string]bool{}
		a.mu.Lock()
		for id := range a.servers {
			ids[id] = true
		}
		a.mu.Unlock()
		for _, st := range serverStates(t, a.cfg.StateDir) {
			ids[st.VolumeID] = true
		}
		for id := range ids {
			if err := a.Detach(context.Background(), id); err != nil {
				t.Errorf("cleanup: detach %s: %v", id, err)
			}
		}
		for _, st := range serverStates(t, a.cfg.StateDir) {
			if attach.ProcAlive(st.Pid, st.StartTime) {
				t.Errorf("cleanup: killing the server process %d of volume %s", st.Pid, st.VolumeID)
				if err := killProc(st.Pid, st.StartTime); err != nil {
					t.Errorf("cleanup: kill %d: %v", st.Pid, err)
				}
			}
		}
	})
	return a
}

// serverStates returns the state files in a state directory.
func serverStates(t testing.TB, dir string) []*serverState {
	t.Helper()
	names, _ := filepath.Glob(filepath.Join(dir, "*.json"))
	var out []*serverState
	for _, n := range names {
		if st, err := readState(n); err == nil {
			out = append(out, st)
		}
	}
	return out
}

// serverPid returns the pid of the volume's server process, from its
// state file.
func serverPid(t testing.TB, a *Attacher, volumeID string) int {
	t.Helper()
	st, err := readState(a.statePath(volumeID))
	if err != nil {
		t.Fatalf("state of volume %s: %v", volumeID, err)
	}
	if !st.Ready || st.Pid <= 0 {
		t.Fatalf("state of volume %s: %+v", volumeID, st)
	}
	return st.Pid
}

// liveServers lists the server processes of this test binary that run
// (zombies aside).
func liveServers(t testing.TB) []int {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	var out []int
	for _, d := range dirs {
		pid, err := strconv.Atoi(filepath.Base(d))
		if err != nil || pid == os.Getpid() {
			continue
		}
		if l, err := os.Readlink(filepath.Join(d, "exe")); err != nil || l != exe {
			continue
		}
		cmd, err := os.ReadFile(filepath.Join(d, "cmdline"))
		if err != nil || !bytes.Contains(cmd, []byte("\x00"+ServeArg+"\x00")) {
			continue
		}
		if attach.ProcAlive(pid, 0) {
			out = append(out, pid)
		}
	}
	return out
}

// waitGone waits for process pid to stop running.
func waitGone(t testing.TB, pid int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for attach.ProcAlive(pid, 0) {
		if time.Now().After(deadline) {
			t.Fatalf("process %d still runs", pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// mountsUnder lists the mount points at or below dir.
func mountsUnder(t testing.TB, dir string) []string {
	t.Helper()
	mps, err := mountinfo.Under(dir)
	if err != nil {
		t.Fatal(err)
	}
	return mps
}

// assertNothingLeft checks that a volume left no mount, mount point, loop
// device or server connection behind.
func assertNothingLeft(t testing.TB, a *Attacher, volumeID string, ts *testServer) {
	t.Helper()
	dir, file := a.paths(volumeID)
	if m := mountsUnder(t, a.cfg.StateDir); len(m) != 0 {
		t.Errorf("mounts left under the state dir: %v", m)
	}
	if _, err := os.Lstat(dir); !os.IsNotExist(err) {
		t.Errorf("mount point %s left behind (%v)", dir, err)
	}
	devs, err := blockdev.FindLoopByBackingFile(file)
	if err != nil {
		t.Fatal(err)
	}
	if len(devs) != 0 {
		t.Errorf("loop devices left on %s: %v", file, devs)
	}
	if _, err := exec.LookPath("losetup"); err == nil {
		out, err := exec.Command("losetup", "-j", file).CombinedOutput()
		if err != nil || len(strings.TrimSpace(string(out))) != 0 {
			t.Errorf("losetup -j %s: %q, %v", file, out, err)
		}
	}
	if ts != nil {
		ts.conns.waitConns(t, "vol", 0)
	}
	if _, err := a.Health(volumeID); err == nil {
		t.Errorf("Health of a detached volume succeeds")
	}
	name := volumeName(volumeID)
	for _, p := range []string{a.lockPath(volumeID), a.statePath(volumeID), a.sockPath(volumeID)} {
		if _, err := os.Lstat(p); !os.IsNotExist(err) {
			t.Errorf("%s left behind (%v)", p, err)
		}
	}
	if left, _ := filepath.Glob(filepath.Join(a.stateDir(), name+".*")); len(left) != 0 {
		t.Errorf("files of the volume left behind: %v", left)
	}
	if pids := liveServers(t); len(pids) != 0 {
		t.Errorf("server processes left: %v", pids)
	}
	a.mu.Lock()
	_, known := a.servers[volumeID]
	a.mu.Unlock()
	if known {
		t.Errorf("the attacher still knows a server of volume %s", volumeID)
	}
}

func target(id, addr string) attach.Target {
	return attach.Target{VolumeID: id, Export: "vol", Addrs: []string{addr}}
}

// mountNS runs functions on one OS thread that has a private mount
// namespace of its own. File systems mounted there are invisible to the
// rest of the host, so namespaces other processes create meanwhile (ip
// netns exec, unshare) do not copy them and keep them busy after the
// unmount.
type mountNS struct {
	fns  chan func()
	done chan struct{}
}

func newMountNS(t testing.TB) *mountNS {
	t.Helper()
	ns := &mountNS{fns: make(chan func()), done: make(chan struct{})}
	ready := make(chan error, 1)
	go func() {
		// The thread is never unlocked: it exits with the goroutine
		// instead of going back to the runtime in another namespace.
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
			ready <- err
			return
		}
		if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
			ready <- err
			return
		}
		ready <- nil
		for {
			select {
			case fn := <-ns.fns:
				fn()
			case <-ns.done:
				return
			}
		}
	}()
	if err := <-ready; err != nil {
		t.Fatalf("private mount namespace: %v", err)
	}
	t.Cleanup(func() { close(ns.done) })
	return ns
}

// do runs fn in the namespace and returns its error.
func (ns *mountNS) do(fn func() error) error {
	errc := make(chan error, 1)
	ns.fns <- func() { errc <- fn() }
	return <-errc
}
