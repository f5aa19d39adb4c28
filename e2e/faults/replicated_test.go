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

package faults

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
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
	"unsafe"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/attach/fuse"
	"github.com/mpnbd/mpnbd/pkg/blockdev"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// The replicated volume's fault test: a switched storage network
// (topo.Fabric, 4 paths of 1 Gbit/s per host) of one client host and
// three storage hosts, each storage host running the storage agent
// (`nbd-server --cluster`) as a process of its own, which reaches the API
// server through a port of its namespace's loopback (forwarded to the
// test's API server), and the controller as a process (it signs the
// storage certificates and fails volumes over). The client host runs the
// fuse transport (this test binary, started in its namespace), whose
// block device fio writes and verifies from the test. Faults: a host's
// death (its agent SIGKILLed, every packet of its namespace dropped: no
// reset), its return, a partition of the primary from the API server
// only, and one from the client only.

// clientTargetEnv, set, makes this test binary the client host's process:
// it attaches the target (JSON) with the fuse transport, prints "device
// <path>", and detaches when its standard input closes.
const (
	clientTargetEnv = "MPNBD_FAULTS_CLIENT_TARGET"
	clientStateEnv  = "MPNBD_FAULTS_CLIENT_STATE"
)

// runClient is the client host's process.
func runClient(target, state string) int {
	var tg attach.Target
	if err := json.Unmarshal([]byte(target), &tg); err != nil {
		fmt.Fprintln(os.Stderr, "client:", err)
		return 1
	}
	a := fuse.New(fuse.Config{StateDir: state})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	att, err := a.Attach(ctx, tg, attach.Options{})
	cancel()
	if err != nil {
		fmt.Fprintln(os.Stderr, "client: attach:", err)
		return 1
	}
	fmt.Println("device", att.Device)
	_, _ = io.Copy(io.Discard, os.Stdin)
	if err := a.Detach(context.Background(), tg.VolumeID); err != nil {
		fmt.Fprintln(os.Stderr, "client: detach:", err)
		return 1
	}
	return 0
}

// storageHost is a storage node of the fabric and its agent's process.
type storageHost struct {
	node, host string
	f          *topo.Fabric
	bin        string
	dir        string
	kubeconfig string
	apiPort    int
	log        string

	cmd  *exec.Cmd
	done chan struct{}
}

// replicatedEnv is the whole setup.
type replicatedEnv struct {
	t     *testing.T
	f     *topo.Fabric
	c     client.Client
	hosts map[string]*storageHost
	bin   string
	logs  string
	// admin is a kubeconfig of the cluster's administrator (mpnbdctl's).
	admin string
	// csi is the controller's CSI endpoint.
	csi string
	// abandoned are the volumes whose client is SIGKILLed at the end
	// instead of detached (its session was fenced, its I/O hangs).
	abandoned map[string]bool
}

const replicatedNamespace = apiserver.DeployNamespace

func newReplicatedEnv(t *testing.T) *replicatedEnv {
	t.Helper()
	need(t, "fio", "ip", "tc")
	topo.RequireNft(t)
	if err := mptcp.Available(); err != nil {
		t.Skipf("skipping: MPTCP unavailable: %v", err)
	}
	bin, err := buildOnce()
	if err != nil {
		t.Fatalf("build the commands: %v", err)
	}
	cfg, c := apiserver.Start(t)
	ctx := context.Background()
	if err := apiserver.Apply(ctx, c, "deploy/rbac-storage-agent.yaml"); err != nil {
		t.Fatal(err)
	}
	f := topo.NewFabricForTest(t, topo.FabricConfig{Name: topo.UniqueName("rf"), Hosts: []string{"cli", "s1", "s2", "s3", "s4"}, Paths: 4, RateMbit: 1000})
	e := &replicatedEnv{t: t, f: f, c: c, hosts: map[string]*storageHost{}, bin: bin, logs: t.TempDir(),
		admin: apiserver.WriteKubeconfig(t, cfg), csi: "unix://" + filepath.Join(t.TempDir(), "c.sock"), abandoned: map[string]bool{}}
	t.Cleanup(func() {
		if t.Failed() {
			e.dumpLogs()
		}
	})

	// The controller: signs the storage certificates, fails volumes over.
	ctlLog, err := os.Create(filepath.Join(e.logs, "controller.log"))
	if err != nil {
		t.Fatal(err)
	}
	ctl := exec.Command(filepath.Join(bin, "controller"), "--endpoint", e.csi,
		"--namespace", replicatedNamespace, "--kubeconfig", e.admin)
	ctl.Stdout, ctl.Stderr = ctlLog, ctlLog
	if err := ctl.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ctl.Process.Kill(); ctl.Wait() })

	// The agents end after the clients (whose cleanups come later and run
	// first) have detached, whenever an agent was last started.
	t.Cleanup(func() {
		for _, h := range e.hosts {
			h.kill(t)
		}
	})
	for i, h := range []string{"s1", "s2", "s3", "s4"} {
		sh := &storageHost{node: "store-" + strconv.Itoa(i+1), host: h, f: f, bin: bin, dir: t.TempDir(),
			log: filepath.Join(e.logs, h+".log")}
		sh.apiPort = forwardAPI(t, f.NS(h), strings.TrimSuffix(strings.TrimPrefix(cfg.Host, "https://"), "/"))
		acfg := apiserver.As(cfg, "mpnbd-storage-agent", sh.node)
		acfg.Host = "https://127.0.0.1:" + strconv.Itoa(sh.apiPort)
		sh.kubeconfig = apiserver.WriteKubeconfig(t, acfg)
		e.hosts[sh.node] = sh
		sh.start(t)
	}
	for n := range e.hosts {
		e.waitFor("storage node "+n+" reports its addresses", time.Minute, func() string {
			var sn v1alpha1.NBDStorageNode
			if err := c.Get(ctx, client.ObjectKey{Name: n}, &sn); err != nil {
				return err.Error()
			}
			if sn.Status.Port == 0 || len(sn.Status.Addresses) != 4 {
				return fmt.Sprintf("status %+v", sn.Status)
			}
			return ""
		})
	}
	return e
}

// forwardAPI listens on a port of ns's loopback and forwards every
// connection to the API server at target; it returns the port.
func forwardAPI(t *testing.T, ns, target string) int {
	t.Helper()
	var l net.Listener
	if err := topo.InNetns(ns, func() error {
		var err error
		l, err = net.Listen("tcp", "127.0.0.1:0")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	// Every connection is closed at the end, before the API server
	// stops: one whose agent died while its host's packets were dropped
	// never hears of it, and would hold the API server's shutdown.
	var mu sync.Mutex
	conns := map[net.Conn]bool{}
	track := func(c net.Conn, add bool) {
		mu.Lock()
		defer mu.Unlock()
		if add {
			conns[c] = true
		} else {
			delete(conns, c)
		}
	}
	t.Cleanup(func() {
		l.Close()
		mu.Lock()
		defer mu.Unlock()
		for c := range conns {
			c.Close()
		}
	})
	go func() {
		for {
			in, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				track(in, true)
				defer func() { in.Close(); track(in, false) }()
				out, err := net.Dial("tcp", target)
				if err != nil {
					fmt.Fprintf(os.Stderr, "forwarding to the API server at %s: %v\n", target, err)
					return
				}
				track(out, true)
				defer func() { out.Close(); track(out, false) }()
				go func() { _, _ = io.Copy(out, in); _ = out.(*net.TCPConn).CloseWrite() }()
				_, _ = io.Copy(in, out)
			}()
		}
	}()
	return l.Addr().(*net.TCPAddr).Port
}

func (h *storageHost) start(t *testing.T) {
	t.Helper()
	var addrs []string
	for _, a := range h.f.Addrs(h.host) {
		addrs = append(addrs, a.String())
	}
	logf, err := os.OpenFile(h.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	h.cmd = topo.Exec(h.f.NS(h.host), filepath.Join(h.bin, "nbd-server"), "--cluster", "--node-name", h.node,
		"--namespace", replicatedNamespace, "--data-dir", h.dir, "--storage-address", strings.Join(addrs, ","),
		"--listen", ":10809", "--metrics-addr", "", "--heartbeat", "2s", "--kubeconfig", h.kubeconfig)
	h.cmd.Stdout, h.cmd.Stderr = logf, logf
	h.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := h.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	h.done = make(chan struct{})
	go func(cmd *exec.Cmd, done chan struct{}) { cmd.Wait(); close(done) }(h.cmd, h.done)
}

// kill SIGKILLs the agent's process group and waits for it.
func (h *storageHost) kill(t *testing.T) {
	t.Helper()
	killGroup(t, h.cmd, h.done, "the agent of "+h.node)
	h.cmd = nil
}

// die is a storage host's death: every packet of its namespace dropped
// (no reset, no ICMP), its agent SIGKILLed.
func (h *storageHost) die(t *testing.T) {
	t.Helper()
	if err := topo.Drop(h.f.NS(h.host), "dead", ""); err != nil {
		t.Fatal(err)
	}
	h.kill(t)
}

// restart SIGKILLs the agent of a host that stays up and starts it again
// over the same data directory.
func (h *storageHost) restart(t *testing.T) {
	t.Helper()
	h.kill(t)
	h.start(t)
}

// revive brings a dead host back: its network, then its agent over the
// same data directory.
func (h *storageHost) revive(t *testing.T) {
	t.Helper()
	if err := topo.Undrop(h.f.NS(h.host), "dead"); err != nil {
		t.Fatal(err)
	}
	h.start(t)
}

func (e *replicatedEnv) dumpLogs() {
	entries, _ := os.ReadDir(e.logs)
	for _, en := range entries {
		b, err := os.ReadFile(filepath.Join(e.logs, en.Name()))
		if err != nil {
			continue
		}
		if len(b) > 12000 {
			b = b[len(b)-12000:]
		}
		e.t.Logf("--- the end of %s:\n%s", en.Name(), b)
	}
}

// waitFor polls cond until it returns "" or timeout passes.
func (e *replicatedEnv) waitFor(what string, timeout time.Duration, cond func() string) {
	e.t.Helper()
	end := time.Now().Add(timeout)
	for {
		msg := cond()
		if msg == "" {
			return
		}
		if time.Now().After(end) {
			e.t.Fatalf("%s: not after %v: %s", what, timeout, msg)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func (e *replicatedEnv) volume(name string) *v1alpha1.NBDVolume {
	e.t.Helper()
	var v v1alpha1.NBDVolume
	if err := e.c.Get(context.Background(), client.ObjectKey{Name: name}, &v); err != nil {
		e.t.Fatal(err)
	}
	return &v
}

// startClient runs the client host's process for target and returns the
// block device it attached.
func (e *replicatedEnv) startClient(target attach.Target) string {
	t := e.t
	t.Helper()
	b, err := json.Marshal(target)
	if err != nil {
		t.Fatal(err)
	}
	logf, err := os.Create(filepath.Join(e.logs, "client-"+target.VolumeID+".log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := topo.Exec(e.f.NS("cli"), os.Args[0], "-test.run=^$")
	state := t.TempDir()
	cmd.Env = append(os.Environ(), clientTargetEnv+"="+string(b), clientStateEnv+"="+state)
	cmd.Stderr = logf
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	// The loop device the client attached, and its backing file as
	// bound then (a fuse volume's: dev:ino on its FUSE mount).
	var loopDev string
	var loopBacking [2]uint64
	t.Cleanup(func() {
		if e.abandoned[target.VolumeID] {
			cmd.Process.Kill()
			<-done
			killByEnv(clientStateEnv + "=" + state)
			// A client killed attached leaves its loop device bound to
			// a file on a dead FUSE mount: detached, as a node's
			// cleanup would, if it still holds that file.
			if st, err := blockdev.StatLoop(loopDev); loopDev != "" && err == nil && [2]uint64{st.BackingDevice, st.BackingInode} == loopBacking {
				switch err := blockdev.DetachLoop(loopDev); {
				case errors.Is(err, blockdev.ErrLoopBusy):
					// Still open (a write of the test's waiting on
					// it): the kernel detaches it at the last close.
					t.Logf("%s, left by the killed client, detaches at its last close (%v)", loopDev, err)
				case err != nil:
					t.Errorf("detaching %s, left by the killed client: %v", loopDev, err)
				}
			}
			return
		}
		stdin.Close()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Error("the client did not detach within 30s")
			cmd.Process.Kill()
			<-done
		}
		if code := cmd.ProcessState.ExitCode(); code != 0 {
			b, _ := os.ReadFile(logf.Name())
			t.Logf("the client exited %d; its log ends:\n%s", code, tail(string(b), 2000))
		}
		// The volume's own process (fuse's server, detached from the
		// client by design) must not outlive the test.
		if n := killByEnv(clientStateEnv + "=" + state); n > 0 {
			t.Logf("%d process(es) of the client's volume outlived its detach: killed", n)
		}
	})
	dev := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if d, ok := strings.CutPrefix(sc.Text(), "device "); ok {
				dev <- d
			}
		}
		close(dev)
	}()
	select {
	case d, ok := <-dev:
		if !ok {
			t.Fatal("the client exited before it attached")
		}
		if st, err := blockdev.StatLoop(d); err == nil {
			loopDev, loopBacking = d, [2]uint64{st.BackingDevice, st.BackingInode}
		}
		return d
	case <-time.After(90 * time.Second):
		t.Fatal("the client did not attach within 90s")
	}
	return ""
}

// pauseProbe writes one block at off of dev every 100ms, each write
// O_DIRECT and O_DSYNC, and keeps the longest time between two completed
// writes, and every error.
type pauseProbe struct {
	mu      sync.Mutex
	last    time.Time
	longest time.Duration
	errs    []error
	stop    chan struct{}
	done    chan struct{}
}

func startPauseProbe(t *testing.T, dev string, off int64) *pauseProbe {
	t.Helper()
	// Close-on-exec: an agent started while the probe runs must not
	// inherit the device (it would keep the client from detaching).
	fd, err := syscall.Open(dev, syscall.O_WRONLY|syscall.O_DIRECT|syscall.O_DSYNC|syscall.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	raw := make([]byte, 8192)
	shift := (4096 - int(uintptr(unsafe.Pointer(&raw[0]))&4095)) & 4095
	buf := raw[shift : shift+4096]
	p := &pauseProbe{last: time.Now(), stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(p.done)
		defer syscall.Close(fd)
		for i := 0; ; i++ {
			select {
			case <-p.stop:
				return
			case <-time.After(100 * time.Millisecond):
			}
			copy(buf, fmt.Sprintf("probe %d", i))
			_, err := syscall.Pwrite(fd, buf, off)
			p.mu.Lock()
			if err != nil {
				p.errs = append(p.errs, err)
			}
			now := time.Now()
			p.longest = max(p.longest, now.Sub(p.last))
			p.last = now
			p.mu.Unlock()
		}
	}()
	t.Cleanup(p.end)
	return p
}

// resumed waits, up to timeout, for a write completed after the call:
// the pause under way, if any, is then whole in the next take.
func (p *pauseProbe) resumed(timeout time.Duration) error {
	since := time.Now()
	end := since.Add(timeout)
	for {
		p.mu.Lock()
		last := p.last
		p.mu.Unlock()
		if last.After(since) {
			return nil
		}
		if time.Now().After(end) {
			return fmt.Errorf("no write completed for %v", time.Since(last).Round(time.Millisecond))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// take returns the longest pause since the last take (including the one
// under way) and starts afresh; and the errors.
func (p *pauseProbe) take() (time.Duration, []error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	l := max(p.longest, time.Since(p.last))
	p.longest = 0
	errs := p.errs
	p.errs = nil
	return l, errs
}

// end stops the probe; a write that hangs (the test failed with the
// volume unreachable) is left behind after 10s.
func (p *pauseProbe) end() {
	select {
	case <-p.stop:
	default:
		close(p.stop)
	}
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
	}
}

// TestReplicatedVolumeFaults: fio --verify=crc32c rounds on a 3-replica
// volume through the fuse transport while, in turn, the primary's host
// dies (the controller promotes a replica in sync; the client reaches it
// with no I/O error), the dead host comes back (rebuilt as a replica,
// back in sync), a secondary's host dies and comes back, the primary is
// cut off from the API server only (its lease lapses: it stops serving,
// another is promoted), and the primary is cut off from the client only
// (nothing moves: the I/O waits, then goes on); last, the primary's
// storage node is drained onto a fourth with mpnbdctl, agents SIGKILLed
// mid-drain (drainPrimary). No round fails, a probe
// writer sees no error, and the longest pause of each case is printed.
// At the end every copy in sync holds the same bytes.
func TestReplicatedVolumeFaults(t *testing.T) {
	e := newReplicatedEnv(t)
	ctx := context.Background()
	c := e.c
	const size = 64 << 20
	const name = "rv"
	token := e.createPublished(name, size, "store-1", "store-2", "store-3")
	record := func() *v1alpha1.ReplicationStatus { return e.volume(name).Status.Replication }
	inSync := func(want ...string) func() string {
		return func() string {
			r := record()
			if r == nil || !slices.Equal(r.InSync, want) {
				return fmt.Sprintf("record %+v", r)
			}
			return ""
		}
	}
	// Served, and its record made with every replica in sync (which the
	// storage certificates, issued by the controller, make possible).
	e.waitFor("the volume served with its three replicas in sync", 2*time.Minute, func() string {
		v := e.volume(name)
		if v.Status.Phase != v1alpha1.VolumeAvailable || v.Status.ObservedGeneration != v.Generation {
			return fmt.Sprintf("status %+v", v.Status)
		}
		return inSync("store-1", "store-2", "store-3")()
	})
	servers := e.servers
	target := attach.Target{VolumeID: name, Export: access.ExportName(name, token, 1), Addrs: servers("s1"),
		Replicas: []attach.Server{{StorageNode: "store-2", Addrs: servers("s2")}, {StorageNode: "store-3", Addrs: servers("s3")}}}
	dev := e.startClient(target)
	probe := startPauseProbe(t, dev, size-4096)

	// fio rounds over the first half, one after another, all along.
	const fioSize = 24 << 20
	finish, failed := fioRounds(t, 3*time.Minute, func(ctx context.Context, n int) (string, error) {
		return fioVerifyCtx(ctx, dev, fioSize, n, "randwrite", "4k")
	})
	check := func(what string) {
		t.Helper()
		select {
		case f := <-failed:
			t.Fatalf("%s: fio: %s", what, f)
		default:
		}
		if err := probe.resumed(time.Minute); err != nil {
			t.Fatalf("%s: the probe's writes did not resume: %v", what, err)
		}
		pause, errs := probe.take()
		if len(errs) > 0 {
			t.Fatalf("%s: the probe's writes failed: %v", what, errs)
		}
		t.Logf("%s: the longest I/O pause %v", what, pause.Round(time.Millisecond))
	}
	settle := func() { time.Sleep(3 * time.Second) }
	primary := func() *storageHost { return e.hosts[record().Primary] }

	// A replica whose storage certificate was not issued yet when the
	// first writes came was dropped; it is back within seconds.
	e.waitFor("every replica in sync under fio", 2*time.Minute, inSync("store-1", "store-2", "store-3"))
	settle()
	check("before any fault")

	// The cycle of faults: once in `make test`, five times in `make soak`.
	cycles := 1
	if os.Getenv("MPNBD_SOAK") == "1" {
		cycles = 5
	}
	for cycle := 1; cycle <= cycles; cycle++ {
		t.Logf("cycle %d of %d", cycle, cycles)
		// 1. The primary's host dies.
		old := primary()
		old.die(t)
		e.waitFor("another replica promoted", time.Minute, func() string {
			if r := record(); r.Primary == old.node {
				return fmt.Sprintf("record %+v", r)
			}
			return ""
		})
		settle()
		check("the primary's host died")

		// 2. It comes back: a replica now, rebuilt, in sync again.
		old.revive(t)
		e.waitFor("the dead host's replica back in sync", 2*time.Minute, inSync("store-1", "store-2", "store-3"))
		check("the dead host came back")

		// 3. A secondary's host dies, and comes back.
		var second *storageHost
		for _, n := range record().InSync {
			if n != record().Primary {
				second = e.hosts[n]
				break
			}
		}
		second.die(t)
		e.waitFor("the dead secondary out of the in-sync set", time.Minute, func() string {
			if slices.Contains(record().InSync, second.node) {
				return fmt.Sprintf("record %+v", record())
			}
			return ""
		})
		settle()
		check("a secondary's host died")
		second.revive(t)
		e.waitFor("the secondary back in sync", 2*time.Minute, inSync("store-1", "store-2", "store-3"))
		check("the secondary came back")

		// 4. The primary cut off from the API server only: its lease lapses,
		// it stops serving, another is promoted.
		cut := primary()
		if err := topo.DropPort(cut.f.NS(cut.host), "api", cut.apiPort); err != nil {
			t.Fatal(err)
		}
		e.waitFor("a replica promoted over the primary cut off from the API server", time.Minute, func() string {
			if r := record(); r.Primary == cut.node {
				return fmt.Sprintf("record %+v", r)
			}
			return ""
		})
		settle()
		check("the primary was cut off from the API server")
		if err := topo.Undrop(cut.f.NS(cut.host), "api"); err != nil {
			t.Fatal(err)
		}
		e.waitFor("the cut-off primary back in sync, as a replica", 2*time.Minute, inSync("store-1", "store-2", "store-3"))
		check("the cut-off primary's API server came back")

		// 5. The primary cut off from the client only: nothing moves; the
		// I/O waits, then goes on.
		cut = primary()
		before := record()
		if err := topo.DropPeers(cut.f.NS(cut.host), "client", e.f.Addrs("cli")); err != nil {
			t.Fatal(err)
		}
		time.Sleep(8 * time.Second)
		if err := topo.Undrop(cut.f.NS(cut.host), "client"); err != nil {
			t.Fatal(err)
		}
		settle()
		check("the primary was cut off from the client for 8s")
		if r := record(); r.Primary != before.Primary {
			t.Errorf("a partition between the client and a live primary moved the volume: %+v, then %+v", before, r)
		}
	}

	// 6. The primary's storage node drained with mpnbdctl under fio: a
	// replica added on the spare node (its agent SIGKILLed while it is
	// copied, and started again), the primary handed to a replica in sync
	// (the drained node's agent SIGKILLed then, and started again), the
	// drained node's replica gone and its copy deleted. The volume keeps
	// three copies in sync.
	e.drainPrimary(name, "store-4")
	check("the primary's storage node was drained")

	rounds := finish()
	probe.end()
	t.Logf("%d fio rounds verified through the faults", rounds)
	if rounds < 1 {
		t.Errorf("no fio round completed")
	}
	// Every copy in sync holds what the primary holds.
	r := record()
	want, err := os.ReadFile(filepath.Join(e.hosts[r.Primary].dir, name+".img"))
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range r.InSync {
		got, err := os.ReadFile(filepath.Join(e.hosts[n].dir, name+".img"))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Errorf("the copy on %s, in sync, differs from the primary's on %s", n, r.Primary)
		}
	}
	var evs corev1.EventList
	if err := c.List(ctx, &evs, client.InNamespace(metav1.NamespaceDefault)); err == nil {
		n := 0
		for _, ev := range evs.Items {
			if ev.InvolvedObject.Name == name && ev.Reason == "FailedOver" {
				n++
			}
		}
		if n < 2 {
			t.Errorf("%d FailedOver Events on the volume, want 2 (a dead primary, one cut off from the API server)", n)
		}
	}
}

// createPublished creates block volume name of size bytes on primary,
// with replicas on the others, published to the client host; it returns
// the client's token.
func (e *replicatedEnv) createPublished(name string, size int64, primary string, replicas ...string) string {
	t := e.t
	t.Helper()
	ctx := context.Background()
	v := &v1alpha1.NBDVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{}},
		Spec:       v1alpha1.NBDVolumeSpec{SizeBytes: size, StorageNode: primary, AccessType: v1alpha1.AccessBlock},
	}
	if len(replicas) > 0 {
		v.Spec.Replicas, v.Spec.ReplicaNodes = int32(len(replicas)+1), replicas
		for _, r := range replicas {
			v.Labels[v1alpha1.ReplicaLabel(r)] = ""
		}
	}
	if err := e.c.Create(ctx, v); err != nil {
		t.Fatal(err)
	}
	token, err := access.NewToken()
	if err != nil {
		t.Fatal(err)
	}
	var cliAddrs []string
	for _, a := range e.f.Addrs("cli") {
		cliAddrs = append(cliAddrs, a.String())
	}
	err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
		v := e.volume(name)
		v.Spec.Publications = []v1alpha1.Publication{{NodeID: "cli", TokenSHA256: access.TokenHash(token), Addresses: cliAddrs, Epoch: 1}}
		return e.c.Update(ctx, v)
	})
	if err != nil {
		t.Fatal(err)
	}
	return token
}

// servers are host's storage addresses with the NBD port.
func (e *replicatedEnv) servers(host string) []string {
	var out []string
	for _, a := range e.f.Addrs(host) {
		out = append(out, net.JoinHostPort(a.String(), "10809"))
	}
	return out
}

// drainPrimary drains the storage node of volume name's primary onto
// spare with mpnbdctl, SIGKILLing the spare's agent while it is copied and
// the drained node's agent once it has handed the primary over, and checks
// that the drained node ends holding nothing: an unreplicated volume on it,
// attached and written, moves too.
func (e *replicatedEnv) drainPrimary(name, spare string) {
	t := e.t
	t.Helper()
	drained := e.hosts[e.volume(name).Status.Replication.Primary]
	// An unreplicated volume on the drained node, attached and written
	// (a known pattern, then a probe writer): it moves too.
	const uv, uvSize = "uv", 16 << 20
	token := e.createPublished(uv, uvSize, drained.node)
	e.waitFor("the unreplicated volume served", time.Minute, func() string {
		if v := e.volume(uv); v.Status.Phase != v1alpha1.VolumeAvailable {
			return fmt.Sprintf("status %+v", v.Status)
		}
		return ""
	})
	uvDev := e.startClient(attach.Target{VolumeID: uv, Export: access.ExportName(uv, token, 1), Addrs: e.servers(drained.host)})
	pattern := make([]byte, 8<<20)
	if _, err := rand.Read(pattern); err != nil {
		t.Fatal(err)
	}
	if err := directIO(uvDev, pattern, 0, true); err != nil {
		t.Fatalf("writing the unreplicated volume: %v", err)
	}
	uvProbe := startPauseProbe(t, uvDev, uvSize-4096)

	logf, err := os.Create(filepath.Join(e.logs, "mpnbdctl-drain.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	ctl := exec.Command(filepath.Join(e.bin, "mpnbdctl"), "--kubeconfig", e.admin, "drain", drained.node, "--wait", "3m")
	ctl.Stdout, ctl.Stderr = logf, logf
	if err := ctl.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- ctl.Wait() }()
	t.Cleanup(func() { ctl.Process.Kill() })

	e.waitFor("a replica added on "+spare+" for the drain", time.Minute, func() string {
		if v := e.volume(name); !slices.Contains(v.Spec.ReplicaNodes, spare) {
			return fmt.Sprintf("replicas %v", v.Spec.ReplicaNodes)
		}
		return ""
	})
	copying := !slices.Contains(e.volume(name).Status.Replication.InSync, spare)
	e.hosts[spare].restart(t)
	t.Logf("the spare's agent SIGKILLed and started again (its copy under way: %v)", copying)
	e.waitFor("the primary handed over by the drain", 2*time.Minute, func() string {
		if r := e.volume(name).Status.Replication; r.Primary == drained.node {
			return fmt.Sprintf("record %+v", r)
		}
		return ""
	})
	drained.restart(t)
	select {
	case err := <-exited:
		if err != nil {
			b, _ := os.ReadFile(logf.Name())
			t.Fatalf("mpnbdctl drain %s: %v:\n%s", drained.node, err, b)
		}
	case <-time.After(4 * time.Minute):
		t.Fatalf("mpnbdctl drain %s did not end within 4m", drained.node)
	}
	v := e.volume(name)
	holders := append([]string{v.Spec.StorageNode}, v.Spec.ReplicaNodes...)
	if slices.Contains(holders, drained.node) || !slices.Contains(holders, spare) || len(holders) != 3 {
		t.Fatalf("after the drain of %s the volume is on %v", drained.node, holders)
	}
	e.waitFor("three copies in sync without the drained node", 2*time.Minute, func() string {
		r := e.volume(name).Status.Replication
		if len(r.InSync) != 3 || slices.Contains(r.InSync, drained.node) {
			return fmt.Sprintf("record %+v", r)
		}
		return ""
	})
	e.waitFor("the drained node's copy deleted", time.Minute, func() string {
		if _, err := os.Stat(filepath.Join(drained.dir, name+".img")); !errors.Is(err, os.ErrNotExist) {
			return fmt.Sprintf("stat: %v", err)
		}
		return ""
	})
	// The unreplicated volume: on another node, alone again, its data
	// read back through the client and in the new node's copy, its probe
	// with no error; its copy on the drained node deleted.
	u := e.volume(uv)
	if u.Spec.StorageNode == drained.node || len(u.Spec.ReplicaNodes) != 0 {
		t.Fatalf("the unreplicated volume after the drain: on %s, replicas %v", u.Spec.StorageNode, u.Spec.ReplicaNodes)
	}
	if err := uvProbe.resumed(time.Minute); err != nil {
		t.Fatalf("the unreplicated volume's probe did not resume: %v", err)
	}
	pause, errs := uvProbe.take()
	uvProbe.end()
	if len(errs) > 0 {
		t.Fatalf("the unreplicated volume's probe writes failed: %v", errs)
	}
	t.Logf("the unreplicated volume moved off the drained node to %s: the longest I/O pause %v", u.Spec.StorageNode, pause.Round(time.Millisecond))
	got := make([]byte, len(pattern))
	if err := directIO(uvDev, got, 0, false); err != nil || !bytes.Equal(got, pattern) {
		t.Fatalf("the unreplicated volume reads back other data after the move (%v)", err)
	}
	f, err := os.Open(filepath.Join(e.hosts[u.Spec.StorageNode].dir, uv+".img"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := io.ReadFull(f, got); err != nil || !bytes.Equal(got, pattern) {
		t.Fatalf("the unreplicated volume's copy on %s differs from what was written (%v)", u.Spec.StorageNode, err)
	}
	e.waitFor("the drained node's copy of the unreplicated volume deleted", time.Minute, func() string {
		if _, err := os.Stat(filepath.Join(drained.dir, uv+".img")); !errors.Is(err, os.ErrNotExist) {
			return fmt.Sprintf("stat: %v", err)
		}
		return ""
	})

	var sn v1alpha1.NBDStorageNode
	if err := e.c.Get(context.Background(), client.ObjectKey{Name: drained.node}, &sn); err != nil {
		t.Fatal(err)
	}
	if !sn.Spec.Unschedulable || !sn.Spec.Drain {
		t.Errorf("the drained node's spec %+v: want cordoned and draining", sn.Spec)
	}
}

// directIO writes buf to dev at off (read when !write), O_DIRECT and,
// for a write, O_DSYNC.
func directIO(dev string, buf []byte, off int64, write bool) error {
	flags := syscall.O_RDONLY | syscall.O_DIRECT
	if write {
		flags = syscall.O_WRONLY | syscall.O_DIRECT | syscall.O_DSYNC
	}
	fd, err := syscall.Open(dev, flags, 0)
	if err != nil {
		return err
	}
	defer syscall.Close(fd)
	raw := make([]byte, len(buf)+4096)
	shift := (4096 - int(uintptr(unsafe.Pointer(&raw[0]))&4095)) & 4095
	aligned := raw[shift : shift+len(buf)]
	var n int
	if write {
		copy(aligned, buf)
		n, err = syscall.Pwrite(fd, aligned, off)
	} else {
		n, err = syscall.Pread(fd, aligned, off)
		copy(buf, aligned)
	}
	if err == nil && n != len(buf) {
		err = fmt.Errorf("%d of %d bytes", n, len(buf))
	}
	return err
}

// killByEnv SIGKILLs every process whose environment holds entry, and
// returns how many.
func killByEnv(entry string) int {
	procs, _ := filepath.Glob("/proc/[0-9]*/environ")
	n := 0
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err != nil || !slices.Contains(strings.Split(string(b), "\x00"), entry) {
			continue
		}
		pid, err := strconv.Atoi(filepath.Base(filepath.Dir(p)))
		if err == nil && pid != os.Getpid() && syscall.Kill(pid, syscall.SIGKILL) == nil {
			n++
		}
	}
	return n
}

// tail is the end of s, at most n bytes.
func tail(s string, n int) string {
	if len(s) > n {
		return s[len(s)-n:]
	}
	return s
}
