package nodeattach

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/e2e/topo"
	"github.com/mpnbd/mpnbd/e2e/vm"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/attach/ublkdev"
	"github.com/mpnbd/mpnbd/pkg/ublk"
)

// ublkTests are the guest tests TestNodeAttachUblkInVM runs.
var ublkTests = []string{"TestUblkTransportAttach", "TestUblkServerKills", "TestUblkProcessKilledMidWrite", "TestDatapathHandover", "TestDatapathHandoverDuringOutage"}

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

func newUblkAttacher(t *testing.T, tp *topo.Topology, stateDir string) *ublkdev.Attacher {
	t.Helper()
	a, err := ublkdev.New(ublkdev.Config{StateDir: stateDir, Logger: testLogger(t), DialContext: clientDialer(tp.ClientNS)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Close)
	return a
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
// error, every block verifies, and the device reads back the server's
// file.
func TestUblkServerKills(t *testing.T) {
	requireUblkGuest(t)
	requireFaultTools(t)
	total, every, down := 20*time.Second, 3*time.Second, time.Second
	if soak() {
		total, every = 2*time.Minute, 10*time.Second
	}
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
	killRounds(t, srv, a, tg, att.Device, 1, total, every, down)
}

// TestUblkProcessKilledMidWrite: the process serving a ublk volume (the
// node plugin) is SIGKILLed in the middle of a fio write+verify round; the
// kernel holds the I/O; a new process takes the device over from the
// state directory, and fio finishes with no error, every block verified.
func TestUblkProcessKilledMidWrite(t *testing.T) {
	requireUblkGuest(t)
	requireFaultTools(t)
	tp := guestTopology(t)
	st := newStorage(t, tp, faultExportSize, true)
	cs := childSpec{ClientNS: tp.ClientNS, Target: st.target(volID(t)), StateDir: t.TempDir(), Mode: attach.Ublk}
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
