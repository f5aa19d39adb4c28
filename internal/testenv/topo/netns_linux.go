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

package topo

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"

	"golang.org/x/sys/unix"
)

// InClient runs fn on a locked OS thread switched into the client
// namespace. See InNetns.
func (t *Topology) InClient(fn func() error) error { return InNetns(t.ClientNS, fn) }

// InServer runs fn on a locked OS thread switched into the server
// namespace. See InNetns.
func (t *Topology) InServer(fn func() error) error { return InNetns(t.ServerNS, fn) }

// InNetns runs fn in the network namespace ns (a name known to
// `ip netns`) and returns its error.
//
// fn runs on a separate goroutine locked to its OS thread; only that
// thread is switched (setns), and it is switched back afterwards.
// Sockets created by fn (listeners, dialled connections) stay in ns and
// may be used from any goroutine after InNetns returns. Goroutines started
// by fn do NOT run in ns. If switching back fails, the thread is left
// locked so the Go runtime terminates it instead of reusing it.
//
// A panic in fn is re-raised in the caller, and runtime.Goexit in fn
// (e.g. t.FailNow) is propagated to the caller, so test helpers behave
// as if fn had been called directly.
func InNetns(ns string, fn func() error) error {
	target, err := os.Open(netnsPath(ns))
	if err != nil {
		return fmt.Errorf("topo: open netns %q: %w", ns, err)
	}
	defer target.Close()

	type outcome struct {
		err      error
		panicked bool
		panicVal any
		goexit   bool
	}
	done := make(chan outcome, 1)
	go func() {
		var o outcome
		returned := false
		defer func() {
			if !returned {
				if r := recover(); r != nil {
					o.panicked, o.panicVal = true, r
				} else {
					o.goexit = true
				}
			}
			done <- o
		}()

		runtime.LockOSThread()
		orig, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			runtime.UnlockOSThread()
			o.err, returned = fmt.Errorf("topo: open current netns: %w", err), true
			return
		}
		defer orig.Close()
		if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			o.err, returned = fmt.Errorf("topo: setns %q: %w", ns, err), true
			return
		}
		defer func() {
			if err := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); err != nil {
				// Keep the thread locked: it exits with this goroutine.
				if o.err == nil {
					o.err = fmt.Errorf("topo: restoring netns after %q: %w", ns, err)
				}
				return
			}
			runtime.UnlockOSThread()
		}()
		o.err = fn()
		returned = true
	}()
	o := <-done
	switch {
	case o.panicked:
		panic(o.panicVal)
	case o.goexit:
		runtime.Goexit()
	}
	return o.err
}

// WriteSysctl sets a sysctl (dotted name, e.g. "net.mptcp.enabled")
// inside namespace ns.
func WriteSysctl(ns, key, value string) error {
	return InNetns(ns, func() error {
		p := filepath.Join("/proc/sys", strings.ReplaceAll(key, ".", "/"))
		if err := os.WriteFile(p, []byte(value), 0o644); err != nil {
			return fmt.Errorf("topo: sysctl %s=%s in %s: %w", key, value, ns, err)
		}
		return nil
	})
}

// nameCallerNetns names the caller's network namespace ns for `ip netns`
// by bind-mounting /proc/self/ns/net where `ip netns add` would mount a
// new one.
func nameCallerNetns(ns string) error {
	if err := os.MkdirAll(netnsDir, 0o755); err != nil {
		return fmt.Errorf("topo: %w", err)
	}
	p := netnsPath(ns)
	f, err := os.OpenFile(p, os.O_CREATE|os.O_EXCL|os.O_RDONLY, 0o444)
	if err != nil {
		return fmt.Errorf("topo: name the caller's namespace %q: %w", ns, err)
	}
	f.Close()
	if err := unix.Mount("/proc/self/ns/net", p, "", unix.MS_BIND, ""); err != nil {
		os.Remove(p)
		return fmt.Errorf("topo: bind-mount the caller's namespace on %s: %w", p, err)
	}
	return nil
}
