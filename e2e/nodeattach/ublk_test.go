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

package nodeattach

import (
	"context"
	"log/slog"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/internal/testenv/vm"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/attach/ublkdev"
	"github.com/mpnbd/mpnbd/pkg/ublk"
)

// ublkTests are the guest tests TestNodeAttachUblkInVM runs.
var ublkTests = []string{"TestUblkTransportAttach", "TestUblkServerKills", "TestUblkTLSServerKills", "TestUblkProcessKilledMidWrite", "TestUblkVolumeProcessKilled", "TestDatapathHandover", "TestDatapathHandoverDuringOutage"}

// TestNodeAttachUblkInVM boots Debian's stock 6.12 kernel, which has
// ublk_drv (and an nbd that refuses MPTCP), and runs the ublk transport's
// guest tests in it.
func TestNodeAttachUblkInVM(t *testing.T) {
	if os.Getenv("MPNBD_IN_VM") == "1" {
		t.Skip("already inside the VM")
	}
	runUblkGuestTests(t, ublkTests, vm.DefaultUblk)
}

// ublkNewestTests run on the newest kernel too: the Node service's flow
// with online expansion, attach, and recovery after a SIGKILL on that
// driver. (All of ublkTests pass there as well; the rest stay on 6.12 to
// keep the suite's time.)
var ublkNewestTests = []string{"TestNodeServiceUblk", "TestUblkTransportAttach", "TestUblkProcessKilledMidWrite"}

// TestNodeAttachUblkNewestInVM boots the newest kernel Debian ships
// (backports), whose ublk driver resizes a device online, and runs
// ublkNewestTests in it.
func TestNodeAttachUblkNewestInVM(t *testing.T) {
	if os.Getenv("MPNBD_IN_VM") == "1" {
		t.Skip("already inside the VM")
	}
	runUblkGuestTests(t, ublkNewestTests, vm.DefaultNewest)
}

// runUblkGuestTests runs the selected ones of names in a VM booting the
// kernel of kernel.
func runUblkGuestTests(t *testing.T, names []string, kernel func(testing.TB) vm.Config) {
	t.Helper()
	names = selectGuestTests(t, names)
	cfg := kernel(t)
	cfg.MemoryMB = 2048
	cfg.Timeout = 15 * time.Minute
	addFaultTools(t, &cfg)
	runGuestTests(t, cfg, names)
}

func requireUblkGuest(t *testing.T) {
	t.Helper()
	requireGuest(t)
	if err := ublk.Available(); err != nil {
		t.Skipf("needs a kernel with ublk (TestNodeAttachUblkInVM boots one): %v", err)
	}
}

// newUblkAttacher is the ublk transport as the node runs it: a process per
// volume (this test binary again), dialing from the client namespace.
func newUblkAttacher(t *testing.T, tp *topo.Topology, stateDir string) *ublkdev.Supervisor {
	t.Helper()
	a, err := newUblkSupervisor(tp.ClientNS, stateDir, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Close)
	return a
}

// newUblkSupervisor makes a Supervisor whose volume processes run in
// network namespace ns (in ours when ns is empty).
func newUblkSupervisor(ns, stateDir string, log *slog.Logger) (*ublkdev.Supervisor, error) {
	if ns == "" {
		return ublkdev.NewSupervisor(ublkdev.Config{StateDir: stateDir, Logger: log})
	}
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	return ublkdev.NewSupervisor(ublkdev.Config{StateDir: stateDir, Logger: log,
		ServeCommand: []string{"nsenter", "--net=/run/netns/" + ns, "--", exe, ublkdev.ServeArg}})
}

// TestUblkTransportAttach: a volume attaches as /dev/ublkbN over MPTCP
// with a subflow per path, idempotently; ext4 on it keeps a file's bytes
// across a remount; detach removes the device and the server connection.
func TestUblkTransportAttach(t *testing.T) {
	requireUblkGuest(t)
	tp := guestTopology(t)
	st := newStorage(t, tp, volSize, true)
	a := newUblkAttacher(t, tp, t.TempDir())
	tg := st.target(volID(t))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	att, err := a.Attach(ctx, tg, attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if att.Transport != attach.Ublk || att.Size != volSize || !strings.HasPrefix(att.Device, "/dev/ublkb") || !att.MPTCP {
		t.Fatalf("attachment %+v", att)
	}
	again, err := a.Attach(ctx, tg, attach.Options{})
	if err != nil || *again != *att {
		t.Fatalf("second attach: %+v, %v; want %+v", again, err, att)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		h, err := a.Health(tg.VolumeID)
		if err == nil && h.Connected && len(h.Subflows) == 1 && h.Subflows[0] == len(tp.Paths) {
			t.Logf("health %+v", h)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("health after 30s: %+v, %v; want %d subflows", h, err, len(tp.Paths))
		}
		time.Sleep(100 * time.Millisecond)
	}
	sum := mkfsMountWrite(t, att.Device, dataSize)
	if got := mountAndSum(t, att.Device); got != sum {
		t.Fatalf("file after remount: %s, want %s", got, sum)
	}
	if err := a.Detach(context.Background(), tg.VolumeID); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(att.Device); !os.IsNotExist(err) {
		t.Fatalf("%s after detach: %v", att.Device, err)
	}
	waitServerConns(t, st, 0)
	if err := a.Detach(context.Background(), tg.VolumeID); err != nil {
		t.Fatalf("second detach: %v", err)
	}
}

// TestUblkServerKills: fio write+verify rounds on /dev/ublkbN while
// Debian's nbd-server is SIGKILLed and restarted every few seconds: no
// error, every block verifies, the device reads back the server's file,
// and the volume's process is the same throughout.
func TestUblkServerKills(t *testing.T) {
	requireUblkGuest(t)
	requireFaultTools(t)
	total, every, down := killTimes()
	tp := guestTopology(t)
	srv := startDebianServer(t, tp, faultExportSize)
	a := newUblkAttacher(t, tp, t.TempDir())
	tg := srv.target(volID(t))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	att, err := a.Attach(ctx, tg, attach.Options{})
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := a.Detach(context.Background(), tg.VolumeID); err != nil {
			t.Errorf("detach: %v", err)
		}
	})
	pid := a.ServerPID(tg.VolumeID)
	killRounds(t, srv, a, tg, att.Device, 1, total, every, down)
	// The storage server's deaths are the session's business: the
	// volume's own process serves on throughout.
	if now := a.ServerPID(tg.VolumeID); now != pid {
		t.Fatalf("the volume's process is %d, was %d: it was replaced while only the storage server died", now, pid)
	}
}

// TestUblkProcessKilledMidWrite: the process that supervises a ublk
// volume (the datapath component) is SIGKILLed in the middle of a fio
// write+verify round; the volume's own process, left without its
// supervisor, stops serving and exits; the kernel holds the I/O; a new
// supervisor takes the device over from the state directory with a new
// volume process, and fio finishes with no error, every block verified.
func TestUblkProcessKilledMidWrite(t *testing.T) {
	requireUblkGuest(t)
	requireFaultTools(t)
	tp := guestTopology(t)
	st := newStorage(t, tp, faultExportSize, true)
	cs := childSpec{Target: st.target(volID(t)), StateDir: t.TempDir(), Mode: attach.Ublk}
	first, dev := startChild(t, cs)
	before := writeIOs(dev)
	f := startFio(t, dev, int(time.Now().UnixNano()%1000000)+3)
	waitWrites(t, f, dev, before, 256)
	first.Process.Kill()
	first.Wait()
	t.Logf("SIGKILL the serving process after %d writes", writeIOs(dev)-before)
	holdRunning(t, f, 2*time.Second, "the time without a serving process")
	cs.Adopt = true
	second, dev2 := startChild(t, cs)
	if dev2 != dev {
		t.Fatalf("taken over as %s, want %s", dev2, dev)
	}
	res := f.wait(t, roundLimit, func(what string) { reportStuck(t, dev, what, "(served by another process)") })
	if !res.ok() {
		t.Fatalf("fio across the serving process's death: %v\n%s", res, tail(res.output, 40))
	}
	t.Logf("fio across the serving process's death: %v", res)
	compareWithImage(t, st.path, dev, func(what string) { reportStuck(t, dev, what, "(served by another process)") })
	// Remove the device through the process serving it: a detach.
	second.Process.Kill()
	second.Wait()
	a := newUblkAttacher(t, tp, cs.StateDir)
	if _, err := a.Adopt(context.Background()); err != nil {
		t.Fatalf("adopt to detach: %v", err)
	}
	if err := a.Detach(context.Background(), cs.Target.VolumeID); err != nil {
		t.Fatalf("detach: %v", err)
	}
}

// TestUblkVolumeProcessKilled: the process of one ublk volume is SIGKILLed
// three times in the middle of fio write+verify rounds, while a second
// volume of the same supervisor runs fio of its own. Each time the kernel
// holds the first device's I/O until the supervisor's next process takes
// it over (user recovery); neither fio sees an error, every block of both
// verifies, both devices read back their server's file, and the second
// volume's process is never replaced: a volume's crash is its own.
func TestUblkVolumeProcessKilled(t *testing.T) {
	requireUblkGuest(t)
	requireFaultTools(t)
	tp := guestTopology(t)
	stA, stB := newStorage(t, tp, faultExportSize, true), newStorage(t, tp, faultExportSize, true)
	a := newUblkAttacher(t, tp, t.TempDir())
	tgA, tgB := stA.target(volID(t)+"-a"), stB.target(volID(t)+"-b")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	attA, err := a.Attach(ctx, tgA, attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	attB, err := a.Attach(ctx, tgB, attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	devA, devB := attA.Device, attB.Device
	pidB := a.ServerPID(tgB.VolumeID)
	if pidB == 0 || pidB == os.Getpid() || a.ServerPID(tgA.VolumeID) == pidB {
		t.Fatalf("volume processes %d and %d (this process %d): want one of their own each", a.ServerPID(tgA.VolumeID), pidB, os.Getpid())
	}
	seed := int(time.Now().UnixNano() % 1000000)
	stuckA := func(what string) { reportStuck(t, devA, what, "(its volume process is SIGKILLed)") }
	stuckB := func(what string) { reportStuck(t, devB, what, "(beside a volume whose process is SIGKILLed)") }
	fB := startFio(t, devB, seed+11)
	fA := startFio(t, devA, seed+7)
	for kill := 1; kill <= 3; kill++ {
		fA = midWrite(t, fA, devA, 128, func() *fioRun { seed++; return startFio(t, devA, seed+7) }, stuckA)
		pid := a.ServerPID(tgA.VolumeID)
		if pid == 0 {
			t.Fatalf("kill %d: no process serves %s", kill, tgA.VolumeID)
		}
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
			t.Fatalf("kill %d: %v", kill, err)
		}
		killed := time.Now()
		for deadline := killed.Add(time.Minute); ; time.Sleep(20 * time.Millisecond) {
			if p := a.ServerPID(tgA.VolumeID); p != 0 && p != pid {
				t.Logf("kill %d: process %d SIGKILLed; %d took the device over %v later", kill, pid, p, time.Since(killed).Round(time.Millisecond))
				break
			}
			if time.Now().After(deadline) {
				h, err := a.Health(tgA.VolumeID)
				t.Fatalf("kill %d: no new process serves the device a minute after the SIGKILL (health %+v, %v)", kill, h, err)
			}
		}
	}
	if res := fA.wait(t, roundLimit, stuckA); !res.ok() {
		t.Fatalf("fio across three SIGKILLs of the volume's process: %v\n%s", res, tail(res.output, 40))
	} else {
		t.Logf("fio across three SIGKILLs of the volume's process: %v", res)
	}
	if res := fB.wait(t, roundLimit, stuckB); !res.ok() {
		t.Fatalf("fio on the other volume: %v\n%s", res, tail(res.output, 40))
	}
	if p := a.ServerPID(tgB.VolumeID); p != pidB {
		t.Fatalf("the other volume's process is %d, was %d: it was replaced", p, pidB)
	}
	compareWithImage(t, stA.path, devA, stuckA)
	compareWithImage(t, stB.path, devB, stuckB)
	h, err := a.Health(tgA.VolumeID)
	if err != nil || !h.Connected {
		t.Fatalf("health after the kills: %+v, %v", h, err)
	}
	for _, tg := range []attach.Target{tgA, tgB} {
		if err := a.Detach(context.Background(), tg.VolumeID); err != nil {
			t.Fatalf("detach %s: %v", tg.VolumeID, err)
		}
	}
	for _, dev := range []string{devA, devB} {
		if _, err := os.Stat(dev); !os.IsNotExist(err) {
			t.Fatalf("%s after detach: %v", dev, err)
		}
	}
	waitServerConns(t, stA, 0)
	waitServerConns(t, stB, 0)
}
