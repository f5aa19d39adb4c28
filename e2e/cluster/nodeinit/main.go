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

// Command nodeinit is PID 1 of a node of the multi-node test cluster
// (package cluster): started in new PID, mount and UTS namespaces and the
// node's network namespace, it makes the node's mount table (its own
// /proc, a fresh /run, the node's /var/lib and /var/log over the host's),
// names the host, says it is ready and then reaps orphans until it is
// told to stop. Killing it (SIGKILL from the host) kills every process
// of the node at once, containers included: the node loses power.
//
// Usage: nodeinit -hostname NAME -ready FILE [-bind SRC=DST]... [-tmpfs DIR]...
package main

import (
	"flag"
	"fmt"
	"os"
	"strings"
	"syscall"

	"github.com/mpnbd/mpnbd/e2e/cluster/internal/reaper"
)

type list []string

func (l *list) String() string     { return strings.Join(*l, ",") }
func (l *list) Set(s string) error { *l = append(*l, s); return nil }

func main() {
	var binds, tmpfs list
	hostname := flag.String("hostname", "", "the node's host name")
	ready := flag.String("ready", "", "file written once the node's namespaces are set up")
	flag.Var(&binds, "bind", "SRC=DST: bind-mount the host directory SRC (created if missing) at DST")
	flag.Var(&tmpfs, "tmpfs", "mount an empty tmpfs at this directory")
	flag.Parse()
	if err := setup(*hostname, binds, tmpfs); err != nil {
		fmt.Fprintf(os.Stderr, "nodeinit: %v\n", err)
		os.Exit(1)
	}
	if *ready != "" {
		if err := os.WriteFile(*ready, []byte(fmt.Sprintln(os.Getpid())), 0o644); err != nil {
			fmt.Fprintf(os.Stderr, "nodeinit: %v\n", err)
			os.Exit(1)
		}
	}
	reaper.Run()
}

func setup(hostname string, binds, tmpfs []string) error {
	var shared []string
	if os.Getpid() != 1 {
		return fmt.Errorf("not PID 1 of a PID namespace (pid %d)", os.Getpid())
	}
	// Nothing mounted here reaches the host, nor the host's later mounts
	// the node.
	if err := syscall.Mount("", "/", "", syscall.MS_REC|syscall.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make / private: %w", err)
	}
	if err := syscall.Mount("proc", "/proc", "proc", syscall.MS_NOSUID|syscall.MS_NODEV|syscall.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mount /proc: %w", err)
	}
	if hostname != "" {
		if err := syscall.Sethostname([]byte(hostname)); err != nil {
			return fmt.Errorf("set the host name: %w", err)
		}
	}
	for _, b := range binds {
		src, dst, ok := strings.Cut(b, "=")
		if !ok || src == "" || dst == "" {
			return fmt.Errorf("-bind %q: want SRC=DST", b)
		}
		if err := os.MkdirAll(src, 0o755); err != nil {
			return err
		}
		if err := syscall.Mount(src, dst, "", syscall.MS_BIND|syscall.MS_REC, ""); err != nil {
			return fmt.Errorf("bind %s at %s: %w", src, dst, err)
		}
		shared = append(shared, dst)
	}
	for _, d := range tmpfs {
		if err := syscall.Mount("tmpfs", d, "tmpfs", syscall.MS_NOSUID|syscall.MS_NODEV, "mode=755"); err != nil {
			return fmt.Errorf("tmpfs at %s: %w", d, err)
		}
		shared = append(shared, d)
	}
	// The node's own mounts shared, as a systemd host's are: what a
	// container mounts into a hostPath below them with Bidirectional
	// propagation (the datapath's FUSE mounts) the node and its other
	// containers see. Each is a peer group of its own: nothing reaches
	// the host's directories behind them.
	for _, d := range shared {
		if err := syscall.Mount("", d, "", syscall.MS_REC|syscall.MS_SHARED, ""); err != nil {
			return fmt.Errorf("make %s shared: %w", d, err)
		}
	}
	return nil
}
