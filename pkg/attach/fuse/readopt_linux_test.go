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
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/internal/capability"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/blockdev"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// checkServerProcess checks that a volume's server process runs in a
// session of its own and that its files are private.
func checkServerProcess(t *testing.T, a *Attacher, volumeID string) {
	t.Helper()
	pid := serverPid(t, a, volumeID)
	f, err := attach.ProcFields(pid)
	if err != nil {
		t.Fatal(err)
	}
	if sid, _ := strconv.Atoi(f[3]); sid != pid {
		t.Errorf("server process %d runs in session %d, not its own", pid, sid)
	}
	for _, p := range []string{a.sockPath(volumeID), a.statePath(volumeID), a.lockPath(volumeID)} {
		st, err := os.Stat(p)
		if err != nil {
			t.Error(err)
			continue
		}
		if st.Mode().Perm() != 0o600 {
			t.Errorf("%s: mode %v, want 0600", p, st.Mode())
		}
	}
	if st, err := os.Stat(a.sockPath(volumeID)); err == nil && st.Mode().Type() != os.ModeSocket {
		t.Errorf("%s is not a socket: %v", a.sockPath(volumeID), st.Mode())
	}
	// Kept in memory (mlockall: its pages locked) and from the OOM killer.
	status, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(status), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmLck:"); ok {
			if kb, _ := strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(rest), " kB")); kb == 0 {
				t.Errorf("server process %d locks no memory (%s): not guarded against reclaim", pid, strings.TrimSpace(line))
			}
		}
	}
	// Lowering oom_score_adj takes CAP_SYS_RESOURCE, which some hosts
	// drop from every process.
	if !capability.Has(capability.Effective, capability.SysResource) {
		t.Logf("oom_score_adj not checked: this process lacks CAP_SYS_RESOURCE, and the server process with it")
	} else if adj, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/oom_score_adj"); err != nil || strings.TrimSpace(string(adj)) != "-1000" {
		t.Errorf("server process %d's oom_score_adj %q (%v), want -1000", pid, adj, err)
	}
}

// directWriter writes random 1 MiB blocks with O_DIRECT round a ring of
// slots on a device and remembers what each slot last got.
type directWriter struct {
	f      *os.File
	slots  [][]byte
	writes atomic.Int64
	errs   atomic.Int64
	first  atomic.Pointer[error]
	stop   chan struct{}
	done   sync.WaitGroup
}

const writerBlock = 1 << 20

func startWriter(t *testing.T, dev string, slots int) *directWriter {
	t.Helper()
	w := &directWriter{f: openDirect(t, dev, os.O_RDWR), slots: make([][]byte, slots), stop: make(chan struct{})}
	w.done.Add(1)
	go func() {
		defer w.done.Done()
		buf := alignedBuf(writerBlock)
		for i := 0; ; i++ {
			select {
			case <-w.stop:
				return
			default:
			}
			slot := i % len(w.slots)
			rand.Read(buf)
			if _, err := w.f.WriteAt(buf, int64(slot)*writerBlock); err != nil {
				w.errs.Add(1)
				w.first.CompareAndSwap(nil, &err)
				continue
			}
			w.slots[slot] = append(w.slots[slot][:0], buf...)
			w.writes.Add(1)
		}
	}()
	return w
}

// waitWrites waits until the writer has done n more writes.
func (w *directWriter) waitWrites(t *testing.T, n int64) {
	t.Helper()
	want := w.writes.Load() + n
	deadline := time.Now().Add(30 * time.Second)
	for w.writes.Load() < want {
		if w.errs.Load() != 0 {
			t.Fatalf("write error: %v", *w.first.Load())
		}
		if time.Now().After(deadline) {
			t.Fatalf("the writer is stuck at %d writes", w.writes.Load())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// finish stops the writer, syncs and closes the device.
func (w *directWriter) finish(t *testing.T) {
	t.Helper()
	close(w.stop)
	w.done.Wait()
	if err := w.f.Sync(); err != nil {
		t.Errorf("fsync: %v", err)
	}
	w.f.Close()
}

// verify reads every slot back through the device and from the export.
func (w *directWriter) verify(t *testing.T, dev string, backend *nbd.MemBackend) {
	t.Helper()
	f := openDirect(t, dev, os.O_RDONLY)
	defer f.Close()
	got := alignedBuf(writerBlock)
	direct := make([]byte, writerBlock)
	for i, want := range w.slots {
		if want == nil {
			continue
		}
		if _, err := f.ReadAt(got, int64(i)*writerBlock); err != nil {
			t.Fatalf("read slot %d: %v", i, err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("slot %d reads back different through the device", i)
		}
		if _, err := backend.ReadAt(direct, int64(i)*writerBlock); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(direct, want) {
			t.Fatalf("slot %d differs in the export", i)
		}
	}
}

// reap waits for process pid if it became our child (we are a subreaper),
// so that it does not stay behind as a zombie.
func reap(pid int) {
	var ws unix.WaitStatus
	for i := 0; i < 500; i++ {
		got, err := unix.Wait4(pid, &ws, unix.WNOHANG, nil)
		if got == pid || errors.Is(err, unix.ECHILD) {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestReadoptAfterAttacherKilled attaches a volume from a child process,
// writes to the device with O_DIRECT and kills the child with SIGKILL
// meanwhile: the writes go on without an error, since the volume's server
// process lives on. A new Attacher adopts the server: Attach returns the
// same device over the same connection, Health works, the data is there,
// and Detach leaves nothing.
func TestReadoptAfterAttacherKilled(t *testing.T) {
	requireFUSE(t)
	const size = 64 << 20
	ts := localServer(t, size)
	state := filepath.Join(t.TempDir(), "state")
	const vol = "pv-readopt"
	ctx := context.Background()

	// The server process, orphaned, becomes our child and we reap it.
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		t.Fatal(err)
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	spec, _ := json.Marshal(attachHelperSpec{StateDir: state, Target: target(vol, ts.addr)})
	helper := exec.Command(exe)
	helper.Env = append(os.Environ(), attachHelperEnv+"="+string(spec))
	helper.Stderr = os.Stderr
	stdin, err := helper.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	defer stdin.Close()
	stdout, err := helper.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := helper.Start(); err != nil {
		t.Fatal(err)
	}
	killed := false
	defer func() {
		if !killed {
			helper.Process.Kill()
			helper.Wait()
		}
	}()
	// Whatever happens, nothing stays behind.
	newAttacher(t, Config{StateDir: state})

	var res attachHelperResult
	if err := json.NewDecoder(stdout).Decode(&res); err != nil {
		t.Fatalf("reading the helper's attachment: %v", err)
	}
	if res.Err != "" || res.Attachment == nil {
		t.Fatalf("attach in the helper: %s", res.Err)
	}
	att := *res.Attachment
	t.Logf("attached by pid %d: %+v", helper.Process.Pid, att)
	ts.conns.waitConns(t, "vol", 1)
	fresh := New(Config{StateDir: state})
	pid := serverPid(t, fresh, vol)
	if pid == helper.Process.Pid {
		t.Fatal("the helper serves the volume itself")
	}

	w := startWriter(t, att.Device, 32)
	w.waitWrites(t, 20)
	if err := helper.Process.Signal(unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	helper.Wait()
	killed = true
	t.Logf("killed the attaching process after %d writes", w.writes.Load())
	w.waitWrites(t, 50)
	time.Sleep(200 * time.Millisecond)
	w.finish(t)
	if n := w.errs.Load(); n != 0 {
		t.Fatalf("%d I/O errors after the attaching process died, first: %v", n, *w.first.Load())
	}
	t.Logf("%d writes, no error", w.writes.Load())
	if !attach.ProcAlive(pid, 0) {
		t.Fatalf("the server process %d died with the attaching process", pid)
	}

	// A new Attacher (as in a restarted plugin) finds the volume.
	adopted, err := fresh.Adopt(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(adopted) != 1 || *adopted[0] != att {
		t.Fatalf("adopted %+v, want [%+v]", adopted, att)
	}
	h, err := fresh.Health(vol)
	if err != nil || !h.Connected {
		t.Fatalf("health through the adopted server: %+v, %v", h, err)
	}
	t.Logf("health: %+v", h)
	again, err := fresh.Attach(ctx, target(vol, ts.addr), attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if *again != att {
		t.Fatalf("attach after the restart: %+v, want %+v", again, att)
	}
	if got := serverPid(t, fresh, vol); got != pid {
		t.Fatalf("server process %d after the re-adoption, want %d", got, pid)
	}
	ts.conns.waitConns(t, "vol", 1)
	w.verify(t, att.Device, ts.backend)

	if err := fresh.Detach(ctx, vol); err != nil {
		t.Fatal(err)
	}
	reap(pid)
	if attach.ProcAlive(pid, 0) {
		t.Errorf("the server process %d still runs after the detach", pid)
	}
	assertNothingLeft(t, fresh, vol, ts)
}

// TestReadoptFreshAttacher drops an Attacher without detaching and works
// the volume from a new one: Health, Resize and Detach go through the
// socket without an Attach first.
func TestReadoptFreshAttacher(t *testing.T) {
	requireFUSE(t)
	const size = 16 << 20
	ts := localServer(t, size)
	state := filepath.Join(t.TempDir(), "state")
	ctx := context.Background()
	const vol = "pv-fresh"
	old := newAttacher(t, Config{StateDir: state})
	att, err := old.Attach(ctx, target(vol, ts.addr), attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	fresh := newAttacher(t, Config{StateDir: state})
	h, err := fresh.Health(vol)
	if err != nil || !h.Connected {
		t.Fatalf("health from a new attacher: %+v, %v", h, err)
	}
	if err := ts.backend.Resize(2 * size); err != nil {
		t.Fatal(err)
	}
	n, err := fresh.Resize(ctx, vol, 2*size)
	if err != nil || n != 2*size {
		t.Fatalf("resize from a new attacher: %d, %v", n, err)
	}
	if _, err := fresh.Resize(ctx, vol, 4*size); !errors.Is(err, attach.ErrTooSmall) {
		t.Errorf("resize past the export's size: %v, want ErrTooSmall", err)
	}
	if n, err := blockdev.DeviceSize(att.Device); err != nil || n != 2*size {
		t.Fatalf("device size after the resize: %d, %v", n, err)
	}
	again, err := fresh.Attach(ctx, target(vol, ts.addr), attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	want := *att
	want.Size = 2 * size
	if *again != want {
		t.Fatalf("attach from a new attacher: %+v, want %+v", again, want)
	}
	ts.conns.waitConns(t, "vol", 1)
	if err := fresh.Detach(ctx, vol); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, fresh, vol, ts)
	// The old attacher has nothing to do anymore.
	if err := old.Detach(ctx, vol); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, old, vol, ts)
}

// TestServerProcessKilled kills a volume's server process: I/O fails and
// Health says why (the documented limitation). Attach starts a new server
// over the remains, and after a second kill Detach cleans up everything.
func TestServerProcessKilled(t *testing.T) {
	requireFUSE(t)
	ts := localServer(t, 16<<20)
	a := newAttacher(t, Config{})
	ctx := context.Background()
	const vol = "pv-killed"
	att, err := a.Attach(ctx, target(vol, ts.addr), attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	pid := serverPid(t, a, vol)
	if err := unix.Kill(pid, unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitGone(t, pid)
	ts.conns.waitConns(t, "vol", 0)

	f := openDirect(t, att.Device, os.O_RDWR)
	if _, err := f.ReadAt(alignedBuf(4096), 0); err == nil {
		t.Error("read succeeds with the server process gone")
	}
	if _, err := f.WriteAt(alignedBuf(4096), 0); err == nil {
		t.Error("write succeeds with the server process gone")
	}
	f.Close()
	h, err := a.Health(vol)
	if err != nil {
		t.Fatal(err)
	}
	if h.Connected || !strings.Contains(h.Message, "gone") {
		t.Errorf("health with the server process gone: %+v", h)
	}
	t.Logf("health: %+v", h)
	if h, err := New(Config{StateDir: a.cfg.StateDir}).Health(vol); err != nil || h.Connected {
		t.Errorf("health from a new attacher with the server process gone: %+v, %v", h, err)
	}

	// Attach again: the remains go, a new server serves the volume.
	att2, err := a.Attach(ctx, target(vol, ts.addr), attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	pid2 := serverPid(t, a, vol)
	if pid2 == pid {
		t.Fatal("the same server process after the reattach")
	}
	ts.conns.waitConns(t, "vol", 1)
	f = openDirect(t, att2.Device, os.O_RDONLY)
	if _, err := f.ReadAt(alignedBuf(4096), 0); err != nil {
		t.Errorf("read after the reattach: %v", err)
	}
	f.Close()
	if h, err := a.Health(vol); err != nil || !h.Connected {
		t.Errorf("health after the reattach: %+v, %v", h, err)
	}

	if err := unix.Kill(pid2, unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitGone(t, pid2)
	if err := a.Detach(ctx, vol); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, a, vol, ts)
}

// TestAttachConcurrentAttachers attaches one volume from two Attachers at
// once: the second waits for the server the first starts and adopts it.
func TestAttachConcurrentAttachers(t *testing.T) {
	requireFUSE(t)
	ts := localServer(t, 16<<20)
	state := filepath.Join(t.TempDir(), "state")
	const vol = "pv-two"
	as := []*Attacher{newAttacher(t, Config{StateDir: state}), newAttacher(t, Config{StateDir: state})}
	atts := make([]*attach.Attachment, len(as))
	errs := make([]error, len(as))
	var wg sync.WaitGroup
	for i, a := range as {
		wg.Add(1)
		go func() {
			defer wg.Done()
			atts[i], errs[i] = a.Attach(context.Background(), target(vol, ts.addr), attach.Options{})
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if *atts[0] != *atts[1] {
		t.Fatalf("attachments %+v and %+v", atts[0], atts[1])
	}
	ts.conns.waitConns(t, "vol", 1)
	if err := as[1].Detach(context.Background(), vol); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, as[1], vol, ts)
	if _, err := as[0].Health(vol); !errors.Is(err, attach.ErrNotAttached) {
		t.Errorf("health through the other attacher after the detach: %v", err)
	}
}

// TestServeCommandFails covers server processes that never get ready:
// one that cannot start, one that exits at once and one that hangs until
// Attach's context ends. Nothing stays behind.
func TestServeCommandFails(t *testing.T) {
	requireFUSE(t)
	ts := localServer(t, 16<<20)
	for _, c := range []struct {
		name    string
		cmd     []string
		timeout time.Duration
	}{
		{"missing", []string{"/nonexistent/mpnbd"}, 0},
		{"exits", []string{"true"}, 0},
		{"hangs", []string{"sleep", "60"}, 500 * time.Millisecond},
	} {
		t.Run(c.name, func(t *testing.T) {
			if !filepath.IsAbs(c.cmd[0]) {
				requireTool(t, c.cmd[0])
			}
			a := newAttacher(t, Config{ServeCommand: c.cmd})
			ctx := context.Background()
			if c.timeout > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, c.timeout)
				defer cancel()
			}
			_, err := a.Attach(ctx, target("pv-cmd", ts.addr), attach.Options{})
			if err == nil {
				t.Fatal("Attach succeeds")
			}
			t.Logf("attach error: %v", err)
			if c.timeout > 0 && !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("error %v does not wrap context.DeadlineExceeded", err)
			}
			assertNothingLeft(t, a, "pv-cmd", ts)
		})
	}
}

// TestDialErrorCrossesProcesses: a refused export keeps its sentinels on
// the way from a server process to the attaching one.
func TestDialErrorCrossesProcesses(t *testing.T) {
	refused := attach.EncodeError(dialError(target("v", "x:1"), nbd.ErrUnknownExport)).Err()
	if !errors.Is(refused, attach.ErrServerRefused) || !errors.Is(refused, nbd.ErrUnknownExport) {
		t.Errorf("refusal decodes to %v without its sentinels", refused)
	}
}

func TestSockPath(t *testing.T) {
	short := sockPathIn("/run/mpnbd/fuse", "pvc-1")
	if short != "/run/mpnbd/fuse/pvc-1.sock" {
		t.Errorf("socket path %q", short)
	}
	long := strings.Repeat("x", 120)
	p := sockPathIn("/run/mpnbd/fuse", long)
	if len(p) > maxSockPath || !strings.HasPrefix(filepath.Base(p), ".") {
		t.Errorf("socket path %q for a long volume ID", p)
	}
	if p == sockPathIn("/run/mpnbd/fuse", strings.Repeat("y", 120)) {
		t.Error("two long volume IDs share a socket")
	}
}

// TestServerSIGTERM: a server process told to stop detaches its volume
// and exits, unless the device is in use, in which case it keeps serving.
func TestServerSIGTERM(t *testing.T) {
	requireFUSE(t)
	ts := localServer(t, 16<<20)
	a := newAttacher(t, Config{UnmountTimeout: 300 * time.Millisecond})
	ctx := context.Background()
	const vol = "pv-term"
	att, err := a.Attach(ctx, target(vol, ts.addr), attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	pid := serverPid(t, a, vol)

	// Claimed, as by a mounted file system: the server stays.
	busy := openDirect(t, att.Device, os.O_RDONLY|unix.O_EXCL)
	if err := unix.Kill(pid, unix.SIGTERM); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	if !attach.ProcAlive(pid, 0) {
		t.Fatal("the server process exited on SIGTERM with its device in use")
	}
	if _, err := busy.ReadAt(alignedBuf(4096), 0); err != nil {
		t.Errorf("read after the refused SIGTERM: %v", err)
	}
	if h, err := a.Health(vol); err != nil || !h.Connected {
		t.Errorf("health after the refused SIGTERM: %+v, %v", h, err)
	}
	busy.Close()

	if err := unix.Kill(pid, unix.SIGTERM); err != nil {
		t.Fatal(err)
	}
	waitGone(t, pid)
	ts.conns.waitConns(t, "vol", 0)
	if devs, err := blockdev.FindLoopByBackingFile(func() string { _, f := a.paths(vol); return f }()); err != nil || len(devs) != 0 {
		t.Errorf("loop devices after SIGTERM: %v, %v", devs, err)
	}
	if err := a.Detach(ctx, vol); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, a, vol, ts)
}
