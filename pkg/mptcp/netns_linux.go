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

package mptcp

import (
	"errors"
	"os"
	"runtime"

	"golang.org/x/sys/unix"
)

// goInCallersNetns runs f on a goroutine of its own in the calling
// thread's network namespace. Keep's slow-path watch makes sockets for its
// probes, and a goroutine may run on any thread: where the caller's thread
// is in a namespace of its own (a test, the benchmark), the goroutine
// locks its thread and moves it there, and the runtime retires that thread
// when f returns. In the host namespace, or where the namespace cannot be
// told, nothing moves.
func goInCallersNetns(f func()) {
	ns, err := os.Open("/proc/thread-self/ns/net")
	var want unix.Stat_t
	if err == nil && unix.Fstat(int(ns.Fd()), &want) != nil {
		ns.Close()
		err = errors.New("no namespace")
	}
	if err != nil {
		go f()
		return
	}
	go func() {
		defer ns.Close()
		var cur unix.Stat_t
		if err := unix.Stat("/proc/thread-self/ns/net", &cur); err == nil && cur.Ino == want.Ino && cur.Dev == want.Dev {
			f()
			return
		}
		runtime.LockOSThread() // never unlocked: the thread goes with the goroutine
		if err := unix.Setns(int(ns.Fd()), unix.CLONE_NEWNET); err != nil {
			// Not allowed to move: the probes will not find their
			// addresses and fall back to clearing the flag.
			runtime.UnlockOSThread()
		}
		f()
	}()
}
