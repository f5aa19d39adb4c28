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

// Package replenv is the setup of the replicated volumes' fault tests: a
// switched storage network (topo.Fabric) of one client host ("cli") and
// storage hosts ("s1".."sN", storage nodes "store-1".."store-N"), each
// storage host running the storage agent (`nbd-server --cluster`) as a
// process of its own, which reaches the API server through a port of its
// namespace's loopback (forwarded to the API server), and the controller
// as a process (it signs the storage certificates and fails volumes
// over). The API server is the test's own (apiserver.Start) or, in the
// VM, the host's, reached through a forward (vm.Config.HostForwards).
// What the client host runs (which transport) is the test's.
package replenv

import (
	"context"
	"fmt"
	"io"
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

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/access"
)

// Namespace is the namespace of the driver's ServiceAccounts here.
const Namespace = apiserver.DeployNamespace

// Port is the agents' NBD port.
const Port = "10809"

// Options describe an Env.
type Options struct {
	// Bin holds the commands: nbd-server, controller, mpnbdctl.
	Bin string
	// API is an administrator's config of the API server, whose CRDs
	// and the deploy tree's storage-agent RBAC are installed; Client is
	// a client of it.
	API    *rest.Config
	Client client.Client
	// StorageHosts is how many storage hosts there are (4 by default).
	StorageHosts int
	// Paths and RateMbit shape every host's storage network (4 paths of
	// 1000 Mbit/s by default).
	Paths, RateMbit int
	// Heartbeat is the agents' heartbeat (2 s by default).
	Heartbeat time.Duration
	// ClientInRoot makes the client host this process's own network
	// namespace (topo.FabricConfig.RootHost): in the VM, where the
	// kernel's nbd netlink family resolves only there.
	ClientInRoot bool
}

// Env is the whole setup.
type Env struct {
	T     testing.TB
	F     *topo.Fabric
	C     client.Client
	Hosts map[string]*StorageHost
	Bin   string
	// Logs holds every process's log.
	Logs string
	// Admin is a kubeconfig of the cluster's administrator (mpnbdctl's).
	Admin string
	// CSI is the controller's CSI endpoint.
	CSI string
}

// StorageHost is a storage node of the fabric and its agent's process.
type StorageHost struct {
	// Node is the storage node's name, Host the fabric's host.
	Node, Host string
	// Dir is the agent's data directory.
	Dir string
	// APIPort is the port of the host's loopback that leads to the API
	// server.
	APIPort int

	f          *topo.Fabric
	bin        string
	kubeconfig string
	heartbeat  time.Duration
	log        string
	cmd        *exec.Cmd
	done       chan struct{}
}

// New sets the fabric, the controller and the agents up; everything is
// stopped when t's cleanups run.
func New(t *testing.T, o Options) *Env {
	t.Helper()
	o.StorageHosts = cmpOr(o.StorageHosts, 4)
	o.Paths = cmpOr(o.Paths, 4)
	o.RateMbit = cmpOr(o.RateMbit, 1000)
	if o.Heartbeat == 0 {
		o.Heartbeat = 2 * time.Second
	}
	hosts := []string{"cli"}
	for i := 1; i <= o.StorageHosts; i++ {
		hosts = append(hosts, "s"+strconv.Itoa(i))
	}
	fc := topo.FabricConfig{Name: topo.UniqueName("rf"), Hosts: hosts, Paths: o.Paths, RateMbit: o.RateMbit}
	if o.ClientInRoot {
		fc.RootHost = "cli"
	}
	f := topo.NewFabricForTest(t, fc)
	apiAddr := strings.TrimSuffix(strings.TrimPrefix(o.API.Host, "https://"), "/")
	e := &Env{T: t, F: f, C: o.Client, Hosts: map[string]*StorageHost{}, Bin: o.Bin, Logs: t.TempDir(),
		Admin: apiserver.WriteKubeconfig(t, o.API), CSI: "unix://" + filepath.Join(t.TempDir(), "c.sock")}
	t.Cleanup(func() {
		if t.Failed() {
			e.DumpLogs()
		}
	})

	// The controller: signs the storage certificates, fails volumes over.
	ctlLog, err := os.Create(filepath.Join(e.Logs, "controller.log"))
	if err != nil {
		t.Fatal(err)
	}
	ctl := exec.Command(filepath.Join(o.Bin, "controller"), "--endpoint", e.CSI,
		"--namespace", Namespace, "--kubeconfig", e.Admin)
	ctl.Stdout, ctl.Stderr = ctlLog, ctlLog
	if err := ctl.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ctl.Process.Kill(); _ = ctl.Wait() })

	// The agents end after the clients (whose cleanups come later and run
	// first) have detached, whenever an agent was last started.
	t.Cleanup(func() {
		for _, h := range e.Hosts {
			h.Kill(t)
		}
	})
	for i := 1; i <= o.StorageHosts; i++ {
		h := "s" + strconv.Itoa(i)
		sh := &StorageHost{Node: "store-" + strconv.Itoa(i), Host: h, f: f, bin: o.Bin, Dir: t.TempDir(),
			heartbeat: o.Heartbeat, log: filepath.Join(e.Logs, h+".log")}
		sh.APIPort = ForwardAPI(t, f.NS(h), apiAddr)
		acfg := apiserver.As(o.API, "mpnbd-storage-agent", sh.Node)
		acfg.Host = "https://127.0.0.1:" + strconv.Itoa(sh.APIPort)
		sh.kubeconfig = apiserver.WriteKubeconfig(t, acfg)
		e.Hosts[sh.Node] = sh
		sh.Start(t)
	}
	ctx := context.Background()
	for n := range e.Hosts {
		e.WaitFor("storage node "+n+" reports its addresses", time.Minute, func() string {
			var sn v1alpha1.NBDStorageNode
			if err := o.Client.Get(ctx, client.ObjectKey{Name: n}, &sn); err != nil {
				return err.Error()
			}
			if sn.Status.Port == 0 || len(sn.Status.Addresses) != o.Paths {
				return fmt.Sprintf("status %+v", sn.Status)
			}
			return ""
		})
	}
	return e
}

func cmpOr(v, def int) int {
	if v == 0 {
		return def
	}
	return v
}

// ForwardAPI listens on a port of ns's loopback (ns "": this process's
// namespace) and forwards every connection to the API server at target
// (host:port); it returns the port.
func ForwardAPI(t testing.TB, ns, target string) int {
	t.Helper()
	var l net.Listener
	listen := func() error {
		var err error
		l, err = net.Listen("tcp", "127.0.0.1:0")
		return err
	}
	var err error
	if ns == "" {
		err = listen()
	} else {
		err = topo.InNetns(ns, listen)
	}
	if err != nil {
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

// Start starts the host's agent.
func (h *StorageHost) Start(t testing.TB) {
	t.Helper()
	var addrs []string
	for _, a := range h.f.Addrs(h.Host) {
		addrs = append(addrs, a.String())
	}
	logf, err := os.OpenFile(h.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	h.cmd = topo.Exec(h.f.NS(h.Host), filepath.Join(h.bin, "nbd-server"), "--cluster", "--node-name", h.Node,
		"--namespace", Namespace, "--data-dir", h.Dir, "--storage-address", strings.Join(addrs, ","),
		"--listen", ":"+Port, "--metrics-addr", "", "--heartbeat", h.heartbeat.String(), "--kubeconfig", h.kubeconfig)
	h.cmd.Stdout, h.cmd.Stderr = logf, logf
	h.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := h.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	h.done = make(chan struct{})
	go func(cmd *exec.Cmd, done chan struct{}) { _ = cmd.Wait(); close(done) }(h.cmd, h.done)
}

// Kill SIGKILLs the agent's process group and waits for it.
func (h *StorageHost) Kill(t testing.TB) {
	t.Helper()
	KillGroup(t, h.cmd, h.done, "the agent of "+h.Node)
	h.cmd = nil
}

// Die is a storage host's death: every packet of its namespace dropped
// (no reset, no ICMP), its agent SIGKILLed.
func (h *StorageHost) Die(t testing.TB) {
	t.Helper()
	if err := topo.Drop(h.f.NS(h.Host), "dead", ""); err != nil {
		t.Fatal(err)
	}
	h.Kill(t)
}

// Restart SIGKILLs the agent of a host that stays up and starts it again
// over the same data directory.
func (h *StorageHost) Restart(t testing.TB) {
	t.Helper()
	h.Kill(t)
	h.Start(t)
}

// Revive brings a dead host back: its network, then its agent over the
// same data directory.
func (h *StorageHost) Revive(t testing.TB) {
	t.Helper()
	if err := topo.Undrop(h.f.NS(h.Host), "dead"); err != nil {
		t.Fatal(err)
	}
	h.Start(t)
}

// KillGroup SIGKILLs the process group of cmd (nil: nothing runs) and
// waits, bounded, for done (closed once cmd was waited for).
func KillGroup(t testing.TB, cmd *exec.Cmd, done <-chan struct{}, what string) {
	t.Helper()
	if cmd == nil {
		return
	}
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) // gone already: the wait below says so
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatalf("%s survived SIGKILL", what)
	}
}

// DumpLogs logs the end of every process's log.
func (e *Env) DumpLogs() {
	entries, _ := os.ReadDir(e.Logs)
	for _, en := range entries {
		b, err := os.ReadFile(filepath.Join(e.Logs, en.Name()))
		if err != nil {
			continue
		}
		if len(b) > 12000 {
			b = b[len(b)-12000:]
		}
		e.T.Logf("--- the end of %s:\n%s", en.Name(), b)
	}
}

// WaitFor polls cond until it returns "" or timeout passes.
func (e *Env) WaitFor(what string, timeout time.Duration, cond func() string) {
	e.T.Helper()
	end := time.Now().Add(timeout)
	for {
		msg := cond()
		if msg == "" {
			return
		}
		if time.Now().After(end) {
			e.T.Fatalf("%s: not after %v: %s", what, timeout, msg)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// Volume is the NBDVolume name as it is now.
func (e *Env) Volume(name string) *v1alpha1.NBDVolume {
	e.T.Helper()
	var v v1alpha1.NBDVolume
	if err := e.C.Get(context.Background(), client.ObjectKey{Name: name}, &v); err != nil {
		e.T.Fatal(err)
	}
	return &v
}

// CreatePublished creates block volume name of size bytes on primary,
// with replicas on the others, published to the client host; it returns
// the client's token.
func (e *Env) CreatePublished(name string, size int64, primary string, replicas ...string) string {
	t := e.T
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
	if err := e.C.Create(ctx, v); err != nil {
		t.Fatal(err)
	}
	token, err := access.NewToken()
	if err != nil {
		t.Fatal(err)
	}
	var cliAddrs []string
	for _, a := range e.F.Addrs("cli") {
		cliAddrs = append(cliAddrs, a.String())
	}
	err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
		v := e.Volume(name)
		v.Spec.Publications = []v1alpha1.Publication{{NodeID: "cli", TokenSHA256: access.TokenHash(token), Addresses: cliAddrs, Epoch: 1}}
		return e.C.Update(ctx, v)
	})
	if err != nil {
		t.Fatal(err)
	}
	return token
}

// Servers are host's storage addresses with the NBD port.
func (e *Env) Servers(host string) []string {
	var out []string
	for _, a := range e.F.Addrs(host) {
		out = append(out, net.JoinHostPort(a.String(), Port))
	}
	return out
}
