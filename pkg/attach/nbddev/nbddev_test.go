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

package nbddev

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/nbd"
	"github.com/mpnbd/mpnbd/pkg/nbd/nbdnl"
)

// fakeKernel records what the attacher asks of the kernel.
type fakeKernel struct {
	mu           sync.Mutex
	connects     []nbdnl.ConnectOptions
	reconfigs    []nbdnl.ReconfigureOptions
	disconnects  []uint32
	connectErr   error
	reconfigErr  error
	nextIndex    uint32
	linkDead     chan nbdnl.LinkDead
	reconfigured chan struct{}
	// holdSockets keeps a reference to every socket handed over, as the
	// real kernel does.
	holdSockets bool
	held        []*os.File
	// healthy: the device has no dead slot, so a RECONFIGURE takes no
	// socket (the real kernel then drops them without an error).
	healthy bool
}

// take marks sockets taken as the real kernel does: it sets them to send
// with the device's request timeout.
func take(files []*os.File) error {
	for _, f := range files {
		tv := syscall.Timeval{Sec: 30}
		if err := syscall.SetsockoptTimeval(int(f.Fd()), syscall.SOL_SOCKET, syscall.SO_SNDTIMEO, &tv); err != nil {
			return err
		}
	}
	return nil
}

func (k *fakeKernel) hold(files []*os.File) {
	if !k.holdSockets {
		return
	}
	for _, f := range files {
		if fd, err := syscall.Dup(int(f.Fd())); err == nil {
			k.held = append(k.held, os.NewFile(uintptr(fd), "held"))
		}
	}
}

func newFakeKernel() *fakeKernel {
	return &fakeKernel{linkDead: make(chan nbdnl.LinkDead, 1), reconfigured: make(chan struct{}, 4)}
}

func (k *fakeKernel) Connect(o nbdnl.ConnectOptions) (uint32, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.connects = append(k.connects, o)
	if k.connectErr != nil {
		return 0, k.connectErr
	}
	k.hold(o.Sockets)
	i := k.nextIndex
	k.nextIndex++
	return i, nil
}

func (k *fakeKernel) Disconnect(i uint32) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.disconnects = append(k.disconnects, i)
	return nil
}

func (k *fakeKernel) Reconfigure(i uint32, o nbdnl.ReconfigureOptions) error {
	k.mu.Lock()
	k.reconfigs = append(k.reconfigs, o)
	err := k.reconfigErr
	if err == nil && !k.healthy {
		if err = take(o.Sockets); err == nil {
			k.hold(o.Sockets)
		}
	}
	k.mu.Unlock()
	k.reconfigured <- struct{}{}
	return err
}

func (k *fakeKernel) WatchLinkDead(ctx context.Context) (<-chan nbdnl.LinkDead, error) {
	out := make(chan nbdnl.LinkDead)
	go func() {
		defer close(out)
		for {
			select {
			case ev := <-k.linkDead:
				out <- ev
			case <-ctx.Done():
				return
			}
		}
	}()
	return out, nil
}

type fakeDevices struct {
	readyErr error
	backends map[string]uint32
}

func (d *fakeDevices) WaitReady(context.Context, uint32, uint64) error { return d.readyErr }

func (d *fakeDevices) FindByBackend(id string) (uint32, bool, error) {
	i, ok := d.backends[id]
	return i, ok, nil
}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func startServer(t *testing.T) (*nbd.Server, string) {
	t.Helper()
	s := &nbd.Server{Logger: quiet()}
	if err := s.AddExport(&nbd.Export{Name: "vol", Backend: nbd.NewMemBackend(1 << 20)}); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go s.Serve(l)
	t.Cleanup(func() { s.Shutdown(context.Background()) })
	return s, l.Addr().String()
}

func newTest(t *testing.T, mode attach.Transport) (*Attacher, *fakeKernel, *fakeDevices, *nbd.Server, attach.Target) {
	t.Helper()
	s, addr := startServer(t)
	k := newFakeKernel()
	d := &fakeDevices{backends: map[string]uint32{}}
	a, err := New(Config{Mode: mode, Kernel: k, Devices: d, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Close)
	return a, k, d, s, attach.Target{VolumeID: "pvc-1", Export: "vol", Addrs: []string{addr}}
}

func conns(s *nbd.Server) int {
	e, _ := s.Export("vol")
	return e.ConnCount()
}

func waitConns(t *testing.T, s *nbd.Server, want int) {
	t.Helper()
	for i := 0; i < 500 && conns(s) != want; i++ {
		time.Sleep(10 * time.Millisecond)
	}
	if n := conns(s); n != want {
		t.Fatalf("server has %d connections, want %d", n, want)
	}
}

func TestConnectSendsEverything(t *testing.T) {
	a, k, _, s, tg := newTest(t, attach.TCP)
	att, err := a.Attach(context.Background(), tg, attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if att.Device != "/dev/nbd0" || att.Size != 1<<20 || att.Transport != attach.TCP || att.MPTCP {
		t.Fatalf("attachment %+v", att)
	}
	if len(k.connects) != 1 {
		t.Fatalf("%d connects", len(k.connects))
	}
	o := k.connects[0]
	e, _ := s.Export("vol")
	if o.BackendID != "pvc-1" || o.ClientFlags != nbdnl.DestroyOnDisconnect || o.Size != 1<<20 ||
		o.BlockSize != 4096 || o.DeadConnTimeout != attach.DefaultDeadConnTimeout ||
		o.Timeout != attach.DefaultRequestTimeout || o.ServerFlags != uint64(e.Flags()) || len(o.Sockets) != 1 {
		t.Fatalf("connect options %+v", o)
	}
	// Idempotent.
	if again, err := a.Attach(context.Background(), tg, attach.Options{}); err != nil || again.Device != att.Device || len(k.connects) != 1 {
		t.Fatalf("second attach: %+v %v (%d connects)", again, err, len(k.connects))
	}
	if err := a.Detach(context.Background(), "pvc-1"); err != nil || len(k.disconnects) != 1 {
		t.Fatalf("detach: %v %v", err, k.disconnects)
	}
	waitConns(t, s, 0)
}

func TestFailedAttachLeavesNothing(t *testing.T) {
	t.Run("not ready", func(t *testing.T) {
		a, k, d, s, tg := newTest(t, attach.TCP)
		d.readyErr = errors.New("no pid file")
		if _, err := a.Attach(context.Background(), tg, attach.Options{}); err == nil {
			t.Fatal("attach succeeded")
		}
		if len(k.disconnects) != 1 {
			t.Fatalf("device not disconnected after a failed wait: %v", k.disconnects)
		}
		waitConns(t, s, 0)
	})
	t.Run("kernel refuses MPTCP", func(t *testing.T) {
		a, k, _, s, tg := newTest(t, attach.Kernel)
		k.connectErr = nbdnl.ErrUnsupportedSocket
		_, err := a.Attach(context.Background(), tg, attach.Options{})
		if !errors.Is(err, attach.ErrUnsupported) {
			t.Fatalf("err = %v", err)
		}
		waitConns(t, s, 0)
	})
	t.Run("unknown export", func(t *testing.T) {
		a, k, _, _, tg := newTest(t, attach.TCP)
		tg.Export = "nope"
		if _, err := a.Attach(context.Background(), tg, attach.Options{}); !errors.Is(err, attach.ErrServerRefused) {
			t.Fatalf("err = %v", err)
		}
		if len(k.connects) != 0 {
			t.Fatal("kernel asked to connect a refused export")
		}
	})
	t.Run("bad target", func(t *testing.T) {
		a, _, _, _, _ := newTest(t, attach.TCP)
		for _, tg := range []attach.Target{{Export: "e", Addrs: []string{"x"}}, {VolumeID: "v", Addrs: []string{"x"}}, {VolumeID: "v", Export: "e"}} {
			if _, err := a.Attach(context.Background(), tg, attach.Options{}); !errors.Is(err, attach.ErrInvalid) {
				t.Errorf("%+v: %v", tg, err)
			}
		}
	})
}

func TestAdoptExistingDevice(t *testing.T) {
	a, k, d, _, tg := newTest(t, attach.TCP)
	d.backends["pvc-1"] = 5
	att, err := a.Attach(context.Background(), tg, attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if att.Device != "/dev/nbd5" || len(k.connects) != 0 || len(k.reconfigs) != 1 || k.reconfigs[0].BackendID != "pvc-1" {
		t.Fatalf("adopt: %+v connects=%d reconfigs=%+v", att, len(k.connects), k.reconfigs)
	}
}

func TestAdoptWrongVolume(t *testing.T) {
	a, k, d, s, tg := newTest(t, attach.TCP)
	d.backends["pvc-1"] = 2
	k.reconfigErr = nbdnl.ErrBackendMismatch
	if _, err := a.Attach(context.Background(), tg, attach.Options{}); !errors.Is(err, attach.ErrWrongVolume) {
		t.Fatalf("err = %v", err)
	}
	waitConns(t, s, 0)
}

func TestLinkDeadReconnects(t *testing.T) {
	a, k, _, s, tg := newTest(t, attach.TCP)
	if _, err := a.Attach(context.Background(), tg, attach.Options{}); err != nil {
		t.Fatal(err)
	}
	waitConns(t, s, 1)
	k.linkDead <- nbdnl.LinkDead{Index: 0}
	select {
	case <-k.reconfigured:
	case <-time.After(10 * time.Second):
		t.Fatal("no RECONFIGURE after LINK_DEAD")
	}
	k.mu.Lock()
	o := k.reconfigs[0]
	k.mu.Unlock()
	if o.BackendID != "pvc-1" || len(o.Sockets) != 1 {
		t.Fatalf("reconfigure options %+v", o)
	}
	for i := 0; i < 100; i++ {
		if h, _ := a.Health("pvc-1"); h.Reconnects == 1 {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatal("reconnect not counted in health")
}

func TestDetachUnknown(t *testing.T) {
	a, k, d, _, _ := newTest(t, attach.TCP)
	if err := a.Detach(context.Background(), "nobody"); err != nil || len(k.disconnects) != 0 {
		t.Fatalf("detach unknown: %v %v", err, k.disconnects)
	}
	d.backends["leftover"] = 3
	if err := a.Detach(context.Background(), "leftover"); err != nil || len(k.disconnects) != 1 || k.disconnects[0] != 3 {
		t.Fatalf("detach a device from an earlier process: %v %v", err, k.disconnects)
	}
}

func TestNewRejectsOtherModes(t *testing.T) {
	if _, err := New(Config{Mode: attach.FUSE, Kernel: newFakeKernel(), Devices: &fakeDevices{}}); !errors.Is(err, attach.ErrInvalid) {
		t.Fatalf("err = %v", err)
	}
}

func TestStateAndAdopt(t *testing.T) {
	_, addr := startServer(t)
	dir := t.TempDir()
	k := newFakeKernel()
	d := &fakeDevices{backends: map[string]uint32{}}
	a, err := New(Config{Mode: attach.TCP, Kernel: k, Devices: d, Logger: quiet(), StateDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	tg := attach.Target{VolumeID: "pvc-9", Export: "vol", Addrs: []string{addr}}
	if _, err := a.Attach(context.Background(), tg, attach.Options{DeadConnTimeout: time.Minute}); err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(dir + "/pvc-9.json")
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("state file: %v %v", st, err)
	}
	a.Close()

	// A fresh process: the device still exists under its identifier.
	d.backends["pvc-9"] = 0
	d.backends["other"] = 1
	if err := os.WriteFile(dir+"/gone.json", []byte(`{"mode":"tcp","target":{"VolumeID":"gone","Export":"vol","Addrs":["x"]}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	b, err := New(Config{Mode: attach.TCP, Kernel: k, Devices: d, Logger: quiet(), StateDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	atts, err := b.Adopt(context.Background())
	if err != nil || len(atts) != 1 || atts[0].Device != "/dev/nbd0" {
		t.Fatalf("adopt: %+v %v", atts, err)
	}
	if len(k.reconfigs) != 1 || k.reconfigs[0].BackendID != "pvc-9" {
		t.Fatalf("reconfigures: %+v", k.reconfigs)
	}
	if _, err := os.Stat(dir + "/gone.json"); !os.IsNotExist(err) {
		t.Fatalf("state of a vanished device kept: %v", err)
	}
	if err := b.Detach(context.Background(), "pvc-9"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir + "/pvc-9.json"); !os.IsNotExist(err) {
		t.Fatalf("state file kept after detach: %v", err)
	}
}

func TestResize(t *testing.T) {
	a, k, _, s, target := newTest(t, attach.TCP)
	ctx := context.Background()
	if _, err := a.Resize(ctx, target.VolumeID, 1<<20); !errors.Is(err, attach.ErrNotAttached) {
		t.Fatalf("Resize before Attach: %v, want ErrNotAttached", err)
	}
	if _, err := a.Attach(ctx, target, attach.Options{}); err != nil {
		t.Fatal(err)
	}
	e, _ := s.Export("vol")
	if _, err := a.Resize(ctx, target.VolumeID, 2<<20); !errors.Is(err, attach.ErrTooSmall) {
		t.Fatalf("Resize past the export's size: %v, want ErrTooSmall", err)
	}
	if err := e.Backend.(*nbd.MemBackend).Resize(2 << 20); err != nil {
		t.Fatal(err)
	}
	n, err := a.Resize(ctx, target.VolumeID, 2<<20)
	if err != nil || n != 2<<20 {
		t.Fatalf("Resize = %d, %v; want %d", n, err, 2<<20)
	}
	k.mu.Lock()
	last := k.reconfigs[len(k.reconfigs)-1]
	k.mu.Unlock()
	if last.Size != 2<<20 || last.BackendID != target.VolumeID || len(last.Sockets) != 0 {
		t.Fatalf("RECONFIGURE %+v; want only size %d with the backend identifier", last, 2<<20)
	}
	att, err := a.Attach(ctx, target, attach.Options{})
	if err != nil || att.Size != 2<<20 {
		t.Fatalf("attachment after Resize: %+v, %v", att, err)
	}
	before := len(k.reconfigs)
	if n, err := a.Resize(ctx, target.VolumeID, 1<<20); err != nil || n != 2<<20 {
		t.Fatalf("Resize to a smaller size = %d, %v; want the export's %d", n, err, 2<<20)
	}
	if len(k.reconfigs) != before {
		t.Fatal("Resize with an unchanged size reconfigured the device")
	}
}
