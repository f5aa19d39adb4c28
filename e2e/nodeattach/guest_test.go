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
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/nbd/nbdnl"
)

// Sizes are modest: the VM runs under TCG, about ten times slower than
// the host.
const (
	volSize  = 512 << 20
	dataSize = 64 << 20
	// bigData is what the main attach test writes through the filesystem.
	bigData = 200 << 20
)

// guestTopology builds a topology whose client host is the guest's own
// network namespace: this process and its children dial from it as a
// node plugin on its host does, and reach the kernel's nbd netlink family
// there.
func guestTopology(t *testing.T) *topo.Topology {
	return newGuestTopology(t, false)
}

// plainGuestTopology is guestTopology for tests whose connections are
// plain TCP (Debian's nbd-server, the tcp and multiconn transports): no
// subflow joins from this namespace, so it does not wait for the MPTCP
// endpoints the others take turns for (topo.Config.PlainTCP).
func plainGuestTopology(t *testing.T) *topo.Topology {
	return newGuestTopology(t, true)
}

func newGuestTopology(t *testing.T, plain bool) *topo.Topology {
	// Rates stay at line rate: TCG is the bottleneck in the VM, not tbf.
	cfg := topo.Uniform(topo.UniqueName("na"), 4, 1000)
	cfg.ClientInCaller, cfg.PlainTCP = true, plain
	return topo.NewForTest(t, cfg)
}

// TestAttachTransports attaches with relay, multiconn and tcp: mkfs.ext4,
// mount, write, sync, unmount, detach, reattach, verify bit-exact; nothing
// left behind afterwards.
func TestAttachTransports(t *testing.T) {
	requireGuest(t)
	for _, mode := range []attach.Transport{attach.Relay, attach.MultiConn, attach.TCP} {
		t.Run(string(mode), func(t *testing.T) {
			tp := guestTopology(t)
			st := newStorage(t, tp, volSize, mode == attach.Relay)
			a, nl := newAttacher(t, tp, mode)
			tg := st.target(volID(t))
			ctx := context.Background()

			att, err := a.Attach(ctx, tg, attach.Options{})
			if err != nil {
				t.Fatalf("attach: %v", err)
			}
			if att.Size != volSize || att.Transport != mode {
				t.Fatalf("attachment %+v", att)
			}
			// Attach is idempotent.
			again, err := a.Attach(ctx, tg, attach.Options{})
			if err != nil || again.Device != att.Device {
				t.Fatalf("second attach: %+v %v", again, err)
			}
			backend, err := nbdnl.Backend(indexOf(t, att.Device))
			if err != nil || backend != tg.VolumeID {
				t.Fatalf("backend identifier %q, %v; want %q", backend, err, tg.VolumeID)
			}
			h, err := a.Health(tg.VolumeID)
			if err != nil || !h.Connected {
				t.Fatalf("health %+v %v", h, err)
			}
			switch mode {
			case attach.Relay:
				if !h.MPTCP {
					t.Fatalf("relay connection is not MPTCP: %+v", h)
				}
			case attach.MultiConn:
				if st.conns() != len(tp.Paths) {
					t.Fatalf("multiconn: server sees %d connections, want %d", st.conns(), len(tp.Paths))
				}
			}

			sum := mkfsMountWrite(t, att.Device, bigData)
			if mode == attach.Relay {
				// Joins complete asynchronously (slowly in a loaded VM):
				// wait, bounded, for one subflow per path.
				var h attach.Health
				for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(200 * time.Millisecond) {
					h, _ = a.Health(tg.VolumeID)
					if len(h.Subflows) == 1 && h.Subflows[0] == len(tp.Paths) || time.Now().After(deadline) {
						break
					}
				}
				if len(h.Subflows) != 1 || h.Subflows[0] != len(tp.Paths) {
					t.Errorf("relay subflows %v after 30 s, want [%d]", h.Subflows, len(tp.Paths))
				}
			}
			if err := a.Detach(ctx, tg.VolumeID); err != nil {
				t.Fatalf("detach: %v", err)
			}
			waitGone(t, nl, st)
			if _, err := os.Stat(att.Device); err == nil {
				// DESTROY_ON_DISCONNECT removes the device once unused.
				t.Logf("note: %s still present after detach", att.Device)
			}

			att2, err := a.Attach(ctx, tg, attach.Options{})
			if err != nil {
				t.Fatalf("reattach: %v", err)
			}
			if got := mountAndSum(t, att2.Device); got != sum {
				t.Fatalf("data after reattach: sha256 %s, want %s", got, sum)
			}
			if err := a.Detach(ctx, tg.VolumeID); err != nil {
				t.Fatal(err)
			}
			// Detach of a detached volume succeeds.
			if err := a.Detach(ctx, tg.VolumeID); err != nil {
				t.Fatalf("second detach: %v", err)
			}
			waitGone(t, nl, st)
		})
	}
}

// TestKernelTransportRefused: the stock kernel refuses MPTCP sockets; the
// refusal is recognised, nothing leaks, and auto falls back to relay.
func TestKernelTransportRefused(t *testing.T) {
	requireGuest(t)
	tp := guestTopology(t)
	st := newStorage(t, tp, volSize, true)
	k, nl := newAttacher(t, tp, attach.Kernel)
	r, _ := newAttacher(t, tp, attach.Relay)
	tg := st.target(volID(t))

	_, err := k.Attach(context.Background(), tg, attach.Options{})
	if !errors.Is(err, attach.ErrUnsupported) {
		t.Fatalf("kernel transport on a stock kernel: %v, want ErrUnsupported", err)
	}
	t.Logf("refusal: %v", err)
	waitGone(t, nl, st)

	m := attach.NewManager(map[attach.Transport]attach.Attacher{attach.Kernel: k, attach.Relay: r}, testLogger(t))
	att, err := m.Attach(context.Background(), attach.Auto, tg, attach.Options{})
	if err != nil {
		t.Fatalf("auto: %v", err)
	}
	if att.Transport != attach.Relay || !m.KernelRefused() {
		t.Fatalf("auto chose %s (kernel refused: %v)", att.Transport, m.KernelRefused())
	}
	if err := m.Detach(context.Background(), tg.VolumeID); err != nil {
		t.Fatal(err)
	}
	waitGone(t, nl, st)
}

// TestServerRestartMidWrite kills the storage server while a file is being
// written on a mounted filesystem and starts it again: the filesystem sees
// no error and the data verifies after a remount. For relay the relay
// redials and replays; for tcp the kernel marks the socket dead, LINK_DEAD
// makes the attacher redial and RECONFIGURE.
func TestServerRestartMidWrite(t *testing.T) {
	requireGuest(t)
	for _, mode := range []attach.Transport{attach.Relay, attach.TCP} {
		t.Run(string(mode), func(t *testing.T) {
			tp := guestTopology(t)
			st := newStorage(t, tp, volSize, mode == attach.Relay)
			a, _ := newAttacher(t, tp, mode)
			tg := st.target(volID(t))
			att, err := a.Attach(context.Background(), tg, attach.Options{})
			if err != nil {
				t.Fatal(err)
			}
			defer detach(t, a, tg.VolumeID)
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
			h, _ := a.Health(tg.VolumeID)
			t.Logf("health after restart: %+v", h)
			if h.Reconnects < 1 {
				t.Errorf("no reconnect recorded (%+v): was the server really restarted mid-write?", h)
			}
			if got := mountAndSum(t, att.Device); got != res.sum {
				t.Fatalf("data after the restart: sha256 %s, want %s", got, res.sum)
			}
		})
	}
}

// TestPathDownMidRead takes a path down while reading and brings it back.
func TestPathDownMidRead(t *testing.T) {
	requireGuest(t)
	tp := guestTopology(t)
	st := newStorage(t, tp, volSize, true)
	a, _ := newAttacher(t, tp, attach.Relay)
	tg := st.target(volID(t))
	att, err := a.Attach(context.Background(), tg, attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer detach(t, a, tg.VolumeID)
	data := make([]byte, dataSize)
	rand.Read(data)
	if err := writeDevice(att.Device, data); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	var linkErr error // read after wg.Wait
	go func() {
		defer wg.Done()
		time.Sleep(300 * time.Millisecond)
		link := tp.Paths[1].ClientIf
		if linkErr = topo.Exec(tp.ClientNS, "ip", "link", "set", link, "down").Run(); linkErr != nil {
			return
		}
		time.Sleep(time.Second)
		linkErr = topo.Exec(tp.ClientNS, "ip", "link", "set", link, "up").Run()
	}()
	for i := 0; i < 3; i++ {
		got, err := readDevice(att.Device, len(data))
		if err != nil {
			t.Fatalf("read %d with a path going down: %v", i, err)
		}
		if !bytes.Equal(got, data) {
			t.Fatalf("read %d differs", i)
		}
	}
	wg.Wait()
	if linkErr != nil {
		t.Fatalf("taking path 1 down and up: %v", linkErr)
	}
}

// TestWrongVolumeRefused: re-adopting a device with another volume's
// identifier is refused by the kernel and reported as such.
func TestWrongVolumeRefused(t *testing.T) {
	requireGuest(t)
	tp := guestTopology(t)
	st := newStorage(t, tp, volSize, false)
	a, nl := newAttacher(t, tp, attach.TCP)
	tg := st.target(volID(t))
	att, err := a.Attach(context.Background(), tg, attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer detach(t, a, tg.VolumeID)
	idx := indexOf(t, att.Device)
	f, err := dialTCPFile(t, tp, st)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	err = nl.Reconfigure(idx, nbdnl.ReconfigureOptions{Sockets: []*os.File{f}, BackendID: "pvc-someone-else"})
	if !errors.Is(err, nbdnl.ErrBackendMismatch) {
		t.Fatalf("reconfigure with another identifier: %v, want ErrBackendMismatch", err)
	}
}

func indexOf(t *testing.T, dev string) uint32 {
	t.Helper()
	var i uint32
	if _, err := fmt.Sscanf(dev, "/dev/nbd%d", &i); err != nil {
		t.Fatalf("device %q: %v", dev, err)
	}
	return i
}

// TestMeasureTransports prints sequential 1 MiB O_DIRECT throughput of
// each transport in the VM (not asserted: TCG makes absolute numbers
// meaningless; the ratios are what matter).
func TestMeasureTransports(t *testing.T) {
	requireGuest(t)
	const n = 64 << 20
	data := make([]byte, n)
	rand.Read(data)
	type row struct {
		mode        attach.Transport
		write, read float64
	}
	var rows []row
	for _, mode := range []attach.Transport{attach.TCP, attach.MultiConn, attach.Relay} {
		// A subtest each: its topology goes when it ends.
		ok := t.Run(string(mode), func(t *testing.T) {
			tp := guestTopology(t)
			st := newStorage(t, tp, volSize, mode == attach.Relay)
			a, _ := newAttacher(t, tp, mode)
			tg := st.target(volID(t))
			att, err := a.Attach(context.Background(), tg, attach.Options{})
			if err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			if err := writeDevice(att.Device, data); err != nil {
				t.Fatal(err)
			}
			w := float64(n) / 1e6 / time.Since(start).Seconds()
			start = time.Now()
			got, err := readDevice(att.Device, n)
			if err != nil {
				t.Fatal(err)
			}
			r := float64(n) / 1e6 / time.Since(start).Seconds()
			if !bytes.Equal(got, data) {
				t.Fatalf("%s: data differs", mode)
			}
			rows = append(rows, row{mode, w, r})
			if err := a.Detach(context.Background(), tg.VolumeID); err != nil {
				t.Fatal(err)
			}
		})
		if !ok {
			return
		}
	}
	t.Logf("%-10s %10s %10s %8s %8s", "transport", "write MB/s", "read MB/s", "w/tcp", "r/tcp")
	for _, r := range rows {
		t.Logf("%-10s %10.1f %10.1f %8.2f %8.2f", r.mode, r.write, r.read, r.write/rows[0].write, r.read/rows[0].read)
	}
}
