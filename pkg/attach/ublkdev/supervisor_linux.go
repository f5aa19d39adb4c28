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

package ublkdev

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/internal/backoff"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/fdpass"
	"github.com/mpnbd/mpnbd/pkg/ublk"
)

// Timeouts of the exchanges with volume processes.
const (
	// ctlTimeout bounds a health request and the writing of a message.
	ctlTimeout = 5 * time.Second
	// opTimeout bounds a resize or detach when the caller's context has
	// no deadline.
	opTimeout = 2 * time.Minute
	// exitTimeout is how long a process may take to exit once it said it
	// would (or was killed) before it is killed (or given up on).
	exitTimeout = 15 * time.Second
	// minBackoff and maxBackoff bound the wait before a volume's process
	// is started again after it died; a process that lived stableAfter
	// restarts the backoff.
	minBackoff  = 250 * time.Millisecond
	maxBackoff  = 10 * time.Second
	stableAfter = time.Minute
)

// errServerGone: the volume's process ended, or its socket broke, before
// it answered.
var errServerGone = errors.New("ublk: the volume's server process is gone")

// Supervisor is the ublk transport with one server process per volume
// (see the package doc). It keeps no state that matters: a new one finds
// the devices in the state directory (Adopt).
type Supervisor struct {
	cfg   Config
	log   *slog.Logger
	local *Attacher // devices no process serves; the state files

	locks attach.VolumeLocks

	mu     sync.Mutex
	vols   map[string]*supervised
	closed bool
}

var (
	_ attach.Attacher    = (*Supervisor)(nil)
	_ attach.Adopter     = (*Supervisor)(nil)
	_ attach.HandingOver = (*Supervisor)(nil)
)

// supervised is a volume a Supervisor keeps served: its process, and the
// next one when that one dies.
type supervised struct {
	target attach.Target
	opts   attach.Options
	log    *slog.Logger
	// ctx ends the supervision: no process is started after it.
	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{} // closed when the supervision has ended

	// Under Supervisor.mu:
	att      attach.Attachment
	srv      *server // nil while no process serves the volume
	stop     bool    // the process's exit is wanted: start none after it
	restarts int
	lastExit string
}

// NewSupervisor checks that the kernel has ublk (else
// attach.ErrUnsupported) and returns a Supervisor.
func NewSupervisor(cfg Config) (*Supervisor, error) {
	local, err := New(cfg)
	if err != nil {
		return nil, err
	}
	return newSupervisor(local.cfg, local), nil
}

// newSupervisor is a Supervisor; a nil local knows of no device that no
// process serves (tests without ublk).
func newSupervisor(cfg Config, local *Attacher) *Supervisor {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Supervisor{cfg: cfg, log: cfg.Logger.With("transport", string(attach.Ublk)), local: local,
		vols: map[string]*supervised{}}
}

// detachUnserved removes the device of a volume no process serves, if
// its state file names one.
func (s *Supervisor) detachUnserved(ctx context.Context, volumeID string) error {
	if s.local == nil {
		return nil
	}
	return s.local.Detach(ctx, volumeID)
}

// Close lets every volume process go: each stops serving and exits,
// leaving its device held by the kernel for the next supervisor's Adopt.
func (s *Supervisor) Close() {
	s.mu.Lock()
	s.closed = true
	var all []*supervised
	for _, v := range s.vols {
		v.stop = true
		v.cancel()
		if v.srv != nil {
			v.srv.conn.Close() // the process leaves the device on EOF
		}
		all = append(all, v)
	}
	s.mu.Unlock()
	for _, v := range all {
		select {
		case <-v.done:
		case <-time.After(teardownTimeout + exitTimeout):
			v.log.Warn("ublk: the volume's server process did not exit")
		}
	}
	if s.local != nil {
		s.local.Close()
	}
}

// lock serializes the calls about one volume.
func (s *Supervisor) lock(id string) func() { return s.locks.Lock(id) }

func (s *Supervisor) get(id string) *supervised {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.vols[id]
}

// Attach serves the target from a new volume process; a volume served
// already is returned as is, and one a dead process left (its state
// file) is taken over.
func (s *Supervisor) Attach(ctx context.Context, t attach.Target, o attach.Options) (*attach.Attachment, error) {
	unlock := s.lock(t.VolumeID)
	defer unlock()
	if v := s.get(t.VolumeID); v != nil {
		s.mu.Lock()
		att := v.att
		s.mu.Unlock()
		return &att, nil
	}
	srv, att, err := s.spawn(ctx, s.spec(modeAttach, t, o, nil))
	if err != nil {
		return nil, err
	}
	s.supervise(t, o, *att, srv)
	s.log.Info("volume attached", "volume_id", t.VolumeID, "device", att.Device, "size", att.Size, "mptcp", att.MPTCP, "pid", srv.pid)
	return att, nil
}

func (s *Supervisor) spec(mode string, t attach.Target, o attach.Options, rec json.RawMessage) serveSpec {
	return serveSpec{Mode: mode, Target: t, Options: o, Record: rec, StateDir: s.cfg.StateDir, Queues: s.cfg.Queues, Depth: s.cfg.Depth}
}

// supervise registers a volume its process srv (nil: none yet) serves
// and keeps it served.
func (s *Supervisor) supervise(t attach.Target, o attach.Options, att attach.Attachment, srv *server) {
	ctx, cancel := context.WithCancel(context.Background())
	v := &supervised{target: t, opts: o, log: s.log.With("volume_id", t.VolumeID), ctx: ctx, cancel: cancel,
		done: make(chan struct{}), att: att, srv: srv}
	s.mu.Lock()
	s.vols[t.VolumeID] = v
	if s.closed {
		v.stop = true
		cancel()
		if srv != nil {
			srv.conn.Close()
		}
	}
	s.mu.Unlock()
	go s.keepServed(v)
}

// keepServed starts a new process whenever the volume's process dies
// unasked, until the supervision ends.
func (s *Supervisor) keepServed(v *supervised) {
	defer close(v.done)
	pause := backoff.New(minBackoff, maxBackoff)
	for {
		s.mu.Lock()
		srv := v.srv
		s.mu.Unlock()
		if srv != nil {
			<-srv.exited
			s.mu.Lock()
			v.srv = nil
			v.lastExit = srv.exitStatus()
			stop := v.stop
			s.mu.Unlock()
			if stop {
				return
			}
			if time.Since(srv.started) > stableAfter {
				pause.Reset()
			}
		}
		delay := pause.Next()
		if srv != nil {
			v.log.Error("ublk: the volume's server process exited; the kernel holds the device's I/O until a new one takes it over",
				"pid", srv.pid, "status", v.lastExit, "restart_in", delay)
		}
		if backoff.Sleep(v.ctx, delay) != nil {
			return
		}
		s.mu.Lock()
		v.restarts++
		s.mu.Unlock()
		next, att, err := s.spawn(v.ctx, s.spec(modeRecover, v.target, v.opts, nil))
		switch {
		case err == nil:
			s.mu.Lock()
			v.srv, v.att = next, *att
			if v.stop {
				next.conn.Close() // asked to stop meanwhile: it leaves the device
			}
			s.mu.Unlock()
			v.log.Info("ublk: a new server process took the device over", "pid", next.pid, "device", att.Device)
		case v.ctx.Err() != nil:
			return
		case errors.Is(err, attach.ErrNotAttached):
			// The device is gone, or its state file: nothing to serve.
			v.log.Error("ublk: the volume's device is gone; not serving it any more", "error", err)
			s.mu.Lock()
			if s.vols[v.target.VolumeID] == v {
				delete(s.vols, v.target.VolumeID)
			}
			s.mu.Unlock()
			return
		default:
			v.log.Error("ublk: a new server process could not take the device over", "error", err, "retry_in", delay)
		}
	}
}

// end stops the supervision of v, whose process srv (if any) was asked to
// exit, and forgets v once it has.
func (s *Supervisor) end(v *supervised, srv *server) {
	if srv != nil {
		srv.awaitExit(v.log)
	}
	v.cancel()
	<-v.done
	s.mu.Lock()
	if s.vols[v.target.VolumeID] == v {
		delete(s.vols, v.target.VolumeID)
	}
	s.mu.Unlock()
}

// stopping marks v's next process exit as wanted and returns the process
// serving it now.
func (s *Supervisor) stopping(v *supervised) *server {
	s.mu.Lock()
	defer s.mu.Unlock()
	v.stop = true
	return v.srv
}

// Detach removes the volume's device and ends its process. Unknown
// volumes succeed.
func (s *Supervisor) Detach(ctx context.Context, volumeID string) error {
	unlock := s.lock(volumeID)
	defer unlock()
	v := s.get(volumeID)
	if v == nil {
		// A device no process serves, or nothing at all.
		return s.detachUnserved(ctx, volumeID)
	}
	srv := s.stopping(v)
	if srv != nil {
		octx, cancel := opContext(ctx)
		resp, err := srv.call(octx, request{Op: opDetach})
		cancel()
		if err == nil && resp.Error != nil {
			// The process could not remove the device and serves on.
			s.mu.Lock()
			v.stop = false
			s.mu.Unlock()
			return fmt.Errorf("ublk: detach %s: %w", volumeID, resp.Error.Err())
		}
		if err != nil && !errors.Is(err, errServerGone) && srv.answers() {
			// Not answered in time, but alive: the process waits to flush
			// what its session acknowledged (the storage node away), and
			// killing it would drop that. It serves on, its detach still
			// under way; the caller tries again.
			s.mu.Lock()
			v.stop = false
			s.mu.Unlock()
			return fmt.Errorf("ublk: detach %s: the volume's server process did not finish: %w", volumeID, err)
		}
		if err != nil {
			v.log.Warn("ublk: the volume's server process is gone; removing the device", "pid", srv.pid, "error", err)
			srv.kill()
		}
	}
	s.end(v, srv)
	// What the process did not remove (it died, or did not answer).
	if err := s.detachUnserved(ctx, volumeID); err != nil {
		return err
	}
	s.log.Info("volume detached", "volume_id", volumeID)
	return nil
}

// Health reports the volume's session, as its process sees it.
func (s *Supervisor) Health(volumeID string) (attach.Health, error) {
	v := s.get(volumeID)
	if v == nil {
		return attach.Health{}, fmt.Errorf("%w: %s", attach.ErrNotAttached, volumeID)
	}
	s.mu.Lock()
	srv, att, restarts, lastExit := v.srv, v.att, v.restarts, v.lastExit
	s.mu.Unlock()
	down := attach.Health{MPTCP: att.MPTCP, Reconnects: restarts}
	if srv == nil {
		down.Message = fmt.Sprintf("no server process serves the device now (the last one: %s); the kernel holds its I/O until a new one takes it over (%d started again so far)", lastExit, restarts)
		return down, nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), ctlTimeout)
	defer cancel()
	resp, err := srv.call(ctx, request{Op: opHealth})
	if err != nil {
		down.Message = fmt.Sprintf("the volume's server process (pid %d) does not answer: %v", srv.pid, err)
		return down, nil
	}
	if resp.Error != nil || resp.Health == nil {
		return attach.Health{}, fmt.Errorf("ublk: health of %s: %w", volumeID, resp.Error.Err())
	}
	// Each new process redialed: its reconnects count after those.
	h := *resp.Health
	h.Reconnects += restarts
	return h, nil
}

// Resize picks up a grown export through the volume's process.
func (s *Supervisor) Resize(ctx context.Context, volumeID string, newSize uint64) (uint64, error) {
	unlock := s.lock(volumeID)
	defer unlock()
	srv, err := s.serving(volumeID)
	if err != nil {
		return 0, err
	}
	octx, cancel := opContext(ctx)
	defer cancel()
	resp, err := srv.call(octx, request{Op: opResize, Size: newSize})
	if err != nil {
		return 0, fmt.Errorf("ublk: resize %s: %w", volumeID, err)
	}
	if resp.Error != nil {
		return 0, resp.Error.Err()
	}
	s.mu.Lock()
	if v := s.vols[volumeID]; v != nil {
		v.att.Size = resp.Size
	}
	s.mu.Unlock()
	return resp.Size, nil
}

// serving is the process serving the volume now.
func (s *Supervisor) serving(volumeID string) (*server, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	v := s.vols[volumeID]
	if v == nil {
		return nil, fmt.Errorf("%w: %s", attach.ErrNotAttached, volumeID)
	}
	if v.srv == nil {
		return nil, fmt.Errorf("ublk: volume %s: no server process serves it now; a new one is being started", volumeID)
	}
	return v.srv, nil
}

// ServerPID is the process serving the volume now (0: none), for
// diagnostics.
func (s *Supervisor) ServerPID(volumeID string) int {
	srv, err := s.serving(volumeID)
	if err != nil {
		return 0
	}
	return srv.pid
}

// Adopt takes over every device the state directory lists, each with a
// process of its own. A device whose first process fails is supervised
// all the same: new processes try again.
func (s *Supervisor) Adopt(ctx context.Context) ([]*attach.Attachment, error) {
	return adoptAll(s.cfg.StateDir, func(r record) (*attach.Attachment, error) { return s.adopt(ctx, r) })
}

// adopt takes over the device of r unless a process of ours serves it.
func (s *Supervisor) adopt(ctx context.Context, r record) (*attach.Attachment, error) {
	id := r.Target.VolumeID
	unlock := s.lock(id)
	defer unlock()
	if s.get(id) != nil {
		return nil, nil
	}
	srv, att, err := s.spawn(ctx, s.spec(modeRecover, r.Target, r.Options, nil))
	if errors.Is(err, attach.ErrNotAttached) {
		return nil, err
	}
	if err != nil {
		s.supervise(r.Target, r.Options, attach.Attachment{VolumeID: id, Transport: attach.Ublk, Device: ublk.BlockPath(r.DevID)}, nil)
		return nil, fmt.Errorf("ublk: take over %s (new processes keep trying): %w", id, err)
	}
	s.supervise(r.Target, r.Options, *att, srv)
	s.log.Info("volume taken over from an earlier process", "volume_id", id, "device", att.Device, "pid", srv.pid)
	return att, nil
}

// HandOff readies a volume for a successor (see Attacher.HandOff): its
// process flushes, and on Release stops serving and exits.
func (s *Supervisor) HandOff(ctx context.Context, volumeID string) (*attach.Handoff, error) {
	unlock := s.lock(volumeID)
	defer unlock()
	v := s.get(volumeID)
	srv, err := s.serving(volumeID)
	if err != nil {
		return nil, err
	}
	resp, err := srv.call(ctx, request{Op: opHandoff})
	if err != nil {
		return nil, fmt.Errorf("hand off %s: %w", volumeID, err)
	}
	if resp.Error != nil || resp.Handoff == nil {
		return nil, fmt.Errorf("hand off %s: %w", volumeID, resp.Error.Err())
	}
	h := resp.Handoff
	h.Resume = func() error {
		ctx, cancel := context.WithTimeout(context.Background(), ctlTimeout)
		defer cancel()
		resp, err := srv.call(ctx, request{Op: opResume})
		if err != nil {
			return err
		}
		return resp.Error.Err()
	}
	h.Release = func() {
		// The process serving now: another one if the first died since.
		cur := s.stopping(v)
		if cur != nil {
			// Its release drains the session through an outage, as long
			// as the volume's outage policy says (releaseContext); killed
			// sooner, it would drop writes it acknowledged.
			ctx, cancel := releaseContext(attach.FailAfter(v.opts))
			_, err := cur.call(ctx, request{Op: opRelease})
			cancel()
			if err != nil {
				// It must not serve beside the successor: the kernel takes
				// the device from a dead process.
				v.log.Warn("ublk: the volume's server process did not release the device; killing it", "pid", cur.pid, "error", err)
				cur.kill()
			}
		}
		s.end(v, cur)
		v.log.Info("ublk: volume handed to a successor")
	}
	return h, nil
}

// TakeHandoff prepares to take a device a predecessor hands off; Start
// starts the volume's process, which takes the device over once the
// predecessor has stopped serving it.
func (s *Supervisor) TakeHandoff(ctx context.Context, h *attach.Handoff) (*attach.Attachment, error) {
	fdpass.Close(h.Files)
	var r record
	if err := json.Unmarshal(h.State, &r); err != nil {
		return nil, fmt.Errorf("%w: handoff of %s: %v", attach.ErrInvalid, h.VolumeID, err)
	}
	if r.Target.VolumeID != h.VolumeID {
		return nil, fmt.Errorf("%w: handoff of %s describes %s", attach.ErrInvalid, h.VolumeID, r.Target.VolumeID)
	}
	h.Start = func() error {
		id := r.Target.VolumeID
		unlock := s.lock(id)
		defer unlock()
		if s.get(id) != nil {
			return nil
		}
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), startTimeout)
		srv, att, err := s.spawn(sctx, s.spec(modeHandoff, r.Target, r.Options, h.State))
		cancel()
		if errors.Is(err, attach.ErrNotAttached) {
			return err
		}
		if err != nil {
			s.log.Warn("ublk: the device handed off is not taken over yet; new processes keep trying", "volume_id", id, "error", err)
			s.supervise(r.Target, r.Options, h.Attachment, nil)
			return nil
		}
		s.supervise(r.Target, r.Options, *att, srv)
		return nil
	}
	h.Abort = func() {}
	att := h.Attachment
	return &att, nil
}

// opContext bounds a long request when ctx does not.
func opContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, opTimeout)
}

// server is one volume process.
type server struct {
	pid     int
	cmd     *exec.Cmd
	conn    *net.UnixConn
	started time.Time
	exited  chan struct{} // closed once waited for

	wmu   sync.Mutex // one request written at a time
	mu    sync.Mutex
	next  uint64
	calls map[uint64]chan response // nil once the socket broke
}

// spawn starts a volume process with sp and waits until it serves the
// volume (or ctx ends, which kills it).
func (s *Supervisor) spawn(ctx context.Context, sp serveSpec) (*server, *attach.Attachment, error) {
	id := sp.Target.VolumeID
	argv := s.cfg.ServeCommand
	if len(argv) == 0 {
		exe, err := os.Executable()
		if err != nil {
			return nil, nil, fmt.Errorf("ublk: the volume process's command: %w", err)
		}
		argv = []string{exe, ServeArg}
	}
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("ublk: socket pair: %w", err)
	}
	ours, theirs := os.NewFile(uintptr(fds[0]), "volume-process"), os.NewFile(uintptr(fds[1]), "supervisor")
	fc, err := net.FileConn(ours)
	ours.Close()
	if err != nil {
		theirs.Close()
		return nil, nil, err
	}
	conn := fc.(*net.UnixConn)
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = append(os.Environ(), ServeEnv+"=1")
	cmd.Dir = "/"
	cmd.Stderr = os.Stderr
	cmd.ExtraFiles = []*os.File{theirs}
	// A session of its own: no signals of our process group or terminal.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	err = cmd.Start()
	theirs.Close()
	if err != nil {
		conn.Close()
		return nil, nil, fmt.Errorf("ublk: start the process of volume %s: %w", id, err)
	}
	srv := &server{pid: cmd.Process.Pid, cmd: cmd, conn: conn, started: time.Now(), exited: make(chan struct{}), calls: map[uint64]chan response{}}
	// answered is closed (giveUp) once the process's answer to the start
	// was read or given up on. A process that fails says why and exits at
	// once: its answer waits in the socket, and closing the socket on its
	// exit before the answer was read would lose it (the attach's error
	// would be only the exit status). A socket whose other end outlives
	// the process closes after ctlTimeout.
	answered := make(chan struct{})
	giveUp := sync.OnceFunc(func() { close(answered) })
	go func() {
		// Its exit status is in cmd.ProcessState (exitStatus).
		_ = cmd.Wait()
		select {
		case <-answered:
		case <-time.After(ctlTimeout):
		}
		conn.Close()
		close(srv.exited)
	}()
	sp.Deadline = time.Now().Add(startTimeout)
	if dl, ok := ctx.Deadline(); ok {
		sp.Deadline = dl
	}
	// A process that neither serves nor fails by its deadline is killed.
	ctx, cancel := context.WithDeadline(ctx, sp.Deadline.Add(exitTimeout))
	defer cancel()
	fail := func(err error) (*server, *attach.Attachment, error) {
		giveUp()
		srv.kill()
		srv.awaitExit(s.log)
		return nil, nil, err
	}
	if err := fdpass.SendJSON(conn, sp, nil, time.Now().Add(ctlTimeout)); err != nil {
		return fail(fmt.Errorf("ublk: the process of volume %s: %w", id, err))
	}
	type ready struct {
		m   readyMsg
		err error
	}
	readyc := make(chan ready, 1)
	go func() {
		var r ready
		_, r.err = fdpass.RecvJSON(conn, &r.m, 0, time.Time{})
		readyc <- r
	}()
	var r ready
	select {
	case r = <-readyc:
	case <-ctx.Done():
		return fail(fmt.Errorf("ublk: volume %s: %w", id, ctx.Err()))
	}
	giveUp()
	switch {
	case r.err != nil:
		return fail(fmt.Errorf("ublk: the process of volume %s ended before it served it (%s)", id, srv.exitStatusAfter(exitTimeout)))
	case r.m.Error != nil:
		srv.awaitExit(s.log)
		return nil, nil, r.m.Error.Err()
	case r.m.Attachment == nil:
		return fail(fmt.Errorf("ublk: the process of volume %s said neither attachment nor error", id))
	}
	go srv.readResponses()
	return srv, r.m.Attachment, nil
}

// readResponses hands each response to its caller until the socket
// breaks.
func (srv *server) readResponses() {
	for {
		var r response
		if _, err := fdpass.RecvJSON(srv.conn, &r, 0, time.Time{}); err != nil {
			srv.mu.Lock()
			for _, ch := range srv.calls {
				close(ch)
			}
			srv.calls = nil
			srv.mu.Unlock()
			return
		}
		srv.mu.Lock()
		ch := srv.calls[r.ID]
		delete(srv.calls, r.ID)
		srv.mu.Unlock()
		if ch != nil {
			ch <- r
		}
	}
}

// call sends a request and waits for its response.
func (srv *server) call(ctx context.Context, req request) (response, error) {
	ch := make(chan response, 1)
	srv.mu.Lock()
	if srv.calls == nil {
		srv.mu.Unlock()
		return response{}, errServerGone
	}
	srv.next++
	req.ID = srv.next
	srv.calls[req.ID] = ch
	srv.mu.Unlock()
	forget := func() {
		srv.mu.Lock()
		if srv.calls != nil {
			delete(srv.calls, req.ID)
		}
		srv.mu.Unlock()
	}
	srv.wmu.Lock()
	err := fdpass.SendJSON(srv.conn, req, nil, time.Now().Add(ctlTimeout))
	srv.wmu.Unlock()
	if err != nil {
		forget()
		return response{}, fmt.Errorf("%w: %v", errServerGone, err)
	}
	select {
	case r, ok := <-ch:
		if !ok {
			return response{}, errServerGone
		}
		return r, nil
	case <-ctx.Done():
		forget()
		return response{}, ctx.Err()
	}
}

// answers reports whether the process answers a health request: one that
// does is alive, whatever else it waits for.
func (srv *server) answers() bool {
	ctx, cancel := context.WithTimeout(context.Background(), ctlTimeout)
	defer cancel()
	_, err := srv.call(ctx, request{Op: opHealth})
	return err == nil
}

// kill ends the process. os.Process signals through a pidfd: this cannot
// hit another process, even after ours is gone, and fails only for one
// that is gone (os.ErrProcessDone).
func (srv *server) kill() { _ = srv.cmd.Process.Kill() }

// awaitExit waits for the process to exit, killing it if it takes longer
// than exitTimeout.
func (srv *server) awaitExit(log *slog.Logger) {
	select {
	case <-srv.exited:
		return
	case <-time.After(exitTimeout):
	}
	log.Warn("ublk: the volume's server process does not exit; killing it", "pid", srv.pid)
	srv.kill()
	select {
	case <-srv.exited:
	case <-time.After(exitTimeout):
		log.Error("ublk: the volume's server process outlives SIGKILL", "pid", srv.pid)
	}
}

// exitStatus says how the process ended, once it has.
func (srv *server) exitStatus() string {
	select {
	case <-srv.exited:
		return srv.cmd.ProcessState.String()
	default:
		return "running"
	}
}

// exitStatusAfter is exitStatus, waiting up to d for the exit.
func (srv *server) exitStatusAfter(d time.Duration) string {
	select {
	case <-srv.exited:
	case <-time.After(d):
	}
	return srv.exitStatus()
}
