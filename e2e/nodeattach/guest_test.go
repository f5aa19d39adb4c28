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

	"github.com/mpnbd/mpnbd/e2e/topo"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/nbd/nbdnl"
)

// Sizes are modest: the VM runs under TCG, about ten times slower than
// the host.
const (
	volSize  = 256 << 20
	dataSize = 64 << 20
)

func guestTopology(t *testing.T) *topo.Topology {
	// Rates stay at line rate: TCG is the bottleneck in the VM, not tbf.
	return topo.NewForTest(t, topo.Uniform(topo.UniqueName("na"), 4, 1000))
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

			sum := mkfsMountWrite(t, att.Device, dataSize)
			if mode == attach.Relay {
				h, _ := a.Health(tg.VolumeID)
				if len(h.Subflows) != 1 || h.Subflows[0] != len(tp.Paths) {
					t.Errorf("relay subflows %v, want [%d]", h.Subflows, len(tp.Paths))
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

// TestRelaySurvivesServerRestart kills the storage server in the middle of
// a write and starts it again: the writer sees no error, data verifies.
func TestRelaySurvivesServerRestart(t *testing.T) {
	requireGuest(t)
	tp := guestTopology(t)
	st := newStorage(t, tp, volSize, true)
	a, _ := newAttacher(t, tp, attach.Relay)
	tg := st.target(volID(t))
	att, err := a.Attach(context.Background(), tg, attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Detach(context.Background(), tg.VolumeID)

	data := make([]byte, dataSize)
	rand.Read(data)
	errc := make(chan error, 1)
	go func() { errc <- writeDevice(att.Device, data) }()
	time.Sleep(500 * time.Millisecond)
	st.restart()
	if err := <-errc; err != nil {
		t.Fatalf("writer saw an error across the server restart: %v", err)
	}
	h, _ := a.Health(tg.VolumeID)
	t.Logf("health after restart: %+v", h)
	got, err := readDevice(att.Device, len(data))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data) {
		t.Fatal("data differs after the server restart")
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
	defer a.Detach(context.Background(), tg.VolumeID)
	data := make([]byte, dataSize)
	rand.Read(data)
	if err := writeDevice(att.Device, data); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		time.Sleep(300 * time.Millisecond)
		link := tp.Paths[1].ClientIf
		topo.Exec(tp.ClientNS, "ip", "link", "set", link, "down").Run()
		time.Sleep(time.Second)
		topo.Exec(tp.ClientNS, "ip", "link", "set", link, "up").Run()
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
	defer a.Detach(context.Background(), tg.VolumeID)
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
