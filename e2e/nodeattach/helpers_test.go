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

// Package nodeattach tests attaching exports as /dev/nbdX for real. The
// tests need the kernel's nbd driver, which the development machines lack,
// so the host test boots a VM with a Debian kernel and runs the guest tests
// (MPNBD_IN_VM=1) inside it: our server in one network namespace, the
// attaching side in the initial one (the nbd netlink family of 6.1 is not
// netns-aware), joined by several veth paths.
package nodeattach

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/attach/nbddev"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
	"github.com/mpnbd/mpnbd/pkg/nbd/nbdnl"
)

func requireGuest(t *testing.T) {
	t.Helper()
	if os.Getenv("MPNBD_IN_VM") != "1" {
		t.Skip("runs inside the test VM only (TestNodeAttachInVM boots it)")
	}
}

func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelInfo}))
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// storage is our NBD server in the topology's server namespace, backed by a
// sparse file that outlives server restarts.
type storage struct {
	t       *testing.T
	tp      *topo.Topology
	path    string
	size    int64
	addr    string
	useMP   bool
	srv     *nbd.Server
	backend *nbd.FileBackend
	log     connLog
}

// connLog records the connections a server opened and closed, by the
// client's address.
type connLog struct {
	mu             sync.Mutex
	opened, closed []string
}

func (l *connLog) ConnOpened(c nbd.ConnInfo, _ string) {
	l.mu.Lock()
	l.opened = append(l.opened, c.RemoteAddr.String())
	l.mu.Unlock()
}

func (l *connLog) ConnClosed(c nbd.ConnInfo, _ string) {
	l.mu.Lock()
	l.closed = append(l.closed, c.RemoteAddr.String())
	l.mu.Unlock()
}

func (l *connLog) Request(string, uint16, int, time.Duration, uint32) {}

func (l *connLog) snapshot() (opened, closed []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.opened...), append([]string(nil), l.closed...)
}

func newStorage(t *testing.T, tp *topo.Topology, size int64, useMPTCP bool) *storage {
	st := &storage{t: t, tp: tp, path: filepath.Join(t.TempDir(), "vol.img"), size: size, useMP: useMPTCP}
	b, err := nbd.OpenFile(st.path, size, true, false)
	if err != nil {
		t.Fatal(err)
	}
	st.backend = b
	st.start("0")
	t.Cleanup(func() {
		st.stop(true)
		st.backend.Close()
	})
	return st
}

func (st *storage) start(port string) {
	st.t.Helper()
	s := &nbd.Server{Logger: testLogger(st.t), Observer: &st.log}
	// The node service opens "vol" with its node token and an epoch in
	// the name (access.ExportName), as a storage agent serves it.
	s.Resolve = func(_ nbd.ConnInfo, name string) (nbd.Grant, error) {
		if v, _, _, ok := access.ParseExport(name); ok && v == "vol" {
			return nbd.Grant{Export: "vol"}, nil
		}
		return nbd.Grant{}, fmt.Errorf("%w: %q", nbd.ErrUnknownExport, name)
	}
	if err := s.AddExport(&nbd.Export{Name: "vol", Backend: st.backend}); err != nil {
		st.t.Fatal(err)
	}
	var l net.Listener
	err := st.tp.InServer(func() error {
		var err error
		// Several attempts: a restarted server may find its port in TIME_WAIT.
		for i := 0; i < 50; i++ {
			l, err = mptcp.Listen(context.Background(), "tcp", net.JoinHostPort("0.0.0.0", port), st.useMP)
			if err == nil {
				return nil
			}
			time.Sleep(100 * time.Millisecond)
		}
		return err
	})
	if err != nil {
		st.t.Fatalf("listen: %v", err)
	}
	go s.Serve(l)
	st.srv = s
	_, p, _ := net.SplitHostPort(l.Addr().String())
	st.addr = net.JoinHostPort(st.tp.ServerAddr(1).String(), p)
}

// stop shuts the server down; hard closes connections at once, the way a
// crash would.
func (st *storage) stop(hard bool) {
	if st.srv == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	if hard {
		cancel()
	} else {
		defer cancel()
	}
	st.srv.Shutdown(ctx)
	st.srv = nil
}

func (st *storage) restart() {
	_, port, _ := net.SplitHostPort(st.addr)
	st.stop(true)
	time.Sleep(300 * time.Millisecond)
	st.start(port)
}

func (st *storage) target(id string) attach.Target {
	var srv, cli []string
	for i := range st.tp.Paths {
		_, port, _ := net.SplitHostPort(st.addr)
		srv = append(srv, net.JoinHostPort(st.tp.ServerAddr(i+1).String(), port))
		cli = append(cli, st.tp.ClientAddr(i+1).String())
	}
	return attach.Target{VolumeID: id, Export: "vol", Addrs: srv, LocalAddrs: cli}
}

func (st *storage) conns() int {
	if st.srv == nil {
		return 0
	}
	e, ok := st.srv.Export("vol")
	if !ok {
		return 0
	}
	return e.ConnCount()
}

// detach detaches a volume at the end of a test (deferred); one the test
// detached already is no error.
func detach(t *testing.T, a *nbddev.Attacher, id string) {
	t.Helper()
	if err := a.Detach(context.Background(), id); err != nil {
		t.Errorf("detach %s: %v", id, err)
	}
}

// newAttacher makes an attacher of this process, which is the client host
// of the guest's topologies (see guestTopology).
func newAttacher(t *testing.T, tp *topo.Topology, mode attach.Transport) (*nbddev.Attacher, *nbdnl.Client) {
	t.Helper()
	nl, err := nbdnl.Dial()
	if err != nil {
		t.Fatalf("nbd netlink: %v", err)
	}
	t.Cleanup(func() { nl.Close() })
	a, err := nbddev.New(nbddev.Config{
		Mode:    mode,
		Kernel:  nl,
		Devices: nbdnl.Sysfs{Root: "/sys"},
		Logger:  testLogger(t),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Close)
	return a, nl
}

func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// writeRandomFile writes n random bytes to path with fsync and returns
// their sha256.
func writeRandomFile(t *testing.T, path string, n int64) string {
	t.Helper()
	sum, err := writeRandomFileErr(path, n)
	if err != nil {
		t.Fatal(err)
	}
	return sum
}

func writeRandomFileErr(path string, n int64) (string, error) {
	f, err := os.Create(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.CopyN(io.MultiWriter(f, h), rand.Reader, n); err != nil {
		return "", err
	}
	if err := f.Sync(); err != nil {
		return "", fmt.Errorf("fsync: %w", err)
	}
	if err := f.Close(); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

func fileSum(t *testing.T, path string) string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatalf("read %s: %v", path, err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// mkfsMountWrite formats dev, mounts it, writes a file and unmounts.
func mkfsMountWrite(t *testing.T, dev string, n int64) string {
	t.Helper()
	run(t, "mkfs.ext4", "-q", "-F", dev)
	mnt := t.TempDir()
	run(t, "mount", dev, mnt)
	sum := writeRandomFile(t, filepath.Join(mnt, "data"), n)
	run(t, "umount", mnt)
	return sum
}

func mountAndSum(t *testing.T, dev string) string {
	t.Helper()
	mnt := t.TempDir()
	run(t, "mount", dev, mnt)
	defer run(t, "umount", mnt)
	return fileSum(t, filepath.Join(mnt, "data"))
}

// nbdDevicesConnected lists connected nbd devices according to the kernel.
func nbdDevicesConnected(t *testing.T, nl *nbdnl.Client) []uint32 {
	t.Helper()
	all, err := nl.StatusAll()
	if err != nil {
		t.Fatal(err)
	}
	var out []uint32
	for _, d := range all {
		if d.Connected {
			out = append(out, d.Index)
		}
	}
	return out
}

// waitGone waits until no nbd device is connected and the server has no
// connection left.
func waitGone(t *testing.T, nl *nbdnl.Client, st *storage) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		devs := nbdDevicesConnected(t, nl)
		n := st.conns()
		if len(devs) == 0 && n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("left behind: connected nbd devices %v, server connections %d", devs, n)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func volID(t *testing.T) string {
	return fmt.Sprintf("pvc-%s-%d", strings.ToLower(strings.ReplaceAll(t.Name(), "/", "-")), time.Now().UnixNano()%100000)
}
