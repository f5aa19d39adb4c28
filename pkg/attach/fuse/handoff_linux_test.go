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
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// TestHandoffUnderFio hands a volume on twice (A -> B -> C, each
// Attacher a process of its own) while fio writes and verifies through
// the loop device: fio must not see an error, each old server process
// must be gone, and the last Attacher manages the volume as its own down
// to a Detach that leaves nothing.
func TestHandoffUnderFio(t *testing.T) {
	requireFUSE(t)
	requireTool(t, "fio")
	const size = 512 << 20
	ts := localServer(t, size)
	stateDir := t.TempDir() + "/state"
	probe := newAttacher(t, Config{StateDir: stateDir}) // detaches what is left
	ctx := context.Background()
	const id = "pv-handoff"
	tg := target(id, ts.addr)
	a := startAttacherProc(t, stateDir)
	r, _ := a.call(t, helperMsg{Op: "attach", Target: &tg})
	att := r.Attachment
	first := serverPid(t, probe, id)

	fctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	fio := exec.CommandContext(fctx, "fio", "--name=handoff", "--filename="+att.Device,
		"--direct=1", "--rw=randwrite", "--bs=4k", "--iodepth=16", "--ioengine=libaio",
		"--verify=crc32c", "--do_verify=1", "--verify_fatal=1", "--verify_backlog=1024",
		"--size=384M", "--randrepeat=0")
	fio.Dir = t.TempDir() // where it leaves its verify state
	var out bytes.Buffer
	fio.Stdout, fio.Stderr = &out, &out
	if err := fio.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- fio.Wait() }()
	running := func(when string) {
		t.Helper()
		select {
		case err := <-done:
			t.Fatalf("fio ended %s (%v): the handover did not happen under I/O\n%s", when, err, out.String())
		default:
		}
	}

	time.Sleep(2 * time.Second)
	running("before the first handover")
	b := startAttacherProc(t, stateDir)
	second := handOverProcs(t, a, b, stateDir, id)
	time.Sleep(2 * time.Second)
	running("before the second handover")
	c := startAttacherProc(t, stateDir)
	third := handOverProcs(t, b, c, stateDir, id)
	running("right after the second handover")

	if err := <-done; err != nil {
		t.Fatalf("fio: %v\n%s", err, out.String())
	}
	if s := out.String(); strings.Contains(s, "verify") && strings.Contains(s, "bad") || strings.Contains(s, "err=") && !strings.Contains(s, "err= 0") {
		t.Fatalf("fio reports errors:\n%s", s)
	}
	t.Logf("servers %d -> %d -> %d; fio:\n%s", first, second, third, lastLines(out.String(), 12))
	if pids := liveServers(t); !slices.Equal(pids, []int{third}) {
		t.Fatalf("server processes %v, want only %d", pids, third)
	}

	// The last Attacher, and a fresh one, know the volume as their own.
	list, err := New(Config{StateDir: stateDir}).Adopt(ctx)
	if err != nil || len(list) != 1 || list[0].Device != att.Device {
		t.Fatalf("Adopt: %v, %v", list, err)
	}
	if r, _ := c.call(t, helperMsg{Op: "attach", Target: &tg}); r.Attachment.Device != att.Device {
		t.Fatalf("Attach after the handovers: %+v", r.Attachment)
	}
	if sz, err := probe.Resize(ctx, id, size); err != nil || sz != size {
		t.Fatalf("Resize after the handovers: %d, %v", sz, err)
	}
	c.call(t, helperMsg{Op: "detach", Volume: id})
	waitGone(t, third)
	assertNothingLeft(t, probe, id, ts)
}

func lastLines(s string, n int) string {
	l := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(l[max(0, len(l)-n):], "\n")
}

// TestHandoffSuccessorFails lets the successor fail before it is ready,
// once by not starting at all and once by dying after it said it was
// ready but before it started: each time the predecessor resumes and the
// writes going on meanwhile succeed and read back.
func TestHandoffSuccessorFails(t *testing.T) {
	requireFUSE(t)
	ts := localServer(t, 64<<20)
	stateDir := t.TempDir() + "/state"
	a := newAttacher(t, Config{StateDir: stateDir})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const id = "pv-handoff-fail"
	att, err := a.Attach(ctx, target(id, ts.addr), attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	pid := serverPid(t, a, id)
	w := startWriter(t, att.Device, 16)
	w.waitWrites(t, 20)

	// A successor command that exits at once.
	broken := New(Config{StateDir: stateDir, ServeCommand: []string{"/bin/false"}})
	h, err := a.HandOff(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := broken.TakeHandoff(ctx, h); err == nil {
		t.Fatal("TakeHandoff with a successor that exits succeeds")
	}
	if err := h.Resume(); err != nil {
		t.Fatalf("Resume: %v", err)
	}
	w.waitWrites(t, 20)

	// A successor killed once it is ready.
	b := New(Config{StateDir: stateDir})
	h, err = a.HandOff(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	before := liveServers(t)
	if _, err := b.TakeHandoff(ctx, h); err != nil {
		t.Fatal(err)
	}
	var succ int
	for _, p := range liveServers(t) {
		if !slices.Contains(before, p) {
			succ = p
		}
	}
	if succ == 0 {
		t.Fatal("no successor process")
	}
	syscall.Kill(succ, syscall.SIGKILL)
	h.Abort()
	if err := h.Resume(); err != nil {
		t.Fatalf("Resume: %v", err)
	}
	if err := h.Start(); err == nil {
		t.Fatal("Start after Abort succeeds")
	}
	w.waitWrites(t, 20)
	w.finish(t)
	w.verify(t, att.Device, ts.backend)
	if got := serverPid(t, a, id); got != pid {
		t.Fatalf("the volume's server is %d, want the predecessor %d", got, pid)
	}
	if hl, err := a.Health(id); err != nil || !hl.Connected {
		t.Fatalf("health: %+v, %v", hl, err)
	}
	if err := a.Detach(ctx, id); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, a, id, ts)
}

// TestHandoffBetweenAttachers moves a volume twice (A -> B -> C, three
// Attachers of this process, each starting a new server process) with
// writes going on throughout; each predecessor's server exits.
func TestHandoffBetweenAttachers(t *testing.T) {
	requireFUSE(t)
	ts := localServer(t, 64<<20)
	stateDir := t.TempDir() + "/state"
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const id = "pv-handoff-attachers"
	a := newAttacher(t, Config{StateDir: stateDir})
	att, err := a.Attach(ctx, target(id, ts.addr), attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	first := serverPid(t, a, id)
	w := startWriter(t, att.Device, 16)
	w.waitWrites(t, 20)
	b := newAttacher(t, Config{StateDir: stateDir})
	second := handOver(ctx, t, a, b, id, w)
	c := newAttacher(t, Config{StateDir: stateDir})
	third := handOver(ctx, t, b, c, id, w)
	t.Logf("servers %d -> %d -> %d", first, second, third)
	w.finish(t)
	w.verify(t, att.Device, ts.backend)
	if err := c.Detach(ctx, id); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, c, id, ts)
}

// handOver hands volume id from one attacher to another while w writes,
// checks that the predecessor's server process is gone and the
// successor's alone serves, and returns the successor's pid once w's
// writes go on.
func handOver(ctx context.Context, t *testing.T, from, to *Attacher, id string, w *directWriter) int {
	t.Helper()
	pred := serverPid(t, from, id)
	h, err := from.HandOff(ctx, id)
	if err != nil {
		t.Fatalf("HandOff: %v", err)
	}
	if _, err := to.TakeHandoff(ctx, h); err != nil {
		if rerr := h.Resume(); rerr != nil {
			t.Errorf("Resume: %v", rerr)
		}
		t.Fatalf("TakeHandoff: %v", err)
	}
	h.Release()
	if err := h.Start(); err != nil {
		t.Fatalf("Start: %v", err)
	}
	if hl, err := to.Health(id); err != nil || !hl.Connected {
		t.Fatalf("health after the handover: %+v, %v", hl, err)
	}
	waitGone(t, pred)
	succ := serverPid(t, to, id)
	if succ == pred {
		t.Fatalf("the same server process %d after the handover", succ)
	}
	if pids := liveServers(t); !slices.Equal(pids, []int{succ}) {
		t.Fatalf("server processes %v, want only %d", pids, succ)
	}
	w.waitWrites(t, 20)
	return succ
}

// TestHandoffAfterTheVolumeMoved: a volume published with storage node A
// moves to B while attached (as a drain moves it: A names B as holding
// it, then stops serving it), and its session follows. A successor that
// takes the volume over is handed the target as it was published (A
// alone): it reaches B through what the session kept
// (Options.ServersFile), and what was written on both sides of the move
// reads back.
func TestHandoffAfterTheVolumeMoved(t *testing.T) {
	requireFUSE(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	backend := nbd.NewMemBackend(64 << 20)
	listen := func() net.Listener {
		l, err := mptcp.Listen(ctx, "tcp", "127.0.0.1:0", mptcp.Available() == nil)
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	// serve serves backend on l, naming the servers that hold it.
	serve := func(l net.Listener, holders []nbd.ServerAddrs) *nbd.Server {
		srv := &nbd.Server{Resolve: func(_ nbd.ConnInfo, name string) (nbd.Grant, error) {
			return nbd.Grant{Export: name, Servers: holders}, nil
		}}
		if err := srv.AddExport(&nbd.Export{Name: "vol", Backend: backend}); err != nil {
			t.Fatal(err)
		}
		go srv.Serve(l)
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			srv.Shutdown(ctx)
		})
		return srv
	}
	la, lb := listen(), listen()
	b := []nbd.ServerAddrs{{Node: "b", Addrs: []string{lb.Addr().String()}}}
	srvA := serve(la, b)
	serve(lb, b)

	const id = "pv-handoff-moved"
	stateDir := t.TempDir() + "/state"
	o := attach.Options{ServersFile: filepath.Join(t.TempDir(), "servers", id+".json")}
	first := newAttacher(t, Config{StateDir: stateDir})
	att, err := first.Attach(ctx, target(id, la.Addr().String()), o)
	if err != nil {
		t.Fatal(err)
	}
	w := startWriter(t, att.Device, 16)
	w.waitWrites(t, 20)
	// A stops serving the volume: the session goes on at B.
	stopped, stop := context.WithCancel(ctx)
	stop()
	srvA.Shutdown(stopped)
	w.waitWrites(t, 20)
	second := newAttacher(t, Config{StateDir: stateDir})
	handOver(ctx, t, first, second, id, w)
	w.finish(t)
	w.verify(t, att.Device, backend)
	if err := second.Detach(ctx, id); err != nil {
		t.Fatal(err)
	}
}
