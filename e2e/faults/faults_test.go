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

// Package faults runs the data path against real storage servers that are
// killed with SIGKILL and restarted under a running fio, and checks that
// the I/O saw no error and every block verifies. The short runs are part
// of the test suite; `make soak` runs them long (MPNBD_SOAK=1).
package faults

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/e2e/internal/replenv"
	"github.com/mpnbd/mpnbd/internal/testenv/pki"
	"github.com/mpnbd/mpnbd/internal/testenv/repo"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/attach/fuse"
	"github.com/mpnbd/mpnbd/pkg/relay"
)

// plan is how long a fault run lasts and how often the server dies.
type plan struct {
	duration time.Duration // of the fio run under kills
	every    time.Duration // between kills
	gap      time.Duration // the server stays dead this long
	outage   time.Duration // one long outage mid-write (0: none)
}

func faultPlan() plan {
	if os.Getenv("MPNBD_SOAK") == "1" {
		return plan{duration: 2 * time.Minute, every: 10 * time.Second, gap: 2 * time.Second, outage: 5 * time.Minute}
	}
	return plan{duration: 20 * time.Second, every: 4 * time.Second, gap: time.Second, outage: 15 * time.Second}
}

func need(t *testing.T, tools ...string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("skipping: needs root (FUSE mounts, loop devices)")
	}
	if err := fuse.Available(); err != nil {
		t.Skipf("skipping: %v", err)
	}
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("skipping: %s not found", tool)
		}
	}
}

// server is a storage server process that can be killed and started again
// on the same address.
type server interface {
	start(t *testing.T)
	kill(t *testing.T) // SIGKILL, the whole process group
	addr() string
	name() string
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// waitNBD waits until addr greets like an NBD server.
func waitNBD(addr string, d time.Duration) error {
	deadline := time.Now().Add(d)
	for {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.SetReadDeadline(time.Now().Add(2 * time.Second))
			hello := make([]byte, 8)
			_, err = c.Read(hello)
			c.Close()
			if err == nil && string(hello) == "NBDMAGIC" {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no NBD server on %s after %v: %v", addr, d, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// nbdServer is Debian's nbd-server, daemonized (a child per client, in
// the daemon's session, so a kill of the group takes them all).
type nbdServer struct {
	dir, image string
	port       int
	pid        int
}

func (s *nbdServer) name() string { return "nbd-server" }
func (s *nbdServer) addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port)) }

func (s *nbdServer) start(t *testing.T) {
	t.Helper()
	cfg := filepath.Join(s.dir, "nbd-server.conf")
	conf := fmt.Sprintf("[generic]\nlistenaddr = 127.0.0.1\nport = %d\n\n[disk]\nexportname = %s\nflush = true\nfua = true\ntrim = true\n", s.port, s.image)
	if err := os.WriteFile(cfg, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	pidFile := filepath.Join(s.dir, "nbd-server.pid")
	os.Remove(pidFile)
	var err error
	for attempt := 0; attempt < 50; attempt++ {
		if out, cerr := exec.Command("nbd-server", "-C", cfg, "-p", pidFile).CombinedOutput(); cerr != nil {
			err = fmt.Errorf("nbd-server: %v: %s", cerr, out)
			time.Sleep(100 * time.Millisecond)
			continue
		}
		if err = waitNBD(s.addr(), 5*time.Second); err == nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		t.Fatalf("start nbd-server: %v", err)
	}
	b, err := os.ReadFile(pidFile)
	if err != nil {
		t.Fatal(err)
	}
	if s.pid, err = strconv.Atoi(strings.TrimSpace(string(b))); err != nil {
		t.Fatalf("pid file: %v", err)
	}
}

func (s *nbdServer) kill(t *testing.T) {
	t.Helper()
	if s.pid <= 0 {
		return
	}
	syscall.Kill(-s.pid, syscall.SIGKILL)
	syscall.Kill(s.pid, syscall.SIGKILL)
	deadline := time.Now().Add(10 * time.Second)
	for syscall.Kill(s.pid, 0) == nil && !zombie(s.pid) {
		if time.Now().After(deadline) {
			t.Fatalf("nbd-server %d survived SIGKILL", s.pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
	s.pid = 0
}

func zombie(pid int) bool {
	state, _, err := attach.ProcStat(pid)
	return err != nil || state == 'Z'
}

// ourServer is our storage server (cmd/nbd-server), which fences
// superseded connections and announces a new incarnation per start. It
// listens on 127.0.0.1, or with ns set in that network namespace on host.
type ourServer struct {
	bin, image string
	port       int
	ns, host   string
	// tls, when set, makes the server require TLS with a storage
	// certificate of its CA, and client certificates of the same CA.
	tls  *testPKI
	cmd  *exec.Cmd
	done chan struct{}
}

// testPKI is a CA, a storage certificate for the server and a node
// certificate in an identity directory (as the node plugin keeps it).
type testPKI = pki.NodeIDFiles

// storageNode is the name the test server's certificate gives.
const storageNode = "store-faults"

func newTestPKI(t *testing.T) *testPKI {
	t.Helper()
	f, err := pki.WriteNodeIDFiles(t.TempDir(), t.TempDir(), storageNode, "node-faults")
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func (s *ourServer) name() string { return "mpnbd nbd-server" }

func (s *ourServer) addr() string {
	host := s.host
	if host == "" {
		host = "127.0.0.1"
	}
	return net.JoinHostPort(host, strconv.Itoa(s.port))
}

func (s *ourServer) start(t *testing.T) {
	t.Helper()
	var err error
	for attempt := 0; attempt < 50; attempt++ {
		argv := []string{s.bin, "--listen", s.addr(), "--export", "disk=" + s.image, "--metrics-addr", "", "--log-level", "warn"}
		if s.tls != nil {
			argv = append(argv, "--tls", "require", "--tls-cert", s.tls.ServerPEM, "--tls-key", s.tls.ServerPEM, "--tls-ca", s.tls.CAPEM)
		}
		if s.ns != "" {
			// ip netns exec execs the server: its pid is the server's.
			argv = append([]string{"ip", "netns", "exec", s.ns}, argv...)
		}
		cmd := exec.Command(argv[0], argv[1:]...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		cmd.Stderr = os.Stderr
		if err = cmd.Start(); err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		if err = waitNBD(s.addr(), 5*time.Second); err == nil {
			s.cmd, s.done = cmd, done
			return
		}
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-done
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("start our nbd-server: %v", err)
}

func (s *ourServer) kill(t *testing.T) {
	t.Helper()
	replenv.KillGroup(t, s.cmd, s.done, "our nbd-server")
	s.cmd = nil
}

var buildOnce = sync.OnceValues(func() (string, error) {
	dir, err := os.MkdirTemp("", "mpnbd-faults-bin")
	if err != nil {
		return "", err
	}
	return dir, repo.BuildCommands(dir)
})

func newServer(t *testing.T, kind string, size int64) server {
	t.Helper()
	dir := t.TempDir()
	image := filepath.Join(dir, "disk.img")
	f, err := os.Create(image)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	f.Close()
	var s server
	switch kind {
	case "nbd-server":
		s = &nbdServer{dir: dir, image: image, port: freePort(t)}
	default:
		bin, err := buildOnce()
		if err != nil {
			t.Fatalf("build the commands: %v", err)
		}
		o := &ourServer{bin: filepath.Join(bin, "nbd-server"), image: image, port: freePort(t)}
		if kind == "ours-tls" {
			o.tls = newTestPKI(t)
		}
		s = o
	}
	s.start(t)
	t.Cleanup(func() { s.kill(t) })
	return s
}

// TestMain: the test binary is also the fuse transport's per-volume server
// process (the attacher runs its own executable again to start one).
func TestMain(m *testing.M) {
	if fuse.ServeRequested() {
		os.Exit(fuse.ServeMain())
	}
	if tg := os.Getenv(clientTargetEnv); tg != "" {
		os.Exit(runClient(tg, os.Getenv(clientStateEnv)))
	}
	os.Exit(m.Run())
}

// attachFuse attaches the server's export with the fuse transport.
func attachFuse(t *testing.T, s server) string {
	return attachFuseWith(t, s, attach.Options{})
}

func attachFuseWith(t *testing.T, s server, o attach.Options) string {
	t.Helper()
	dev, _ := attachFuseAttacher(t, s, o)
	return dev
}

// attachFuseAttacher attaches the volume of s with the fuse transport and
// returns its device and the attacher that asks its health.
func attachFuseAttacher(t *testing.T, s server, o attach.Options) (string, *fuse.Attacher) {
	t.Helper()
	a := fuse.New(fuse.Config{StateDir: t.TempDir()})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tg := attach.Target{VolumeID: "pv-faults", Export: "disk", Addrs: []string{s.addr()}}
	if our, ok := s.(*ourServer); ok && our.tls != nil {
		tg.TLS = &attach.TargetTLS{StorageNode: storageNode, IdentityDir: our.tls.IdentityDir}
	}
	att, err := a.Attach(ctx, tg, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := a.Detach(context.Background(), "pv-faults"); err != nil {
			t.Errorf("detach: %v", err)
		}
	})
	return att.Device, a
}

var fioErr = regexp.MustCompile(`err=\s*(\d+)`)

// fioVerify writes size bytes at random with crc32c checksums, then reads
// everything back and verifies it. It returns fio's output.
func fioVerify(t *testing.T, dev string, size int64, seed int) (string, error) {
	t.Helper()
	return fioVerifyCtx(context.Background(), dev, size, seed, "randwrite", "4k")
}

// fioVerifyCtx is fioVerify with the access pattern rw and block size bs,
// and fio killed when ctx ends.
func fioVerifyCtx(ctx context.Context, dev string, size int64, seed int, rw, bs string, more ...string) (string, error) {
	args := []string{
		"--name=verify", "--filename=" + dev, "--direct=1", "--ioengine=libaio", "--iodepth=16",
		"--rw=" + rw, "--bs=" + bs, "--size=" + strconv.FormatInt(size, 10), "--randseed=" + strconv.Itoa(seed),
		"--verify=crc32c", "--do_verify=1", "--verify_fatal=1", "--verify_state_save=0", "--group_reporting",
	}
	args = append(args, more...)
	out, err := exec.CommandContext(ctx, "fio", args...).CombinedOutput()
	s := string(out)
	if err == nil {
		for _, m := range fioErr.FindAllStringSubmatch(s, -1) {
			if m[1] != "0" {
				err = fmt.Errorf("fio reported err=%s", m[1])
			}
		}
	}
	return s, err
}

// fioRounds runs write+verify rounds of round on dev, one after another,
// until the returned finish is called; finish waits for the round running
// then (at most roundLimit) and fails the test if any round failed or that
// one did not end. failed reports the first failure as it happens.
func fioRounds(t *testing.T, roundLimit time.Duration, round func(ctx context.Context, n int) (string, error)) (finish func() int, failed <-chan string) {
	t.Helper()
	stop := make(chan struct{})
	rounds := make(chan int, 1)
	fail := make(chan string, 1)
	go func() {
		n := 0
		defer func() { rounds <- n }()
		for {
			select {
			case <-stop:
				return
			default:
			}
			ctx, cancel := context.WithTimeout(context.Background(), roundLimit)
			out, err := round(ctx, n+1)
			cancel()
			if err != nil {
				fail <- "round " + strconv.Itoa(n+1) + ": " + err.Error() + "\n" + out
				return
			}
			n++
		}
	}()
	finish = func() int {
		t.Helper()
		close(stop)
		var n int
		select {
		case n = <-rounds:
		case <-time.After(roundLimit + 10*time.Second):
			t.Fatalf("a fio round still runs %v after it started at the latest", roundLimit+10*time.Second)
		}
		select {
		case f := <-fail:
			t.Fatalf("fio: %s", f)
		default:
		}
		return n
	}
	return finish, fail
}

// killer kills s every p.every and starts it again after p.gap until stop
// is closed; it returns the number of kills.
func killer(t *testing.T, s server, p plan, stop <-chan struct{}) <-chan int {
	out := make(chan int, 1)
	go func() {
		kills := 0
		defer func() { out <- kills }()
		for {
			select {
			case <-stop:
				return
			case <-time.After(p.every):
			}
			s.kill(t)
			kills++
			time.Sleep(p.gap)
			s.start(t)
		}
	}()
	return out
}

// roundsUnderKills runs round (numbered from 1) again and again while s is
// killed and restarted by plan p, for p.duration and at least once. A
// failed round fails the test at once, and so does a run in which the
// server was never killed. It returns the rounds run and the kills.
func roundsUnderKills(t *testing.T, s server, p plan, round func(n int) (string, error)) (rounds, kills int) {
	t.Helper()
	stop := make(chan struct{})
	killed := killer(t, s, p, stop)
	deadline := time.Now().Add(p.duration)
	for ; rounds == 0 || time.Now().Before(deadline); rounds++ {
		if out, err := round(rounds + 1); err != nil {
			close(stop)
			<-killed
			t.Fatalf("round %d against %s: %v\n%s", rounds+1, s.name(), err, out)
		}
	}
	close(stop)
	kills = <-killed
	if kills == 0 {
		t.Fatal("the server was never killed: the run proves nothing")
	}
	return rounds, kills
}

// TestFuseServerKills: fio with crc32c verification on the fuse transport
// while the storage server is SIGKILLed and restarted again and again:
// no I/O error, no verify failure. ours-tls: an encrypted volume (the
// server requires TLS and the node certificate; every reconnect upgrades
// again).
func TestFuseServerKills(t *testing.T) {
	need(t, "fio", "nbd-server")
	p := faultPlan()
	for _, kind := range []string{"nbd-server", "ours", "ours-tls"} {
		t.Run(kind, func(t *testing.T) {
			s := newServer(t, kind, 256<<20)
			dev, a := attachFuseAttacher(t, s, attach.Options{})
			rounds, n := roundsUnderKills(t, s, p, func(round int) (string, error) {
				return fioVerify(t, dev, 32<<20, round)
			})
			t.Logf("%s: %d fio write+verify rounds, %d SIGKILLs of the server: 0 I/O errors, 0 verify failures", s.name(), rounds, n)
			checkRequestsThroughKills(t, a, p)
		})
	}
}

// checkRequestsThroughKills reads the volume's request counts after fio
// ran through SIGKILLs of the server with no I/O error: reads and writes
// counted, every one answered by the server with a success (none an
// error or failed by the session, as fio saw none), and some request that
// waited through a kill counted with the wait (at least half the time
// the server stayed down).
func checkRequestsThroughKills(t *testing.T, a *fuse.Attacher, p plan) {
	t.Helper()
	h, err := a.Health("pv-faults")
	if err != nil {
		t.Fatalf("health: %v", err)
	}
	ops := map[string]relay.RequestStats{}
	long := uint64(0)
	for _, r := range h.Requests {
		ops[r.Op] = r
		if r.Errors != 0 || r.Failed != 0 || r.OK != r.Count() {
			t.Errorf("%s requests: %d counted, %d ok, %d errors, %d failed; fio saw no error", r.Op, r.Count(), r.OK, r.Errors, r.Failed)
		}
		for i, n := range r.Buckets {
			// Bucket i holds requests longer than bound i-1.
			if i > 0 && time.Duration(relay.LatencyBounds[i-1]*float64(time.Second)) >= p.gap/2 {
				long += n
			}
		}
	}
	if ops["read"].Count() == 0 || ops["write"].Count() == 0 {
		t.Errorf("request counts %+v: no reads or no writes counted", h.Requests)
	}
	if long == 0 {
		t.Errorf("no request counted as longer than %v, though the server was killed under fio and stayed down %v each time", p.gap/2, p.gap)
	}
	t.Logf("requests counted: %d reads, %d writes, %d flushes; %d waited %v or more", ops["read"].Count(), ops["write"].Count(), ops["flush"].Count(), long, p.gap/2)
}

// TestFuseServerKillsDuringReads: data written once with crc32c
// checksums is read back and verified, 1 MiB at a time, round after round,
// while the storage server is SIGKILLed and restarted: every kill lands
// in a read (reads that size our server executes on the goroutine that
// reads the connection, see pkg/nbd's inlineRequests). No I/O error, no
// verify failure, and the server was killed.
func TestFuseServerKillsDuringReads(t *testing.T) {
	need(t, "fio")
	p := faultPlan()
	for _, kind := range []string{"ours", "ours-tls"} {
		t.Run(kind, func(t *testing.T) {
			const size = 64 << 20
			s := newServer(t, kind, size)
			dev := attachFuse(t, s)
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			out, err := fioVerifyCtx(ctx, dev, size, 1, "write", "1M")
			cancel()
			if err != nil {
				t.Fatalf("writing the data: %v\n%s", err, out)
			}
			rounds, n := roundsUnderKills(t, s, p, func(int) (string, error) {
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
				defer cancel()
				out, err := fioVerifyCtx(ctx, dev, size, 1, "write", "1M", "--verify_only=1")
				if err == nil && !strings.Contains(out, "READ: bw=") {
					err = fmt.Errorf("fio read nothing")
				}
				return out, err
			})
			t.Logf("%s: %d verified read rounds of %d MiB, %d SIGKILLs of the server: 0 I/O errors, 0 verify failures", s.name(), rounds, size>>20, n)
		})
	}
}

// TestFuseLongOutage: the storage server is gone for p.outage in the
// middle of a verified write; the write completes with no error and the
// data verifies.
func TestFuseLongOutage(t *testing.T) {
	need(t, "fio", "nbd-server")
	p := faultPlan()
	s := newServer(t, "nbd-server", 256<<20)
	dev := attachFuse(t, s)
	res := make(chan error, 1)
	var out string
	go func() {
		var err error
		out, err = fioVerify(t, dev, 64<<20, 7)
		res <- err
	}()
	time.Sleep(time.Second)
	s.kill(t)
	select {
	case err := <-res:
		t.Fatalf("fio ended while the server was away (%v): it must wait\n%s", err, out)
	case <-time.After(p.outage):
	}
	s.start(t)
	select {
	case err := <-res:
		if err != nil {
			t.Fatalf("after a %v outage: %v\n%s", p.outage, err, out)
		}
	case <-time.After(5 * time.Minute):
		t.Fatal("fio did not finish after the server came back")
	}
	t.Logf("server gone %v mid-write: fio finished with no error and verified", p.outage)
}

// TestFusePluginRestartDuringOutage: the storage server is SIGKILLed in the
// middle of a verified write; while it is away the attacher that attached
// the volume is dropped and a new one (a restarted node plugin) takes the
// volume over from the state directory. The volume's server process, a
// process of its own, waits the outage out; once the storage server is
// back the write completes with no error and verifies, and the new
// attacher detaches the volume.
func TestFusePluginRestartDuringOutage(t *testing.T) {
	need(t, "fio", "nbd-server")
	p := faultPlan()
	s := newServer(t, "nbd-server", 256<<20)
	state := t.TempDir()
	tg := attach.Target{VolumeID: "pv-restart", Export: "disk", Addrs: []string{s.addr()}}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	att, err := fuse.New(fuse.Config{StateDir: state}).Attach(ctx, tg, attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	res := make(chan error, 1)
	var out string
	go func() {
		var err error
		out, err = fioVerify(t, att.Device, 64<<20, 11)
		res <- err
	}()
	time.Sleep(time.Second)
	s.kill(t)
	fresh := fuse.New(fuse.Config{StateDir: state})
	t.Cleanup(func() {
		if err := fresh.Detach(context.Background(), tg.VolumeID); err != nil {
			t.Errorf("detach from the new attacher: %v", err)
		}
	})
	atts, err := fresh.Adopt(ctx)
	if err != nil || len(atts) != 1 || atts[0].Device != att.Device {
		t.Fatalf("the new attacher took over %+v (%v), want %s", atts, err, att.Device)
	}
	// The volume's process notices the dead connection on its own
	// schedule (the kill's reset, or its next request): bounded.
	var h attach.Health
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		h, err = fresh.Health(tg.VolumeID)
		if (err == nil && !h.Connected) || time.Now().After(deadline) {
			break
		}
	}
	if err != nil || h.Connected {
		t.Errorf("health from the new attacher 5 s into the outage: %+v, %v", h, err)
	}
	select {
	case err := <-res:
		t.Fatalf("fio ended while the server was away (%v): it must wait\n%s", err, out)
	case <-time.After(p.outage):
	}
	s.start(t)
	select {
	case err := <-res:
		if err != nil {
			t.Fatalf("after a %v outage and a new attacher: %v\n%s", p.outage, err, out)
		}
	case <-time.After(5 * time.Minute):
		t.Fatal("fio did not finish after the server came back")
	}
	if h, err := fresh.Health(tg.VolumeID); err != nil || !h.Connected {
		t.Errorf("health from the new attacher after the outage: %+v, %v", h, err)
	}
	t.Logf("server gone %v mid-write, attacher replaced meanwhile: fio finished with no error and verified", p.outage)
}

// TestFuseBoundedWait: with deadConnTimeout set, a read while the storage
// server is SIGKILLed fails (EIO) once the bound passed instead of
// waiting; the session goes on redialing, and once the server is back
// I/O works again and what was written and flushed before the kill reads
// back byte for byte.
func TestFuseBoundedWait(t *testing.T) {
	need(t, "nbd-server")
	const bound = 3 * time.Second
	s := newServer(t, "nbd-server", 64<<20)
	dev := attachFuseWith(t, s, attach.Options{DeadConnTimeout: bound})
	f, err := os.OpenFile(dev, os.O_RDWR|syscall.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf, err := syscall.Mmap(-1, 0, 1<<20, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = syscall.Munmap(buf) }() // ours: it cannot fail
	want := bytes.Repeat([]byte("bounded!"), len(buf)/8)
	copy(buf, want)
	if _, err := f.WriteAt(buf, 4<<20); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	s.kill(t)
	start := time.Now()
	res := make(chan error, 1)
	go func() { _, err := f.ReadAt(buf, 8<<20); res <- err }()
	select {
	case err := <-res:
		if err == nil {
			t.Fatal("a read succeeded with the server killed")
		}
		t.Logf("read with the server gone failed after %v: %v", time.Since(start).Round(time.Millisecond), err)
	case <-time.After(60 * time.Second):
		t.Fatalf("a read still waits 60s after the server died, with deadConnTimeout %v", bound)
	}
	s.start(t)
	deadline := time.Now().Add(60 * time.Second)
	for {
		clear(buf)
		_, err := f.ReadAt(buf, 4<<20)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("reads still fail 60s after the server came back: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if !bytes.Equal(buf, want) {
		t.Fatal("data written and flushed before the kill differs once the server is back")
	}
	copy(buf, want)
	if _, err := f.WriteAt(buf, 12<<20); err != nil {
		t.Fatalf("write once the server is back: %v", err)
	}
	if err := f.Sync(); err != nil {
		t.Fatalf("fsync once the server is back: %v", err)
	}
}
