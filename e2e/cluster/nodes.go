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

package cluster

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/internal/testenv/repo"
	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/blockdev"
	"github.com/mpnbd/mpnbd/pkg/mountinfo"
)

// The networks of a multi-node cluster. Every node has a management link
// to the host (a bridge: the API server, the node's InternalIP, the pod
// network's routes) and StoragePaths storage NICs, each on a bridge of
// its own (a storage switch: no address on the host), shaped to
// StorageRateMbit in both directions.
const (
	// MgmtGateway is the host's address on the management bridge: nodes
	// and their pods reach the API server there.
	MgmtGateway     = "10.98.0.1"
	mgmtBridge      = "mpnbd-mgmt"
	StoragePaths    = 4
	StorageRateMbit = 1000
	// nodeHostPrefix names every host-side link of a node ("mpn<k>m",
	// "mpn<k>s<i>"), which the host check looks for.
	nodeLinkPrefix = "mpn"
)

// NodeConfig is one node of a multi-node cluster.
type NodeConfig struct {
	// Name is the node's name and host name.
	Name string
	// Labels are the Node object's labels (the kubelet's --node-labels).
	Labels map[string]string
}

// A Node is a host of a multi-node cluster as far as anything running on
// it can tell: its own network namespace (kept across its boots, like a
// machine's NICs: "mpnbd-<name>"), and for each boot a PID, mount and UTS
// namespace whose PID 1 is nodeinit. In the mount namespace the node has
// its own /var/lib (its kubelet root at /var/lib/kubelet, hostPath
// volumes such as /var/lib/mpnbd), its own /var/log and a fresh /run;
// everything else is the host's (the binaries, /dev, /sys). Its
// containerd and kubelet run in those namespaces; pods are nested in
// them, so killing nodeinit kills every process of the node at once.
// The kubelet puts its pods under the cgroup /mpnbd-<name>, apart from
// the other nodes'.
type Node struct {
	Name  string
	Index int // 1-based
	// IP is the node's InternalIP, on the management network.
	IP string
	// PodCIDR is the node's pod network, on a bridge in its namespace.
	PodCIDR string
	// Containerd is the node's containerd socket (reachable from the host).
	Containerd string
	labels     map[string]string
	c          *Cluster
	// init is this boot's nodeinit (nil while the node is down).
	init     *exec.Cmd
	initDone chan struct{}
	procs    []*proc
}

// Netns is the node's network namespace (ip netns).
func (n *Node) Netns() string { return "mpnbd-" + n.Name }

// StorageAddr is the node's address on storage path i (1-based).
func (n *Node) StorageAddr(i int) string { return fmt.Sprintf("10.77.%d.%d", i, 10+n.Index) }

// StorageCIDR is storage path i's subnet.
func StorageCIDR(i int) string { return fmt.Sprintf("10.77.%d.0/24", i) }

func (n *Node) dir(parts ...string) string {
	return n.c.path(append([]string{"nodes", n.Name}, parts...)...)
}

func (n *Node) cgroup() string { return "mpnbd-" + n.Name }

// Up reports whether the node is running (booted and not killed).
func (n *Node) Up() bool { return n.init != nil }

func ipCmd(args ...string) error {
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		return fmt.Errorf("ip %s: %w: %s", strings.Join(args, " "), err, out)
	}
	return nil
}

// networks makes the management bridge and the storage bridges.
func (c *Cluster) networks() error {
	cmds := [][]string{
		{"link", "add", mgmtBridge, "type", "bridge"},
		{"addr", "add", MgmtGateway + "/24", "dev", mgmtBridge},
		{"link", "set", mgmtBridge, "up"},
	}
	for i := 1; i <= StoragePaths; i++ {
		b := fmt.Sprintf("mpnbd-st%d", i)
		cmds = append(cmds, []string{"link", "add", b, "type", "bridge"}, []string{"link", "set", b, "up"})
	}
	for _, a := range cmds {
		if err := ipCmd(a...); err != nil {
			return err
		}
	}
	return nil
}

// hostLinks are the host-side ends of the node's links: the management
// link, then storage paths 1..StoragePaths.
func (n *Node) hostLinks() []string {
	l := []string{fmt.Sprintf("%s%dm", nodeLinkPrefix, n.Index)}
	for i := 1; i <= StoragePaths; i++ {
		l = append(l, fmt.Sprintf("%s%ds%d", nodeLinkPrefix, n.Index, i))
	}
	return l
}

// wire makes the node's network namespace and links: the management
// link (the node's InternalIP, its default route, the host's route to
// its pods) and its storage NICs.
func (n *Node) wire() error {
	ns := n.Netns()
	if err := ipCmd("netns", "add", ns); err != nil {
		return err
	}
	links := n.hostLinks()
	mgmt := links[0]
	cmds := [][]string{
		{"link", "add", mgmt, "type", "veth", "peer", "name", "mgmt0", "netns", ns},
		{"link", "set", mgmt, "master", mgmtBridge, "up"},
		{"-n", ns, "link", "set", "lo", "up"},
		{"-n", ns, "addr", "add", n.IP + "/24", "dev", "mgmt0"},
		{"-n", ns, "link", "set", "mgmt0", "up"},
		{"-n", ns, "route", "add", "default", "via", MgmtGateway},
		{"route", "add", n.PodCIDR, "via", n.IP},
	}
	for i := 1; i <= StoragePaths; i++ {
		h, p := links[i], fmt.Sprintf("st%d", i)
		cmds = append(cmds,
			[]string{"link", "add", h, "type", "veth", "peer", "name", p, "netns", ns},
			[]string{"link", "set", h, "master", fmt.Sprintf("mpnbd-st%d", i), "up"},
			[]string{"-n", ns, "addr", "add", n.StorageAddr(i) + "/24", "dev", p},
			[]string{"-n", ns, "link", "set", p, "up"},
		)
	}
	for _, a := range cmds {
		if err := ipCmd(a...); err != nil {
			return err
		}
	}
	for i := 1; i <= StoragePaths; i++ {
		h, p := links[i], fmt.Sprintf("st%d", i)
		for _, args := range [][]string{
			append([]string{"qdisc", "add", "dev", h, "root"}, topo.TBFArgs(StorageRateMbit)...),
			append([]string{"-n", ns, "qdisc", "add", "dev", p, "root"}, topo.TBFArgs(StorageRateMbit)...),
		} {
			if out, err := exec.Command("tc", args...).CombinedOutput(); err != nil {
				return fmt.Errorf("tc %s: %w: %s", strings.Join(args, " "), err, out)
			}
		}
	}
	// The node routes its pods' traffic.
	return n.RunIn("sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
}

// RunIn runs a command in the node's network namespace (as a test would
// on the node's host network; a node that is down keeps its network
// namespace).
func (n *Node) RunIn(name string, args ...string) error {
	out, err := exec.Command("ip", append([]string{"netns", "exec", n.Netns(), name}, args...)...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("on %s: %s %s: %w: %s", n.Name, name, strings.Join(args, " "), err, out)
	}
	return nil
}

// Exec runs a command in every namespace of the running node (its mount
// table included) and returns its combined output.
func (n *Node) Exec(ctx context.Context, name string, args ...string) (string, error) {
	if n.init == nil {
		return "", fmt.Errorf("node %s is down", n.Name)
	}
	cmd := exec.CommandContext(ctx, "nsenter", append(n.enter(), append([]string{name}, args...)...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("on %s: %s %s: %w: %s", n.Name, name, strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// enter is nsenter's arguments entering the node's namespaces.
func (n *Node) enter() []string {
	return []string{"-t", strconv.Itoa(n.init.Process.Pid), "-m", "-u", "-n", "-p", "--"}
}

// makeCgroups makes the node's cgroup in every hierarchy, the kubelet's
// cgroupRoot (it must exist).
func (n *Node) makeCgroups() error {
	hs, err := os.ReadDir("/sys/fs/cgroup")
	if err != nil {
		return err
	}
	for _, h := range hs {
		d := filepath.Join("/sys/fs/cgroup", h.Name(), n.cgroup())
		if err := os.Mkdir(d, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return fmt.Errorf("cgroup %s: %w", d, err)
		}
		if h.Name() == "cpuset" {
			// A cpuset cgroup takes no task before it has CPUs and memory nodes.
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				v, err := os.ReadFile(filepath.Join("/sys/fs/cgroup/cpuset", f))
				if err != nil {
					return err
				}
				if err := os.WriteFile(filepath.Join(d, f), v, 0o644); err != nil {
					return fmt.Errorf("%s/%s: %w", d, f, err)
				}
			}
		}
	}
	return nil
}

// removeCgroups removes the node's cgroups, deepest first, once every
// process in them is gone.
func (n *Node) removeCgroups() error {
	hs, err := os.ReadDir("/sys/fs/cgroup")
	if err != nil {
		return err
	}
	var errs []error
	for _, h := range hs {
		root := filepath.Join("/sys/fs/cgroup", h.Name(), n.cgroup())
		var dirs []string
		_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		for i := len(dirs) - 1; i >= 0; i-- {
			if err := os.Remove(dirs[i]); err != nil && !errors.Is(err, os.ErrNotExist) {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// boot starts the node: nodeinit in new namespaces, containerd, the
// kubelet.
func (n *Node) boot(ctx context.Context) error {
	c := n.c
	if err := n.makeCgroups(); err != nil {
		return err
	}
	ready := n.dir("booted")
	_ = os.Remove(ready) // absent on the first boot
	if err := os.MkdirAll(c.path("logs", n.Name), 0o755); err != nil {
		return err
	}
	log, err := os.OpenFile(c.path("logs", n.Name, "nodeinit.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	// nsenter joins the node's network namespace, then is nodeinit: PID 1
	// of the new PID namespace.
	cmd := exec.Command("nsenter", "--net=/run/netns/"+n.Netns(), "--", c.nodeinit,
		"-hostname", n.Name, "-ready", ready,
		"-bind", n.dir("var-lib")+"=/var/lib", "-bind", n.dir("var-log")+"=/var/log", "-tmpfs", "/run")
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags: syscall.CLONE_NEWPID | syscall.CLONE_NEWNS | syscall.CLONE_NEWUTS,
		Setpgid:    true,
	}
	if err := cmd.Start(); err != nil {
		log.Close()
		return fmt.Errorf("start node %s: %w", n.Name, err)
	}
	n.init, n.initDone = cmd, make(chan struct{})
	go func(done chan struct{}) {
		_ = cmd.Wait() // how it ended is in its log
		log.Close()
		close(done)
	}(n.initDone)
	if err := c.waitFor("node "+n.Name+" to boot", 30*time.Second, func() error {
		select {
		case <-n.initDone:
			return fmt.Errorf("nodeinit exited: %s", c.LogTail(n.Name+"/nodeinit", 10))
		default:
		}
		_, err := os.Stat(ready)
		return err
	}); err != nil {
		return err
	}
	c.logf("node %s booted (nodeinit pid %d)", n.Name, cmd.Process.Pid)
	if err := n.runtime(ctx); err != nil {
		return err
	}
	return n.kubelet()
}

// bootNodes wires and boots the nodes of Config.Nodes and waits for all
// of them to be Ready.
func (c *Cluster) bootNodes(ctx context.Context) error {
	if err := c.buildNodeinit(ctx); err != nil {
		return err
	}
	if err := c.buildPause(ctx); err != nil {
		return err
	}
	if err := c.networks(); err != nil {
		return err
	}
	for i, nc := range c.cfg.Nodes {
		k := i + 1
		n := &Node{Name: nc.Name, Index: k, IP: fmt.Sprintf("10.98.0.%d", 10+k),
			PodCIDR: fmt.Sprintf("10.88.%d.0/24", k), labels: nc.Labels, c: c}
		c.Nodes = append(c.Nodes, n)
		if err := n.wire(); err != nil {
			return err
		}
	}
	for _, n := range c.Nodes {
		if err := n.boot(ctx); err != nil {
			return err
		}
	}
	for _, n := range c.Nodes {
		if err := c.waitNodeReady(ctx, n.Name); err != nil {
			return err
		}
	}
	return nil
}

// startIn runs a daemon of the node in its namespaces, logging to
// <dir>/logs/<node>/<name>.log.
func (n *Node) startIn(name, bin string, args ...string) error {
	p, err := n.c.spawn(n.Name+"/"+name, "nsenter", append(n.enter(), append([]string{bin}, args...)...)...)
	if err != nil {
		return err
	}
	n.procs = append(n.procs, p)
	return nil
}

func (n *Node) runtime(ctx context.Context) error {
	n.Containerd = n.dir("containerd", "containerd.sock")
	cfg, err := writeRuntimeConfig(n.dir(), n.Containerd, n.PodCIDR, n.dir("var-lib", "cni", "networks"))
	if err != nil {
		return err
	}
	if err := n.startIn("containerd", "containerd", "--config", cfg); err != nil {
		return err
	}
	if err := n.c.waitFor("containerd on "+n.Name, time.Minute, func() error {
		_, err := ctr(ctx, n.Containerd, "version")
		return err
	}); err != nil {
		return err
	}
	return importInto(ctx, n.Containerd, n.c.pauseTar)
}

func (n *Node) kubelet() error {
	cfg, err := writeKubeletConfig(n.dir(), n.Containerd, "0.0.0.0", "/"+n.cgroup())
	if err != nil {
		return err
	}
	var labels []string
	for k, v := range n.labels {
		labels = append(labels, k+"="+v)
	}
	args := []string{"--config", cfg, "--kubeconfig", n.c.path("kubelet-" + n.Name + ".kubeconfig"),
		"--hostname-override", n.Name, "--node-ip", n.IP, "--v", "2"}
	if len(labels) > 0 {
		args = append(args, "--node-labels", strings.Join(labels, ","))
	}
	return n.startIn("kubelet", filepath.Join(n.c.cfg.KubeBin, "kubelet"), args...)
}

// Kill powers the node off: its links drop every packet (no reset is
// sent, nothing answers), then every process of the node is SIGKILLed at
// once. Its network namespace and its disks (its directory) stay, as a
// machine's do.
func (n *Node) Kill() error {
	if n.init == nil {
		return fmt.Errorf("node %s is down already", n.Name)
	}
	if err := n.cut(); err != nil {
		return err
	}
	err := n.halt(syscall.SIGKILL)
	n.c.logf("node %s killed", n.Name)
	return err
}

// Cut cuts the running node off: its links drop every packet, in and
// out (no reset is sent), its processes go on. Heal undoes it.
func (n *Node) Cut() error { return n.cut() }

// Heal lets a cut node's packets through again.
func (n *Node) Heal() error { return n.RunIn("nft", "delete", "table", "inet", cutTable) }

// cutTable is the nftables table that drops a dead node's packets.
const cutTable = "mpnbd_cut"

func (n *Node) cut() error {
	rules := "table inet " + cutTable + " {\n" +
		" chain in { type filter hook prerouting priority -400; policy drop; }\n" +
		" chain out { type filter hook output priority -400; policy drop; }\n}\n"
	cmd := exec.Command("ip", "netns", "exec", n.Netns(), "nft", "-f", "-")
	cmd.Stdin = strings.NewReader(rules)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("cut node %s off: %w: %s", n.Name, err, out)
	}
	return nil
}

// halt ends the node's PID namespace with sig to its init, waits for
// every process of the node to be gone and detaches the loop devices it
// left.
func (n *Node) halt(sig syscall.Signal) error {
	nodeDevs, devErr := n.mountDevices()
	// ESRCH only: it is gone, and initDone says so.
	_ = syscall.Kill(n.init.Process.Pid, sig)
	select {
	case <-n.initDone:
	case <-time.After(15 * time.Second):
		_ = syscall.Kill(n.init.Process.Pid, syscall.SIGKILL)
		<-n.initDone
	}
	// The daemons' nsenter parents see their children die.
	for _, p := range n.procs {
		select {
		case <-p.done:
		case <-time.After(15 * time.Second):
			_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
			<-p.done
		}
		p.log.Close()
	}
	n.procs, n.init = nil, nil
	if devErr != nil {
		return fmt.Errorf("the mounts of node %s: %w", n.Name, devErr)
	}
	detached, err := detachNodeLoops(nodeDevs)
	if detached > 0 {
		n.c.logf("node %s: %d loop devices it left detached", n.Name, detached)
	}
	if err != nil {
		return fmt.Errorf("the loop devices node %s left: %w", n.Name, err)
	}
	return nil
}

// Revive brings a killed node back: its links carry packets again, and it
// boots over its own state (containerd's and the kubelet's, /var/lib);
// it returns once the Node is Ready.
func (n *Node) Revive(ctx context.Context) error {
	if n.init != nil {
		return fmt.Errorf("node %s is up", n.Name)
	}
	if err := n.Heal(); err != nil {
		return err
	}
	if err := n.boot(ctx); err != nil {
		return err
	}
	return n.c.waitNodeReady(ctx, n.Name)
}

// shutdown stops the node for good: the kubelet first (so it stops
// restarting containers), then everything else with its PID namespace.
func (n *Node) shutdown() error {
	var errs []error
	if n.init != nil {
		for _, p := range n.procs {
			if strings.HasSuffix(p.name, "/kubelet") {
				stopProc(p)
			}
		}
		if err := n.halt(syscall.SIGKILL); err != nil {
			errs = append(errs, err)
		}
	}
	if err := n.removeCgroups(); err != nil {
		errs = append(errs, err)
	}
	// The host-side links first: a network namespace goes (and its links
	// with it) only once nothing holds it, and then asynchronously.
	for _, l := range n.hostLinks() {
		_ = exec.Command("ip", "link", "del", l).Run() // absent when Up failed before making it
	}
	if err := exec.Command("ip", "netns", "del", n.Netns()).Run(); err != nil {
		errs = append(errs, fmt.Errorf("delete the network namespace of %s: %w", n.Name, err))
	}
	return errors.Join(errs...)
}

// downNodes shuts every node down and removes the networks.
func (c *Cluster) downNodes() error {
	var errs []error
	for _, n := range c.Nodes {
		if err := n.shutdown(); err != nil {
			errs = append(errs, err)
		}
	}
	if len(c.cfg.Nodes) > 0 {
		// Absent when Up failed before making them; the nodes' host-side
		// links went with their namespaces.
		_ = exec.Command("ip", "link", "del", mgmtBridge).Run()
		for i := 1; i <= StoragePaths; i++ {
			_ = exec.Command("ip", "link", "del", fmt.Sprintf("mpnbd-st%d", i)).Run()
		}
	}
	return errors.Join(errs...)
}

// statFields are the fields of /proc/PID/stat after the command name
// (which may hold anything): [0] is the state, [1] the parent's PID,
// [11] and [12] utime and stime.
func statFields(pid int) []string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil
	}
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return nil
	}
	return strings.Fields(string(b)[i+1:])
}

// pidsInNS lists the host's processes in the PID namespace ns (the link
// text of /proc/PID/ns/pid) and their descendants (containers nest PID
// namespaces of their own).
func pidsInNS(ns string) []int {
	parent := map[int]int{}
	in := map[int]bool{}
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if f := statFields(pid); len(f) > 1 {
			parent[pid], _ = strconv.Atoi(f[1])
		}
		if l, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", pid)); err == nil && l == ns {
			in[pid] = true
		}
	}
	var pids []int
	for pid := range parent {
		for p := pid; p > 1; p = parent[p] {
			if in[p] {
				pids = append(pids, pid)
				break
			}
		}
	}
	return pids
}

// pids are the host PIDs of the node's processes (its containers' too).
func (n *Node) pids() []int {
	if n.init == nil {
		return nil
	}
	ns, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", n.init.Process.Pid))
	if err != nil {
		return nil
	}
	return pidsInNS(ns)
}

// mountDevices are the devices (st_dev) of the file systems mounted in
// the mount namespace of process pid.
func mountDevices(pid int) (map[uint64]bool, error) {
	mounts, err := mountinfo.Of(pid)
	if err != nil {
		return nil, err
	}
	devs := map[uint64]bool{}
	for _, m := range mounts {
		devs[unix.Mkdev(uint32(m.Major), uint32(m.Minor))] = true
	}
	return devs, nil
}

// mountDevices are the devices of the file systems mounted in any mount
// namespace of the node's processes (its own, its containers').
func (n *Node) mountDevices() (map[uint64]bool, error) {
	devs := map[uint64]bool{}
	seen := map[string]bool{}
	for _, pid := range n.pids() {
		ns, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", pid))
		if err != nil || seen[ns] {
			continue // gone meanwhile, or read already
		}
		seen[ns] = true
		d, err := mountDevices(pid)
		if err != nil {
			continue // gone meanwhile
		}
		maps.Copy(devs, d)
	}
	if len(seen) == 0 {
		return nil, fmt.Errorf("no process of node %s to read mounts from", n.Name)
	}
	return devs, nil
}

// detachNodeLoops detaches the loop devices a dead node left bound, as its
// power-off would have (loop devices belong to the host's kernel, not to
// the node's namespaces): the ones backed by a file on a file system only
// the node had mounted (nodeDevs less the host's: the volumes' FUSE
// files), and, first, the ones backed by those devices' nodes (the
// kubelet's locks on block volumes). It returns how many it detached.
func detachNodeLoops(nodeDevs map[uint64]bool) (int, error) {
	hostDevs, err := mountDevices(os.Getpid())
	if err != nil {
		return 0, err
	}
	type loop struct {
		name     string
		dev, ino uint64
	}
	var bound []loop
	entries, _ := os.ReadDir("/sys/block")
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), "loop") {
			continue
		}
		st, err := blockdev.StatLoop("/dev/" + e.Name())
		if err != nil {
			continue // not bound
		}
		bound = append(bound, loop{"/dev/" + e.Name(), st.BackingDevice, st.BackingInode})
	}
	var own, holders []string
	ownNode := map[[2]uint64]bool{}
	for _, l := range bound {
		if nodeDevs[l.dev] && !hostDevs[l.dev] {
			own = append(own, l.name)
			var st unix.Stat_t
			if unix.Stat(l.name, &st) == nil {
				ownNode[[2]uint64{st.Dev, st.Ino}] = true
			}
		}
	}
	for _, l := range bound {
		if ownNode[[2]uint64{l.dev, l.ino}] {
			holders = append(holders, l.name)
		}
	}
	var errs []error
	for _, d := range append(holders, own...) {
		if err := blockdev.DetachLoop(d); err != nil {
			errs = append(errs, err)
		}
	}
	return len(holders) + len(own), errors.Join(errs...)
}

// buildNodeinit builds nodeinit into the cluster's directory.
func (c *Cluster) buildNodeinit(ctx context.Context) error {
	root, err := repo.Root()
	if err != nil {
		return err
	}
	c.nodeinit = c.path("bin", "nodeinit")
	build := exec.CommandContext(ctx, "go", "build", "-trimpath", "-o", c.nodeinit, "./cluster/nodeinit")
	build.Dir = filepath.Join(root, "e2e")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		return fmt.Errorf("build nodeinit: %w: %s", err, out)
	}
	return nil
}
