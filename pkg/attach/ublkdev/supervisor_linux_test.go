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

package ublkdev

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

// The supervisor's tests run its real volume processes (this test binary
// again, through the real serve loop) with a fake engine in place of the
// ublk device, so they need neither root nor ublk. What the fake does is
// chosen by the target's export name: "refuse" fails the start, "crash"
// exits shortly after every start, "gone" fails every takeover as a
// device that is gone; each start, detach and release leaves a line in a
// file of the state directory.

func TestMain(m *testing.M) {
	if ServeRequested() {
		os.Exit(serveVolumeMain(fakeStart))
	}
	os.Exit(m.Run())
}

func fakeStart(sp serveSpec, log *slog.Logger) (engine, *attach.Attachment, error) {
	id := sp.Target.VolumeID
	note(sp.StateDir, "starts-"+id, sp.Mode)
	switch {
	case sp.Target.Export == "refuse":
		return nil, nil, fmt.Errorf("%w: export %q refused", attach.ErrServerRefused, sp.Target.Export)
	case sp.Target.Export == "gone" && sp.Mode != modeAttach:
		return nil, nil, goneIsNotAttached(errGone)
	case sp.Target.Export == "crash":
		time.AfterFunc(100*time.Millisecond, func() { os.Exit(3) })
	}
	att := &attach.Attachment{VolumeID: id, Transport: attach.Ublk, Device: "/dev/ublkb-fake-" + id, Size: 1 << 20}
	return &fakeEngine{sp: sp, att: *att}, att, nil
}

// note appends a line to a file of dir.
func note(dir, name, line string) {
	f, err := os.OpenFile(filepath.Join(dir, name), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		panic(err)
	}
	fmt.Fprintln(f, line)
	f.Close()
}

func notes(t *testing.T, dir, name string) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, name))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	return strings.Fields(string(b))
}

type fakeEngine struct {
	sp  serveSpec
	att attach.Attachment
}

func (e *fakeEngine) Health(string) (attach.Health, error) {
	return attach.Health{Connected: true, Message: e.sp.Mode}, nil
}

func (e *fakeEngine) Resize(_ context.Context, _ string, n uint64) (uint64, error) { return n, nil }

func (e *fakeEngine) HandOff(context.Context, string) (*attach.Handoff, error) {
	b, err := json.Marshal(record{Target: e.sp.Target, Options: e.sp.Options, DevID: 7})
	if err != nil {
		return nil, err
	}
	return &attach.Handoff{VolumeID: e.sp.Target.VolumeID, Transport: attach.Ublk, Target: e.sp.Target, Attachment: e.att, State: b,
		Resume: func() error { return nil }}, nil
}

func (e *fakeEngine) Detach(ctx context.Context, _ string) error {
	if e.sp.Target.Export == "slowdetach" {
		// Its session waits for the storage node to flush: until the
		// test lets it (a file "flushable"), or the request's end.
		for {
			if _, err := os.Stat(filepath.Join(e.sp.StateDir, "flushable")); err == nil {
				break
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("%w: storage node away", attach.ErrUnflushed)
			case <-time.After(10 * time.Millisecond):
			}
		}
	}
	note(e.sp.StateDir, "detached-"+e.sp.Target.VolumeID, fmt.Sprint(os.Getpid()))
	return nil
}

func (e *fakeEngine) releaseVolume(string) {
	if e.sp.Target.Export == "slowrelease" {
		// Its session drains through an outage: until the test lets it
		// (a file "releasable").
		note(e.sp.StateDir, "releasing-"+e.sp.Target.VolumeID, fmt.Sprint(os.Getpid()))
		for {
			if _, err := os.Stat(filepath.Join(e.sp.StateDir, "releasable")); err == nil {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	note(e.sp.StateDir, "released-"+e.sp.Target.VolumeID, fmt.Sprint(os.Getpid()))
}

func (e *fakeEngine) Close() {}

func newTestSupervisor(t *testing.T) (*Supervisor, string) {
	t.Helper()
	dir := t.TempDir()
	s := newSupervisor(Config{StateDir: dir, Queues: 1, Depth: 8}, nil)
	t.Cleanup(s.Close)
	return s, dir
}

func fakeTarget(id, export string) attach.Target {
	return attach.Target{VolumeID: id, Export: export, Addrs: []string{"127.0.0.1:1"}}
}

func attachOK(t *testing.T, s *Supervisor, tg attach.Target) *attach.Attachment {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	att, err := s.Attach(ctx, tg, attach.Options{})
	if err != nil {
		t.Fatalf("attach %s: %v", tg.VolumeID, err)
	}
	return att
}

// waitFor polls cond until it holds, failing the test with what after a
// generous bound.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("not after 30s: %s", what)
		}
	}
}

func TestSupervisorServesEachVolumeInItsOwnProcess(t *testing.T) {
	s, dir := newTestSupervisor(t)
	a, b := fakeTarget("pv-a", "vol"), fakeTarget("pv-b", "vol")
	attA := attachOK(t, s, a)
	attachOK(t, s, b)
	pa, pb := s.ServerPID("pv-a"), s.ServerPID("pv-b")
	if pa == 0 || pb == 0 || pa == pb || pa == os.Getpid() {
		t.Fatalf("volume processes %d and %d (ours %d): want one each", pa, pb, os.Getpid())
	}
	again := attachOK(t, s, a)
	if *again != *attA || s.ServerPID("pv-a") != pa || len(notes(t, dir, "starts-pv-a")) != 1 {
		t.Fatalf("second attach: %+v, process %d, starts %v; want %+v from process %d, started once", again, s.ServerPID("pv-a"), notes(t, dir, "starts-pv-a"), attA, pa)
	}
	h, err := s.Health("pv-a")
	if err != nil || !h.Connected || h.Message != modeAttach {
		t.Fatalf("health: %+v, %v", h, err)
	}
	if n, err := s.Resize(context.Background(), "pv-a", 2<<20); err != nil || n != 2<<20 {
		t.Fatalf("resize: %d, %v", n, err)
	}
	for _, id := range []string{"pv-a", "pv-b"} {
		pid := s.ServerPID(id)
		if err := s.Detach(context.Background(), id); err != nil {
			t.Fatalf("detach %s: %v", id, err)
		}
		if got := notes(t, dir, "detached-"+id); len(got) != 1 || got[0] != fmt.Sprint(pid) {
			t.Fatalf("%s detached by %v, want by %d", id, got, pid)
		}
		if syscall.Kill(pid, 0) == nil {
			t.Fatalf("process %d of %s lives on after the detach", pid, id)
		}
		if _, err := s.Health(id); !errors.Is(err, attach.ErrNotAttached) {
			t.Fatalf("health of %s after detach: %v", id, err)
		}
		if err := s.Detach(context.Background(), id); err != nil {
			t.Fatalf("second detach of %s: %v", id, err)
		}
	}
}

func TestSupervisorAttachErrorCrosses(t *testing.T) {
	s, _ := newTestSupervisor(t)
	_, err := s.Attach(context.Background(), fakeTarget("pv-r", "refuse"), attach.Options{})
	if !errors.Is(err, attach.ErrServerRefused) || !strings.Contains(err.Error(), `export "refuse" refused`) {
		t.Fatalf("attach: %v, want the process's ErrServerRefused", err)
	}
	if _, err := s.Health("pv-r"); !errors.Is(err, attach.ErrNotAttached) {
		t.Fatalf("health after a failed attach: %v", err)
	}
}

// TestSupervisorRestartsAKilledProcess: a volume process SIGKILLed is
// replaced by one that takes the device over (recover mode); the other
// volume's process stays; Close lets both processes leave their devices.
func TestSupervisorRestartsAKilledProcess(t *testing.T) {
	s, dir := newTestSupervisor(t)
	attachOK(t, s, fakeTarget("pv-a", "vol"))
	attachOK(t, s, fakeTarget("pv-b", "vol"))
	pa, pb := s.ServerPID("pv-a"), s.ServerPID("pv-b")
	for kill := 1; kill <= 2; kill++ {
		if err := syscall.Kill(pa, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		old := pa
		waitFor(t, "a new process serves pv-a", func() bool {
			pa = s.ServerPID("pv-a")
			return pa != 0 && pa != old
		})
		if h, err := s.Health("pv-a"); err != nil || h.Message != modeRecover || h.Reconnects != kill {
			t.Fatalf("kill %d: health of the new process %+v, %v; want it started to recover, %d reconnects", kill, h, err, kill)
		}
	}
	if got := notes(t, dir, "starts-pv-a"); strings.Join(got, " ") != "attach recover recover" {
		t.Fatalf("starts of pv-a: %v", got)
	}
	if s.ServerPID("pv-b") != pb || len(notes(t, dir, "starts-pv-b")) != 1 {
		t.Fatalf("pv-b: process %d (was %d), starts %v", s.ServerPID("pv-b"), pb, notes(t, dir, "starts-pv-b"))
	}
	s.Close()
	for id, pid := range map[string]int{"pv-a": pa, "pv-b": pb} {
		if got := notes(t, dir, "released-"+id); len(got) != 1 || got[0] != fmt.Sprint(pid) {
			t.Fatalf("%s released by %v at Close, want by %d", id, got, pid)
		}
	}
}

// TestSupervisorCrashLoopStaysWithItsVolume: a volume whose processes keep
// dying is started again and again, the other volume's process is never
// touched, and a detach ends the loop.
func TestSupervisorCrashLoopStaysWithItsVolume(t *testing.T) {
	s, dir := newTestSupervisor(t)
	attachOK(t, s, fakeTarget("pv-ok", "vol"))
	pid := s.ServerPID("pv-ok")
	attachOK(t, s, fakeTarget("pv-crash", "crash"))
	waitFor(t, "pv-crash started four times", func() bool { return len(notes(t, dir, "starts-pv-crash")) >= 4 })
	h, err := s.Health("pv-crash")
	if err != nil {
		t.Fatalf("health of the crashing volume: %v", err)
	}
	t.Logf("health of the crashing volume: %+v", h)
	if err := s.Detach(context.Background(), "pv-crash"); err != nil {
		t.Fatalf("detach of the crashing volume: %v", err)
	}
	if _, err := s.Health("pv-crash"); !errors.Is(err, attach.ErrNotAttached) {
		t.Fatalf("health after the detach: %v", err)
	}
	if s.ServerPID("pv-ok") != pid || len(notes(t, dir, "starts-pv-ok")) != 1 {
		t.Fatalf("the other volume: process %d (was %d), starts %v", s.ServerPID("pv-ok"), pid, notes(t, dir, "starts-pv-ok"))
	}
	if h, err := s.Health("pv-ok"); err != nil || !h.Connected {
		t.Fatalf("the other volume's health: %+v, %v", h, err)
	}
}

// TestSupervisorForgetsAGoneDevice: when a new process finds the device
// gone, the volume is not served any more.
func TestSupervisorForgetsAGoneDevice(t *testing.T) {
	s, _ := newTestSupervisor(t)
	attachOK(t, s, fakeTarget("pv-g", "gone"))
	if err := syscall.Kill(s.ServerPID("pv-g"), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "pv-g forgotten", func() bool {
		_, err := s.Health("pv-g")
		return errors.Is(err, attach.ErrNotAttached)
	})
}

// TestSupervisorHandsOver: a handoff called off leaves the process
// serving; a released one ends it, and a successor supervisor's process
// takes the device (handoff mode).
func TestSupervisorHandsOver(t *testing.T) {
	s, dir := newTestSupervisor(t)
	tg := fakeTarget("pv-h", "vol")
	attachOK(t, s, tg)
	pid := s.ServerPID("pv-h")
	ctx := context.Background()
	h, err := s.HandOff(ctx, "pv-h")
	if err != nil {
		t.Fatal(err)
	}
	if err := h.Resume(); err != nil || s.ServerPID("pv-h") != pid {
		t.Fatalf("resume: %v, process %d (was %d)", err, s.ServerPID("pv-h"), pid)
	}
	h, err = s.HandOff(ctx, "pv-h")
	if err != nil {
		t.Fatal(err)
	}
	h.Release()
	if got := notes(t, dir, "released-pv-h"); len(got) != 1 || got[0] != fmt.Sprint(pid) {
		t.Fatalf("released by %v, want by %d", got, pid)
	}
	if syscall.Kill(pid, 0) == nil || s.ServerPID("pv-h") != 0 {
		t.Fatalf("process %d lives on after the release (serving: %d)", pid, s.ServerPID("pv-h"))
	}

	next := newSupervisor(Config{StateDir: dir, Queues: 1, Depth: 8}, nil)
	defer next.Close()
	wire, err := json.Marshal(h)
	if err != nil {
		t.Fatal(err)
	}
	var taken attach.Handoff
	if err := json.Unmarshal(wire, &taken); err != nil {
		t.Fatal(err)
	}
	att, err := next.TakeHandoff(ctx, &taken)
	if err != nil || att.VolumeID != "pv-h" {
		t.Fatalf("take handoff: %+v, %v", att, err)
	}
	if err := taken.Start(); err != nil {
		t.Fatal(err)
	}
	if hh, err := next.Health("pv-h"); err != nil || hh.Message != modeHandoff {
		t.Fatalf("health of the successor's process: %+v, %v", hh, err)
	}
	bad := attach.Handoff{VolumeID: "pv-other", State: taken.State}
	if _, err := next.TakeHandoff(ctx, &bad); !errors.Is(err, attach.ErrInvalid) {
		t.Fatalf("a handoff describing another volume: %v, want ErrInvalid", err)
	}
}

// TestSupervisorDetachWaitsForAFlushingProcess: a volume process that has
// not finished its detach when the caller's context ends, because its
// session waits for the storage node to flush what it acknowledged, is
// alive: the detach fails and the process is left to flush (killed, it
// would drop the writes); a later detach succeeds once it could.
func TestSupervisorDetachWaitsForAFlushingProcess(t *testing.T) {
	s, dir := newTestSupervisor(t)
	attachOK(t, s, fakeTarget("pv-slow", "slowdetach"))
	pid := s.ServerPID("pv-slow")
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	err := s.Detach(ctx, "pv-slow")
	cancel()
	if err == nil {
		t.Fatal("a detach whose process is still flushing succeeds: the process was killed, and its writes with it")
	}
	if syscall.Kill(pid, 0) != nil || s.ServerPID("pv-slow") != pid {
		t.Fatalf("the flushing process %d was ended (serving now: %d)", pid, s.ServerPID("pv-slow"))
	}
	note(dir, "flushable", "")
	if err := s.Detach(context.Background(), "pv-slow"); err != nil {
		t.Fatalf("the detach once the process could flush: %v", err)
	}
	// The first request's detach, still under way, may end too.
	got := notes(t, dir, "detached-pv-slow")
	if len(got) == 0 || slices.ContainsFunc(got, func(p string) bool { return p != fmt.Sprint(pid) }) {
		t.Fatalf("detached by %v, want by %d", got, pid)
	}
}

// TestSupervisorReleaseWaitsForADrainingProcess: a volume process whose
// release waits for its session to drain (the storage node away) is
// waited for, past every control timeout, not killed with the writes it
// drains: the release ends when the process has released the volume.
func TestSupervisorReleaseWaitsForADrainingProcess(t *testing.T) {
	old := teardownTimeout
	teardownTimeout = 100 * time.Millisecond
	t.Cleanup(func() { teardownTimeout = old })
	s, dir := newTestSupervisor(t)
	attachOK(t, s, fakeTarget("pv-r", "slowrelease"))
	pid := s.ServerPID("pv-r")
	h, err := s.HandOff(context.Background(), "pv-r")
	if err != nil {
		t.Fatal(err)
	}
	released := make(chan struct{})
	go func() {
		defer close(released)
		h.Release()
	}()
	waitFor(t, "the process releasing", func() bool { return len(notes(t, dir, "releasing-pv-r")) > 0 })
	// Past every bound of a control request, and then some.
	time.Sleep(teardownTimeout + ctlTimeout + time.Second)
	if syscall.Kill(pid, 0) != nil {
		t.Fatal("the process draining its session was killed: the writes it held are gone")
	}
	note(dir, "releasable", "")
	select {
	case <-released:
	case <-time.After(30 * time.Second):
		t.Fatal("the release does not end once the process has released the volume")
	}
	if got := notes(t, dir, "released-pv-r"); len(got) != 1 || got[0] != fmt.Sprint(pid) {
		t.Fatalf("released by %v, want by %d", got, pid)
	}
}
