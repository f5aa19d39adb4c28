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

package fuse

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/fdpass"
)

// handoffHelperEnv, set to a state directory, makes the test binary an
// Attacher process that a test drives over descriptor 3 (a unix stream
// socket, one helperMsg a frame of fdpass.SendJSON, files attached): a
// datapath process of its own, as in an upgrade, where the handoff's
// files really travel from one process to the next.
const handoffHelperEnv = "MPNBD_FUSE_TEST_HANDOFF"

type helperMsg struct {
	Op         string             `json:",omitempty"`
	Volume     string             `json:",omitempty"`
	Target     *attach.Target     `json:",omitempty"`
	Handoff    *attach.Handoff    `json:",omitempty"`
	Attachment *attach.Attachment `json:",omitempty"`
	Err        string             `json:",omitempty"`
}

func sendMsg(c *net.UnixConn, m helperMsg, files []*os.File) error {
	return fdpass.SendJSON(c, m, files, time.Time{})
}

func recvMsg(c *net.UnixConn) (helperMsg, []*os.File, error) {
	var m helperMsg
	files, err := fdpass.RecvJSON(c, &m, 8, time.Time{})
	return m, files, err
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// handoffHelper serves the test's requests until the socket closes.
func handoffHelper(stateDir string) int {
	fc, err := net.FileConn(os.NewFile(3, "ctl"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	c := fc.(*net.UnixConn)
	a := New(Config{StateDir: stateDir})
	ctx := context.Background()
	var h *attach.Handoff
	for {
		m, files, err := recvMsg(c)
		if err != nil {
			return 0
		}
		var r helperMsg
		var out []*os.File
		switch m.Op {
		case "attach":
			r.Attachment, err = a.Attach(ctx, *m.Target, attach.Options{})
		case "handoff":
			if h, err = a.HandOff(ctx, m.Volume); err == nil {
				r.Handoff, out = h, h.Files
			}
		case "resume":
			err = h.Resume()
		case "release":
			h.Release()
		case "take":
			h = m.Handoff
			h.Files, files = files, nil
			r.Attachment, err = a.TakeHandoff(ctx, h)
		case "start":
			err = h.Start()
		case "abort":
			h.Abort()
		case "detach":
			err = a.Detach(ctx, m.Volume)
		default:
			err = fmt.Errorf("unknown op %q", m.Op)
		}
		r.Err = errString(err)
		if err := sendMsg(c, r, out); err != nil {
			fmt.Fprintln(os.Stderr, "handoff helper:", err)
			return 2
		}
		// The files went on; copies kept here would keep the lock.
		fdpass.Close(out)
		fdpass.Close(files)
	}
}

// attacherProc is a handoffHelper process.
type attacherProc struct {
	cmd *exec.Cmd
	c   *net.UnixConn
}

func startAttacherProc(t *testing.T, stateDir string) *attacherProc {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	mine, theirs := os.NewFile(uintptr(fds[0]), "ctl"), os.NewFile(uintptr(fds[1]), "ctl")
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), handoffHelperEnv+"="+stateDir)
	cmd.Stderr = os.Stderr
	cmd.ExtraFiles = []*os.File{theirs}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	theirs.Close()
	fc, err := net.FileConn(mine)
	mine.Close()
	if err != nil {
		t.Fatal(err)
	}
	p := &attacherProc{cmd: cmd, c: fc.(*net.UnixConn)}
	t.Cleanup(func() {
		p.c.Close()
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			cmd.Process.Kill()
			<-done
		}
	})
	return p
}

// call sends a request and returns the answer, failing the test on an
// error of the exchange or a reported one.
func (p *attacherProc) call(t *testing.T, m helperMsg, files ...*os.File) (helperMsg, []*os.File) {
	t.Helper()
	p.c.SetDeadline(time.Now().Add(2 * time.Minute))
	if err := sendMsg(p.c, m, files); err != nil {
		t.Fatalf("%s: %v", m.Op, err)
	}
	r, got, err := recvMsg(p.c)
	if err != nil {
		t.Fatalf("%s: %v", m.Op, err)
	}
	if r.Err != "" {
		fdpass.Close(got)
		t.Fatalf("%s: %s", m.Op, r.Err)
	}
	return r, got
}

// handOverProcs moves the volume from the Attacher process from to the
// one to, passing the handoff's files through this process as an
// upgrade's coordinator would; it returns the new server's pid.
func handOverProcs(t *testing.T, from, to *attacherProc, stateDir, id string) int {
	t.Helper()
	probe := New(Config{StateDir: stateDir})
	old := serverPid(t, probe, id)
	start := time.Now()
	r, files := from.call(t, helperMsg{Op: "handoff", Volume: id})
	if len(files) != nFiles || r.Handoff == nil {
		t.Fatalf("handoff with %d files", len(files))
	}
	_, _ = to.call(t, helperMsg{Op: "take", Handoff: r.Handoff}, files...)
	fdpass.Close(files)
	from.call(t, helperMsg{Op: "release"})
	to.call(t, helperMsg{Op: "start"})
	t.Logf("handover from server %d took %v", old, time.Since(start).Round(time.Millisecond))
	waitGone(t, old)
	pid := serverPid(t, probe, id)
	if pid == old || !attach.ProcAlive(pid, 0) {
		t.Fatalf("the volume's server is %d after the handover from %d", pid, old)
	}
	if hl, err := probe.Health(id); err != nil || !hl.Connected {
		t.Fatalf("health after the handover: %+v, %v", hl, err)
	}
	return pid
}
