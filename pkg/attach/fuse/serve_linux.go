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
	"net"
	"os"
	"os/signal"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/logging"
	"github.com/mpnbd/mpnbd/pkg/relay"
)

// ServeMain is the body of a volume's server process, which an Attacher
// starts with Config.ServeCommand: it attaches the volume it is given,
// serves it and its control socket until the volume is detached, and
// returns the exit code for os.Exit (0 after a detach). SIGTERM and
// SIGINT detach as well, unless the device is in use, in which case the
// process logs that and keeps serving. It logs to standard error.
func ServeMain() int {
	// Our standard error may be a pipe whose reader (a log collector of
	// the plugin) goes away; losing log lines beats dying of SIGPIPE.
	signal.Ignore(syscall.SIGPIPE, syscall.SIGHUP)
	unix.Umask(0o077)
	pid := os.Getpid()
	log := logging.FromEnv(os.Stderr).With("transport", string(attach.FUSE), "pid", pid)
	// The FUSE requests of the volume's page cache writeback must not
	// wait on memory reclaim that waits on them (mlockall is not
	// inherited across exec: the attaching process's guard is not ours).
	if err := relay.GuardAgainstReclaim(); err != nil {
		log.Warn("fuse: not fully guarded against memory reclaim", "error", err)
	}

	ready, lockf, err := serveFiles()
	if err != nil {
		log.Error("fuse: this process was not started by an Attacher", "error", err)
		return 2
	}
	defer runtime.KeepAlive(lockf) // its lock must last as long as we do
	_, start, err := attach.ProcStat(pid)
	if err != nil {
		log.Warn("fuse: own start time", "error", err)
	}
	// report tells the attaching process how far we got; a successor
	// reports twice (ready, serving), the others once.
	report := func(m readyMsg) {
		m.Pid, m.StartTime = pid, start
		if err := json.NewEncoder(ready).Encode(m); err != nil {
			log.Warn("fuse: reporting to the attaching process", "error", err)
		}
	}
	defer ready.Close()

	var sp serveSpec
	dec := json.NewDecoder(os.Stdin)
	if err := dec.Decode(&sp); err != nil {
		err = fmt.Errorf("%w: fuse: reading the attach request: %v", attach.ErrInvalid, err)
		log.Error("fuse: server", "error", err)
		report(readyMsg{Error: attach.EncodeError(err)})
		return 2
	}
	log = log.With("volume_id", sp.Target.VolumeID)
	if sp.Handoff != nil {
		return serveSuccessor(sp, dec, report, ready, lockf, pid, start, log)
	}
	os.Stdin.Close()

	s, err := startServer(sp, lockf, pid, start, log)
	if err != nil {
		log.Error("fuse: attach failed", "error", err)
		report(readyMsg{Error: attach.EncodeError(err)})
		return 1
	}
	att := s.attachment()
	report(readyMsg{Attachment: &att})
	ready.Close()
	return s.run()
}

// serveFiles returns the descriptors an Attacher passes: 3, where the
// attach's outcome goes, and 4, the volume's lock file, locked.
func serveFiles() (ready, lock *os.File, err error) {
	for _, fd := range []int{3, 4} {
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); err != nil {
			return nil, nil, fmt.Errorf("descriptor %d: %w", fd, err)
		}
		unix.CloseOnExec(fd)
	}
	return os.NewFile(3, "ready"), os.NewFile(4, "lock"), nil
}

// volumeServer serves one volume and its control socket.
type volumeServer struct {
	cfg   Config
	log   *slog.Logger
	lock  *os.File
	v     *volume
	sock  string
	state string
	pid   int
	start uint64
	ln    *net.UnixListener
	opts  attach.Options

	mu       sync.Mutex // serializes resize and detach
	attMu    sync.Mutex // guards v.att, which resize changes
	detached atomic.Bool
	exit     chan struct{}
	exitOnce sync.Once
}

func startServer(sp serveSpec, lockf *os.File, pid int, start uint64, log *slog.Logger) (*volumeServer, error) {
	t := sp.Target
	if t.VolumeID == "" || len(t.Addrs) == 0 || sp.StateDir == "" {
		return nil, fmt.Errorf("%w: fuse: incomplete attach request (volume %q, %d addresses, state directory %q)", attach.ErrInvalid, t.VolumeID, len(t.Addrs), sp.StateDir)
	}
	// The lock comes from the Attacher, taken; this only checks that.
	if err := unix.Flock(int(lockf.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		return nil, fmt.Errorf("fuse: volume %s: the lock handed over is not held: %w", t.VolumeID, err)
	}
	if sp.Deadline.IsZero() {
		sp.Deadline = time.Now().Add(startTimeout)
	}
	s := newVolumeServer(sp, lockf, pid, start, log)
	cfg := s.cfg
	st := serverState{VolumeID: t.VolumeID, Pid: pid, StartTime: start, Socket: s.sock, StartDeadline: sp.Deadline}
	if err := writeState(s.state, st); err != nil {
		return nil, fmt.Errorf("fuse: state file: %w", err)
	}
	ctx, cancel := context.WithDeadline(context.Background(), sp.Deadline)
	defer cancel()
	dir, file := volumePaths(sp.StateDir, t.VolumeID)
	v, err := startVolume(ctx, cfg, t, sp.Options, dir, file, log)
	if err != nil {
		os.Remove(s.state)
		return nil, err
	}
	s.v = v
	fail := func(err error) (*volumeServer, error) {
		if terr := teardown(v, cfg.UnmountTimeout, log); terr != nil {
			log.Error("fuse: cleaning up after a failed attach", "error", terr)
		}
		if !v.closed {
			// Nothing was acknowledged to anyone who waits for it: no
			// retry will come for the session.
			v.path.Close(cfg.UnmountTimeout)
			v.closed = true
		}
		os.Remove(s.state)
		return nil, err
	}
	if err := s.publish(); err != nil {
		return fail(err)
	}
	log.Info("fuse: serving", "socket", s.sock)
	return s, nil
}

func newVolumeServer(sp serveSpec, lockf *os.File, pid int, start uint64, log *slog.Logger) *volumeServer {
	cfg := Config{
		StateDir:       sp.StateDir,
		Logger:         log,
		MaxWrite:       sp.MaxWrite,
		MaxBackground:  sp.MaxBackground,
		UnmountTimeout: sp.UnmountTimeout,
		bufferedLoop:   sp.BufferedLoop,
		cachedFile:     sp.CachedFile,
		syncDIO:        sp.SyncDIO,
	}.withDefaults()
	return &volumeServer{
		cfg:   cfg,
		log:   log,
		lock:  lockf,
		sock:  sockPathIn(sp.StateDir, sp.Target.VolumeID),
		state: statePathIn(sp.StateDir, sp.Target.VolumeID),
		pid:   pid,
		start: start,
		opts:  sp.Options,
		exit:  make(chan struct{}),
	}
}

// publish listens on the control socket and says so in the state file:
// from then on Attachers find the server.
func (s *volumeServer) publish() error {
	ln, err := listenControl(s.sock)
	if err != nil {
		return fmt.Errorf("fuse: control socket: %w", err)
	}
	st := serverState{VolumeID: s.v.target.VolumeID, Pid: s.pid, StartTime: s.start, Socket: s.sock, Ready: true, Device: s.v.att.Device}
	if err := writeState(s.state, st); err != nil {
		ln.Close()
		os.Remove(s.sock)
		return fmt.Errorf("fuse: state file: %w", err)
	}
	s.ln = ln
	return nil
}

func (s *volumeServer) attachment() attach.Attachment {
	s.attMu.Lock()
	defer s.attMu.Unlock()
	return s.v.att
}

// run serves the control socket until the volume is detached.
func (s *volumeServer) run() int {
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	go s.accept()
	for {
		select {
		case <-s.exit:
			s.log.Info("fuse: server exits")
			return 0
		case sig := <-sigs:
			s.log.Info("fuse: detaching on a signal", "signal", sig.String())
			if err := s.detach(s.cfg.UnmountTimeout); err != nil {
				s.log.Error("fuse: detach failed; still serving", "error", err)
				continue
			}
			s.log.Info("fuse: server exits")
			return 0
		}
	}
}

func (s *volumeServer) accept() {
	for {
		c, err := s.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			s.log.Warn("fuse: control socket", "error", err)
			time.Sleep(100 * time.Millisecond)
			continue
		}
		go s.handle(c)
	}
}

func (s *volumeServer) handle(c net.Conn) {
	defer c.Close()
	if err := checkPeer(c); err != nil {
		s.log.Warn("fuse: control connection refused", "error", err)
		return
	}
	c.SetReadDeadline(time.Now().Add(ctlTimeout))
	var req ctlRequest
	dec := json.NewDecoder(c)
	if err := dec.Decode(&req); err != nil {
		s.log.Debug("fuse: control request", "error", err)
		return
	}
	if req.Op == opHandoff {
		s.handoff(c.(*net.UnixConn), dec)
		return
	}
	resp := s.do(req)
	c.SetWriteDeadline(time.Now().Add(ctlTimeout))
	if err := json.NewEncoder(c).Encode(resp); err != nil {
		s.log.Debug("fuse: control response", "op", req.Op, "error", err)
	}
	if req.Op == opDetach && resp.Error == nil {
		s.exitOnce.Do(func() { close(s.exit) })
	}
}

func (s *volumeServer) do(req ctlRequest) *ctlResponse {
	resp := &ctlResponse{Pid: s.pid, StartTime: s.start}
	if s.detached.Load() && req.Op != opDetach {
		resp.Error = attach.EncodeError(fmt.Errorf("%w: %s (detaching)", attach.ErrNotAttached, s.v.target.VolumeID))
		return resp
	}
	switch req.Op {
	case opStatus:
		att := s.attachment()
		resp.Attachment = &att
	case opHealth:
		h := s.v.health()
		resp.Health = &h
	case opResize:
		size, err := s.resize(req.Size)
		resp.Size, resp.Error = size, attach.EncodeError(err)
	case opDetach:
		resp.Error = attach.EncodeError(s.detach(req.UnmountTimeout))
	default:
		resp.Error = attach.EncodeError(fmt.Errorf("%w: fuse: unknown control operation %q", attach.ErrInvalid, req.Op))
	}
	return resp
}

func (s *volumeServer) resize(newSize uint64) (uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	got, err := s.v.resize(ctx, s.cfg, newSize)
	if err != nil {
		return 0, err
	}
	s.attMu.Lock()
	s.v.att.Size = got
	s.attMu.Unlock()
	s.log.Info("fuse: resized", "size", got)
	return got, nil
}

// detach tears the volume down; the process exits after a success.
func (s *volumeServer) detach(timeout time.Duration) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.detached.Load() {
		return nil
	}
	if timeout <= 0 {
		timeout = s.cfg.UnmountTimeout
	}
	if err := teardown(s.v, timeout, s.log); err != nil {
		return err
	}
	s.detached.Store(true)
	s.ln.Close()
	for _, p := range []string{s.sock, s.state} {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			s.log.Warn("fuse: removing a file of the server", "path", p, "error", err)
		}
	}
	s.log.Info("fuse: detached", "device", s.v.att.Device)
	return nil
}
