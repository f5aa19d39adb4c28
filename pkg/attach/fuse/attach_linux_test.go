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
	"errors"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/blockdev"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// alignedBuf returns a zeroed buffer of n bytes aligned for O_DIRECT.
func alignedBuf(n int) []byte {
	const align = 4096
	b := make([]byte, n+align)
	off := int(uintptr(unsafe.Pointer(&b[0])) & (align - 1))
	if off != 0 {
		off = align - off
	}
	return b[off : off+n]
}

func openDirect(t testing.TB, dev string, flag int) *os.File {
	t.Helper()
	f, err := os.OpenFile(dev, flag|unix.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func TestAttachLocal(t *testing.T) {
	requireFUSE(t)
	const size = 64 << 20
	ts := localServer(t, size)
	a := newAttacher(t, Config{})
	ctx := context.Background()

	resetFreeLoopQueues(t)
	att, err := a.Attach(ctx, target("pv-local", ts.addr), attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if att.Transport != attach.FUSE || att.VolumeID != "pv-local" || !strings.HasPrefix(att.Device, "/dev/loop") || att.Size != size {
		t.Fatalf("attachment %+v", att)
	}
	st, err := blockdev.StatLoop(att.Device)
	if err != nil {
		t.Fatal(err)
	}
	if !st.DirectIO {
		t.Errorf("loop device without direct I/O: %+v", st)
	}
	_, file := a.paths("pv-local")
	if st.BackingFile != file {
		t.Errorf("backing file %q, want %q", st.BackingFile, file)
	}
	checkQueue(t, att.Device)
	ts.conns.waitConns(t, "vol", 1)
	checkServerProcess(t, a, "pv-local")

	// Same volume again: the same attachment, no second connection.
	again, err := a.Attach(ctx, target("pv-local", ts.addr), attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if *again != *att {
		t.Fatalf("second attach %+v, first %+v", again, att)
	}
	ts.conns.waitConns(t, "vol", 1)

	// Direct I/O on the device reaches the export.
	want := alignedBuf(4 << 20)
	rand.Read(want)
	f := openDirect(t, att.Device, os.O_RDWR)
	if _, err := f.WriteAt(want, 1<<20); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	got := alignedBuf(len(want))
	if _, err := f.ReadAt(got, 1<<20); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if !bytes.Equal(got, want) {
		t.Fatal("read back through the device differs")
	}
	direct := make([]byte, len(want))
	if _, err := ts.backend.ReadAt(direct, 1<<20); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(direct, want) {
		t.Fatal("the export does not hold what was written to the device")
	}

	// Discard and write-zeroes reach the export as zeroes.
	f = openDirect(t, att.Device, os.O_RDWR)
	rng := [2]uint64{1 << 20, 1 << 20}
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.BLKZEROOUT, uintptr(unsafe.Pointer(&rng[0]))); e != 0 {
		t.Fatalf("BLKZEROOUT: %v", e)
	}
	rng = [2]uint64{2 << 20, 1 << 20}
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.BLKDISCARD, uintptr(unsafe.Pointer(&rng[0]))); e != 0 {
		t.Fatalf("BLKDISCARD: %v", e)
	}
	f.Close()
	if _, err := ts.backend.ReadAt(direct, 1<<20); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(direct[:2<<20], make([]byte, 2<<20)) {
		t.Error("zeroed and discarded ranges do not read back as zeroes")
	}
	if !bytes.Equal(direct[2<<20:], want[2<<20:]) {
		t.Error("data next to the zeroed ranges changed")
	}

	h, err := a.Health("pv-local")
	if err != nil {
		t.Fatal(err)
	}
	if !h.Connected {
		t.Errorf("health %+v: not connected", h)
	}
	if h.MPTCP != att.MPTCP || att.MPTCP && len(h.Subflows) != 1 {
		t.Errorf("health %+v for attachment %+v", h, att)
	}
	t.Logf("health: %+v", h)

	// Grow the export, then the device.
	if err := ts.backend.Resize(size * 2); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Resize(ctx, "pv-local", size*4); !errors.Is(err, attach.ErrTooSmall) {
		t.Error("Resize past the export's size succeeds")
	}
	n, err := a.Resize(ctx, "pv-local", size*2)
	if err != nil {
		t.Fatal(err)
	}
	if n != size*2 {
		t.Fatalf("size after resize %d, want %d", n, size*2)
	}
	if n, err := blockdev.DeviceSize(att.Device); err != nil || n != size*2 {
		t.Fatalf("device size after resize %d, %v", n, err)
	}
	checkQueue(t, att.Device)
	// The new end is writable.
	f = openDirect(t, att.Device, os.O_RDWR)
	if _, err := f.WriteAt(want[:1<<20], size*2-(1<<20)); err != nil {
		t.Fatalf("write at the new end: %v", err)
	}
	f.Close()
	ts.conns.waitConns(t, "vol", 1)

	if err := a.Detach(ctx, "pv-local"); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, a, "pv-local", ts)
	if err := a.Detach(ctx, "pv-local"); err != nil {
		t.Errorf("second detach: %v", err)
	}
	if err := a.Detach(ctx, "never-attached"); err != nil {
		t.Errorf("detach of an unknown volume: %v", err)
	}
}

// checkQueue fails the test unless the loop device dev sends requests of
// at most the largest FUSE request and reads ahead four of them.
func checkQueue(t *testing.T, dev string) {
	t.Helper()
	q, err := blockdev.StatQueue(dev)
	if err != nil {
		t.Fatal(err)
	}
	if want := (blockdev.QueueLimits{MaxSectorsKB: DefaultMaxWrite >> 10, ReadAheadKB: 4 * DefaultMaxWrite >> 10}); q != want {
		t.Errorf("loop device %s: queue %+v, want %+v", dev, q, want)
	}
}

// resetFreeLoopQueues gives every unbound loop device the request size
// and readahead a new device has, so that
// checkQueue sees what the attach set, not what an earlier user of the
// device left behind (binding a loop device does not reset them).
func resetFreeLoopQueues(t *testing.T) {
	t.Helper()
	dirs, err := filepath.Glob("/sys/block/loop*")
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "loop", "backing_file")); err == nil {
			continue
		}
		// The largest request size the device takes, and the kernel's
		// default readahead.
		if err := blockdev.SetQueueLimits("/dev/"+filepath.Base(d), blockdev.QueueLimits{MaxSectorsKB: math.MaxUint32, ReadAheadKB: 128}); err != nil {
			t.Fatal(err)
		}
	}
}

// TestAttachConcurrent attaches one volume from several goroutines: one
// attachment, one connection.
func TestAttachConcurrent(t *testing.T) {
	requireFUSE(t)
	ts := localServer(t, 16<<20)
	a := newAttacher(t, Config{})
	const n = 4
	devs := make(chan string, n)
	errs := make(chan error, n)
	for i := 0; i < n; i++ {
		go func() {
			att, err := a.Attach(context.Background(), target("pv-conc", ts.addr), attach.Options{})
			if err != nil {
				errs <- err
				return
			}
			devs <- att.Device
		}()
	}
	var first string
	for i := 0; i < n; i++ {
		select {
		case err := <-errs:
			t.Fatal(err)
		case d := <-devs:
			if first == "" {
				first = d
			} else if d != first {
				t.Fatalf("concurrent attaches got %s and %s", first, d)
			}
		}
	}
	ts.conns.waitConns(t, "vol", 1)
	if err := a.Detach(context.Background(), "pv-conc"); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, a, "pv-conc", ts)
}

// TestServerGoneAndBack: with the server gone, I/O on the device waits
// (no error) and health says so; when a server is back on the address the
// I/O completes with the right data. With deadConnTimeout bounded, I/O
// fails instead once it passed, and works again once the server is back.
func TestServerGoneAndBack(t *testing.T) {
	requireFUSE(t)
	for _, bounded := range []bool{false, true} {
		t.Run(map[bool]string{false: "hard", true: "bounded"}[bounded], func(t *testing.T) {
			ts := localServer(t, 16<<20)
			want := bytes.Repeat([]byte{0x5a}, 4096)
			if _, err := ts.backend.WriteAt(want, 0); err != nil {
				t.Fatal(err)
			}
			a := newAttacher(t, Config{})
			o := attach.Options{}
			if bounded {
				o.DeadConnTimeout = 500 * time.Millisecond
			}
			att, err := a.Attach(context.Background(), target("pv-gone", ts.addr), o)
			if err != nil {
				t.Fatal(err)
			}
			ts.stop()
			f := openDirect(t, att.Device, os.O_RDONLY)
			defer f.Close()
			got := alignedBuf(4096)
			res := make(chan error, 1)
			go func() { _, err := f.ReadAt(got, 0); res <- err }()
			if bounded {
				select {
				case err := <-res:
					if err == nil {
						t.Fatal("read succeeds with the server gone past deadConnTimeout")
					}
				case <-time.After(20 * time.Second):
					t.Fatal("read still waits long past a bounded deadConnTimeout")
				}
				if h, err := a.Health("pv-gone"); err != nil || !h.Failing || !strings.Contains(h.Message, "I/O fails") {
					t.Errorf("health past the bounded wait: %+v, %v", h, err)
				}
				ts.restart(t)
				deadline := time.Now().Add(20 * time.Second)
				for {
					_, err := f.ReadAt(got, 0)
					if err == nil {
						break
					}
					if time.Now().After(deadline) {
						t.Fatalf("reads still fail 20s after the server came back: %v", err)
					}
					time.Sleep(50 * time.Millisecond)
				}
				if !bytes.Equal(got, want) {
					t.Fatal("read after the outage returned the wrong data")
				}
				f.Close()
				if err := a.Detach(context.Background(), "pv-gone"); err != nil {
					t.Fatal(err)
				}
				assertNothingLeft(t, a, "pv-gone", ts)
				return
			}
			select {
			case err := <-res:
				t.Fatalf("read returned (%v) with the server gone: it must wait", err)
			case <-time.After(time.Second):
			}
			if h, err := a.Health("pv-gone"); err != nil || h.Connected || h.Message == "" {
				t.Errorf("health with the server gone: %+v, %v", h, err)
			}
			ts.restart(t)
			select {
			case err := <-res:
				if err != nil {
					t.Fatalf("read after the server came back: %v", err)
				}
			case <-time.After(20 * time.Second):
				t.Fatal("read did not complete after the server came back")
			}
			if !bytes.Equal(got, want) {
				t.Fatal("read after the outage returned the wrong data")
			}
			if h, _ := a.Health("pv-gone"); !h.Connected || h.Reconnects == 0 {
				t.Errorf("health after the outage: %+v", h)
			}
			f.Close()
			if err := a.Detach(context.Background(), "pv-gone"); err != nil {
				t.Fatal(err)
			}
			assertNothingLeft(t, a, "pv-gone", ts)
		})
	}
}

func TestAttachReadOnly(t *testing.T) {
	requireFUSE(t)
	ts := localServer(t, 16<<20)
	a := newAttacher(t, Config{})
	att, err := a.Attach(context.Background(), target("pv-ro", ts.addr), attach.Options{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	st, err := blockdev.StatLoop(att.Device)
	if err != nil || !st.ReadOnly {
		t.Fatalf("loop status %+v, %v: want read-only", st, err)
	}
	_, file := a.paths("pv-ro")
	if f, err := os.OpenFile(file, os.O_RDWR, 0); err == nil {
		f.Close()
		t.Error("export file of a read-only volume opens for writing")
	}
	if err := a.Detach(context.Background(), "pv-ro"); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, a, "pv-ro", ts)
}

func TestAttachUnknownExport(t *testing.T) {
	requireFUSE(t)
	ts := localServer(t, 16<<20)
	a := newAttacher(t, Config{})
	tg := target("pv-unknown", ts.addr)
	tg.Export = "no-such-export"
	_, err := a.Attach(context.Background(), tg, attach.Options{})
	if !errors.Is(err, attach.ErrServerRefused) {
		t.Fatalf("Attach to an unknown export: %v, want ErrServerRefused", err)
	}
	if !errors.Is(err, nbd.ErrUnknownExport) {
		t.Errorf("error %v does not wrap nbd.ErrUnknownExport", err)
	}
	assertNothingLeft(t, a, "pv-unknown", ts)
}

func TestAttachMountFails(t *testing.T) {
	requireFUSE(t)
	ts := localServer(t, 16<<20)

	// The state directory is a file: nothing can be mounted under it.
	notDir := filepath.Join(t.TempDir(), "state")
	if err := os.WriteFile(notDir, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	a := newAttacher(t, Config{StateDir: notDir})
	if _, err := a.Attach(context.Background(), target("pv-nodir", ts.addr), attach.Options{}); err == nil {
		t.Fatal("Attach with a file as state directory succeeds")
	}
	ts.conns.waitConns(t, "vol", 0)

	// The mount itself fails, after the dial: a file is where the mount
	// point goes before the attach, which leaves it alone (it is not
	// ours). The server process has dialed, and closes the connection
	// again.
	a = newAttacher(t, Config{})
	dir, _ := a.paths("pv-nomount")
	if err := os.MkdirAll(filepath.Dir(dir), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dir, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	dials := ts.conns.opened("vol")
	if _, err := a.Attach(context.Background(), target("pv-nomount", ts.addr), attach.Options{}); err == nil {
		t.Fatal("Attach succeeds although the mount point is a file")
	} else {
		t.Logf("attach error: %v", err)
	}
	if ts.conns.opened("vol") == dials {
		t.Fatal("the attach failed before dialling")
	}
	ts.conns.waitConns(t, "vol", 0)
	if m := mountsUnder(t, a.cfg.StateDir); len(m) != 0 {
		t.Errorf("mounts left: %v", m)
	}
	if st, err := os.Lstat(dir); err != nil || !st.Mode().IsRegular() {
		t.Errorf("the file at the mount point: %v, %v", st, err)
	}
	os.Remove(dir)
	assertNothingLeft(t, a, "pv-nomount", ts)
}

// TestAttachLoopFails makes the last step fail: the loop device cannot be
// made (block size the kernel refuses), and the mount and the connection
// made before it are undone.
func TestAttachLoopFails(t *testing.T) {
	requireFUSE(t)
	ts := localServer(t, 16<<20)
	a := newAttacher(t, Config{})
	_, err := a.Attach(context.Background(), target("pv-noloop", ts.addr), attach.Options{BlockSize: 3000})
	if err == nil {
		t.Fatal("Attach with an invalid block size succeeds")
	}
	t.Logf("attach error: %v", err)
	assertNothingLeft(t, a, "pv-noloop", ts)
}

// TestStaleAttachment leaves an attachment behind that no server process
// owns (no lock, socket or state file), with its mount still served and
// its loop device, and checks that a new Attacher cleans it up, both on
// Detach and on Attach (which then starts a server process).
func TestStaleAttachment(t *testing.T) {
	requireFUSE(t)
	ts := localServer(t, 16<<20)
	state := filepath.Join(t.TempDir(), "state")
	fresh := newAttacher(t, Config{StateDir: state})
	// leave serves the volume from this process, as a server process
	// does, but holds none of the files by which Attachers find one.
	leave := func() *volume {
		t.Helper()
		if err := os.MkdirAll(state, 0o700); err != nil {
			t.Fatal(err)
		}
		dir, file := fresh.paths("pv-stale")
		log := fresh.cfg.Logger.With("volume_id", "pv-stale")
		v, err := startVolume(context.Background(), fresh.cfg, target("pv-stale", ts.addr), attach.Options{}, dir, file, log)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	ctx := context.Background()

	v := leave()
	if err := fresh.Detach(ctx, "pv-stale"); err != nil {
		t.Fatalf("detach of a stale attachment: %v", err)
	}
	v.path.Close(time.Second)
	assertNothingLeft(t, fresh, "pv-stale", ts)

	v = leave()
	att, err := fresh.Attach(ctx, target("pv-stale", ts.addr), attach.Options{})
	if err != nil {
		t.Fatalf("attach over a stale attachment: %v", err)
	}
	v.path.Close(time.Second)
	ts.conns.waitConns(t, "vol", 1)
	f := openDirect(t, att.Device, os.O_RDONLY)
	if _, err := f.ReadAt(alignedBuf(4096), 0); err != nil {
		t.Fatalf("read after reattach: %v", err)
	}
	f.Close()
	if err := fresh.Detach(ctx, "pv-stale"); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, fresh, "pv-stale", ts)
}

func TestVolumeName(t *testing.T) {
	for id, want := range map[string]string{
		"pvc-0123-abcd": "pvc-0123-abcd",
		"a.b_c":         "a.b_c",
	} {
		if got := volumeName(id); got != want {
			t.Errorf("volumeName(%q) = %q, want %q", id, got, want)
		}
	}
	for _, id := range []string{"../x", "a/b", ".hidden", "", strings.Repeat("x", 200), "a b", "a.sock", "b.lock", "c.json", "d.json.tmp"} {
		got := volumeName(id)
		if !strings.HasPrefix(got, "v-") || strings.ContainsAny(got, "/ ") {
			t.Errorf("volumeName(%q) = %q", id, got)
		}
	}
	if volumeName("a/b") == volumeName("a/c") {
		t.Error("different IDs share a name")
	}
}

// TestMountOnFileUndone mounts on a regular file: the mount syscall
// succeeds (FUSE mounts files too) but the file system cannot serve a
// directory there, and the failed mount must not stay behind.
func TestMountOnFileUndone(t *testing.T) {
	requireFUSE(t)
	dir := t.TempDir()
	p := filepath.Join(dir, "file")
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := Config{}.withDefaults()
	node := &exportFile{log: cfg.Logger}
	srv, err := mountServer(p, node, "x", cfg, cfg.Logger)
	if err == nil {
		if err := srv.unmount(p); err != nil {
			t.Errorf("unmount: %v", err)
		}
		t.Fatal("mount on a file succeeds")
	}
	if m := mountsUnder(t, dir); len(m) != 0 {
		t.Fatalf("mounts left: %v", m)
	}
}

// TestDetachWithMountCopy detaches while another mount namespace holds a
// copy of the FUSE mount (as one made by `ip netns exec` or a container
// start would): the unmount here does not end the FUSE connection, so
// Detach aborts it rather than waiting for that namespace to go away.
func TestDetachWithMountCopy(t *testing.T) {
	requireFUSE(t)
	requireTool(t, "unshare")
	ts := localServer(t, 16<<20)
	a := newAttacher(t, Config{UnmountTimeout: 500 * time.Millisecond})
	if _, err := a.Attach(context.Background(), target("pv-copy", ts.addr), attach.Options{}); err != nil {
		t.Fatal(err)
	}
	dir, _ := a.paths("pv-copy")
	holder := exec.Command("unshare", "--mount", "--propagation", "private", "sleep", "60")
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		holder.Process.Kill()
		holder.Wait()
	}()
	// Wait until the copy exists in the holder's namespace.
	deadline := time.Now().Add(5 * time.Second)
	for {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", holder.Process.Pid))
		if bytes.Contains(b, []byte(dir)) && !bytes.Equal(mustReadlink(t, holder.Process.Pid), mustReadlink(t, os.Getpid())) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the holder's mount namespace never showed the FUSE mount")
		}
		time.Sleep(10 * time.Millisecond)
	}
	start := time.Now()
	if err := a.Detach(context.Background(), "pv-copy"); err != nil {
		t.Fatal(err)
	}
	t.Logf("detach took %v", time.Since(start).Round(time.Millisecond))
	assertNothingLeft(t, a, "pv-copy", ts)
}

func mustReadlink(t *testing.T, pid int) []byte {
	t.Helper()
	s, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", pid))
	if err != nil {
		t.Fatal(err)
	}
	return []byte(s)
}
