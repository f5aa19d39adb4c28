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
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/e2e/internal/replenv"
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

// replicatedEnv is replenv's setup with the fuse client's processes.
type replicatedEnv struct {
	*replenv.Env
	// abandoned are the volumes whose client is SIGKILLed at the end
	// instead of detached (its session was fenced, its I/O hangs).
	abandoned map[string]bool
}

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
	if err := apiserver.Apply(context.Background(), c, "deploy/rbac-storage-agent.yaml"); err != nil {
		t.Fatal(err)
	}
	return &replicatedEnv{Env: replenv.New(t, replenv.Options{Bin: bin, API: cfg, Client: c}), abandoned: map[string]bool{}}
}

// startClient runs the client host's process for target and returns the
// block device it attached.
func (e *replicatedEnv) startClient(target attach.Target) string {
	t := e.T
	t.Helper()
	b, err := json.Marshal(target)
	if err != nil {
		t.Fatal(err)
	}
	logf, err := os.Create(filepath.Join(e.Logs, "client-"+target.VolumeID+".log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := topo.Exec(e.F.NS("cli"), os.Args[0], "-test.run=^$")
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
	c := e.C
	const size = 64 << 20
	const name = "rv"
	token := e.CreatePublished(name, size, "store-1", "store-2", "store-3")
	record := func() *v1alpha1.ReplicationStatus { return e.Volume(name).Status.Replication }
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
	e.WaitFor("the volume served with its three replicas in sync", 2*time.Minute, func() string {
		v := e.Volume(name)
		if v.Status.Phase != v1alpha1.VolumeAvailable || v.Status.ObservedGeneration != v.Generation {
			return fmt.Sprintf("status %+v", v.Status)
		}
		return inSync("store-1", "store-2", "store-3")()
	})
	servers := e.Servers
	target := attach.Target{VolumeID: name, Export: access.ExportName(name, token, 1), Addrs: servers("s1"),
		Replicas: []attach.Server{{StorageNode: "store-2", Addrs: servers("s2")}, {StorageNode: "store-3", Addrs: servers("s3")}}}
	dev := e.startClient(target)
	probe := replenv.StartPauseProbe(t, dev, size-4096)

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
		pause, err := probe.Pause(time.Minute)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		t.Logf("%s: the longest I/O pause %v", what, pause.Round(time.Millisecond))
	}
	settle := func() { time.Sleep(3 * time.Second) }
	primary := func() *replenv.StorageHost { return e.Hosts[record().Primary] }

	// A replica whose storage certificate was not issued yet when the
	// first writes came was dropped; it is back within seconds.
	e.WaitFor("every replica in sync under fio", 2*time.Minute, inSync("store-1", "store-2", "store-3"))
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
		old.Die(t)
		e.WaitFor("another replica promoted", time.Minute, func() string {
			if r := record(); r.Primary == old.Node {
				return fmt.Sprintf("record %+v", r)
			}
			return ""
		})
		settle()
		check("the primary's host died")

		// 2. It comes back: a replica now, rebuilt, in sync again.
		old.Revive(t)
		e.WaitFor("the dead host's replica back in sync", 2*time.Minute, inSync("store-1", "store-2", "store-3"))
		check("the dead host came back")

		// 3. A secondary's host dies, and comes back.
		var second *replenv.StorageHost
		for _, n := range record().InSync {
			if n != record().Primary {
				second = e.Hosts[n]
				break
			}
		}
		second.Die(t)
		e.WaitFor("the dead secondary out of the in-sync set", time.Minute, func() string {
			if slices.Contains(record().InSync, second.Node) {
				return fmt.Sprintf("record %+v", record())
			}
			return ""
		})
		settle()
		check("a secondary's host died")
		second.Revive(t)
		e.WaitFor("the secondary back in sync", 2*time.Minute, inSync("store-1", "store-2", "store-3"))
		check("the secondary came back")

		// 4. The primary cut off from the API server only: its lease lapses,
		// it stops serving, another is promoted.
		cut := primary()
		if err := topo.DropPort(e.F.NS(cut.Host), "api", cut.APIPort); err != nil {
			t.Fatal(err)
		}
		e.WaitFor("a replica promoted over the primary cut off from the API server", time.Minute, func() string {
			if r := record(); r.Primary == cut.Node {
				return fmt.Sprintf("record %+v", r)
			}
			return ""
		})
		settle()
		check("the primary was cut off from the API server")
		if err := topo.Undrop(e.F.NS(cut.Host), "api"); err != nil {
			t.Fatal(err)
		}
		e.WaitFor("the cut-off primary back in sync, as a replica", 2*time.Minute, inSync("store-1", "store-2", "store-3"))
		check("the cut-off primary's API server came back")

		// 5. The primary cut off from the client only: nothing moves; the
		// I/O waits, then goes on.
		cut = primary()
		before := record()
		if err := topo.DropPeers(e.F.NS(cut.Host), "client", e.F.Addrs("cli")); err != nil {
			t.Fatal(err)
		}
		time.Sleep(8 * time.Second)
		if err := topo.Undrop(e.F.NS(cut.Host), "client"); err != nil {
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
	probe.End()
	t.Logf("%d fio rounds verified through the faults", rounds)
	if rounds < 1 {
		t.Errorf("no fio round completed")
	}
	// Every copy in sync holds what the primary holds.
	r := record()
	want, err := os.ReadFile(filepath.Join(e.Hosts[r.Primary].Dir, name+".img"))
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range r.InSync {
		got, err := os.ReadFile(filepath.Join(e.Hosts[n].Dir, name+".img"))
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

// drainPrimary drains the storage node of volume name's primary onto
// spare with mpnbdctl, SIGKILLing the spare's agent while it is copied and
// the drained node's agent once it has handed the primary over, and checks
// that the drained node ends holding nothing: an unreplicated volume on it,
// attached and written, moves too.
func (e *replicatedEnv) drainPrimary(name, spare string) {
	t := e.T
	t.Helper()
	drained := e.Hosts[e.Volume(name).Status.Replication.Primary]
	// An unreplicated volume on the drained node, attached and written
	// (a known pattern, then a probe writer): it moves too.
	const uv, uvSize = "uv", 16 << 20
	token := e.CreatePublished(uv, uvSize, drained.Node)
	e.WaitFor("the unreplicated volume served", time.Minute, func() string {
		if v := e.Volume(uv); v.Status.Phase != v1alpha1.VolumeAvailable {
			return fmt.Sprintf("status %+v", v.Status)
		}
		return ""
	})
	uvDev := e.startClient(attach.Target{VolumeID: uv, Export: access.ExportName(uv, token, 1), Addrs: e.Servers(drained.Host)})
	pattern := make([]byte, 8<<20)
	if _, err := rand.Read(pattern); err != nil {
		t.Fatal(err)
	}
	if err := replenv.DirectIO(uvDev, pattern, 0, true); err != nil {
		t.Fatalf("writing the unreplicated volume: %v", err)
	}
	uvProbe := replenv.StartPauseProbe(t, uvDev, uvSize-4096)

	logf, err := os.Create(filepath.Join(e.Logs, "mpnbdctl-drain.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	ctl := exec.Command(filepath.Join(e.Bin, "mpnbdctl"), "--kubeconfig", e.Admin, "drain", drained.Node, "--wait", "3m")
	ctl.Stdout, ctl.Stderr = logf, logf
	if err := ctl.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- ctl.Wait() }()
	t.Cleanup(func() { ctl.Process.Kill() })

	e.WaitFor("a replica added on "+spare+" for the drain", time.Minute, func() string {
		if v := e.Volume(name); !slices.Contains(v.Spec.ReplicaNodes, spare) {
			return fmt.Sprintf("replicas %v", v.Spec.ReplicaNodes)
		}
		return ""
	})
	copying := !slices.Contains(e.Volume(name).Status.Replication.InSync, spare)
	e.Hosts[spare].Restart(t)
	t.Logf("the spare's agent SIGKILLed and started again (its copy under way: %v)", copying)
	e.WaitFor("the primary handed over by the drain", 2*time.Minute, func() string {
		if r := e.Volume(name).Status.Replication; r.Primary == drained.Node {
			return fmt.Sprintf("record %+v", r)
		}
		return ""
	})
	drained.Restart(t)
	select {
	case err := <-exited:
		if err != nil {
			b, _ := os.ReadFile(logf.Name())
			t.Fatalf("mpnbdctl drain %s: %v:\n%s", drained.Node, err, b)
		}
	case <-time.After(4 * time.Minute):
		t.Fatalf("mpnbdctl drain %s did not end within 4m", drained.Node)
	}
	v := e.Volume(name)
	holders := append([]string{v.Spec.StorageNode}, v.Spec.ReplicaNodes...)
	if slices.Contains(holders, drained.Node) || !slices.Contains(holders, spare) || len(holders) != 3 {
		t.Fatalf("after the drain of %s the volume is on %v", drained.Node, holders)
	}
	e.WaitFor("three copies in sync without the drained node", 2*time.Minute, func() string {
		r := e.Volume(name).Status.Replication
		if len(r.InSync) != 3 || slices.Contains(r.InSync, drained.Node) {
			return fmt.Sprintf("record %+v", r)
		}
		return ""
	})
	e.WaitFor("the drained node's copy deleted", time.Minute, func() string {
		if _, err := os.Stat(filepath.Join(drained.Dir, name+".img")); !errors.Is(err, os.ErrNotExist) {
			return fmt.Sprintf("stat: %v", err)
		}
		return ""
	})
	// The unreplicated volume: on another node, alone again, its data
	// read back through the client and in the new node's copy, its probe
	// with no error; its copy on the drained node deleted.
	u := e.Volume(uv)
	if u.Spec.StorageNode == drained.Node || len(u.Spec.ReplicaNodes) != 0 {
		t.Fatalf("the unreplicated volume after the drain: on %s, replicas %v", u.Spec.StorageNode, u.Spec.ReplicaNodes)
	}
	if err := uvProbe.Resumed(time.Minute); err != nil {
		t.Fatalf("the unreplicated volume's probe did not resume: %v", err)
	}
	pause, errs := uvProbe.Take()
	uvProbe.End()
	if len(errs) > 0 {
		t.Fatalf("the unreplicated volume's probe writes failed: %v", errs)
	}
	t.Logf("the unreplicated volume moved off the drained node to %s: the longest I/O pause %v", u.Spec.StorageNode, pause.Round(time.Millisecond))
	got := make([]byte, len(pattern))
	if err := replenv.DirectIO(uvDev, got, 0, false); err != nil || !bytes.Equal(got, pattern) {
		t.Fatalf("the unreplicated volume reads back other data after the move (%v)", err)
	}
	f, err := os.Open(filepath.Join(e.Hosts[u.Spec.StorageNode].Dir, uv+".img"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := io.ReadFull(f, got); err != nil || !bytes.Equal(got, pattern) {
		t.Fatalf("the unreplicated volume's copy on %s differs from what was written (%v)", u.Spec.StorageNode, err)
	}
	e.WaitFor("the drained node's copy of the unreplicated volume deleted", time.Minute, func() string {
		if _, err := os.Stat(filepath.Join(drained.Dir, uv+".img")); !errors.Is(err, os.ErrNotExist) {
			return fmt.Sprintf("stat: %v", err)
		}
		return ""
	})

	var sn v1alpha1.NBDStorageNode
	if err := e.C.Get(context.Background(), client.ObjectKey{Name: drained.Node}, &sn); err != nil {
		t.Fatal(err)
	}
	if !sn.Spec.Unschedulable || !sn.Spec.Drain {
		t.Errorf("the drained node's spec %+v: want cordoned and draining", sn.Spec)
	}
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
