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
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/blockdev"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// fourPaths builds the 4-path topology, serves a memory export of size
// bytes from the server namespace and returns an attacher whose server
// processes run in the client's network namespace (nsenter --net, which
// leaves the mount namespace alone). Only the sockets live in the
// namespaces: the FUSE mount and the loop device are the host's.
func fourPaths(t testing.TB, prefix string, size int64) (*topo.Topology, *testServer, *Attacher) {
	t.Helper()
	requireFUSE(t)
	requireTool(t, "nsenter")
	tp := topo.NewForTest(t, topo.Default4(topo.UniqueName(prefix)))
	if err := mptcp.Available(); err != nil {
		t.Skipf("skipping: MPTCP unavailable: %v", err)
	}
	var l net.Listener
	err := tp.InServer(func() error {
		var err error
		l, err = mptcp.Listen(context.Background(), "tcp", net.JoinHostPort(tp.ServerAddr(1).String(), "0"), true)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	ts := serveMem(t, l, size)
	a := newAttacher(t, Config{ServeCommand: inClientServe(t, tp)})
	return tp, ts, a
}

// inClientServe is a ServeCommand whose server processes run in the
// topology's client network namespace (nsenter --net, which leaves the
// mount namespace alone).
func inClientServe(t testing.TB, tp *topo.Topology) []string {
	t.Helper()
	requireTool(t, "nsenter")
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return []string{"nsenter", "--net=/run/netns/" + tp.ClientNS, "--", exe, ServeArg}
}

func run(t testing.TB, name string, args ...string) {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %v: %v\n%s", name, args, err, out)
	}
}

// The ext4 file system is mounted in a private mount namespace (see
// mountNS) so that concurrent namespace creation elsewhere on the host
// cannot keep it, and so the loop device, busy after the unmount.

func mountExt4(ns *mountNS, dev string, mnt string) error {
	return ns.do(func() error { return unix.Mount(dev, mnt, "ext4", 0, "") })
}

func unmountExt4(ns *mountNS, mnt string) error {
	return ns.do(func() error { return unix.Unmount(mnt, 0) })
}

// TestExt4OverFourPaths puts ext4 on a FUSE-attached volume carried by one
// MPTCP connection with a subflow on each of 4 paths, writes 200 MiB,
// detaches, attaches again and reads everything back bit-exact.
func TestExt4OverFourPaths(t *testing.T) {
	requireTool(t, "mkfs.ext4")
	_, ts, a := fourPaths(t, "fu", 512<<20)
	ns := newMountNS(t)
	mnt := t.TempDir()
	// A safety net: the test unmounts it (and this fails, EINVAL).
	t.Cleanup(func() { _ = unmountExt4(ns, mnt) })
	ctx := context.Background()
	const vol = "pv-ext4"

	att, err := a.Attach(ctx, target(vol, ts.addr), attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if !att.MPTCP {
		t.Fatalf("attachment %+v does not run MPTCP", att)
	}
	run(t, "mkfs.ext4", "-q", "-F", att.Device)
	if err := mountExt4(ns, att.Device, mnt); err != nil {
		t.Fatal(err)
	}

	const files, fileSize = 50, 4 << 20 // 200 MiB
	sums := make(map[string][32]byte)
	start := time.Now()
	err = ns.do(func() error {
		buf := make([]byte, fileSize)
		for i := 0; i < files; i++ {
			rand.Read(buf)
			name := fmt.Sprintf("f%02d", i)
			if err := os.WriteFile(filepath.Join(mnt, name), buf, 0o600); err != nil {
				return err
			}
			sums[name] = sha256.Sum256(buf)
		}
		unix.Sync()
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("wrote %d MiB through ext4 in %v", files*fileSize>>20, time.Since(start).Round(time.Millisecond))
	if err := unmountExt4(ns, mnt); err != nil {
		t.Fatal(err)
	}
	if err := a.Detach(ctx, vol); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, a, vol, ts)

	att, err = a.Attach(ctx, target(vol, ts.addr), attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := mountExt4(ns, att.Device, mnt); err != nil {
		t.Fatal(err)
	}
	start = time.Now()
	err = ns.do(func() error {
		for name, want := range sums {
			f, err := os.Open(filepath.Join(mnt, name))
			if err != nil {
				return err
			}
			h := sha256.New()
			_, err = io.Copy(h, f)
			f.Close()
			if err != nil {
				return err
			}
			var got [32]byte
			h.Sum(got[:0])
			if got != want {
				return fmt.Errorf("%s: sha256 differs after reattach", name)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("verified %d files in %v", len(sums), time.Since(start).Round(time.Millisecond))

	// The subflows join while data moves; by now all 4 paths are up.
	var h attach.Health
	deadline := time.Now().Add(10 * time.Second)
	for {
		h, err = a.Health(vol)
		if err != nil {
			t.Fatal(err)
		}
		if len(h.Subflows) == 1 && h.Subflows[0] == 4 || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("health: %+v", h)
	if !h.Connected || !h.MPTCP || len(h.Subflows) != 1 || h.Subflows[0] != 4 {
		t.Errorf("health %+v: want connected over MPTCP with 4 subflows", h)
	}

	// Detach is refused while the file system is mounted, and changes
	// nothing.
	a.cfg.UnmountTimeout = 200 * time.Millisecond
	if err := a.Detach(ctx, vol); !errors.Is(err, blockdev.ErrLoopBusy) {
		t.Fatalf("detach with ext4 mounted: %v, want ErrLoopBusy", err)
	}
	a.cfg.UnmountTimeout = 0
	a.cfg = a.cfg.withDefaults()
	if err := ns.do(func() error { _, err := os.ReadFile(filepath.Join(mnt, "f00")); return err }); err != nil {
		t.Fatalf("read after the refused detach: %v", err)
	}
	if h, err := a.Health(vol); err != nil || !h.Connected {
		t.Fatalf("health after the refused detach: %+v, %v", h, err)
	}

	if err := unmountExt4(ns, mnt); err != nil {
		t.Fatal(err)
	}
	if err := a.Detach(ctx, vol); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, a, vol, ts)
}

// TestAttachFirstPathDown: the first storage address's path is down (its
// server-side link dropped, so connections to it time out rather than
// fail) before the attach: the volume attaches over another address, its
// I/O works, and the session keeps that address for redials.
func TestAttachFirstPathDown(t *testing.T) {
	requireFUSE(t)
	if err := mptcp.Available(); err != nil {
		t.Skipf("skipping: MPTCP unavailable: %v", err)
	}
	tp := topo.NewForTest(t, topo.Default4(topo.UniqueName("fd")))
	var l net.Listener
	if err := tp.InServer(func() error {
		var err error
		l, err = mptcp.Listen(context.Background(), "tcp", "0.0.0.0:0", true)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	ts := serveMem(t, l, 64<<20)
	_, port, _ := net.SplitHostPort(ts.addr)
	var addrs []string
	for i := range tp.Paths {
		addrs = append(addrs, net.JoinHostPort(tp.ServerAddr(i+1).String(), port))
	}
	if out, err := topo.Exec(tp.ServerNS, "ip", "link", "set", tp.Paths[0].ServerIf, "down").CombinedOutput(); err != nil {
		t.Fatalf("path 1 down: %v: %s", err, out)
	}
	a := newAttacher(t, Config{ServeCommand: inClientServe(t, tp)})
	start := time.Now()
	att, err := a.Attach(context.Background(), attach.Target{VolumeID: "pv-firstdown", Export: "vol", Addrs: addrs}, attach.Options{})
	if err != nil {
		t.Fatalf("attach with the first path down: %v", err)
	}
	t.Logf("attached in %v with %s down", time.Since(start).Round(time.Millisecond), addrs[0])
	want := alignedBuf(1 << 20)
	for i := range want {
		want[i] = byte(i * 7)
	}
	f := openDirect(t, att.Device, os.O_RDWR)
	if _, err := f.WriteAt(want, 0); err != nil {
		t.Fatal(err)
	}
	got := alignedBuf(len(want))
	if _, err := f.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if !bytes.Equal(got, want) {
		t.Fatal("data read back differs")
	}
	if err := a.Detach(context.Background(), "pv-firstdown"); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, a, "pv-firstdown", ts)
}
