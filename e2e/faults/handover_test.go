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

package faults

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/datapath"
)

// datapathProc is a `node --serve-datapath` process.
type datapathProc struct {
	cmd   *exec.Cmd
	ready string
	done  chan struct{}
}

func startDatapath(t *testing.T, bin, state, name string) *datapathProc {
	t.Helper()
	p := &datapathProc{ready: filepath.Join(t.TempDir(), name+".ready"), done: make(chan struct{})}
	// Each in a mount namespace of its own, as each datapath container
	// has: the FUSE mount of one is not seen by the next.
	p.cmd = exec.Command("unshare", "--mount", "--propagation=private", filepath.Join(bin, "node"), "--node-id=n1", "--serve-datapath="+filepath.Join(state, "datapath.sock"),
		"--state-dir="+state, "--transports=fuse", "--ready-file="+p.ready)
	p.cmd.Stdout, p.cmd.Stderr = os.Stderr, os.Stderr
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.cmd.Wait(); close(p.done) }()
	t.Cleanup(func() { p.kill(t) })
	deadline := time.Now().Add(2 * time.Minute)
	for {
		if _, err := os.Stat(p.ready); err == nil {
			return p
		}
		select {
		case <-p.done:
			t.Fatalf("datapath %s exited before it was ready", name)
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("datapath %s not ready within 2m", name)
		}
	}
}

func (p *datapathProc) kill(t *testing.T) {
	p.cmd.Process.Kill()
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		t.Error("datapath survived SIGKILL")
	}
}

// servingPid returns the pid of the process serving the volume's FUSE
// file system, from its state file.
func servingPid(t *testing.T, state, volume string) int {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(state, "fuse", volume+".json"))
	if err != nil {
		t.Fatal(err)
	}
	var st struct {
		Pid int `json:"pid"`
	}
	if err := json.Unmarshal(b, &st); err != nil || st.Pid <= 0 {
		t.Fatalf("state file of %s: %s (%v)", volume, b, err)
	}
	return st.Pid
}

func waitExit(t *testing.T, pid int, what string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for syscall.Kill(pid, 0) == nil && !zombie(pid) {
		if time.Now().After(deadline) {
			t.Fatalf("%s (pid %d) still runs 30s after the handover", what, pid)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestFuseDatapathHandover: the planned upgrade of the datapath component
// with a fuse volume, with the real commands. `node --serve-datapath`
// serves the volume (through a FUSE server process of its own) while fio
// writes and verifies on the loop device; a second datapath (in another
// mount namespace, as another container is) starts beside
// it and takes the volume over (the FUSE connection's /dev/fuse and the
// volume's lock over SCM_RIGHTS, to a new FUSE server process); the first
// datapath is SIGKILLed, as a pod deletion after the surge would; a third
// takes over from the second. The old FUSE server processes must be gone
// after their handover, fio must end with no error or verify failure,
// and the last datapath must report the volume connected and detach it,
// leaving no mount and no loop device.
func TestFuseDatapathHandover(t *testing.T) {
	need(t, "fio", "unshare")
	s := newServer(t, "ours", 256<<20)
	bin, err := buildOnce()
	if err != nil {
		t.Fatalf("build the commands: %v", err)
	}
	state := t.TempDir()
	prev := startDatapath(t, bin, state, "a")
	c := &datapath.Client{Path: filepath.Join(state, "datapath.sock")}
	tg := attach.Target{VolumeID: "pv-handover", Export: "disk", Addrs: []string{s.addr()}}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	att, err := c.Attach(ctx, attach.FUSE, tg, attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	res := make(chan error, 1)
	var out string
	go func() {
		var err error
		out, err = fioVerify(t, att.Device, 192<<20, 17)
		res <- err
	}()
	for i, name := range []string{"b", "c"} {
		time.Sleep(2 * time.Second)
		select {
		case err := <-res:
			t.Fatalf("fio ended before handover %d (%v): make it longer\n%s", i+1, err, out)
		default:
		}
		old := servingPid(t, state, tg.VolumeID)
		next := startDatapath(t, bin, state, name)
		waitExit(t, old, "the predecessor's FUSE server")
		if pid := servingPid(t, state, tg.VolumeID); pid == old {
			t.Fatalf("handover %d: the volume is still served by pid %d", i+1, old)
		}
		prev.kill(t)
		prev = next
		t.Logf("handover %d done; the predecessor SIGKILLed", i+1)
	}
	select {
	case err := <-res:
		if err != nil {
			t.Fatalf("fio across two handovers: %v\n%s", err, out)
		}
	case <-time.After(5 * time.Minute):
		t.Fatal("fio did not finish")
	}
	tr, h, err := c.Health(tg.VolumeID)
	if err != nil || tr != attach.FUSE || !h.Connected {
		t.Fatalf("health from the last datapath: %s %+v %v", tr, h, err)
	}
	if err := c.Detach(ctx, tg.VolumeID); err != nil {
		t.Fatalf("detach through the last datapath: %v", err)
	}
	mounts, _ := os.ReadFile("/proc/self/mountinfo")
	if strings.Contains(string(mounts), filepath.Join(state, "fuse")) {
		t.Fatalf("a mount under the state directory is left after the detach")
	}
	// The loop device was set up in the first datapath's mount namespace:
	// the last one must still find and release it.
	if bf, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(att.Device), "loop", "backing_file")); err == nil {
		t.Fatalf("%s is still bound (to %s) after the detach", att.Device, strings.TrimSpace(string(bf)))
	}
	t.Logf("fio wrote and verified 192 MiB across two datapath handovers with no error")
}
