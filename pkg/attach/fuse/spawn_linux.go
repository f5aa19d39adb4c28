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
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"syscall"
	"time"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

// launched is a server process just started: its standard input, where
// the spec went (and, for a successor, the word to start goes), and what
// it reports on descriptor 3, in order.
type launched struct {
	cmd    *exec.Cmd
	pid    int
	stdin  *os.File
	msgs   <-chan readyResult
	exited <-chan struct{}
}

type readyResult struct {
	msg readyMsg
	err error
}

// kill ends the process. os.Process signals through a pidfd: this cannot
// hit another process, even after ours is gone, and fails only for one
// that is gone (os.ErrProcessDone).
func (l *launched) kill() { _ = l.cmd.Process.Kill() }

// awaitExit waits for the process to exit, killing it if it takes longer
// than exitTimeout.
func (l *launched) awaitExit() {
	select {
	case <-l.exited:
	case <-time.After(exitTimeout):
		l.kill()
		<-l.exited
	}
}

// launch starts a server process with spec on its standard input and
// extra as descriptors 4 on.
func (a *Attacher) launch(spec serveSpec, extra []*os.File) (*launched, error) {
	argv := a.cfg.ServeCommand
	if len(argv) == 0 {
		exe, err := os.Executable()
		if err != nil {
			return nil, fmt.Errorf("fuse: the server command: %w", err)
		}
		argv = []string{exe, ServeArg}
	}
	b, err := json.Marshal(spec)
	if err != nil {
		return nil, err
	}
	specR, specW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	readyR, readyW, err := os.Pipe()
	if err != nil {
		specR.Close()
		specW.Close()
		return nil, err
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = append(os.Environ(), ServeEnv+"=1")
	cmd.Dir = "/"
	cmd.Stdin = specR
	// Logs go where ours go, straight to the file: nothing of this
	// process sits in between.
	cmd.Stderr = os.Stderr
	cmd.ExtraFiles = append([]*os.File{readyW}, extra...)
	// A session of its own: the process outlives ours and does not get
	// the signals of our process group or terminal.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	err = cmd.Start()
	specR.Close()
	readyW.Close()
	if err != nil {
		specW.Close()
		readyR.Close()
		return nil, err
	}
	exited := make(chan struct{})
	go func() {
		// Its exit status is in cmd.ProcessState.
		_ = cmd.Wait()
		close(exited)
	}()
	msgs := make(chan readyResult, 2)
	go func() {
		defer readyR.Close()
		dec := json.NewDecoder(readyR)
		for {
			var r readyResult
			r.err = dec.Decode(&r.msg)
			msgs <- r
			if r.err != nil {
				close(msgs)
				return
			}
		}
	}()
	l := &launched{cmd: cmd, pid: cmd.Process.Pid, stdin: specW, msgs: msgs, exited: exited}
	// A server that dies unread makes the write fail rather than block.
	if _, err := specW.Write(append(b, '\n')); err != nil {
		a.cfg.Logger.Debug("fuse: writing the server's spec", "pid", l.pid, "error", err)
	}
	return l, nil
}

// next waits for the process's next report; ctx bounds the wait.
func (l *launched) next(ctx context.Context) (readyMsg, error) {
	select {
	case r, ok := <-l.msgs:
		if !ok || r.err != nil {
			// Its exit status, once Wait has it.
			select {
			case <-l.exited:
				return readyMsg{}, fmt.Errorf("the server process ended before it was ready (%v)", l.cmd.ProcessState)
			case <-time.After(exitTimeout):
				return readyMsg{}, errors.New("the server process closed its report pipe before it was ready")
			}
		}
		if r.msg.Error != nil {
			return readyMsg{}, r.msg.Error.Err()
		}
		return r.msg, nil
	case <-ctx.Done():
		return readyMsg{}, ctx.Err()
	}
}

// specFor is the spec of a server process of this Attacher.
func (a *Attacher) specFor(t attach.Target, o attach.Options, deadline time.Time) serveSpec {
	return serveSpec{
		Target:         t,
		Options:        o,
		StateDir:       a.stateDir(),
		MaxWrite:       a.cfg.MaxWrite,
		MaxBackground:  a.cfg.MaxBackground,
		UnmountTimeout: a.cfg.UnmountTimeout,
		Deadline:       deadline,
		BufferedLoop:   a.cfg.bufferedLoop,
		CachedFile:     a.cfg.cachedFile,
		SyncDIO:        a.cfg.syncDIO,
	}
}

// spawn starts the volume's server process, handing it the volume's lock
// lf, and waits until it serves the volume.
func (a *Attacher) spawn(ctx context.Context, t attach.Target, o attach.Options, lf *os.File, log *slog.Logger) (*attach.Attachment, error) {
	id := t.VolumeID
	deadline := time.Now().Add(startTimeout)
	if d, ok := ctx.Deadline(); ok {
		deadline = d
	}
	l, err := a.launch(a.specFor(t, o, deadline), []*os.File{lf})
	if err != nil {
		a.dropLock(id, lf)
		return nil, fmt.Errorf("fuse: start the server process of volume %s: %w", id, err)
	}
	lf.Close() // the server holds the lock now
	l.stdin.Close()
	p := &serverProc{id: id, sock: a.sockPath(id), pid: l.pid, exited: l.exited}
	log = log.With("pid", p.pid)
	// fail waits for the process to exit, killing it if it does not, and
	// cleans up after it.
	fail := func(err error) (*attach.Attachment, error) {
		l.awaitExit()
		a.scrub(id, log)
		return nil, err
	}
	msg, err := l.next(ctx)
	if err != nil {
		if ctx.Err() != nil {
			l.kill()
			return fail(fmt.Errorf("fuse: attach volume %s: %w", id, ctx.Err()))
		}
		if attach.IsRemote(err) {
			return fail(err) // the server's own words
		}
		return fail(fmt.Errorf("fuse: volume %s: %w", id, err))
	}
	p.start = msg.StartTime
	// Ready is what the server says on its socket.
	if err := p.refresh(ctx); err != nil {
		l.kill()
		return fail(fmt.Errorf("fuse: the server process of volume %s does not answer on %s: %w", id, p.sock, err))
	}
	a.setServer(id, p)
	log.Info("fuse: attached through a server process", "device", p.att.Device, "size", p.att.Size, "mptcp", p.att.MPTCP)
	att := p.att
	return &att, nil
}
