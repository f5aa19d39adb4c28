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
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/attach/nbddev"
	"github.com/mpnbd/mpnbd/pkg/nbd/nbdnl"
)

// The fault tests run real storage-server processes (Debian's nbd-server,
// or ours) in the topology's server namespace and kill them with SIGKILL while fio
// writes and verifies the raw device. MPNBD_SOAK=1 makes them long.

const (
	envSoak = "MPNBD_SOAK"
	// faultExportSize is the backing file of the fault tests; fio uses the
	// first fioSize bytes of it.
	faultExportSize = 64 << 20
	fioSize         = 8 << 20
	// nbdServerPort is where nbd-server listens; every topology has its own
	// server namespace, so a fixed port is fine.
	nbdServerPort = 10809
)

func soak() bool { return os.Getenv(envSoak) == "1" }

// envOurServer names our nbd-server binary in the guest (built by the
// host test).
const envOurServer = "MPNBD_TEST_NBD_SERVER"

// faultModes are the transports the fault tests run: the kernel-socket
// and relay transports on the stock kernel, the kernel transport on the
// kernel whose nbd accepts MPTCP.
func faultModes() []attach.Transport {
	if os.Getenv(envMPTCPKernel) == "1" {
		return []attach.Transport{attach.Kernel}
	}
	return []attach.Transport{attach.Relay, attach.TCP, attach.MultiConn}
}

// requireFaultTools skips when the guest lacks fio or nbd-server: the host
// test copies them in only when the host has them (apt-get install fio
// nbd-server).
func requireFaultTools(t *testing.T) {
	t.Helper()
	for _, tool := range []string{"fio", "nbd-server"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s is not in the VM (the host test copies it from the host, which lacks it: install the Debian package %s): %v", tool, tool, err)
		}
	}
}

// debianServer is Debian's nbd-server serving a file in the server
// namespace. It daemonizes and forks a child per client; kill ends the
// daemon and every child with SIGKILL, as a crash would.
type debianServer struct {
	t       *testing.T
	tp      *topo.Topology
	dir     string
	image   string
	config  string
	pidFile string

	mu     sync.Mutex
	leader int // the daemon's pid, also its session id; 0 while down
	kills  int
}

const debianServerConfig = `[generic]
listenaddr = 0.0.0.0
port = %d

[vol]
exportname = %s
flush = true
fua = true
trim = true
`

func startDebianServer(t *testing.T, tp *topo.Topology, size int64) *debianServer {
	t.Helper()
	dir := t.TempDir()
	s := &debianServer{t: t, tp: tp, dir: dir, image: filepath.Join(dir, "vol.img"),
		config: filepath.Join(dir, "config"), pidFile: filepath.Join(dir, "nbd-server.pid")}
	f, err := os.Create(s.image)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if err := os.WriteFile(s.config, fmt.Appendf(nil, debianServerConfig, nbdServerPort, s.image), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := s.start(); err != nil {
		t.Fatal(err)
	}
	// Registered after the topology's cleanup, so it runs before the
	// namespaces go.
	t.Cleanup(func() { s.kill() })
	return s
}

// start runs the daemon and waits until it accepts connections. After
// binding its port nbd-server generates Diffie-Hellman parameters for TLS,
// CPU-bound work that takes from half a second to more than ten under
// TCG, while connections queue unanswered; start waits until it sleeps in its accept
// loop. A few attempts, since a daemon that cannot bind exits.
func (s *debianServer) start() error {
	var last error
	for attempt := 1; attempt <= 5; attempt++ {
		begin := time.Now()
		pid, err := s.startOnce()
		if err == nil {
			s.mu.Lock()
			s.leader = pid
			s.mu.Unlock()
			s.t.Logf("nbd-server up (pid %d) after %v", pid, time.Since(begin).Round(time.Millisecond))
			return nil
		}
		last = err
		s.t.Logf("nbd-server start attempt %d: %v", attempt, err)
		time.Sleep(time.Duration(attempt) * 300 * time.Millisecond)
	}
	return fmt.Errorf("nbd-server did not come up in 5 attempts: %w", last)
}

func (s *debianServer) startOnce() (int, error) {
	os.Remove(s.pidFile)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Output goes to a file: a daemon holding on to a pipe would keep the
	// command from finishing.
	out, err := os.CreateTemp(s.dir, "start-*.log")
	if err != nil {
		return 0, err
	}
	defer out.Close()
	cmd := exec.CommandContext(ctx, "ip", "netns", "exec", s.tp.ServerNS, "nbd-server", "-C", s.config, "-p", s.pidFile)
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Run(); err != nil {
		msg, _ := os.ReadFile(out.Name())
		return 0, fmt.Errorf("ip netns exec %s nbd-server: %v: %s", s.tp.ServerNS, err, bytes.TrimSpace(msg))
	}
	// The daemon writes its pid file before it binds its port and exits if
	// that fails.
	deadline := time.Now().Add(15 * time.Second)
	pid := 0
	for pid == 0 {
		if b, err := os.ReadFile(s.pidFile); err == nil {
			pid, _ = strconv.Atoi(strings.TrimSpace(string(b)))
		}
		if pid == 0 {
			if time.Now().After(deadline) {
				return 0, fmt.Errorf("no pid in %s after 15s", s.pidFile)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	deadline = time.Now().Add(time.Minute)
	for {
		if !alive(pid) {
			return 0, fmt.Errorf("nbd-server (pid %d) exited before serving on port %d (its log goes to syslog, absent in the VM)", pid, nbdServerPort)
		}
		if listening(pid, nbdServerPort) && inAcceptLoop(pid) {
			return pid, nil
		}
		if time.Now().After(deadline) {
			syscall.Kill(pid, syscall.SIGKILL)
			return 0, fmt.Errorf("nbd-server (pid %d) not waiting for connections on port %d after a minute (listening: %v)", pid, nbdServerPort, listening(pid, nbdServerPort))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// inAcceptLoop reports whether the daemon sleeps in pselect6 (syscall 270
// on x86-64), where its loop waits for connections.
func inAcceptLoop(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/syscall")
	if err != nil {
		return false
	}
	f := strings.Fields(string(b))
	return len(f) > 0 && f[0] == "270"
}

// kill SIGKILLs the daemon and its children and waits until they are
// gone. It returns how many processes it killed.
func (s *debianServer) kill() int {
	s.mu.Lock()
	leader := s.leader
	s.leader = 0
	s.mu.Unlock()
	if leader == 0 {
		return 0
	}
	procs := sessionProcs(leader)
	for _, p := range procs {
		syscall.Kill(p, syscall.SIGKILL)
	}
	deadline := time.Now().Add(10 * time.Second)
	for _, p := range procs {
		for alive(p) {
			if time.Now().After(deadline) {
				s.t.Errorf("nbd-server process %d survived SIGKILL for 10s", p)
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	s.mu.Lock()
	s.kills++
	s.mu.Unlock()
	return len(procs)
}

// clients is the number of per-client processes the daemon runs: the
// connections it serves.
func (s *debianServer) clients() int {
	s.mu.Lock()
	leader := s.leader
	s.mu.Unlock()
	if leader == 0 {
		return 0
	}
	return len(sessionProcs(leader)) - 1
}

func (s *debianServer) killCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.kills
}

func (s *debianServer) imagePath() string { return s.image }

func (s *debianServer) target(id string) attach.Target {
	var srv, cli []string
	for i := range s.tp.Paths {
		srv = append(srv, net.JoinHostPort(s.tp.ServerAddr(i+1).String(), strconv.Itoa(nbdServerPort)))
		cli = append(cli, s.tp.ClientAddr(i+1).String())
	}
	return attach.Target{VolumeID: id, Export: "vol", Addrs: srv, LocalAddrs: cli}
}

// procStat is what /proc/PID/stat says of a process.
type procStat struct {
	pid, ppid, session int
	state              byte
}

func readStat(pid int) (procStat, bool) {
	// state ppid pgrp session ...
	f, err := attach.ProcFields(pid)
	if err != nil {
		return procStat{}, false
	}
	ppid, _ := strconv.Atoi(f[1])
	sess, _ := strconv.Atoi(f[3])
	return procStat{pid: pid, ppid: ppid, session: sess, state: f[0][0]}, true
}

// alive reports whether pid exists and has not exited (a zombie counts as
// gone: it holds no sockets).
func alive(pid int) bool {
	st, ok := readStat(pid)
	return ok && st.state != 'Z' && st.state != 'X'
}

// sessionProcs lists leader, the members of its session and their
// descendants, leader first.
func sessionProcs(leader int) []int {
	ents, _ := os.ReadDir("/proc")
	var all []procStat
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if st, ok := readStat(pid); ok && st.state != 'Z' {
			all = append(all, st)
		}
	}
	in := map[int]bool{leader: true}
	for changed := true; changed; {
		changed = false
		for _, st := range all {
			if !in[st.pid] && (st.session == leader || in[st.ppid]) {
				in[st.pid], changed = true, true
			}
		}
	}
	out := []int{leader}
	for _, st := range all {
		if in[st.pid] && st.pid != leader {
			out = append(out, st.pid)
		}
	}
	return out
}

// listening reports whether a socket listens on port in pid's network
// namespace.
func listening(pid, port int) bool { return tcpSockets(pid, port, "0A") > 0 }

// established counts the established TCP sockets on local port port in
// pid's network namespace.
func established(pid, port int) int { return tcpSockets(pid, port, "01") }

// tcpSockets counts the TCP sockets on local port port in pid's network
// namespace whose state (as /proc/net/tcp gives it, in hex) is state.
func tcpSockets(pid, port int, state string) int {
	want := fmt.Sprintf(":%04X", port)
	n := 0
	for _, f := range []string{"tcp", "tcp6"} {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/%s", pid, f))
		if err != nil {
			continue
		}
		for _, l := range strings.Split(string(b), "\n")[1:] {
			fs := strings.Fields(l)
			if len(fs) > 3 && strings.HasSuffix(fs[1], want) && fs[3] == state {
				n++
			}
		}
	}
	return n
}

// blockStat is the number of reads and writes dev completed (/sys/block
// stat), -1 each if unknown.
func blockStat(dev string) (reads, writes int64) {
	b, err := os.ReadFile("/sys/block/" + filepath.Base(dev) + "/stat")
	if err != nil {
		return -1, -1
	}
	f := strings.Fields(string(b))
	if len(f) < 5 {
		return -1, -1
	}
	reads, _ = strconv.ParseInt(f[0], 10, 64)
	writes, _ = strconv.ParseInt(f[4], 10, 64)
	return reads, writes
}

// deviceIOs is the number of reads and writes dev completed.
func deviceIOs(dev string) int64 {
	r, w := blockStat(dev)
	return r + w
}

// faultServer is a storage server running as processes of its own that
// the fault tests SIGKILL and start again: Debian's nbd-server
// (debianServer) or ours (ourServer).
type faultServer interface {
	// kill SIGKILLs the server's processes, as a crash would, and waits
	// until they are gone; it returns how many it killed.
	kill() int
	// start starts the server again and waits until it takes connections.
	start() error
	// killCount is the number of kills of a running server so far.
	killCount() int
	// clients is the number of client connections the server serves (at
	// least: ours counts an MPTCP connection once per subflow).
	clients() int
	// imagePath is the file the server serves.
	imagePath() string
}

// killer SIGKILLs the server again and again: once the client is back
// (the server serves conns connections and the device completes I/O
// again), it waits interval, kills, leaves the server down for down and
// starts it again, until stopped. It leaves the server running.
type killer struct {
	stopc chan struct{}
	done  chan struct{}
}

// reconnectLimit bounds how long the client may take to come back after
// a restart.
const reconnectLimit = 3 * time.Minute

// roundLimit bounds one fio round under faults. It only catches a hang:
// under TCG a round can take minutes (each kill costs the kernel-socket
// transports a request timeout, nbd-server takes up to half a minute to
// start on a loaded host).
const roundLimit = 5 * time.Minute

func killEvery(t *testing.T, s faultServer, dev string, conns int, interval, down time.Duration) *killer {
	k := &killer{stopc: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(k.done)
		for {
			// Wait for the client to be back: a kill is meant to hit a live
			// data path.
			since, base := time.Now(), deviceIOs(dev)
			for s.clients() < conns || deviceIOs(dev)-base < 64 {
				select {
				case <-k.stopc:
					return
				case <-time.After(50 * time.Millisecond):
				}
				if time.Since(since) > reconnectLimit {
					t.Errorf("the client did not come back within %v of nbd-server's restart: %d of %d connections, %d I/Os completed since",
						reconnectLimit, s.clients(), conns, deviceIOs(dev)-base)
					return
				}
			}
			select {
			case <-k.stopc:
				return
			case <-time.After(interval):
			}
			n := s.kill()
			t.Logf("SIGKILL nbd-server (%d processes), kill #%d", n, s.killCount())
			time.Sleep(down)
			if err := s.start(); err != nil {
				t.Errorf("restarting the killed server: %v", err)
				return
			}
		}
	}()
	return k
}

// stop ends the kills; the server is running afterwards.
func (k *killer) stop(t *testing.T) {
	t.Helper()
	close(k.stopc)
	select {
	case <-k.done:
	case <-time.After(3 * time.Minute):
		t.Fatal("the kill loop did not stop within 3 minutes (a server start hangs)")
	}
}

// fioResult is one fio run.
type fioResult struct {
	err     error // fio's exit
	jobErr  int   // the job's error (errno), from fio's JSON
	written int64
	read    int64
	elapsed time.Duration
	output  string
}

func (r fioResult) ok() bool {
	return r.err == nil && r.jobErr == 0 && r.written == fioSize && r.read == fioSize
}

func (r fioResult) String() string {
	return fmt.Sprintf("exit %v, err=%d, wrote %d, verified %d bytes in %v", r.err, r.jobErr, r.written, r.read, r.elapsed.Round(time.Millisecond))
}

// fioArgs writes fioSize bytes at random 4 KiB offsets of dev and reads
// them back, checking each block's crc32c and header. randrepeat=0 with a
// per-round seed gives every round its own order of offsets: fio's header
// check compares the sequence number of the write that put a block there,
// so a block left from an earlier round (a write the server lost) fails
// it. With the default randrepeat=1 the order is the same in every round
// and such a block would pass.
func fioArgs(dev string, seed int) []string {
	return []string{"--name=faults", "--filename=" + dev, "--direct=1", "--ioengine=libaio", "--iodepth=16",
		"--rw=randwrite", "--bs=4k", "--size=" + strconv.Itoa(fioSize), "--verify=crc32c", "--do_verify=1",
		"--verify_fatal=1", "--randrepeat=0", "--randseed=" + strconv.Itoa(seed), "--verify_state_save=0",
		"--output-format=json"}
}

// fioRun is a running fio.
type fioRun struct {
	cmd    *exec.Cmd
	stdout bytes.Buffer
	stderr bytes.Buffer
	start  time.Time
	exited chan struct{} // closed once res is set
	res    fioResult
}

func startFio(t *testing.T, dev string, seed int) *fioRun {
	t.Helper()
	return startFioArgs(t, fioArgs(dev, seed))
}

// startFioArgs starts fio with args; the result's byte counts are those of
// a report with one job.
func startFioArgs(t *testing.T, args []string) *fioRun {
	t.Helper()
	r := &fioRun{cmd: exec.Command("fio", args...), exited: make(chan struct{})}
	r.cmd.Stdout, r.cmd.Stderr = &r.stdout, &r.stderr
	r.start = time.Now()
	if err := r.cmd.Start(); err != nil {
		t.Fatalf("fio: %v", err)
	}
	go func() {
		err := r.cmd.Wait()
		res := fioResult{err: err, elapsed: time.Since(r.start), output: r.stdout.String() + r.stderr.String()}
		res.jobErr, res.written, res.read = parseFio(r.stdout.Bytes())
		r.res = res
		close(r.exited)
	}()
	return r
}

// parseFio returns the job's error, bytes written and bytes read back (-1
// each when fio printed no report).
func parseFio(out []byte) (jobErr int, written, read int64) {
	var rep struct {
		Jobs []struct {
			Error int `json:"error"`
			Write struct {
				IOBytes int64 `json:"io_bytes"`
			} `json:"write"`
			Read struct {
				IOBytes int64 `json:"io_bytes"`
			} `json:"read"`
		} `json:"jobs"`
	}
	if i := bytes.IndexByte(out, '{'); i >= 0 {
		out = out[i:]
	}
	if err := json.Unmarshal(out, &rep); err != nil || len(rep.Jobs) != 1 {
		return -1, -1, -1
	}
	j := rep.Jobs[0]
	return j.Error, j.Write.IOBytes, j.Read.IOBytes
}

// running reports whether fio is still going.
func (r *fioRun) running() bool {
	select {
	case <-r.exited:
		return false
	default:
		return true
	}
}

// wait waits up to limit for fio. When it does not finish, the test fails
// with what stuck says of the data path (it also detaches the device, to
// unblock fio).
func (r *fioRun) wait(t *testing.T, limit time.Duration, stuck func(what string)) fioResult {
	t.Helper()
	select {
	case <-r.exited:
		return r.res
	case <-time.After(limit):
	}
	stuck(fmt.Sprintf("fio did not finish within %v (running for %v)", limit, time.Since(r.start).Round(time.Second)))
	r.cmd.Process.Kill()
	select {
	case <-r.exited:
		t.Logf("fio after the detach: %v\n%s", r.res, tail(r.res.output, 20))
	case <-time.After(30 * time.Second):
		t.Logf("fio still not gone 30s after the detach")
	}
	t.FailNow()
	return fioResult{}
}

// attacherStuck reports I/O that does not finish on a device of a, with
// the data path's state, and detaches the device: disconnecting fails
// what waits, so the test can end.
func attacherStuck(t *testing.T, a attach.Attacher, tg attach.Target, dev string) func(string) {
	return func(what string) {
		t.Helper()
		h, herr := a.Health(tg.VolumeID)
		reportStuck(t, dev, what, fmt.Sprintf("%+v %v", h, herr))
		if err := a.Detach(context.Background(), tg.VolumeID); err != nil {
			t.Logf("detach to unblock the I/O: %v", err)
		}
	}
}

// deviceStuck is attacherStuck for a device another process attached: it
// disconnects the device through netlink.
func deviceStuck(t *testing.T, dev string) func(string) {
	return func(what string) {
		t.Helper()
		reportStuck(t, dev, what, "(attached by another process)")
		nl, err := nbdnl.Dial()
		if err != nil {
			t.Logf("netlink to disconnect %s: %v", dev, err)
			return
		}
		defer nl.Close()
		if err := nl.Disconnect(indexOf(t, dev)); err != nil {
			t.Logf("disconnect %s to unblock the I/O: %v", dev, err)
		}
	}
}

func reportStuck(t *testing.T, dev, what, health string) {
	t.Helper()
	inflight, _ := os.ReadFile("/sys/block/" + filepath.Base(dev) + "/inflight")
	dmesg, _ := exec.Command("dmesg").CombinedOutput()
	t.Errorf("%s on %s: I/O is stuck\nhealth: %s\ninflight (reads writes): %s\ndmesg tail:\n%s",
		what, dev, health, strings.TrimSpace(string(inflight)), tail(string(dmesg), 30))
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// writeIOs is the number of writes the device completed.
func writeIOs(dev string) int64 {
	_, w := blockStat(dev)
	return w
}

// attachFault starts nbd-server in a new topology and attaches its export
// with mode.
func attachFault(t *testing.T, mode attach.Transport) (*debianServer, *nbddev.Attacher, attach.Target, *attach.Attachment) {
	t.Helper()
	// Debian's nbd-server speaks plain TCP.
	tp := plainGuestTopology(t)
	srv := startDebianServer(t, tp, faultExportSize)
	a, _ := newAttacher(t, tp, mode)
	tg := srv.target(volID(t))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	att, err := a.Attach(ctx, tg, attach.Options{})
	if err != nil {
		t.Fatalf("attach %s to nbd-server: %v", mode, err)
	}
	t.Cleanup(func() {
		if err := a.Detach(context.Background(), tg.VolumeID); err != nil {
			t.Errorf("detach: %v", err)
		}
	})
	if mode == attach.MultiConn {
		if n := srv.clients(); n != len(tp.Paths) {
			t.Fatalf("multiconn: nbd-server serves %d connections, want %d", n, len(tp.Paths))
		}
	}
	t.Logf("%s attached as %s (%d bytes) to nbd-server", mode, att.Device, att.Size)
	return srv, a, tg, att
}

// compareWithImage reads what the rounds wrote through the device and
// compares it with the server's file: what the device shows must be what
// the server holds, not something only the client still has.
func compareWithImage(t *testing.T, image, dev string, stuck func(string)) {
	t.Helper()
	type result struct {
		b   []byte
		err error
	}
	done := make(chan result, 1)
	go func() {
		b, err := readDevice(dev, fioSize)
		done <- result{b, err}
	}()
	var got result
	select {
	case got = <-done:
	case <-time.After(2 * time.Minute):
		stuck("reading the device back did not finish within 2m")
		t.FailNow()
	}
	if got.err != nil {
		t.Fatalf("read %s back: %v", dev, got.err)
	}
	f, err := os.Open(image)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	want := make([]byte, fioSize)
	if _, err := f.ReadAt(want, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got.b, want) {
		for off := 0; off < fioSize; off += 4096 {
			if !bytes.Equal(got.b[off:off+4096], want[off:off+4096]) {
				t.Fatalf("%s differs from the server's file at offset %d", dev, off)
			}
		}
	}
	t.Logf("%s reads back what the server's file holds (%d bytes)", dev, fioSize)
}

// TestTransportsServerKills runs fio write+verify rounds on the raw device
// of each transport while nbd-server is SIGKILLed and restarted every few
// seconds: every round must finish without an error, every block must
// verify, and the device must then read back what the server's file
// holds. A kill comes a few seconds after the client is back from the
// last one (3 s in the suite, about 20 s of rounds per transport; with
// MPNBD_SOAK=1 10 s, two minutes per transport).
func TestTransportsServerKills(t *testing.T) {
	requireGuest(t)
	requireFaultTools(t)
	// The fault tests wait out outages, stalls and timeouts side by side.
	t.Parallel()
	total, every, down := killTimes()
	for _, mode := range faultModes() {
		t.Run(string(mode), func(t *testing.T) {
			// Side by side: each has its own topology, server and device.
			t.Parallel()
			srv, a, tg, att := attachFault(t, mode)
			conns := 1
			if mode == attach.MultiConn {
				conns = len(srv.tp.Paths)
			}
			killRounds(t, srv, a, tg, att.Device, conns, total, every, down)
		})
	}
}

// killTimes are the kill rounds' length, the time between the client's
// return and the next kill, and the time the server stays down: about 20
// s of rounds with a kill every 3 s (two minutes, every 10 s with
// MPNBD_SOAK=1).
func killTimes() (total, every, down time.Duration) {
	if soak() {
		return 2 * time.Minute, 10 * time.Second, time.Second
	}
	return 20 * time.Second, 3 * time.Second, time.Second
}

// killRounds runs fio write+verify rounds on dev for about total while
// srv is SIGKILLed every few seconds (see killEvery); every round must
// finish with no error and verify, the client must have reconnected, and
// the device must then read back the server's file.
func killRounds(t *testing.T, srv faultServer, a attach.Attacher, tg attach.Target, dev string, conns int, total, every, down time.Duration) {
	t.Helper()
	start := time.Now()
	k := killEvery(t, srv, dev, conns, every, down)
	stopped := false
	defer func() {
		if !stopped {
			close(k.stopc)
			<-k.done
		}
	}()
	seed := int(time.Now().UnixNano() % 1000000)
	rounds := 0
	for time.Since(start) < total {
		rounds++
		seed++
		res := startFio(t, dev, seed).wait(t, roundLimit, attacherStuck(t, a, tg, dev))
		t.Logf("round %d (kills so far %d): %v", rounds, srv.killCount(), res)
		if !res.ok() {
			t.Fatalf("round %d with nbd-server being killed: %v\n%s", rounds, res, tail(res.output, 40))
		}
	}
	stopped = true
	k.stop(t)
	kills := srv.killCount()
	h, _ := a.Health(tg.VolumeID)
	t.Logf("%d rounds, %d SIGKILLs of nbd-server in %v; health %+v", rounds, kills, time.Since(start).Round(time.Second), h)
	if kills < 1 {
		t.Fatalf("no kill happened during %d rounds (%v)", rounds, time.Since(start).Round(time.Second))
	}
	if h.Reconnects < 1 {
		t.Errorf("%d kills but no reconnect recorded: %+v", kills, h)
	}
	compareWithImage(t, srv.imagePath(), dev, attacherStuck(t, a, tg, dev))
}

// TestTransportsLongOutage kills nbd-server in the middle of a fio
// write+verify round and leaves it down for a while (30 s in the suite,
// 5 minutes with MPNBD_SOAK=1): fio waits, finishes without an error once
// the server is back, and the device reads back what the server's file
// holds.
func TestTransportsLongOutage(t *testing.T) {
	requireGuest(t)
	requireFaultTools(t)
	// The fault tests wait out outages, stalls and timeouts side by side.
	t.Parallel()
	outage := 30 * time.Second
	if soak() {
		outage = 5 * time.Minute
	}
	for _, mode := range faultModes() {
		t.Run(string(mode), func(t *testing.T) {
			// The transports wait out their outages side by side: each has
			// its own topology, server and device.
			t.Parallel()
			srv, a, tg, att := attachFault(t, mode)
			seed := int(time.Now().UnixNano()%1000000) + 1
			before := writeIOs(att.Device)
			f := startFio(t, att.Device, seed)
			// Kill once fio is well into its writes.
			waitWrites(t, f, att.Device, before, 256)
			n := srv.kill()
			t.Logf("SIGKILL nbd-server (%d processes) after %d writes; down for %v", n, writeIOs(att.Device)-before, outage)
			// The I/O must wait: fio cannot finish while the server is away.
			holdRunning(t, f, outage, "the outage")
			stalled, _ := a.Health(tg.VolumeID)
			t.Logf("health at the end of the outage: %+v", stalled)
			if stalled.Connected {
				t.Errorf("health says connected after %v with the server down: %+v", outage, stalled)
			}
			if err := srv.start(); err != nil {
				t.Fatalf("restart nbd-server: %v", err)
			}
			back := time.Now()
			res := f.wait(t, roundLimit, attacherStuck(t, a, tg, att.Device))
			if !res.ok() {
				t.Fatalf("fio round across a %v outage: %v\n%s", outage, res, tail(res.output, 40))
			}
			h, _ := a.Health(tg.VolumeID)
			t.Logf("%s: fio finished %v after the server came back, %v in all, across a %v outage: %v; health %+v",
				mode, time.Since(back).Round(time.Millisecond), res.elapsed.Round(time.Millisecond), outage, res, h)
			if h.Reconnects < 1 {
				t.Errorf("no reconnect recorded: %+v", h)
			}
			compareWithImage(t, srv.image, att.Device, attacherStuck(t, a, tg, att.Device))
		})
	}
}
