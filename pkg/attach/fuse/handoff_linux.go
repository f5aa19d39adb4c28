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
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/fdpass"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// handoffTimeout is how long a successor waits for the word to start
// (then it gives up, leaving the volume alone). A quiesced predecessor
// waits for its word, resume or release, without a bound: resuming on a
// timeout of its own while its caller, alive, may be releasing it would
// have it serve (and acknowledge writes) until the caller kills it, the
// successor about to serve. Only the end of the caller's connection (the
// caller is gone) resumes it.
var handoffTimeout = 2 * time.Minute

// handoffFlushTimeout bounds the flush before the files leave.
const handoffFlushTimeout = 30 * time.Second

var _ attach.HandingOver = (*Attacher)(nil)

// handoffState is the transport's part of an attach.Handoff (its State):
// what a successor needs besides the files to serve the connection as
// the predecessor did.
type handoffState struct {
	Init      initParams    `json:"init"`
	StateDir  string        `json:"state_dir"`
	Size      uint64        `json:"size"`
	ReadOnly  bool          `json:"read_only,omitempty"`
	CanZero   bool          `json:"can_zero,omitempty"`
	OpenFlags uint32        `json:"open_flags"`
	MTime     time.Time     `json:"mtime"`
	Conn      string        `json:"conn,omitempty"` // the FUSE connection under fusectl
	Device    string        `json:"device"`
	Session   nbd.SessionID `json:"session"`
	// Pid and StartTime are the predecessor's.
	Pid       int    `json:"pid"`
	StartTime uint64 `json:"start_time"`
}

// handoffMsg is a predecessor's answer to opHandoff.
type handoffMsg struct {
	Target     attach.Target     `json:"target"`
	Options    attach.Options    `json:"options"`
	Attachment attach.Attachment `json:"attachment"`
	State      handoffState      `json:"state"`
}

// successorSpec is what a successor's serveSpec adds.
type successorSpec struct {
	State      handoffState      `json:"state"`
	Attachment attach.Attachment `json:"attachment"`
}

// startMsg, on a successor's standard input, tells it to serve.
type startMsg struct {
	Start bool `json:"start"`
}

// The files of a handoff, in attach.Handoff.Files order: the FUSE
// connection; the volume's lock file, whose lock the successor holds
// from the moment it has the file (a flock belongs to the open file, not
// to a process), so that no Attacher finds the volume unlocked and cleans
// it up while it moves; and a pidfd of the predecessor server, by which
// the successor serves only once the predecessor has exited (a server of
// an earlier release sends none).
const (
	fileFUSE = iota
	fileLock
	filePidfd
	nFiles
)

// quiesce stops taking requests from the kernel, once those taken are
// answered, and flushes the acknowledged writes: nothing of the volume
// is left in this process but what the successor is told.
func (v *volume) quiesce(timeout time.Duration) (*handoffState, error) {
	if v.server == nil || v.closed {
		return nil, fmt.Errorf("%w: %s (detaching)", attach.ErrNotAttached, v.target.VolumeID)
	}
	v.server.stop()
	if !v.node.readOnly {
		if err := v.path.Flush(timeout); err != nil {
			v.resume()
			return nil, fmt.Errorf("fuse: handoff of volume %s: flush: %w", v.target.VolumeID, err)
		}
	}
	return &handoffState{
		Init:      v.server.params,
		Size:      v.node.size.Load(),
		ReadOnly:  v.node.readOnly,
		CanZero:   v.node.canZero,
		OpenFlags: v.node.openFlags,
		MTime:     v.node.mtime,
		Conn:      v.conn,
		Device:    v.dev,
		Session:   v.path.ID,
	}, nil
}

// resume serves the volume again after quiesce.
func (v *volume) resume() {
	// Whoever passed the descriptor to a process (exec.Cmd) made the
	// shared open file blocking; reads must not block past a stop.
	fd, err := fdpass.RawFd(v.server.dev)
	if err == nil {
		err = unix.SetNonblock(fd, true)
	}
	if err != nil {
		v.server.log.Error("fuse: /dev/fuse stays blocking: a stop will wait for the next request", "error", err)
	}
	v.server.start()
}

// handoff serves opHandoff on c, whose decoder is dec: quiesce, send the
// handoff with its files, then wait for the verdict, as long as the
// caller keeps the connection. Anything but release (resume, the
// connection's end) resumes.
func (s *volumeServer) handoff(c *net.UnixConn, dec *json.Decoder) {
	s.mu.Lock()
	defer s.mu.Unlock()
	resp := &ctlResponse{Pid: s.pid, StartTime: s.start}
	// An answer that cannot be sent leaves the caller with a closed
	// connection or a timeout: an error there too.
	send := func() {
		c.SetWriteDeadline(time.Now().Add(ctlTimeout))
		if err := json.NewEncoder(c).Encode(resp); err != nil {
			s.log.Warn("fuse: answering a handoff request", "error", err)
		}
	}
	if s.detached.Load() {
		resp.Error = attach.EncodeError(fmt.Errorf("%w: %s (detaching)", attach.ErrNotAttached, s.v.target.VolumeID))
		send()
		return
	}
	st, err := s.v.quiesce(handoffFlushTimeout)
	if err != nil {
		resp.Error = attach.EncodeError(err)
		send()
		return
	}
	st.StateDir, st.Pid, st.StartTime = s.cfg.StateDir, s.pid, s.start
	resp.Handoff = &handoffMsg{Target: s.v.target, Options: s.opts, Attachment: s.attachment(), State: *st}
	// One line of JSON, as every answer on the socket, the files with its
	// first bytes.
	files := []*os.File{s.v.server.dev, s.lock}
	if fd, perr := unix.PidfdOpen(os.Getpid(), 0); perr == nil {
		pf := os.NewFile(uintptr(fd), "pidfd")
		defer pf.Close()
		files = append(files, pf)
	} else {
		s.log.Warn("fuse: no pidfd for the successor: it will serve without seeing this process exit", "error", perr)
	}
	b, err := json.Marshal(resp)
	if err == nil {
		err = fdpass.Send(c, append(b, '\n'), files, time.Now().Add(ctlTimeout))
	}
	if err != nil {
		s.v.resume()
		s.log.Warn("fuse: sending the handoff failed; serving again", "error", err)
		return
	}
	s.log.Info("fuse: quiesced for a handoff")
	c.SetReadDeadline(time.Time{})
	var next ctlRequest
	err = dec.Decode(&next)
	resp = &ctlResponse{Pid: s.pid, StartTime: s.start}
	if err == nil && next.Op == opRelease {
		s.release()
		send()
		s.exitOnce.Do(func() { close(s.exit) })
		return
	}
	s.v.resume()
	s.log.Info("fuse: serving again after a handoff that did not happen", "op", next.Op, "error", err)
	if err == nil {
		if next.Op != opResume {
			resp.Error = attach.EncodeError(fmt.Errorf("%w: fuse: %q during a handoff (resumed)", attach.ErrInvalid, next.Op))
		}
		send()
	}
}

// release gives the volume up to the successor: it closes the NBD
// session (everything is flushed), stops answering on the socket and
// leaves the mount, the loop device and the files, which are the
// successor's now, as they are.
func (s *volumeServer) release() {
	s.detached.Store(true)
	s.ln.Close()
	s.v.path.Close(s.cfg.UnmountTimeout)
	s.v.closed = true
	s.log.Info("fuse: released the volume to a successor")
}

// HandOff quiesces a volume served by a server process and returns it
// ready for TakeHandoff (see attach.Handoff). Until Resume or Release,
// the server takes no request of the device; if the Attacher goes away
// first (its connection ends), it serves again.
func (a *Attacher) HandOff(ctx context.Context, volumeID string) (*attach.Handoff, error) {
	if volumeID == "" {
		return nil, fmt.Errorf("%w: empty volume ID", attach.ErrInvalid)
	}
	unlock := a.lock(volumeID)
	defer unlock()
	p := a.findServer(volumeID)
	if p == nil {
		return nil, fmt.Errorf("%w: %s", attach.ErrNotAttached, volumeID)
	}
	log := a.cfg.Logger.With("volume_id", volumeID, "transport", string(attach.FUSE), "pid", p.pid)
	octx, cancel := opContext(ctx)
	defer cancel()
	c, rd, msg, files, err := p.callHandoff(octx)
	if err != nil {
		return nil, fmt.Errorf("fuse: handoff of volume %s: %w", volumeID, err)
	}
	var once sync.Once
	verdict := func(op string) (resp ctlResponse, err error) {
		err = errors.New("handoff already ended")
		once.Do(func() {
			defer c.Close()
			c.SetDeadline(time.Now().Add(opTimeout))
			if err = json.NewEncoder(c).Encode(ctlRequest{Op: op}); err != nil {
				return
			}
			if err = json.NewDecoder(rd).Decode(&resp); err == nil && resp.Error != nil {
				err = resp.Error.Err()
			}
		})
		return resp, err
	}
	state, err := json.Marshal(msg.State)
	if err != nil {
		// Our copies of the files go too: the lock's would hold it.
		fdpass.Close(files)
		if _, rerr := verdict(opResume); rerr != nil {
			err = errors.Join(err, fmt.Errorf("resume: %w", rerr))
		}
		return nil, fmt.Errorf("fuse: handoff of volume %s: %w", volumeID, err)
	}
	h := &attach.Handoff{
		VolumeID:   volumeID,
		Transport:  attach.FUSE,
		Target:     msg.Target,
		Options:    msg.Options,
		Attachment: msg.Attachment,
		State:      state,
		Files:      files,
	}
	h.Resume = func() error {
		fdpass.Close(h.Files) // copies, if nobody took them
		_, err := verdict(opResume)
		if err != nil {
			return fmt.Errorf("fuse: resume volume %s: %w", volumeID, err)
		}
		log.Info("fuse: the volume's server serves again")
		return nil
	}
	h.Release = func() {
		fdpass.Close(h.Files)
		if _, err := verdict(opRelease); err != nil {
			log.Warn("fuse: releasing the volume", "error", err)
		}
		// The successor may start once the predecessor is gone.
		deadline := time.Now().Add(exitTimeout)
		for attach.ProcAlive(p.pid, p.start) {
			if time.Now().After(deadline) {
				log.Warn("fuse: the released server does not exit; killing it", "pid", p.pid)
				if err := killProc(p.pid, p.start); err != nil {
					log.Error("fuse: killing the released server", "pid", p.pid, "error", err)
				}
				deadline = time.Now().Add(exitTimeout)
			}
			time.Sleep(10 * time.Millisecond)
		}
		a.mu.Lock()
		if q := a.servers[volumeID]; q != nil && q.pid == p.pid {
			delete(a.servers, volumeID)
		}
		a.mu.Unlock()
		log.Info("fuse: handed the volume off")
	}
	log.Info("fuse: the volume's server quiesced for a handoff")
	return h, nil
}

// callHandoff sends opHandoff and reads the answer with its files. The
// connection stays open for the verdict; rd reads what follows.
func (p *serverProc) callHandoff(ctx context.Context) (*net.UnixConn, io.Reader, *handoffMsg, []*os.File, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", p.sock)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	c := nc.(*net.UnixConn)
	fail := func(err error) (*net.UnixConn, io.Reader, *handoffMsg, []*os.File, error) {
		c.Close()
		return nil, nil, nil, nil, ctxError(ctx, err)
	}
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	if err := json.NewEncoder(c).Encode(ctlRequest{Op: opHandoff}); err != nil {
		return fail(err)
	}
	// The files come with the first bytes of the answer.
	var files []*os.File
	var data []byte
	buf := make([]byte, 64<<10)
	for !bytes.Contains(data, []byte{'\n'}) {
		n, fs, err := fdpass.Recv(c, buf, nFiles-len(files), time.Time{})
		files = append(files, fs...)
		data = append(data, buf[:n]...)
		if err != nil {
			fdpass.Close(files)
			return fail(err)
		}
	}
	i := bytes.IndexByte(data, '\n')
	var resp ctlResponse
	if err := json.Unmarshal(data[:i], &resp); err != nil {
		fdpass.Close(files)
		return fail(err)
	}
	if resp.Pid != p.pid {
		fdpass.Close(files)
		return fail(fmt.Errorf("%s is answered by pid %d, not %d", p.sock, resp.Pid, p.pid))
	}
	if resp.Error != nil {
		fdpass.Close(files)
		return fail(resp.Error.Err())
	}
	if resp.Handoff == nil || len(files) < nFiles-1 {
		// Without its files the server cannot have sent a handoff.
		fdpass.Close(files)
		return fail(fmt.Errorf("handoff answer with %d files", len(files)))
	}
	c.SetDeadline(time.Time{})
	rd := io.MultiReader(bytes.NewReader(data[i+1:]), bufio.NewReader(c))
	return c, rd, resp.Handoff, files, nil
}

// TakeHandoff starts a server process for a volume handed off by a
// predecessor in the same state directory: it dials the export,
// continuing the predecessor's NBD session, and waits, without reading
// the kernel's requests, until h.Start. The files are closed here once
// the process has them.
func (a *Attacher) TakeHandoff(ctx context.Context, h *attach.Handoff) (*attach.Attachment, error) {
	if h == nil || h.Transport != attach.FUSE || h.VolumeID == "" {
		return nil, fmt.Errorf("%w: fuse: not a handoff of a FUSE volume", attach.ErrInvalid)
	}
	files := h.Files
	h.Files = nil
	defer fdpass.Close(files)
	var st handoffState
	if err := json.Unmarshal(h.State, &st); err != nil {
		return nil, fmt.Errorf("%w: fuse: handoff state: %v", attach.ErrInvalid, err)
	}
	if len(files) != nFiles && len(files) != nFiles-1 {
		return nil, fmt.Errorf("%w: fuse: handoff with %d files, want %d", attach.ErrInvalid, len(files), nFiles)
	}
	if filepath.Clean(st.StateDir) != a.stateDir() {
		return nil, fmt.Errorf("%w: fuse: handoff from state directory %s, not %s", attach.ErrInvalid, st.StateDir, a.stateDir())
	}
	id := h.VolumeID
	unlock := a.lock(id)
	defer unlock()
	log := a.cfg.Logger.With("volume_id", id, "transport", string(attach.FUSE))
	spec := a.specFor(h.Target, h.Options, time.Now().Add(handoffTimeout))
	spec.Handoff = &successorSpec{State: st, Attachment: h.Attachment}
	extra := []*os.File{files[fileLock], files[fileFUSE]}
	if len(files) > filePidfd {
		extra = append(extra, files[filePidfd])
	}
	l, err := a.launch(spec, extra)
	if err != nil {
		return nil, fmt.Errorf("fuse: start the successor server of volume %s: %w", id, err)
	}
	log = log.With("pid", l.pid)
	abort := func() {
		l.stdin.Close()
		l.awaitExit()
	}
	msg, err := l.next(ctx)
	if err != nil {
		abort()
		return nil, fmt.Errorf("fuse: the successor server of volume %s: %w", id, err)
	}
	p := &serverProc{id: id, sock: a.sockPath(id), pid: l.pid, start: msg.StartTime, exited: l.exited}
	var once sync.Once
	h.Abort = func() { once.Do(abort) }
	h.Start = func() error {
		err := errors.New("handoff already started or aborted")
		once.Do(func() { err = a.startSuccessor(l, p, log) })
		return err
	}
	log.Info("fuse: the successor server is ready")
	att := h.Attachment
	return &att, nil
}

// startSuccessor tells a ready successor to serve and waits until it
// does.
func (a *Attacher) startSuccessor(l *launched, p *serverProc, log *slog.Logger) error {
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	b, _ := json.Marshal(startMsg{Start: true})
	_, err := l.stdin.Write(append(b, '\n'))
	l.stdin.Close()
	if err == nil {
		_, err = l.next(ctx)
	}
	if err == nil {
		err = p.refresh(ctx)
	}
	if err != nil {
		return fmt.Errorf("fuse: start the successor server of volume %s: %w", p.id, err)
	}
	unlock := a.lock(p.id)
	a.setServer(p.id, p)
	unlock()
	log.Info("fuse: the successor server serves the volume", "device", p.att.Device)
	return nil
}
