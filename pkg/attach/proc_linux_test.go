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

package attach

import (
	"os"
	"os/exec"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestProcStat(t *testing.T) {
	state, start, err := ProcStat(os.Getpid())
	if err != nil || start == 0 || state == 'Z' {
		t.Fatalf("ProcStat(self) = %c, %d, %v", state, start, err)
	}
	if !ProcAlive(os.Getpid(), start) || ProcAlive(os.Getpid(), start+1) {
		t.Error("ProcAlive does not tell the start time apart")
	}
	if ProcAlive(0, 0) || ProcAlive(1<<30, 0) {
		t.Error("ProcAlive of a process that cannot exist")
	}
	// A child that exited and is not reaped yet is a zombie: not alive.
	cmd := exec.Command("true")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Wait() }()
	deadline := time.Now().Add(10 * time.Second)
	for ProcAlive(cmd.Process.Pid, 0) {
		if time.Now().After(deadline) {
			t.Fatal("an exited child still counts as alive")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if state, _, err := ProcStat(cmd.Process.Pid); err != nil || state != 'Z' {
		t.Errorf("the exited child: state %c, %v; want a zombie", state, err)
	}
}

// TestPidfdExitedBy: a pidfd tells a process's exit, waiting up to a
// deadline; a running process is not taken for exited, nor is an unknown
// one (nil).
func TestPidfdExitedBy(t *testing.T) {
	if f, err := SelfPidfd(); err != nil {
		t.Skipf("no pidfds here: %v", err)
	} else {
		if PidfdExitedBy(f, time.Now().Add(20*time.Millisecond)) {
			t.Error("this process taken for exited")
		}
		f.Close()
	}
	if PidfdExitedBy(nil, time.Now().Add(time.Second)) {
		t.Error("no pidfd taken for an exited process")
	}
	cmd := exec.Command("sleep", "0.3")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	fd, err := unix.PidfdOpen(cmd.Process.Pid, 0)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "pidfd")
	defer f.Close()
	if PidfdExitedBy(f, time.Now().Add(20*time.Millisecond)) {
		t.Error("a running sleep taken for exited")
	}
	// Not reaped yet: a pidfd is readable at the exit, before the wait.
	if !PidfdExitedBy(f, time.Now().Add(10*time.Second)) {
		t.Error("the sleep's exit not seen within 10s")
	}
	cmd.Wait()
}
