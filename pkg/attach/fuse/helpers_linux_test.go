package fuse

import (
	"bufio"
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/blockdev"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// requireFUSE skips unless FUSE and loop devices can be used.
func requireFUSE(t testing.TB) {
	t.Helper()
	if err := Available(); err != nil {
		t.Skipf("skipping: %v", err)
	}
}

func requireTool(t testing.TB, name string) {
	t.Helper()
	if _, err := exec.LookPath(name); err != nil {
		t.Skipf("skipping: %s not found: %v", name, err)
	}
}

// connCounter is a server Observer counting open connections per export.
type connCounter struct {
	mu   sync.Mutex
	open map[string]int
}

func (c *connCounter) ConnOpened(_ nbd.ConnInfo, export string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.open == nil {
		c.open = map[string]int{}
	}
	c.open[export]++
}

func (c *connCounter) ConnClosed(_ nbd.ConnInfo, export string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.open[export]--
}

func (c *connCounter) Request(string, uint16, int, time.Duration, uint32) {}

func (c *connCounter) count(export string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.open[export]
}

// waitConns waits for the server to report want connections to export.
func (c *connCounter) waitConns(t testing.TB, export string, want int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for c.count(export) != want {
		if time.Now().After(deadline) {
			t.Fatalf("server has %d connections to %q, want %d", c.count(export), export, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

type testServer struct {
	srv     *nbd.Server
	addr    string
	conns   *connCounter
	backend *nbd.MemBackend
}

// serveMem serves a memory export named "vol" on l.
func serveMem(t testing.TB, l net.Listener, size int64) *testServer {
	t.Helper()
	ts := &testServer{conns: &connCounter{}, backend: nbd.NewMemBackend(size), addr: l.Addr().String()}
	ts.srv = &nbd.Server{Observer: ts.conns}
	if err := ts.srv.AddExport(&nbd.Export{Name: "vol", Backend: ts.backend}); err != nil {
		t.Fatal(err)
	}
	go ts.srv.Serve(l)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		ts.srv.Shutdown(ctx)
	})
	return ts
}

// localServer serves on the loopback address, with MPTCP when the host
// has it.
func localServer(t testing.TB, size int64) *testServer {
	t.Helper()
	l, err := mptcp.Listen(context.Background(), "tcp", "127.0.0.1:0", mptcp.Available() == nil)
	if err != nil {
		t.Fatal(err)
	}
	return serveMem(t, l, size)
}

// newAttacher returns an attacher with a fresh state directory that
// detaches everything it still holds when the test ends.
func newAttacher(t testing.TB, c Config) *Attacher {
	t.Helper()
	if c.StateDir == "" {
		c.StateDir = filepath.Join(t.TempDir(), "state")
	}
	a := New(c)
	t.Cleanup(func() {
		a.mu.Lock()
		var ids []string
		for id := range a.vols {
			ids = append(ids, id)
		}
		a.mu.Unlock()
		for _, id := range ids {
			if err := a.Detach(context.Background(), id); err != nil {
				t.Errorf("cleanup: detach %s: %v", id, err)
			}
		}
	})
	return a
}

// mountsUnder lists the mount points at or below dir.
func mountsUnder(t testing.TB, dir string) []string {
	t.Helper()
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 4 {
			mp := unescapeMountPath(fields[4])
			if mp == dir || strings.HasPrefix(mp, dir+"/") {
				out = append(out, mp)
			}
		}
	}
	return out
}

// assertNothingLeft checks that a volume left no mount, mount point, loop
// device or server connection behind.
func assertNothingLeft(t testing.TB, a *Attacher, volumeID string, ts *testServer) {
	t.Helper()
	dir, file := a.paths(volumeID)
	if m := mountsUnder(t, a.cfg.StateDir); len(m) != 0 {
		t.Errorf("mounts left under the state dir: %v", m)
	}
	if _, err := os.Lstat(dir); !os.IsNotExist(err) {
		t.Errorf("mount point %s left behind (%v)", dir, err)
	}
	devs, err := blockdev.FindLoopByBackingFile(file)
	if err != nil {
		t.Fatal(err)
	}
	if len(devs) != 0 {
		t.Errorf("loop devices left on %s: %v", file, devs)
	}
	if _, err := exec.LookPath("losetup"); err == nil {
		out, err := exec.Command("losetup", "-j", file).CombinedOutput()
		if err != nil || len(strings.TrimSpace(string(out))) != 0 {
			t.Errorf("losetup -j %s: %q, %v", file, out, err)
		}
	}
	if ts != nil {
		ts.conns.waitConns(t, "vol", 0)
	}
	if _, err := a.Health(volumeID); err == nil {
		t.Errorf("Health of a detached volume succeeds")
	}
}

func target(id, addr string) attach.Target {
	return attach.Target{VolumeID: id, Export: "vol", Addrs: []string{addr}}
}

// mountNS runs functions on one OS thread that has a private mount
// namespace of its own. File systems mounted there are invisible to the
// rest of the host, so namespaces other processes create meanwhile (ip
// netns exec, unshare) do not copy them and keep them busy after the
// unmount.
type mountNS struct {
	fns  chan func()
	done chan struct{}
}

func newMountNS(t testing.TB) *mountNS {
	t.Helper()
	ns := &mountNS{fns: make(chan func()), done: make(chan struct{})}
	ready := make(chan error, 1)
	go func() {
		// The thread is never unlocked: it exits with the goroutine
		// instead of going back to the runtime in another namespace.
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
			ready <- err
			return
		}
		if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
			ready <- err
			return
		}
		ready <- nil
		for {
			select {
			case fn := <-ns.fns:
				fn()
			case <-ns.done:
				return
			}
		}
	}()
	if err := <-ready; err != nil {
		t.Fatalf("private mount namespace: %v", err)
	}
	t.Cleanup(func() { close(ns.done) })
	return ns
}

// do runs fn in the namespace and returns its error.
func (ns *mountNS) do(fn func() error) error {
	errc := make(chan error, 1)
	ns.fns <- func() { errc <- fn() }
	return <-errc
}
