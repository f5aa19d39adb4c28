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
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
)

// TestNodesUpDown brings up a cluster of three nodes, each a host of its
// own in namespaces, and checks what makes them hosts: their own names,
// mount tables (/var/lib/kubelet each), pod networks routed across nodes,
// storage NICs on shared storage networks; then kills one (every process
// gone at once, its packets dropped: NotReady, unreachable), brings it
// back over its state, and takes the cluster down, leaving the host as it
// was. It logs what the harness costs.
func TestNodesUpDown(t *testing.T) {
	requireCluster(t)
	before := hostState(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	c, down := upForTest(ctx, t, "3 nodes", Config{Dir: t.TempDir(), KubeBin: KubeBin(), Log: testLog{t}, Nodes: []NodeConfig{
		{Name: "node-a", Labels: map[string]string{"mpnbd.io/storage-node": "true"}},
		{Name: "node-b", Labels: map[string]string{"mpnbd.io/storage-node": "true"}},
		{Name: "node-c"},
	}})
	defer down()
	kubectl := func(args ...string) string {
		t.Helper()
		out, err := c.Kubectl(ctx, args...)
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(out)
	}
	a, b, cn := c.Nodes[0], c.Nodes[1], c.Nodes[2]

	if got := kubectl("get", "nodes", "-l", "mpnbd.io/storage-node=true", "-o", "jsonpath={.items[*].metadata.name}"); got != "node-a node-b" {
		t.Errorf("storage-node labels on %q, want node-a node-b", got)
	}
	for _, n := range c.Nodes {
		if got := kubectl("get", "node", n.Name, "-o", `jsonpath={.status.addresses[?(@.type=="InternalIP")].address}`); got != n.IP {
			t.Errorf("%s: InternalIP %q, want %s", n.Name, got, n.IP)
		}
		if out, err := n.Exec(ctx, "hostname"); err != nil || strings.TrimSpace(out) != n.Name {
			t.Errorf("%s: hostname %q (%v)", n.Name, out, err)
		}
		// Its own /var/lib: what one node writes there no other sees.
		if _, err := n.Exec(ctx, "sh", "-c", "echo "+n.Name+" > /var/lib/mpnbd-e2e-marker"); err != nil {
			t.Fatal(err)
		}
		// The kubelet's root is the usual path, on the node's /var/lib, a
		// shared mount as on a systemd host (mount propagation for CSI:
		// what a container mounts under a hostPath there, the node sees).
		for _, d := range []string{"/var/lib/kubelet", "/var/lib"} {
			if out, err := n.Exec(ctx, "findmnt", "-no", "PROPAGATION", "-T", d); err != nil || !strings.Contains(out, "shared") {
				t.Errorf("%s: %s propagation %q (%v)", n.Name, d, out, err)
			}
		}
	}
	for _, n := range c.Nodes {
		if out, err := n.Exec(ctx, "cat", "/var/lib/mpnbd-e2e-marker"); err != nil || strings.TrimSpace(out) != n.Name {
			t.Errorf("%s reads %q from its /var/lib (%v)", n.Name, out, err)
		}
	}
	if _, err := os.Stat("/var/lib/mpnbd-e2e-marker"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a node's /var/lib reached the host's: %v", err)
	}

	// A pod on each node, in its node's pod network, reachable from the
	// other nodes; every storage NIC reaches the other nodes' on its path.
	for _, n := range c.Nodes {
		pod := fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata: {name: p-%s, namespace: default}
spec:
  nodeName: %s
  containers:
  - {name: pause, image: %s, imagePullPolicy: Never}
`, n.Name, n.Name, PauseImage)
		if out, err := kubectlStdin(ctx, c, pod, "apply", "-f", "-"); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
	}
	podIP := map[string]string{}
	for _, n := range c.Nodes {
		kubectl("wait", "--for=condition=Ready", "pod/p-"+n.Name, "--timeout=120s")
		ip := kubectl("get", "pod", "p-"+n.Name, "-o", "jsonpath={.status.podIP}")
		_, cidr, _ := net.ParseCIDR(n.PodCIDR)
		if parsed := net.ParseIP(ip); parsed == nil || !cidr.Contains(parsed) {
			t.Fatalf("pod on %s has IP %q, outside its node's %s", n.Name, ip, n.PodCIDR)
		}
		podIP[n.Name] = ip
	}
	for _, from := range c.Nodes {
		for _, to := range c.Nodes {
			if from == to {
				continue
			}
			if err := reachable(from, podIP[to.Name]); err != nil {
				t.Errorf("from %s to the pod on %s: %v", from.Name, to.Name, err)
			}
			for i := 1; i <= StoragePaths; i++ {
				if err := reachable(from, to.StorageAddr(i)); err != nil {
					t.Errorf("from %s to %s on storage path %d: %v", from.Name, to.Name, i, err)
				}
			}
		}
	}
	for _, n := range c.Nodes {
		rss, cpu := n.usage()
		t.Logf("harness cost: %s: %d processes' resident memory %d MiB, CPU %.1f s since boot", n.Name, len(n.pids()), rss>>20, cpu)
	}

	// Kill node-c: every process of it at once; its packets vanish.
	pidNS, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", cn.init.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	if err := cn.Kill(); err != nil {
		t.Fatal(err)
	}
	if left := pidsInNS(pidNS); len(left) > 0 {
		t.Errorf("processes of the killed node left: %v", left)
	}
	if err := reachable(a, cn.StorageAddr(1)); err == nil || !isTimeout(err) {
		t.Errorf("the killed node's storage address answers: %v", err)
	}
	if err := reachable(b, podIP["node-c"]); err == nil || !isTimeout(err) {
		t.Errorf("the killed node's pod answers: %v", err)
	}
	end := time.Now().Add(NodeMonitorGrace + time.Minute)
	for {
		ready := kubectl("get", "node", cn.Name, "-o", `jsonpath={.status.conditions[?(@.type=="Ready")].status}`)
		if ready == "Unknown" || ready == "False" {
			t.Logf("node-c NotReady (%s) %v after its death", ready, time.Since(killed).Round(time.Second))
			break
		}
		if time.Now().After(end) {
			t.Fatalf("node-c still Ready=%s %v after its death", ready, time.Since(killed).Round(time.Second))
		}
		time.Sleep(time.Second)
	}

	// Back over its own state: Ready, its pod running again, its /var/lib kept.
	if err := cn.Revive(ctx); err != nil {
		t.Fatal(err)
	}
	if out, err := cn.Exec(ctx, "cat", "/var/lib/mpnbd-e2e-marker"); err != nil || strings.TrimSpace(out) != "node-c" {
		t.Errorf("node-c lost its /var/lib: %q (%v)", out, err)
	}
	kubectl("wait", "--for=condition=Ready", "pod/p-node-c", "--timeout=120s")
	if err := reachable(a, cn.StorageAddr(1)); err != nil {
		t.Errorf("the revived node's storage address: %v", err)
	}
	kubectl("delete", "pods", "--all", "--wait=true", "--timeout=60s")

	down()
	if after := hostState(t); after != before {
		t.Errorf("the host changed:\nbefore: %s\nafter:  %s", before, after)
	}
	for _, n := range []string{"node-a", "node-b", "node-c"} {
		if _, err := os.Stat(filepath.Join("/sys/fs/cgroup/pids", "mpnbd-"+n)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("cgroup of %s left: %v", n, err)
		}
	}
}

// reachable dials port 1 of addr from the node's network namespace: a
// refusal is an answer (reachable), a timeout is not.
func reachable(n *Node, addr string) error {
	return topo.InNetns(n.Netns(), func() error {
		conn, err := net.DialTimeout("tcp", net.JoinHostPort(addr, "1"), 2*time.Second)
		if err == nil {
			conn.Close()
			return nil
		}
		if errors.Is(err, syscall.ECONNREFUSED) {
			return nil
		}
		return err
	})
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// usage sums the resident memory (bytes) and CPU time (seconds) of the
// node's processes.
func (n *Node) usage() (rss int64, cpu float64) {
	tick := 100.0 // USER_HZ on Linux
	for _, pid := range n.pids() {
		if f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid)); err == nil {
			sc := bufio.NewScanner(f)
			for sc.Scan() {
				if v, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
					kb, _ := strconv.ParseInt(strings.Fields(v)[0], 10, 64)
					rss += kb << 10
				}
			}
			f.Close()
		}
		if f := statFields(pid); len(f) > 12 {
			u, _ := strconv.ParseFloat(f[11], 64)
			s, _ := strconv.ParseFloat(f[12], 64)
			cpu += (u + s) / tick
		}
	}
	return rss, cpu
}
