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
	"os"
	"slices"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/internal/testenv/vm"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/nbd/nbdnl"
)

// envMPTCPKernel tells the guest tests that the VM runs the kernel of
// hack/vm-kernel-mptcp.sh, whose nbd accepts MPTCP sockets.
const envMPTCPKernel = "MPNBD_VM_NBD_MPTCP"

// mptcpKernelTests are the guest tests TestNodeAttachMPTCPKernelInVM
// runs on that kernel.
var mptcpKernelTests = []string{"TestKernelTransportAttach", "TestKernelTransportPathFlap",
	"TestKernelTransportServerRestart", "TestKernelTransportAuto", "TestTransportsServerKills",
	"TestTransportsLongOutage", "TestPluginRestartDuringOutage", "TestServerStallPastRequestTimeout",
	"TestReadoptHealthyDevices", "TestUblkTransportAttach", "TestUblkProcessKilledMidWrite", "TestDatapathHandover", "TestDatapathHandoverDuringOutage",
	"TestRelayTLSServerKills"}

// TestNodeAttachMPTCPKernelInVM boots the VM with the kernel whose nbd
// accepts MPTCP sockets (built by hack/vm-kernel-mptcp.sh; the test skips
// with the reason when it is not built) and runs the `kernel` transport's
// guest tests in it.
func TestNodeAttachMPTCPKernelInVM(t *testing.T) {
	if os.Getenv("MPNBD_IN_VM") == "1" {
		t.Skip("already inside the VM")
	}
	runMPTCPKernelVM(t, selectGuestTests(t, mptcpKernelTests), nil, 15*time.Minute)
}

// runMPTCPKernelVM runs the guest tests names in the VM booted with the
// MPTCP kernel, with env exported, for at most timeout.
func runMPTCPKernelVM(t *testing.T, names []string, env map[string]string, timeout time.Duration, tools ...string) vm.Result {
	t.Helper()
	cfg := vm.DefaultMPTCP(t)
	cfg.Tools = append(cfg.Tools, tools...)
	cfg.MemoryMB = 2048
	cfg.Timeout = timeout
	cfg.Env = map[string]string{envMPTCPKernel: "1"}
	for k, v := range env {
		cfg.Env[k] = v
	}
	addFaultTools(t, &cfg)
	res := runGuestTests(t, cfg, names)
	return res
}

func requireMPTCPKernel(t *testing.T) {
	t.Helper()
	requireGuest(t)
	if os.Getenv(envMPTCPKernel) != "1" {
		t.Skip("needs the VM kernel whose nbd accepts MPTCP (TestNodeAttachMPTCPKernelInVM boots it)")
	}
}

// waitSubflows polls the volume's health until its one connection has
// want subflows, and fails the test after a generous deadline.
func waitSubflows(t *testing.T, a attach.Attacher, volumeID string, want int) attach.Health {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		h, err := a.Health(volumeID)
		if err != nil {
			t.Fatalf("health: %v", err)
		}
		if len(h.Subflows) == 1 && h.Subflows[0] == want {
			return h
		}
		if time.Now().After(deadline) {
			t.Fatalf("subflows %v, want [%d] (health %+v)", h.Subflows, want, h)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// logClientSubflows logs what ss reports for the client side's subflows
// and returns how many there are.
func logClientSubflows(t *testing.T, tp *topo.Topology) int {
	t.Helper()
	subs, err := tp.ClientSubflows()
	if err != nil {
		t.Logf("ss: %v", err)
		return 0
	}
	for _, s := range subs {
		t.Logf("subflow %v -> %v flags %s sent %d received %d", s.Local, s.Remote, s.Flags, s.BytesSent, s.BytesReceived)
	}
	return len(subs)
}

// TestKernelTransportAttach: the kernel's nbd driver takes the MPTCP
// socket itself. The connection gets a subflow per path, a filesystem
// written through it verifies after a detach and a reattach, and nothing
// is left behind.
func TestKernelTransportAttach(t *testing.T) {
	requireMPTCPKernel(t)
	tp := guestTopology(t)
	st := newStorage(t, tp, volSize, true)
	a, nl := newAttacher(t, tp, attach.Kernel)
	tg := st.target(volID(t))
	ctx := context.Background()

	att, err := a.Attach(ctx, tg, attach.Options{})
	if err != nil {
		t.Fatalf("attach with the kernel transport: %v", err)
	}
	if att.Transport != attach.Kernel || att.Size != volSize || !att.MPTCP {
		t.Fatalf("attachment %+v, want kernel transport over MPTCP", att)
	}
	if _, err := os.Stat(att.Device); err != nil {
		t.Fatalf("device: %v", err)
	}
	idx := indexOf(t, att.Device)
	if backend, err := nbdnl.Backend(idx); err != nil || backend != tg.VolumeID {
		t.Fatalf("backend identifier %q, %v; want %q", backend, err, tg.VolumeID)
	}
	if devs := nbdDevicesConnected(t, nl); !slices.Contains(devs, idx) {
		t.Fatalf("nbd%d not connected according to the kernel (connected: %v)", idx, devs)
	}
	if n := st.conns(); n != 1 {
		t.Fatalf("server sees %d connections, want the one MPTCP connection", n)
	}
	h := waitSubflows(t, a, tg.VolumeID, len(tp.Paths))
	t.Logf("health: %+v", h)

	sum := mkfsMountWrite(t, att.Device, dataSize)
	h = waitSubflows(t, a, tg.VolumeID, len(tp.Paths))
	if !h.Connected || !h.MPTCP || h.Reconnects != 0 {
		t.Fatalf("health after the write: %+v", h)
	}
	if n := logClientSubflows(t, tp); n != len(tp.Paths) {
		t.Errorf("ss lists %d client subflows, want %d", n, len(tp.Paths))
	}

	if err := a.Detach(ctx, tg.VolumeID); err != nil {
		t.Fatalf("detach: %v", err)
	}
	waitGone(t, nl, st)

	att2, err := a.Attach(ctx, tg, attach.Options{})
	if err != nil {
		t.Fatalf("reattach: %v", err)
	}
	if att2.Transport != attach.Kernel {
		t.Fatalf("reattach: %+v", att2)
	}
	if got := mountAndSum(t, att2.Device); got != sum {
		t.Fatalf("data after reattach: sha256 %s, want %s", got, sum)
	}
	if err := a.Detach(ctx, tg.VolumeID); err != nil {
		t.Fatal(err)
	}
	waitGone(t, nl, st)
}

// TestKernelTransportPathFlap takes one of the four paths down in the
// middle of a filesystem write and brings it back: MPTCP carries on over
// the other subflows, so the write sees no error, the device never loses
// its connection (no reconnect) and the data verifies.
func TestKernelTransportPathFlap(t *testing.T) {
	requireMPTCPKernel(t)
	tp := guestTopology(t)
	st := newStorage(t, tp, volSize, true)
	a, _ := newAttacher(t, tp, attach.Kernel)
	tg := st.target(volID(t))
	att, err := a.Attach(context.Background(), tg, attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer detach(t, a, tg.VolumeID)
	waitSubflows(t, a, tg.VolumeID, len(tp.Paths))

	run(t, "mkfs.ext4", "-q", "-F", att.Device)
	mnt := t.TempDir()
	run(t, "mount", att.Device, mnt)
	mounted := true
	defer func() {
		if mounted {
			run(t, "umount", mnt)
		}
	}()
	type result struct {
		sum string
		err error
	}
	done := make(chan result, 1)
	go func() {
		sum, err := writeRandomFileErr(mnt+"/data", 2*dataSize)
		done <- result{sum, err}
	}()
	link := tp.Paths[1].ClientIf
	time.Sleep(500 * time.Millisecond)
	if out, err := topo.Exec(tp.ClientNS, "ip", "link", "set", link, "down").CombinedOutput(); err != nil {
		t.Fatalf("link down: %v\n%s", err, out)
	}
	time.Sleep(1500 * time.Millisecond)
	if out, err := topo.Exec(tp.ClientNS, "ip", "link", "set", link, "up").CombinedOutput(); err != nil {
		t.Fatalf("link up: %v\n%s", err, out)
	}
	res := <-done
	if res.err != nil {
		t.Fatalf("filesystem write with a path going down: %v", res.err)
	}
	run(t, "umount", mnt)
	mounted = false
	h, err := a.Health(tg.VolumeID)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("health after the path flap: %+v", h)
	logClientSubflows(t, tp)
	if !h.Connected || !h.MPTCP || h.Reconnects != 0 {
		t.Errorf("the MPTCP connection did not ride out the path flap: %+v", h)
	}
	if got := mountAndSum(t, att.Device); got != res.sum {
		t.Fatalf("data after the path flap: sha256 %s, want %s", got, res.sum)
	}
}

// TestKernelTransportServerRestart kills the storage server's connection
// in the middle of a filesystem write and starts the server again: the
// kernel marks the socket dead and multicasts LINK_DEAD, the attacher
// redials over MPTCP and hands the new socket over with RECONFIGURE and
// the volume's backend identifier; the write sees no error and the data
// verifies after a remount.
func TestKernelTransportServerRestart(t *testing.T) {
	requireMPTCPKernel(t)
	tp := guestTopology(t)
	st := newStorage(t, tp, volSize, true)
	a, _ := newAttacher(t, tp, attach.Kernel)
	tg := st.target(volID(t))
	att, err := a.Attach(context.Background(), tg, attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer detach(t, a, tg.VolumeID)
	idx := indexOf(t, att.Device)
	run(t, "mkfs.ext4", "-q", "-F", att.Device)
	mnt := t.TempDir()
	run(t, "mount", att.Device, mnt)
	mounted := true
	defer func() {
		if mounted {
			run(t, "umount", mnt)
		}
	}()

	type result struct {
		sum string
		err error
	}
	done := make(chan result, 1)
	go func() {
		sum, err := writeRandomFileErr(mnt+"/data", dataSize)
		done <- result{sum, err}
	}()
	time.Sleep(700 * time.Millisecond)
	st.restart()
	res := <-done
	if res.err != nil {
		t.Fatalf("filesystem write failed across the server restart: %v", res.err)
	}
	run(t, "umount", mnt)
	mounted = false

	h, err := a.Health(tg.VolumeID)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("health after restart: %+v", h)
	if h.Reconnects < 1 {
		t.Errorf("no reconnect recorded (%+v): was the server really restarted mid-write?", h)
	}
	if !h.MPTCP {
		t.Errorf("the replacement connection is not MPTCP: %+v", h)
	}
	if backend, err := nbdnl.Backend(idx); err != nil || backend != tg.VolumeID {
		t.Errorf("backend identifier after the reconnect %q, %v; want %q", backend, err, tg.VolumeID)
	}
	if got := mountAndSum(t, att.Device); got != res.sum {
		t.Fatalf("data after the restart: sha256 %s, want %s", got, res.sum)
	}
	waitSubflows(t, a, tg.VolumeID, len(tp.Paths))
}

// TestKernelTransportAuto: on a kernel that accepts MPTCP sockets, auto
// picks the kernel transport and records no refusal (on the stock kernel
// TestKernelTransportRefused shows it picking relay).
func TestKernelTransportAuto(t *testing.T) {
	requireMPTCPKernel(t)
	tp := guestTopology(t)
	st := newStorage(t, tp, volSize, true)
	k, nl := newAttacher(t, tp, attach.Kernel)
	r, _ := newAttacher(t, tp, attach.Relay)
	tg := st.target(volID(t))

	m := attach.NewManager(map[attach.Transport]attach.Attacher{attach.Kernel: k, attach.Relay: r}, testLogger(t))
	att, err := m.Attach(context.Background(), attach.Auto, tg, attach.Options{})
	if err != nil {
		t.Fatalf("auto: %v", err)
	}
	if att.Transport != attach.Kernel || m.KernelRefused() || len(m.Fallbacks()) != 0 {
		t.Fatalf("auto chose %s (kernel refused: %v, fallbacks %+v), want kernel",
			att.Transport, m.KernelRefused(), m.Fallbacks())
	}
	if tr, ok := m.Chosen(tg.VolumeID); !ok || tr != attach.Kernel {
		t.Fatalf("chosen transport %q %v", tr, ok)
	}
	tr, h, err := m.Health(tg.VolumeID)
	if err != nil || tr != attach.Kernel || !h.MPTCP {
		t.Fatalf("health through the manager: %s %+v %v", tr, h, err)
	}
	if err := m.Detach(context.Background(), tg.VolumeID); err != nil {
		t.Fatal(err)
	}
	waitGone(t, nl, st)
}
