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

// Package cluster brings up a real Kubernetes on this machine for the
// end-to-end suites: etcd, kube-apiserver, kube-controller-manager,
// kube-scheduler, and for each node containerd (its own root, state and
// socket) and a kubelet, from binaries (Kubernetes built by
// hack/kube-binaries.sh, the rest from Debian), with nothing pulled from
// a registry. Down stops everything it started and undoes what it and the
// kubelets changed on the host (mounts, network namespaces and links,
// iptables chains, cgroups, sysctls).
//
// One node (Config.Nodes empty) is the host itself. Several nodes
// (Config.Nodes) are each a host of their own as far as anything on them
// can tell (Node): a network namespace with a management link (its
// InternalIP; the host routes the pod networks between nodes and serves
// the API server at MgmtGateway) and StoragePaths storage NICs on shared,
// shaped storage networks; and for each boot new PID, mount and UTS
// namespaces under nodeinit, with the node's own /var/lib (the kubelet at
// /var/lib/kubelet, hostPath volumes), /var/log and /run. What was learnt
// making them:
//   - A PID namespace per node makes a power-off exact: SIGKILL to its PID
//     1 and the kernel kills every process of the node, containers (nested
//     PID namespaces) included, and the node's mounts go with its mount
//     namespace. Its packets are dropped first (nftables in its network
//     namespace), so nothing sends a reset.
//   - The kubelets share the host's cgroup hierarchies: each puts its pods
//     under a cgroupRoot of its own (/mpnbd-<node>), which must exist in
//     every hierarchy (cpuset's with CPUs and memory nodes) before it starts.
//   - A node's own /var/lib keeps the kubelets (and anything a DaemonSet
//     keeps in a hostPath) apart; /run must be the node's too (runc's state,
//     the CRI's network namespace files, the iptables lock).
//   - A network namespace is freed asynchronously once nothing holds it:
//     delete the host-side links explicitly, or they outlive the node.
//   - The API server reaches the kubelets by InternalIP (a node's name does
//     not resolve on the host).
//   - Cost (TestNodesUpDown): ~9 s to bring three nodes up after the
//     control plane, ~140 MiB resident memory per idle node (nodeinit,
//     containerd, kubelet), well under a CPU second per minute each.
package cluster

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// Fixed ports: pods reach the API server on the host's 127.0.0.1:6443
// (there is no kube-proxy), so it cannot move.
const (
	APIServerPort = 6443
	etcdPort      = 12379
	etcdPeerPort  = 12380
	serviceCIDR   = "10.0.0.0/24"
	serviceIP     = "10.0.0.1"
	podCIDR       = "10.88.0.0/24"
	// PodGateway is the host's address on the pod bridge. Pods reach the
	// API server there (it listens on every address; there is no
	// kube-proxy for the service IP): set KUBERNETES_SERVICE_HOST to it.
	PodGateway = "10.88.0.1"
	// NodeMonitorGrace is how long a node of a multi-node cluster may
	// stay silent before it is NotReady.
	NodeMonitorGrace = 20 * time.Second
	// PauseImage is the sandbox image Up imports.
	PauseImage = "mpnbd.local/pause:1"
)

// Config configures Up.
type Config struct {
	// Dir holds everything of the cluster (certificates, data, logs,
	// the kubelet's and containerd's roots).
	Dir string
	// KubeBin is the directory with kube-apiserver, kube-controller-manager,
	// kube-scheduler, kubelet and kubectl.
	KubeBin string
	// NodeName is the node's name; the host name when empty.
	NodeName string
	// Log receives progress lines; nil discards them.
	Log io.Writer
	// Nodes, when given, are the cluster's nodes, each a host of its own
	// in namespaces (Node); NodeName is then unused. None: one node, the
	// host itself.
	Nodes []NodeConfig
}

// Cluster is a running cluster.
type Cluster struct {
	cfg        Config
	pki        *pki
	procs      []*proc
	sysctls    map[string]string
	Kubeconfig string // admin (system:masters)
	Containerd string // containerd's socket (one node: the host's)
	// NodeName is the node's name; with Config.Nodes, the first one's.
	NodeName string
	// Nodes are the nodes of a multi-node cluster (Config.Nodes).
	Nodes []*Node
	// nodeinit is the nodes' PID 1, pauseTar the pause image.
	nodeinit, pauseTar string
}

type proc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
	log  *os.File
}

func (c *Cluster) logf(format string, args ...any) {
	if c.cfg.Log != nil {
		fmt.Fprintf(c.cfg.Log, "cluster: "+format+"\n", args...)
	}
}

func (c *Cluster) path(parts ...string) string {
	return filepath.Join(append([]string{c.cfg.Dir}, parts...)...)
}

// start runs a daemon of the control plane (or of the host as the only
// node), logging to <dir>/logs/<name>.log.
func (c *Cluster) start(name, bin string, args ...string) error {
	p, err := c.spawn(name, bin, args...)
	if err != nil {
		return err
	}
	c.procs = append(c.procs, p)
	return nil
}

// spawn runs a daemon in a process group of its own, logging to
// <dir>/logs/<name>.log (name may hold a directory: "node-a/kubelet").
func (c *Cluster) spawn(name, bin string, args ...string) (*proc, error) {
	logPath := c.path("logs", name+".log")
	if err := os.MkdirAll(filepath.Dir(logPath), 0o755); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, done: make(chan struct{}), log: f}
	go func() {
		_ = cmd.Wait() // how it ended is in its log
		close(p.done)
	}()
	c.logf("started %s (pid %d)", name, cmd.Process.Pid)
	return p, nil
}

// LogTail returns the last lines of a component's log.
func (c *Cluster) LogTail(name string, lines int) string {
	b, _ := os.ReadFile(c.path("logs", name+".log"))
	l := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(l) > lines {
		l = l[len(l)-lines:]
	}
	return strings.Join(l, "\n")
}

// alive fails when a started daemon has exited.
func (c *Cluster) alive() error {
	procs := c.procs
	for _, n := range c.Nodes {
		procs = append(procs, n.procs...)
	}
	for _, p := range procs {
		select {
		case <-p.done:
			return fmt.Errorf("%s exited: %s", p.name, c.LogTail(p.name, 20))
		default:
		}
	}
	return nil
}

// waitFor polls ok until it succeeds, a daemon dies or the timeout ends.
func (c *Cluster) waitFor(what string, timeout time.Duration, ok func() error) error {
	end := time.Now().Add(timeout)
	for {
		err := ok()
		if err == nil {
			return nil
		}
		if aerr := c.alive(); aerr != nil {
			return fmt.Errorf("waiting for %s: %w", what, aerr)
		}
		if time.Now().After(end) {
			return fmt.Errorf("waiting for %s: %w", what, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// Up brings the cluster up. On failure everything started is stopped.
func Up(ctx context.Context, cfg Config) (_ *Cluster, err error) {
	if len(cfg.Nodes) > 0 {
		cfg.NodeName = cfg.Nodes[0].Name
	}
	if cfg.NodeName == "" {
		h, err := os.Hostname()
		if err != nil {
			return nil, err
		}
		cfg.NodeName = strings.ToLower(h)
	}
	for _, b := range []string{"kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet"} {
		if _, err := os.Stat(filepath.Join(cfg.KubeBin, b)); err != nil {
			return nil, fmt.Errorf("cluster: %s: %w (build it with hack/kube-binaries.sh)", b, err)
		}
	}
	for _, b := range []string{"etcd", "containerd", "runc", "ctr", "iptables"} {
		if _, err := exec.LookPath(b); err != nil {
			return nil, fmt.Errorf("cluster: %s is missing (hack/install-deps.sh installs it)", b)
		}
	}
	c := &Cluster{cfg: cfg, NodeName: cfg.NodeName, sysctls: map[string]string{}}
	defer func() {
		if err != nil {
			err = errors.Join(err, c.Down())
		}
	}()
	if err := os.MkdirAll(cfg.Dir, 0o755); err != nil {
		return nil, err
	}
	// The kubelet changes these (the nodes route through the host); Down
	// restores them.
	for _, k := range []string{"vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops", "net/ipv4/ip_forward"} {
		if b, err := os.ReadFile("/proc/sys/" + k); err == nil {
			c.sysctls[k] = strings.TrimSpace(string(b))
		}
	}
	if err := c.certificates(); err != nil {
		return nil, err
	}
	if err := c.controlPlane(ctx); err != nil {
		return nil, err
	}
	if len(cfg.Nodes) > 0 {
		if err := c.bootNodes(ctx); err != nil {
			return nil, err
		}
	} else {
		if err := c.runtime(ctx); err != nil {
			return nil, err
		}
		if err := c.kubelet(ctx); err != nil {
			return nil, err
		}
	}
	// Pods need their namespace's default service account.
	if err := c.waitFor("the default service account", time.Minute, func() error {
		_, err := c.Kubectl(ctx, "get", "serviceaccount", "default", "-n", "default")
		return err
	}); err != nil {
		return nil, err
	}
	return c, nil
}

func (c *Cluster) certificates() error {
	p, err := newPKI(c.path("pki"))
	if err != nil {
		return err
	}
	c.pki = p
	host, _ := os.Hostname()
	type cert struct {
		name, cn string
		orgs     []string
		hosts    []string
	}
	issue := []cert{
		{"apiserver", "kube-apiserver", nil, []string{"127.0.0.1", PodGateway, MgmtGateway, serviceIP, "localhost", host,
			"kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"}},
		{"admin", "admin", []string{"system:masters"}, nil},
		{"controller-manager", "system:kube-controller-manager", nil, nil},
		{"scheduler", "system:kube-scheduler", nil, nil},
		{"kubelet", "system:node:" + c.NodeName, []string{"system:nodes"}, nil},
		{"apiserver-kubelet-client", "kube-apiserver-kubelet-client", []string{"system:masters"}, nil},
	}
	for _, n := range c.cfg.Nodes {
		issue = append(issue, cert{"kubelet-" + n.Name, "system:node:" + n.Name, []string{"system:nodes"}, nil})
	}
	for _, i := range issue {
		if err := p.issue(i.name, i.cn, i.orgs, i.hosts); err != nil {
			return err
		}
	}
	server := fmt.Sprintf("https://127.0.0.1:%d", APIServerPort)
	c.Kubeconfig = c.path("admin.kubeconfig")
	for _, n := range []string{"admin", "controller-manager", "scheduler", "kubelet"} {
		if err := p.kubeconfig(c.path(n+".kubeconfig"), server, n); err != nil {
			return err
		}
	}
	// The nodes reach the API server on the management network.
	for _, n := range c.cfg.Nodes {
		name := "kubelet-" + n.Name
		if err := p.kubeconfig(c.path(name+".kubeconfig"), fmt.Sprintf("https://%s:%d", MgmtGateway, APIServerPort), name); err != nil {
			return err
		}
	}
	return nil
}

func (c *Cluster) controlPlane(ctx context.Context) error {
	p := c.pki
	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", etcdPort)
	if err := c.start("etcd", "etcd", "--data-dir", c.path("etcd"), "--name", "mpnbd-e2e",
		"--listen-client-urls", etcdURL, "--advertise-client-urls", etcdURL,
		"--listen-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", etcdPeerPort),
		"--initial-advertise-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", etcdPeerPort),
		"--initial-cluster", fmt.Sprintf("mpnbd-e2e=http://127.0.0.1:%d", etcdPeerPort),
		"--unsafe-no-fsync"); err != nil {
		return err
	}
	bin := func(n string) string { return filepath.Join(c.cfg.KubeBin, n) }
	// The host's name resolves to 127.0.0.1, where its kubelet listens;
	// the nodes' kubelets listen on their InternalIPs.
	addressTypes := "Hostname,InternalIP"
	if len(c.cfg.Nodes) > 0 {
		addressTypes = "InternalIP"
	}
	if err := c.start("kube-apiserver", bin("kube-apiserver"),
		"--etcd-servers", etcdURL,
		"--bind-address", "0.0.0.0", "--advertise-address", "127.0.0.1",
		"--secure-port", fmt.Sprint(APIServerPort),
		"--endpoint-reconciler-type", "none",
		"--kubelet-preferred-address-types", addressTypes,
		"--allow-privileged=true",
		"--authorization-mode", "Node,RBAC",
		"--client-ca-file", p.path("ca.crt"),
		"--tls-cert-file", p.path("apiserver.crt"), "--tls-private-key-file", p.path("apiserver.key"),
		"--kubelet-client-certificate", p.path("apiserver-kubelet-client.crt"),
		"--kubelet-client-key", p.path("apiserver-kubelet-client.key"),
		"--service-account-issuer", "https://kubernetes.default.svc",
		"--service-account-key-file", p.path("sa.pub"),
		"--service-account-signing-key-file", p.path("sa.key"),
		"--service-cluster-ip-range", serviceCIDR,
	); err != nil {
		return err
	}
	if err := c.waitFor("the API server", 2*time.Minute, c.apiReady); err != nil {
		return err
	}
	cmArgs := []string{"--kubeconfig", c.path("controller-manager.kubeconfig"),
		"--authentication-kubeconfig", c.path("controller-manager.kubeconfig"),
		"--authorization-kubeconfig", c.path("controller-manager.kubeconfig"),
		"--leader-elect=false", "--use-service-account-credentials",
		"--service-account-private-key-file", p.path("sa.key"),
		"--root-ca-file", p.path("ca.crt"),
		"--cluster-signing-cert-file", p.path("ca.crt"), "--cluster-signing-key-file", p.path("ca.key"),
		"--controllers", "*,-cloud-node-lifecycle,-service-lb-controller,-node-route-controller",
		"--bind-address", "127.0.0.1", "--secure-port", "10257"}
	if len(c.cfg.Nodes) > 0 {
		// A node that stops reporting is NotReady after 20 s instead of
		// the default 50 s, which the node-loss scenarios wait for.
		cmArgs = append(cmArgs, "--node-monitor-grace-period", NodeMonitorGrace.String())
	}
	if err := c.start("kube-controller-manager", bin("kube-controller-manager"), cmArgs...); err != nil {
		return err
	}
	return c.start("kube-scheduler", bin("kube-scheduler"),
		"--kubeconfig", c.path("scheduler.kubeconfig"),
		"--authentication-kubeconfig", c.path("scheduler.kubeconfig"),
		"--authorization-kubeconfig", c.path("scheduler.kubeconfig"),
		"--leader-elect=false", "--bind-address", "127.0.0.1", "--secure-port", "10259")
}

// apiReady asks the API server's /readyz as admin.
func (c *Cluster) apiReady() error {
	hc, err := c.httpClient()
	if err != nil {
		return err
	}
	resp, err := hc.Get(fmt.Sprintf("https://127.0.0.1:%d/readyz", APIServerPort))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		return fmt.Errorf("readyz: %s: %s", resp.Status, b)
	}
	return nil
}

func (c *Cluster) httpClient() (*http.Client, error) {
	ca, err := os.ReadFile(c.pki.path("ca.crt"))
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca)
	cert, err := tls.LoadX509KeyPair(c.pki.path("admin.crt"), c.pki.path("admin.key"))
	if err != nil {
		return nil, err
	}
	return &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{cert}},
	}}, nil
}

// Kubectl runs the cached kubectl as admin.
func (c *Cluster) Kubectl(ctx context.Context, args ...string) (string, error) {
	kubectl := filepath.Join(c.cfg.KubeBin, "kubectl")
	if _, err := os.Stat(kubectl); err != nil {
		kubectl = "kubectl"
	}
	cmd := exec.CommandContext(ctx, kubectl, append([]string{"--kubeconfig", c.Kubeconfig}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}
