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
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

// fakeHandoffServer answers one opHandoff on a control socket with reply
// (one write, the descriptors of files attached, as the server processes
// of every release write it), then, unless reply is cut short, answers
// the verdict. It returns the socket's path.
func fakeHandoffServer(t *testing.T, reply []byte, files []*os.File, closeAfter bool) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "v.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	var oob []byte
	if len(files) > 0 {
		fds := make([]int, len(files))
		for i, f := range files {
			fds[i] = int(f.Fd())
		}
		oob = unix.UnixRights(fds...)
	}
	done := make(chan struct{})
	t.Cleanup(func() {
		ln.Close()
		<-done
	})
	go func() {
		defer close(done)
		c, err := ln.AcceptUnix()
		if err != nil {
			return
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(30 * time.Second))
		dec := json.NewDecoder(c)
		var req ctlRequest
		if err := dec.Decode(&req); err != nil || req.Op != opHandoff {
			t.Errorf("request %+v, %v; want %s", req, err, opHandoff)
			return
		}
		if _, _, err := c.WriteMsgUnix(reply, oob, nil); err != nil {
			t.Errorf("reply: %v", err)
			return
		}
		if closeAfter {
			return
		}
		if err := dec.Decode(&req); err != nil {
			return
		}
		if req.Op != opResume {
			t.Errorf("verdict %q, want %q", req.Op, opResume)
		}
		// A failure shows in the test's read of the answer.
		_ = json.NewEncoder(c).Encode(ctlResponse{Pid: os.Getpid()})
	}()
	return sock
}

func handoffLine(t *testing.T, resp ctlResponse) []byte {
	t.Helper()
	b, err := json.Marshal(resp)
	if err != nil {
		t.Fatal(err)
	}
	return append(b, '\n')
}

// pipeAllClosed reports whether every write end of r's pipe is closed.
func pipeAllClosed(r *os.File) error {
	if err := r.SetReadDeadline(time.Now().Add(5 * time.Second)); err != nil {
		return err
	}
	_, err := io.ReadAll(r)
	return err
}

// The answer to opHandoff is a line of JSON, the FUSE connection and the
// lock file attached to its first bytes; what follows on the connection
// is the verdict's exchange.
func TestCallHandoffWire(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	lock, err := os.Create(filepath.Join(t.TempDir(), "v.lock"))
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Close()
	msg := &handoffMsg{Target: attach.Target{VolumeID: "v"}, State: handoffState{Device: "/dev/loop9", Pid: os.Getpid()}}
	line := handoffLine(t, ctlResponse{Pid: os.Getpid(), Handoff: msg})
	p := &serverProc{id: "v", sock: fakeHandoffServer(t, line, []*os.File{w, lock}, false), pid: os.Getpid()}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, rd, got, files, err := p.callHandoff(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// A server of an earlier release sends no pidfd: still a handoff.
	if len(files) != nFiles-1 || got.Target.VolumeID != "v" || got.State.Device != "/dev/loop9" {
		t.Fatalf("handoff %+v with %d files", got, len(files))
	}
	if _, err := files[fileFUSE].Write([]byte("fuse")); err != nil {
		t.Fatal(err)
	}
	var a, b unix.Stat_t
	if err := unix.Fstat(int(lock.Fd()), &a); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fstat(int(files[fileLock].Fd()), &b); err != nil || a.Ino != b.Ino || a.Dev != b.Dev {
		t.Fatalf("the lock file received is not the one sent (%v)", err)
	}
	for _, f := range files {
		f.Close()
	}
	if err := json.NewEncoder(c).Encode(ctlRequest{Op: opResume}); err != nil {
		t.Fatal(err)
	}
	var resp ctlResponse
	if err := json.NewDecoder(bufio.NewReader(rd)).Decode(&resp); err != nil || resp.Error != nil {
		t.Fatalf("the verdict's answer %+v, %v", resp, err)
	}
	w.Close()
	if err := r.SetReadDeadline(time.Now().Add(5 * time.Second)); err != nil {
		t.Fatal(err)
	}
	if b, err := io.ReadAll(r); err != nil || string(b) != "fuse" {
		t.Fatalf("the pipe reads %q, %v", b, err)
	}
}

// An answer that is not a complete handoff fails the call, and the files
// that came with it are closed.
func TestCallHandoffRefused(t *testing.T) {
	line := handoffLine(t, ctlResponse{Pid: os.Getpid(), Handoff: &handoffMsg{Target: attach.Target{VolumeID: "v"}}})
	for _, tc := range []struct {
		name       string
		reply      []byte
		files      int
		closeAfter bool
		want       string
	}{
		{"one file", line, 1, false, "with 1 files"},
		{"more files than room for", line, nFiles + 1, false, "more files than expected"},
		{"cut short", line[:len(line)/2], 2, true, "EOF"},
		{"error", handoffLine(t, ctlResponse{Pid: os.Getpid(), Error: attach.EncodeError(attach.ErrNotAttached)}), 2, false, "not attached"},
		{"another pid", handoffLine(t, ctlResponse{Pid: 1, Handoff: &handoffMsg{}}), 2, false, "pid 1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, w, err := os.Pipe()
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			files := make([]*os.File, tc.files)
			for i := range files {
				files[i] = w
			}
			p := &serverProc{id: "v", sock: fakeHandoffServer(t, tc.reply, files, tc.closeAfter), pid: os.Getpid()}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			c, _, _, got, err := p.callHandoff(ctx)
			if err == nil {
				c.Close()
				for _, f := range got {
					f.Close()
				}
				t.Fatal("the call succeeded")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q, want it to say %q", err, tc.want)
			}
			w.Close()
			if err := pipeAllClosed(r); err != nil {
				t.Fatalf("a received file is still open: %v", err)
			}
		})
	}
}
