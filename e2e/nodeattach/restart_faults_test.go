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
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/nbd/nbdnl"
)

// ourServerPort is where our nbd-server process listens in its namespace.
const ourServerPort = 10810

// ourServer is our nbd-server binary running in the topology's server
// namespace as a process of its own, so that a test can stop it (SIGSTOP)
// as a stalled server would be, or kill it and start it again.
type ourServer struct {
	t     *testing.T
	tp    *topo.Topology
	bin   string
	image string
	// tls, when set, makes the server require TLS (see tlsFiles).
	tls *tlsFiles

	mu     sync.Mutex
	cmd    *exec.Cmd     // nil while down
	exited chan struct{} // closed once cmd is reaped
	kills  int
}

func startOurServer(t *testing.T, tp *topo.Topology, size int64) *ourServer {
	t.Helper()
	return startOurServerTLS(t, tp, size, nil)
}

// startOurServerTLS is startOurServer with TLS required as tf says (none
// when tf is nil).
func startOurServerTLS(t *testing.T, tp *topo.Topology, size int64, tf *tlsFiles) *ourServer {
	t.Helper()
	bin := os.Getenv(envOurServer)
	if bin == "" {
		t.Skipf("our nbd-server is not in the VM (%s unset: the host test builds it)", envOurServer)
	}
	s := &ourServer{t: t, tp: tp, bin: bin, image: filepath.Join(t.TempDir(), "vol.img"), tls: tf}
	f, err := os.Create(s.image)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if err := s.start(); err != nil {
		t.Fatal(err)
	}
	// Registered after the topology's cleanup, so it runs before the
	// namespaces go.
	t.Cleanup(func() {
		s.signal(syscall.SIGCONT)
		s.kill()
	})
	return s
}

// start runs the server and waits until it listens. A few attempts, since
// a server that cannot listen exits.
func (s *ourServer) start() error {
	var last error
	for attempt := 1; attempt <= 5; attempt++ {
		begin := time.Now()
		pid, err := s.startOnce()
		if err == nil {
			s.t.Logf("our nbd-server up (pid %d) after %v", pid, time.Since(begin).Round(time.Millisecond))
			return nil
		}
		last = err
		s.t.Logf("our nbd-server start attempt %d: %v", attempt, err)
		time.Sleep(time.Duration(attempt) * 300 * time.Millisecond)
	}
	return fmt.Errorf("our nbd-server did not come up in 5 attempts: %w", last)
}

func (s *ourServer) startOnce() (int, error) {
	args := []string{"netns", "exec", s.tp.ServerNS, s.bin,
		"--listen", net.JoinHostPort("0.0.0.0", strconv.Itoa(ourServerPort)),
		"--export", "vol=" + s.image, "--metrics-addr=", "--log-level", "info"}
	if s.tls != nil {
		args = append(args, "--tls", "require", "--tls-cert", s.tls.ServerPEM, "--tls-key", s.tls.ServerPEM, "--tls-ca", s.tls.CAPEM)
	}
	// ip netns exec execs the server: its pid is the server's.
	cmd := exec.Command("ip", args...)
	cmd.Stdout, cmd.Stderr = testWriter{s.t}, testWriter{s.t}
	if err := cmd.Start(); err != nil {
		return 0, err
	}
	exited := make(chan struct{})
	go func() {
		cmd.Wait()
		close(exited)
	}()
	pid := cmd.Process.Pid
	deadline := time.Now().Add(30 * time.Second)
	for !listening(pid, ourServerPort) {
		if !alive(pid) || time.Now().After(deadline) {
			up := alive(pid)
			cmd.Process.Kill()
			<-exited
			return 0, fmt.Errorf("our nbd-server (pid %d) is not listening on port %d (running: %v; it gives up after 30s)", pid, ourServerPort, up)
		}
		time.Sleep(20 * time.Millisecond)
	}
	s.mu.Lock()
	s.cmd, s.exited = cmd, exited
	s.mu.Unlock()
	return pid, nil
}

func (s *ourServer) signal(sig syscall.Signal) {
	s.mu.Lock()
	cmd := s.cmd
	s.mu.Unlock()
	if cmd != nil {
		syscall.Kill(cmd.Process.Pid, sig)
	}
}

// kill SIGKILLs the server and waits until it is gone; it returns how
// many processes it killed (0 when it was down).
func (s *ourServer) kill() int {
	s.mu.Lock()
	cmd, exited := s.cmd, s.exited
	s.cmd = nil
	s.mu.Unlock()
	if cmd == nil {
		return 0
	}
	cmd.Process.Kill()
	select {
	case <-exited:
	case <-time.After(10 * time.Second):
		s.t.Errorf("our nbd-server (pid %d) survived SIGKILL for 10s", cmd.Process.Pid)
	}
	s.mu.Lock()
	s.kills++
	s.mu.Unlock()
	return 1
}

func (s *ourServer) killCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.kills
}

// clients counts the server's established TCP sockets on its port: one
// per plain connection, one per subflow of an MPTCP one.
func (s *ourServer) clients() int {
	s.mu.Lock()
	cmd := s.cmd
	s.mu.Unlock()
	if cmd == nil {
		return 0
	}
	return established(cmd.Process.Pid, ourServerPort)
}

func (s *ourServer) imagePath() string { return s.image }

func (s *ourServer) target(id string) attach.Target {
	var srv, cli []string
	for i := range s.tp.Paths {
		srv = append(srv, net.JoinHostPort(s.tp.ServerAddr(i+1).String(), strconv.Itoa(ourServerPort)))
		cli = append(cli, s.tp.ClientAddr(i+1).String())
	}
	return attach.Target{VolumeID: id, Export: "vol", Addrs: srv, LocalAddrs: cli}
}

// kernelSocketModes are the transports whose sockets the kernel holds (a
// request timeout applies to them, and they outlive the attaching process).
func kernelSocketModes() []attach.Transport {
	if os.Getenv(envMPTCPKernel) == "1" {
		return []attach.Transport{attach.Kernel}
	}
	return []attach.Transport{attach.TCP, attach.MultiConn}
}

// waitWrites waits until dev completed n writes more than before, while
// fio runs.
func waitWrites(t *testing.T, f *fioRun, dev string, before, n int64) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for writeIOs(dev)-before < n {
		if !f.running() {
			t.Fatalf("fio ended early: %v\n%s", f.res, tail(f.res.output, 40))
		}
		if time.Now().After(deadline) {
			t.Fatalf("fio completed %d writes in a minute, fewer than %d", writeIOs(dev)-before, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// midWrite returns a fio run on dev that is running and has completed n
// writes since the call: f, or, where f ends first (a fast transport
// finishes a round), a new run of start once f's result checked out.
func midWrite(t *testing.T, f *fioRun, dev string, n int64, start func() *fioRun, stuck func(string)) *fioRun {
	t.Helper()
	before := writeIOs(dev)
	deadline := time.Now().Add(time.Minute)
	for writeIOs(dev)-before < n || !f.running() {
		if !f.running() {
			if res := f.wait(t, roundLimit, stuck); !res.ok() {
				t.Fatalf("fio on %s: %v\n%s", dev, res, tail(res.output, 40))
			}
			before = writeIOs(dev)
			f = start()
		}
		if time.Now().After(deadline) {
			t.Fatalf("fio completed %d writes on %s in a minute, fewer than %d", writeIOs(dev)-before, dev, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return f
}

// holdRunning checks, for d, that fio keeps waiting (no error ends it).
func holdRunning(t *testing.T, f *fioRun, d time.Duration, what string) {
	t.Helper()
	start := time.Now()
	for time.Since(start) < d {
		if !f.running() {
			t.Fatalf("fio ended %v into %s: %v\n%s", time.Since(start).Round(time.Millisecond), what, f.res, tail(f.res.output, 40))
		}
		time.Sleep(min(time.Second, d-time.Since(start)+time.Millisecond))
	}
}

// TestPluginRestartDuringOutage: the storage server (Debian's nbd-server)
// is SIGKILLed in the middle of a fio write+verify round, then the
// attaching process (the node plugin's part) is SIGKILLed too, and a new
// one re-adopts the device while the server is still away. The outage
// lasts 20 s (5 minutes with MPNBD_SOAK=1); once the server is back, fio
// finishes with no error, every block verifies, and the device reads back
// what the server's file holds.
func TestPluginRestartDuringOutage(t *testing.T) {
	requireGuest(t)
	requireFaultTools(t)
	// The fault tests wait out outages, stalls and timeouts side by side.
	t.Parallel()
	outage := 20 * time.Second
	if soak() {
		outage = 5 * time.Minute
	}
	for _, mode := range faultModes() {
		t.Run(string(mode), func(t *testing.T) {
			t.Parallel()
			tp := plainGuestTopology(t) // Debian's nbd-server: plain TCP
			srv := startDebianServer(t, tp, faultExportSize)
			cs := childSpec{Target: srv.target(volID(t)), StateDir: t.TempDir(), Mode: mode}
			first, dev := startChild(t, cs)
			t.Cleanup(func() { disconnectDevice(t, dev) })
			before := writeIOs(dev)
			f := startFio(t, dev, int(time.Now().UnixNano()%1000000)+7)
			waitWrites(t, f, dev, before, 256)
			n := srv.kill()
			down := time.Now()
			first.Process.Kill()
			first.Wait()
			t.Logf("SIGKILL nbd-server (%d processes) and the attaching process after %d writes", n, writeIOs(dev)-before)
			cs.Adopt = true
			_, dev2 := startChild(t, cs)
			if dev2 != dev {
				t.Fatalf("re-adopted %s, want %s", dev2, dev)
			}
			t.Logf("a new attaching process re-adopted %s %v into the outage", dev, time.Since(down).Round(time.Millisecond))
			holdRunning(t, f, outage-time.Since(down), "the outage")
			if err := srv.start(); err != nil {
				t.Fatalf("restart nbd-server: %v", err)
			}
			back := time.Now()
			res := f.wait(t, roundLimit, deviceStuck(t, dev))
			if !res.ok() {
				t.Fatalf("fio across a %v outage and a plugin restart: %v\n%s", outage, res, tail(res.output, 40))
			}
			t.Logf("%s: fio finished %v after the server came back, across a %v outage with the plugin restarted: %v",
				mode, time.Since(back).Round(time.Millisecond), outage, res)
			compareWithImage(t, srv.image, dev, deviceStuck(t, dev))
		})
	}
}

// disconnectDevice disconnects an nbd device another process attached.
func disconnectDevice(t *testing.T, dev string) {
	t.Helper()
	nl, err := nbdnl.Dial()
	if err != nil {
		t.Errorf("netlink: %v", err)
		return
	}
	defer nl.Close()
	if err := nl.Disconnect(indexOf(t, dev)); err != nil {
		t.Errorf("disconnect %s: %v", dev, err)
	}
}

// timeoutsSince counts the kernel's request-timeout messages for dev in
// the kernel log after the kernel time since (seconds, as dmesg prints
// them). Counting from a time, not by
// difference of totals, holds when the ring buffer wraps meanwhile (the
// tests running beside this one log a lot).
func timeoutsSince(dev string, since float64) int {
	out, _ := exec.Command("dmesg").CombinedOutput()
	n := 0
	for _, l := range strings.Split(string(out), "\n") {
		if strings.Contains(l, filepath.Base(dev)+": Connection timed out") && kernelTime(l) > since {
			n++
		}
	}
	return n
}

// lastKernelTime is the kernel time of the newest line in the kernel log,
// or 0.
func lastKernelTime() float64 {
	out, _ := exec.Command("dmesg").CombinedOutput()
	last := 0.0
	for _, l := range strings.Split(string(out), "\n") {
		last = max(last, kernelTime(l))
	}
	return last
}

// kernelTime is the time in seconds at the start of a dmesg line
// ("[  415.720990] ..."), or 0.
func kernelTime(l string) float64 {
	rest, ok := strings.CutPrefix(l, "[")
	if !ok {
		return 0
	}
	ts, _, ok := strings.Cut(rest, "]")
	if !ok {
		return 0
	}
	v, err := strconv.ParseFloat(strings.TrimSpace(ts), 64)
	if err != nil {
		return 0
	}
	return v
}

// TestServerStallPastRequestTimeout: our nbd-server, a process of its own,
// is stopped (SIGSTOP) in the middle of a fio write+verify round for five
// times the device's request timeout, then continued. The kernel's
// request timeout fires meanwhile (the kernel log says so: the test fails
// if it never did), and yet no request fails: fio finishes with no error,
// every block verifies, and the device reads back the server's file.
func TestServerStallPastRequestTimeout(t *testing.T) {
	requireGuest(t)
	requireFaultTools(t)
	// The fault tests wait out outages, stalls and timeouts side by side.
	t.Parallel()
	const reqTimeout = 3 * time.Second
	stall := 5 * reqTimeout
	if soak() {
		stall = 2 * time.Minute
	}
	for _, mode := range kernelSocketModes() {
		t.Run(string(mode), func(t *testing.T) {
			t.Parallel()
			// tcp and multiconn are plain TCP; kernel is MPTCP.
			newTopology := plainGuestTopology
			if mode == attach.Kernel {
				newTopology = guestTopology
			}
			tp := newTopology(t)
			srv := startOurServer(t, tp, faultExportSize)
			a, _ := newAttacher(t, tp, mode)
			tg := srv.target(volID(t))
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			att, err := a.Attach(ctx, tg, attach.Options{RequestTimeout: reqTimeout})
			cancel()
			if err != nil {
				t.Fatalf("attach %s: %v", mode, err)
			}
			t.Cleanup(func() {
				if err := a.Detach(context.Background(), tg.VolumeID); err != nil {
					t.Errorf("detach: %v", err)
				}
			})
			since := lastKernelTime()
			before := writeIOs(att.Device)
			f := startFio(t, att.Device, int(time.Now().UnixNano()%1000000)+11)
			waitWrites(t, f, att.Device, before, 256)
			srv.signal(syscall.SIGSTOP)
			t.Logf("SIGSTOP our nbd-server after %d writes, for %v (request timeout %v)", writeIOs(att.Device)-before, stall, reqTimeout)
			holdRunning(t, f, stall, "the stall")
			srv.signal(syscall.SIGCONT)
			res := f.wait(t, roundLimit, attacherStuck(t, a, tg, att.Device))
			if !res.ok() {
				t.Fatalf("fio across a %v stall: %v\n%s", stall, res, tail(res.output, 40))
			}
			// Two witnesses that the request timeout fired: the kernel's
			// message, which is rate limited across all devices (the
			// tests beside this one can use up the burst), and the
			// reconnect it causes: a stopped server's sockets stay open,
			// so only a timeout marks them dead.
			fired := timeoutsSince(att.Device, since)
			h, _ := a.Health(tg.VolumeID)
			t.Logf("%s: %d request timeout messages during the stall, %d reconnects; fio: %v; health %+v", mode, fired, h.Reconnects, res, h)
			if fired == 0 && h.Reconnects == 0 {
				t.Fatalf("the kernel's request timeout never fired during a %v stall (no message, no reconnect): the test did not exercise it", stall)
			}
			compareWithImage(t, srv.image, att.Device, attacherStuck(t, a, tg, att.Device))
		})
	}
}

// TestReadoptHealthyDevices: the attaching process is SIGKILLed while a
// writer runs on a device whose connections are healthy (the kernel holds
// them), and a new process re-adopts the device. The writer sees no
// error, the data reads back, and the server sees exactly one connection
// per device connection afterwards: the very ones from before, untouched
// (the new process's unused connections close without superseding them).
func TestReadoptHealthyDevices(t *testing.T) {
	requireGuest(t)
	for _, mode := range kernelSocketModes() {
		t.Run(string(mode), func(t *testing.T) {
			tp := guestTopology(t)
			st := newStorage(t, tp, volSize, true)
			slots := 1
			if mode == attach.MultiConn {
				slots = len(tp.Paths)
			}
			cs := childSpec{Target: st.target(volID(t)), StateDir: t.TempDir(), Mode: mode}
			first, dev := startChild(t, cs)
			t.Cleanup(func() { disconnectDevice(t, dev) })
			waitServerConns(t, st, slots)
			opened, closed := st.log.snapshot()
			var originals []string
			for _, c := range opened {
				if !slices.Contains(closed, c) {
					originals = append(originals, c)
				}
			}

			data := make([]byte, dataSize)
			rand.Read(data)
			errc := make(chan error, 1)
			start := time.Now()
			go func() { errc <- writeDevice(dev, data) }()
			time.Sleep(300 * time.Millisecond)
			first.Process.Kill()
			first.Wait()
			cs.Adopt = true
			_, dev2 := startChild(t, cs)
			if dev2 != dev {
				t.Fatalf("re-adopted %s, want %s", dev2, dev)
			}
			select {
			case err := <-errc:
				if err != nil {
					t.Fatalf("writer saw an error across the re-adoption: %v", err)
				}
			case <-time.After(2 * time.Minute):
				t.Fatal("writer stuck after the re-adoption")
			}
			t.Logf("%s: the writer finished %v after it began, across the re-adoption", mode, time.Since(start).Round(time.Millisecond))
			got, err := readDevice(dev, len(data))
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, data) {
				t.Fatal("data differs after the re-adoption")
			}
			waitServerConns(t, st, slots)
			time.Sleep(time.Second)
			if n := st.conns(); n != slots {
				t.Fatalf("the server has %d connections a second later, want %d", n, slots)
			}
			opened, closed = st.log.snapshot()
			for _, c := range originals {
				if slices.Contains(closed, c) {
					t.Errorf("the device's connection from %s was closed by the re-adoption", c)
				}
			}
			t.Logf("%s: server connections opened %d, closed %d; the %d from before the restart all still serve", mode, len(opened), len(closed), len(originals))
		})
	}
}

func waitServerConns(t *testing.T, st *storage, want int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for st.conns() != want {
		if time.Now().After(deadline) {
			opened, closed := st.log.snapshot()
			t.Fatalf("the server has %d connections after 30s, want %d (opened %v, closed %v)", st.conns(), want, opened, closed)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestKernelTime(t *testing.T) {
	for l, want := range map[string]float64{
		"[  415.720990] IPv6: ADDRCONF(NETDEV_CHANGE): x: link becomes ready": 415.72099,
		"[    0.970283] int3: 0000 [#1] PREEMPT SMP NOPTI":                    0.970283,
		"no timestamp": 0,
		"[ bad] x":     0,
	} {
		if got := kernelTime(l); got != want {
			t.Errorf("kernelTime(%q) = %v, want %v", l, got, want)
		}
	}
}
