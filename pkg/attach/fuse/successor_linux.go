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
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

// successorFd is the descriptor a successor gets the FUSE connection on;
// predecessorFd the predecessor server's pidfd, if it sent one.
const (
	successorFd   = 5
	predecessorFd = 6
)

// serveSuccessor is ServeMain of a successor: it prepares to serve the
// connection it was handed, reports that it is ready, and serves once
// told to start on standard input and once the predecessor server has
// exited (its pidfd says so): a predecessor still running serves the
// volume (it resumed when the process that handed it off went away), and
// two readers of one FUSE connection would split its requests. Told
// nothing, or the predecessor still running, by the spec's deadline, it
// exits without touching the volume, which the predecessor serves.
func serveSuccessor(sp serveSpec, dec *json.Decoder, report func(readyMsg), ready, lockf *os.File, pid int, start uint64, log *slog.Logger) int {
	if _, err := unix.FcntlInt(successorFd, unix.F_GETFD, 0); err != nil {
		err = fmt.Errorf("%w: fuse: no FUSE connection on descriptor %d: %v", attach.ErrInvalid, successorFd, err)
		report(readyMsg{Error: attach.EncodeError(err)})
		return 2
	}
	unix.CloseOnExec(successorFd)
	var pred *os.File
	if _, err := unix.FcntlInt(predecessorFd, unix.F_GETFD, 0); err == nil {
		unix.CloseOnExec(predecessorFd)
		pred = os.NewFile(predecessorFd, "predecessor pidfd")
		defer pred.Close()
	}
	// Passing the descriptor made the open file blocking; the readers
	// need it non-blocking, in the poller, so that a later handoff can
	// stop them.
	if err := unix.SetNonblock(successorFd, true); err != nil {
		report(readyMsg{Error: attach.EncodeError(err)})
		return 2
	}
	dev := os.NewFile(successorFd, "/dev/fuse")
	s, err := takeOver(sp, lockf, dev, pid, start, log)
	if err != nil {
		log.Error("fuse: taking the handoff failed", "error", err)
		report(readyMsg{Error: attach.EncodeError(err)})
		return 1
	}
	att := s.attachment()
	report(readyMsg{Attachment: &att})

	startc := make(chan error, 1)
	go func() {
		var m startMsg
		err := dec.Decode(&m)
		if err == nil && !m.Start {
			err = fmt.Errorf("not told to start")
		}
		startc <- err
	}()
	wait := time.Until(sp.Deadline)
	select {
	case err = <-startc:
	case <-time.After(wait):
		err = fmt.Errorf("not started within %v", wait.Round(time.Second))
	}
	if err == nil && pred != nil && !attach.PidfdExitedBy(pred, sp.Deadline) {
		err = fmt.Errorf("the predecessor server (pid %d) still runs at the deadline: it serves the volume", sp.Handoff.State.Pid)
	}
	if err != nil {
		// The predecessor still serves the volume: leave it all alone.
		log.Info("fuse: the handoff was called off", "error", err)
		s.v.path.Close(s.cfg.UnmountTimeout)
		return 1
	}
	os.Stdin.Close()
	s.v.server.start()
	if err := s.publish(); err != nil {
		// The device is served; only the control socket is missing.
		log.Error("fuse: serving the volume, but not its control socket", "error", err)
		report(readyMsg{Error: attach.EncodeError(err)})
		ready.Close()
		return s.runUnpublished()
	}
	report(readyMsg{Attachment: &att})
	ready.Close()
	log.Info("fuse: serving the volume handed off", "socket", s.sock, "predecessor", sp.Handoff.State.Pid)
	return s.run()
}

// takeOver builds the volume a successor serves from the handoff, with
// a new connection of the predecessor's NBD session; it reads nothing
// from the kernel yet.
func takeOver(sp serveSpec, lockf, dev *os.File, pid int, start uint64, log *slog.Logger) (*volumeServer, error) {
	t := sp.Target
	if t.VolumeID == "" || len(t.Addrs) == 0 || sp.StateDir == "" {
		return nil, fmt.Errorf("%w: fuse: incomplete handoff (volume %q, %d addresses, state directory %q)", attach.ErrInvalid, t.VolumeID, len(t.Addrs), sp.StateDir)
	}
	// The lock file is the predecessor's open file: its lock is ours.
	if err := unix.Flock(int(lockf.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		return nil, fmt.Errorf("fuse: volume %s: the lock handed over is not held: %w", t.VolumeID, err)
	}
	s := newVolumeServer(sp, lockf, pid, start, log)
	ctx, cancel := context.WithDeadline(context.Background(), sp.Deadline)
	defer cancel()
	v, err := volumeFromHandoff(ctx, s.cfg, t, sp.Options, sp.Handoff, dev, log)
	if err != nil {
		return nil, err
	}
	s.v = v
	return s, nil
}

// volumeFromHandoff dials the export on the handoff's NBD session and
// builds the volume around the FUSE connection dev, not served yet.
func volumeFromHandoff(ctx context.Context, cfg Config, t attach.Target, o attach.Options, h *successorSpec, dev *os.File, log *slog.Logger) (*volume, error) {
	hs := h.State
	dp, err := attach.OpenSession(ctx, attach.SessionConfig{ID: hs.Session, Logger: log}, t, o)
	if err != nil {
		return nil, dialError(t, err)
	}
	node := &exportFile{
		bio:       dp.Client,
		readOnly:  hs.ReadOnly,
		canZero:   hs.CanZero,
		openFlags: hs.OpenFlags,
		mtime:     hs.MTime,
		log:       log,
	}
	node.size.Store(hs.Size)
	dir, file := volumePaths(cfg.StateDir, t.VolumeID)
	srv, err := newFuseServer(dev, hs.Init, node, filepath.Base(file), cfg.readers(), log)
	if err != nil {
		dp.Close(cfg.UnmountTimeout)
		return nil, err
	}
	att := h.Attachment
	att.MPTCP = dp.Multipath
	return &volume{
		target: t,
		opts:   o,
		dir:    dir,
		file:   file,
		path:   dp,
		node:   node,
		att:    att,
		server: srv,
		conn:   hs.Conn,
		dev:    hs.Device,
	}, nil
}

// runUnpublished serves a volume nobody can reach through the socket
// until the kernel ends the connection.
func (s *volumeServer) runUnpublished() int {
	<-s.v.server.done()
	return 1
}
