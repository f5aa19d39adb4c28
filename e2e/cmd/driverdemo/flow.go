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

package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/driver"
)

const (
	namespace   = "mpnbd-system"
	storageNode = "storage-1"
	workerNode  = "worker-1"
	csiName     = "pvc-driverdemo"
	nbdPort     = 10809
	// readyTimeout bounds each wait for a component to come up.
	readyTimeout = 90 * time.Second
)

// csiClients talk to the controller and node plugins.
type csiClients struct {
	ctrl     csi.ControllerClient
	node     csi.NodeClient
	closeAll func()
}

// run performs the demo's steps; teardown steps are pushed as it goes.
func (d *demo) run(ctx context.Context) error {
	o := d.o
	err := d.step("checks: commands, tools and devices", func() error { return d.checks() })
	if err != nil {
		return err
	}
	if err := d.step("work directory", func() error {
		dir := o.workDir
		if dir == "" {
			parent := ""
			if o.fio {
				parent = fioWorkParent()
			}
			var err error
			if dir, err = os.MkdirTemp(parent, "driverdemo-"); err != nil {
				return err
			}
		} else if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		d.dir, _ = filepath.Abs(dir)
		for _, sub := range []string{"logs", "volumes", "node-state"} {
			if err := os.MkdirAll(filepath.Join(d.dir, sub), 0o755); err != nil {
				return err
			}
		}
		d.onCleanup("remove the work directory", func(context.Context) error {
			if left := leftovers(d.dir, nil); len(left) > 0 {
				return fmt.Errorf("kept %s: still in use: %s", d.dir, strings.Join(left, "; "))
			}
			if o.keep {
				fmt.Fprintf(d.out, "  (logs kept in %s)\n", filepath.Join(d.dir, "logs"))
				return removeAllBut(d.dir, "logs")
			}
			if o.workDir != "" {
				return removeAllBut(d.dir, "")
			}
			return os.RemoveAll(d.dir)
		})
		fmt.Fprintf(d.out, "     %s\n", d.dir)
		return nil
	}); err != nil {
		return err
	}

	if err := d.step(fmt.Sprintf("network: 4 paths x %d Mbit/s between the worker (client namespace) and the storage node (server namespace)", o.rateMbit), func() error {
		t, err := topo.Up(topo.Uniform(o.name, 4, o.rateMbit))
		d.onCleanup("remove the network namespaces", func(context.Context) error {
			if err := topo.Down(o.name); err != nil {
				return err
			}
			if left := leftovers(d.dir, []string{topo.ClientNSName(o.name), topo.ServerNSName(o.name)}); len(left) > 0 {
				return fmt.Errorf("still there: %s", strings.Join(left, "; "))
			}
			return nil
		})
		if err != nil {
			return err
		}
		d.topo = t
		d.res.Paths = len(t.Paths)
		d.res.LineMBps = t.LineRateMBps()
		// Sweep before the namespaces go: it finds processes by them.
		d.onCleanup("check for leftovers (mounts, loop devices, processes)", func(context.Context) error {
			return sweep(d.dir, []string{t.ClientNS, t.ServerNS})
		})
		for i, p := range t.Paths {
			fmt.Fprintf(d.out, "     path %d: %s %s  <->  %s %s\n", i+1, t.ClientNS, p.ClientAddr, t.ServerNS, p.ServerAddr)
		}
		return nil
	}); err != nil {
		return err
	}

	var (
		cfg *rest.Config
		c   client.Client
	)
	if err := d.step("API server (etcd + kube-apiserver) with the CRDs; namespace, worker Node and CSINode", func() error {
		var stop func() error
		var err error
		cfg, c, stop, err = apiserver.StartEnv()
		if err != nil {
			return err
		}
		d.onCleanup("stop the API server", func(context.Context) error { return stop() })
		fmt.Fprintf(d.out, "     %s\n", cfg.Host)
		return d.registerWorker(ctx, c)
	}); err != nil {
		return err
	}

	if err := d.step("storage agent (nbd-server --cluster) in the server namespace", func() error {
		return d.startAgent(ctx, cfg, c)
	}); err != nil {
		return err
	}

	var cc *csiClients
	if err := d.step("controller plugin (host) and node plugin (client namespace)", func() error {
		var err error
		cc, err = d.startPlugins(ctx, cfg)
		return err
	}); err != nil {
		return err
	}
	mark := len(d.undos)
	if err := d.volume(ctx, c, cc); err != nil || !o.fio {
		return err
	}
	// The measurement's volumes have the worker and the paths to
	// themselves.
	if err := d.tearDown("tear down the demo's volume", mark); err != nil {
		return err
	}
	return d.fsBench(ctx, cc)
}

// checks fails early, with a clear message, when something the demo
// needs is missing.
func (d *demo) checks() error {
	var missing []string
	cmds := []string{"controller", "node", "nbd-server"}
	tools := []string{"nsenter", "ip", "tc", "ss", "losetup", "mkfs." + d.o.fsType}
	if d.o.fio {
		cmds = append(cmds, "nbdload")
		tools = append(tools, "fio", "mkfs.ext4", "mkfs.xfs")
	}
	for _, b := range cmds {
		p := filepath.Join(d.o.binDir, b)
		if st, err := os.Stat(p); err != nil || st.IsDir() || st.Mode()&0o111 == 0 {
			missing = append(missing, p+" (run hack/demo.sh, which builds the commands into bin/)")
		}
	}
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			missing = append(missing, tool)
		}
	}
	if d.o.transport == "fuse" {
		if _, err := os.Stat("/dev/fuse"); err != nil {
			missing = append(missing, "/dev/fuse (the fuse transport needs it)")
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("missing: %s", strings.Join(missing, ", "))
	}
	bin, _ := filepath.Abs(d.o.binDir)
	d.o.binDir = bin
	fmt.Fprintf(d.out, "     commands from %s, transport %s\n", bin, d.o.transport)
	return nil
}

// registerWorker creates what the kubelet and the node plugin would: the
// driver's namespace, the worker's Node object with its storage
// addresses (exports then accept only connections from them) and its
// CSINode.
func (d *demo) registerWorker(ctx context.Context, c client.Client) error {
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}}); err != nil {
		return err
	}
	var addrs []string
	for _, p := range d.topo.Paths {
		addrs = append(addrs, p.ClientAddr.String())
	}
	// The node plugin has no API access here: the Node announces what it
	// would, the storage addresses and the hash of its token.
	tok, err := access.LoadOrCreateToken(filepath.Join(d.dir, "node-state", "token"))
	if err != nil {
		return err
	}
	d.nodeToken = tok
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: workerNode,
		Annotations: map[string]string{access.AnnotationStorageAddresses: strings.Join(addrs, ","), access.AnnotationTokenSHA256: access.TokenHash(tok)}}}
	if err := c.Create(ctx, node); err != nil {
		return err
	}
	csiNode := &storagev1.CSINode{ObjectMeta: metav1.ObjectMeta{Name: workerNode},
		Spec: storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{{Name: driver.DriverName, NodeID: workerNode}}}}
	if err := c.Create(ctx, csiNode); err != nil {
		return err
	}
	fmt.Fprintf(d.out, "     Node %s, %s=%s\n", workerNode, access.AnnotationStorageAddresses, strings.Join(addrs, ","))
	return nil
}

// startProc starts one of the driver's commands and stops it at
// teardown.
func (d *demo) startProc(name, ns string, args ...string) (*process, error) {
	p, err := startProcess(filepath.Join(d.dir, "logs"), name, ns, filepath.Join(d.o.binDir, name), args...)
	if err != nil {
		return nil, err
	}
	where := "host"
	if ns != "" {
		where = ns
	}
	fmt.Fprintf(d.out, "     %s (pid %d, in %s): %s %s\n", name, p.cmd.Process.Pid, where, name, strings.Join(args, " "))
	d.onCleanup("stop "+name, func(context.Context) error { return p.stop(30 * time.Second) })
	return p, nil
}

// startAgent runs the storage agent in the server namespace, reaching
// the API server through a forwarder, and waits for its first report.
func (d *demo) startAgent(ctx context.Context, cfg *rest.Config, c client.Client) error {
	u, err := url.Parse(cfg.Host)
	if err != nil {
		return fmt.Errorf("API server address %q: %w", cfg.Host, err)
	}
	fw, err := newForwarder(d.topo.ServerNS, u.Host)
	if err != nil {
		return err
	}
	d.onCleanup("stop the API server forwarder", func(context.Context) error { return fw.Close() })
	// The API server's certificate is valid for 127.0.0.1, which is what
	// the agent dials in its namespace.
	inner := rest.CopyConfig(cfg)
	inner.Host = fmt.Sprintf("https://%s", net.JoinHostPort("127.0.0.1", fmt.Sprint(fw.Port())))
	kc := filepath.Join(d.dir, "kubeconfig-storage-node")
	if err := apiserver.WriteKubeconfigFile(kc, inner); err != nil {
		return err
	}
	fmt.Fprintf(d.out, "     forwarder %s:127.0.0.1:%d -> host %s\n", d.topo.ServerNS, fw.Port(), u.Host)
	var addrs []string
	for _, p := range d.topo.Paths {
		addrs = append(addrs, p.ServerAddr.String())
	}
	// --fio reads the agent's request counters.
	metrics := ""
	if d.o.fio {
		metrics = agentMetricsAddr
	}
	p, err := d.startProc("nbd-server", d.topo.ServerNS,
		"--cluster", "--node-name", storageNode, "--namespace", namespace,
		"--data-dir", filepath.Join(d.dir, "volumes"),
		"--storage-address", strings.Join(addrs, ","),
		"--listen", hostPort("", nbdPort),
		"--metrics-addr", metrics, "--heartbeat", "2s", "--kubeconfig", kc)
	if err != nil {
		return err
	}
	return waitFor(ctx, "the storage agent's NBDStorageNode report", readyTimeout, func() error {
		if err := p.exited(); err != nil {
			return permanent(err)
		}
		sn := &v1alpha1.NBDStorageNode{}
		if err := c.Get(ctx, client.ObjectKey{Name: storageNode}, sn); err != nil {
			return err
		}
		if sn.Status.Port == 0 || sn.Status.AvailableBytes == 0 {
			return fmt.Errorf("status %+v", sn.Status)
		}
		fmt.Fprintf(d.out, "     NBDStorageNode %s: port %d, addresses %s, %d MiB available\n",
			sn.Name, sn.Status.Port, strings.Join(sn.Status.Addresses, ","), sn.Status.AvailableBytes>>20)
		return nil
	})
}

func hostPort(host string, port int) string { return net.JoinHostPort(host, fmt.Sprint(port)) }

// startPlugins runs the controller on the host and the node plugin in
// the client namespace and connects CSI clients to both.
func (d *demo) startPlugins(ctx context.Context, cfg *rest.Config) (*csiClients, error) {
	kc := filepath.Join(d.dir, "kubeconfig")
	if err := apiserver.WriteKubeconfigFile(kc, cfg); err != nil {
		return nil, err
	}
	ctrlSock := filepath.Join(d.dir, "controller.sock")
	nodeSock := filepath.Join(d.dir, "node.sock")
	ctrlProc, err := d.startProc("controller", "", "--endpoint", "unix://"+ctrlSock, "--namespace", namespace,
		"--kubeconfig", kc, "--wait-timeout", "60s")
	if err != nil {
		return nil, err
	}
	transports := d.o.transport
	if transports == "auto" {
		transports = ""
	}
	var addrs []string
	for _, p := range d.topo.Paths {
		addrs = append(addrs, p.ClientAddr.String())
	}
	nodeArgs := []string{"--endpoint", "unix://" + nodeSock, "--node-id", workerNode,
		"--state-dir", filepath.Join(d.dir, "node-state"), "--storage-address", strings.Join(addrs, ",")}
	if transports != "" {
		nodeArgs = append(nodeArgs, "--transports", transports)
	}
	nodeProc, err := d.startProc("node", d.topo.ClientNS, nodeArgs...)
	if err != nil {
		return nil, err
	}
	cc := &csiClients{}
	var conns []*grpc.ClientConn
	cc.closeAll = func() {
		for _, c := range conns {
			c.Close()
		}
	}
	d.onCleanup("close the CSI connections", func(context.Context) error { cc.closeAll(); return nil })
	for _, s := range []struct {
		sock string
		p    *process
	}{{ctrlSock, ctrlProc}, {nodeSock, nodeProc}} {
		conn, err := grpc.NewClient("unix://"+s.sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return nil, err
		}
		conns = append(conns, conn)
		id := csi.NewIdentityClient(conn)
		err = waitFor(ctx, s.p.name+" plugin's Probe", readyTimeout, func() error {
			if err := s.p.exited(); err != nil {
				return permanent(err)
			}
			pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			r, err := id.Probe(pctx, &csi.ProbeRequest{})
			if err != nil {
				return err
			}
			if r.GetReady() != nil && !r.GetReady().GetValue() {
				return errors.New("not ready")
			}
			return nil
		})
		if err != nil {
			return nil, err
		}
		if s.p == ctrlProc {
			cc.ctrl = csi.NewControllerClient(conn)
		} else {
			cc.node = csi.NewNodeClient(conn)
		}
	}
	info, err := cc.node.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	if err != nil {
		return nil, fmt.Errorf("NodeGetInfo: %w", err)
	}
	fmt.Fprintf(d.out, "     NodeGetInfo: node %s, topology %v\n", info.GetNodeId(), info.GetAccessibleTopology().GetSegments())
	return cc, nil
}

// permanentError ends a waitFor at once.
type permanentError struct{ err error }

func (e permanentError) Error() string { return e.err.Error() }
func (e permanentError) Unwrap() error { return e.err }

// permanent wraps err so that waitFor gives up.
func permanent(err error) error { return permanentError{err} }

// waitFor polls ok every 200 ms until it returns nil, a permanent error,
// ctx ends or timeout passes.
func waitFor(ctx context.Context, what string, timeout time.Duration, ok func() error) error {
	end := time.Now().Add(timeout)
	for {
		err := ok()
		if err == nil {
			return nil
		}
		var perm permanentError
		if errors.As(err, &perm) {
			return fmt.Errorf("waiting for %s: %w", what, perm.err)
		}
		if time.Now().After(end) {
			return fmt.Errorf("waiting for %s: gave up after %s: %w", what, timeout, err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for %s: %w (last: %v)", what, ctx.Err(), err)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// removeAllBut empties dir except for the entry keep.
func removeAllBut(dir, keep string) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range ents {
		if e.Name() != keep {
			errs = append(errs, os.RemoveAll(filepath.Join(dir, e.Name())))
		}
	}
	return errors.Join(errs...)
}
