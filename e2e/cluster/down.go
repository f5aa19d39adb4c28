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
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/mpnbd/mpnbd/pkg/mountinfo"
)

// Down stops the cluster and leaves the host as it was: containers and
// their shims, daemons (in reverse order of start), mounts under the
// cluster's directory, the CNI network namespaces and bridge, the
// kubelet's iptables chains and the sysctls it changed.
func (c *Cluster) Down() error {
	var errs []error
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := c.downNodes(); err != nil {
		errs = append(errs, err)
	}
	// The kubelet first, so it stops restarting containers.
	c.stop("kubelet")
	if c.Containerd != "" {
		if out, err := c.ctr(ctx, "tasks", "ls", "-q"); err == nil {
			// Best effort, here and below: a container already gone fails
			// these, and the suite compares the host before and after.
			for _, id := range strings.Fields(out) {
				_, _ = c.ctr(ctx, "tasks", "kill", "-s", "SIGKILL", id)
			}
			time.Sleep(500 * time.Millisecond)
			for _, id := range strings.Fields(out) {
				_, _ = c.ctr(ctx, "tasks", "rm", "-f", id)
			}
		}
		if out, err := c.ctr(ctx, "containers", "ls", "-q"); err == nil {
			for _, id := range strings.Fields(out) {
				_, _ = c.ctr(ctx, "containers", "rm", id)
			}
		}
	}
	for i := len(c.procs) - 1; i >= 0; i-- {
		c.stop(c.procs[i].name)
	}
	// Shims outlive containerd: kill those of our containerd.
	killShims(c.Containerd)
	if err := unmountUnder(c.cfg.Dir); err != nil {
		errs = append(errs, err)
	}
	if out, err := exec.Command("ip", "-o", "netns", "list").Output(); err == nil {
		for _, l := range strings.Split(string(out), "\n") {
			if f := strings.Fields(l); len(f) > 0 && strings.HasPrefix(f[0], "cni-") {
				_ = exec.Command("ip", "netns", "del", f[0]).Run()
			}
		}
	}
	_ = exec.Command("ip", "link", "del", "mpnbd-e2e0").Run() // absent unless the CNI made it
	cleanIPTables()
	for k, v := range c.sysctls {
		if err := os.WriteFile("/proc/sys/"+k, []byte(v), 0o644); err != nil {
			errs = append(errs, fmt.Errorf("restore %s: %w", k, err))
		}
	}
	for _, p := range c.procs {
		p.log.Close()
	}
	return errors.Join(errs...)
}

// stop sends SIGTERM to a daemon's process group, then SIGKILL.
func (c *Cluster) stop(name string) {
	for _, p := range c.procs {
		if p.name == name {
			stopProc(p)
		}
	}
}

// stopProc sends SIGTERM to a daemon's process group, then SIGKILL.
func stopProc(p *proc) {
	select {
	case <-p.done:
		return
	default:
	}
	// ESRCH only: the group is gone, and p.done says so.
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(15 * time.Second):
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.done
	}
}

// killShims kills the containerd-shim processes started for socket.
func killShims(socket string) {
	if socket == "" {
		return
	}
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid := e.Name()
		cmdline, err := os.ReadFile("/proc/" + pid + "/cmdline")
		if err != nil {
			continue
		}
		args := strings.Split(string(cmdline), "\x00")
		if len(args) > 0 && strings.Contains(args[0], "containerd-shim") && slices.Contains(args, socket) {
			if n, err := strconv.Atoi(pid); err == nil {
				_ = syscall.Kill(n, syscall.SIGKILL) // ESRCH: it exited meanwhile
			}
		}
	}
}

// unmountUnder lazily unmounts every mount below dir, deepest first.
func unmountUnder(dir string) error {
	mps, err := mountinfo.Under(dir)
	if err != nil {
		return err
	}
	var errs []error
	for _, m := range mps {
		if err := syscall.Unmount(m, syscall.MNT_DETACH); err != nil && !errors.Is(err, syscall.EINVAL) && !errors.Is(err, syscall.ENOENT) {
			errs = append(errs, fmt.Errorf("unmount %s: %w", m, err))
		}
	}
	return errors.Join(errs...)
}

// cleanIPTables removes the chains the kubelet adds.
func cleanIPTables() {
	for _, bin := range []string{"iptables", "ip6tables"} {
		for _, table := range []string{"filter", "nat", "mangle"} {
			for _, jump := range []struct{ chain, target string }{
				{"INPUT", "KUBE-FIREWALL"}, {"OUTPUT", "KUBE-FIREWALL"},
			} {
				for exec.Command(bin, "-t", table, "-D", jump.chain, "-j", jump.target).Run() == nil {
				}
			}
			for _, chain := range []string{"KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT", "KUBE-NODE-PORT"} {
				// Fails for a chain the kubelet did not make.
				_ = exec.Command(bin, "-t", table, "-F", chain).Run()
				_ = exec.Command(bin, "-t", table, "-X", chain).Run()
			}
		}
	}
}
