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
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/fdpass"
	"github.com/mpnbd/mpnbd/pkg/logging"
	"github.com/mpnbd/mpnbd/pkg/relay"
)

// serveFd is the descriptor of the supervisor's socket in a volume
// process.
const serveFd = 3

// specTimeout bounds the wait for the spec at a volume process's start.
const specTimeout = 30 * time.Second

// ServeMain is the main of a volume process (see ServeRequested): it reads
// the volume from the supervisor's socket, serves it, and answers the
// supervisor's requests until one ends it or the supervisor goes away.
// It returns the process's exit code.
func ServeMain() int {
	return serveVolumeMain(func(sp serveSpec, log *slog.Logger) (engine, *attach.Attachment, error) {
		// The queues must not wait on memory reclaim that waits on them.
		if err := relay.GuardAgainstReclaim(); err != nil {
			log.Warn("ublk: not fully guarded against memory reclaim", "error", err)
		}
		a, err := New(Config{StateDir: sp.StateDir, Queues: sp.Queues, Depth: sp.Depth, Logger: log})
		if err != nil {
			return nil, nil, err
		}
		ctx, cancel := context.WithDeadline(context.Background(), sp.Deadline)
		defer cancel()
		att, err := a.serveVolume(ctx, sp)
		if err != nil {
			a.Close()
			return nil, nil, err
		}
		return a, att, nil
	})
}

// engine serves a volume process's volume: an *Attacher.
type engine interface {
	Health(volumeID string) (attach.Health, error)
	Resize(ctx context.Context, volumeID string, newSize uint64) (uint64, error)
	HandOff(ctx context.Context, volumeID string) (*attach.Handoff, error)
	Detach(ctx context.Context, volumeID string) error
	releaseVolume(volumeID string)
	Close()
}

// serveVolumeMain is ServeMain with the volume started by start.
func serveVolumeMain(start func(serveSpec, *slog.Logger) (engine, *attach.Attachment, error)) int {
	// Our standard error may be a pipe whose reader goes away; losing
	// log lines beats dying of SIGPIPE.
	signal.Ignore(syscall.SIGPIPE, syscall.SIGHUP)
	pid := os.Getpid()
	// The engine adds the transport and the volume to what it logs.
	base := logging.FromEnv(os.Stderr).With("pid", pid)
	log := base.With("transport", string(attach.Ublk))
	c, err := serveConn()
	if err != nil {
		log.Error("ublk: this process was not started by a supervisor", "error", err)
		return 2
	}
	defer c.Close()
	var sp serveSpec
	if _, err := fdpass.RecvJSON(c, &sp, 0, time.Now().Add(specTimeout)); err != nil {
		log.Error("ublk: reading the volume to serve", "error", err)
		return 2
	}
	// From here on the socket waits as long as the supervisor lives.
	c.SetReadDeadline(time.Time{})
	log = log.With("volume_id", sp.Target.VolumeID)
	report := func(m readyMsg) error {
		m.Pid = pid
		return fdpass.SendJSON(c, m, nil, time.Now().Add(ctlTimeout))
	}
	e, att, err := start(sp, base)
	if err != nil {
		log.Error("ublk: the volume is not served", "mode", sp.Mode, "error", err)
		// Not heard, this error reaches the supervisor as our exit.
		_ = report(readyMsg{Error: attach.EncodeError(err)})
		return 1
	}
	defer e.Close()
	if err := report(readyMsg{Attachment: att}); err != nil {
		log.Error("ublk: the supervisor does not hear that the volume is served; leaving it", "error", err)
		e.releaseVolume(sp.Target.VolumeID)
		return 1
	}
	vs := &volumeServer{e: e, id: sp.Target.VolumeID, c: c, log: log, exit: make(chan int, 1)}
	return vs.run()
}

// serveConn is the supervisor's socket, descriptor 3.
func serveConn() (*net.UnixConn, error) {
	if _, err := unix.FcntlInt(serveFd, unix.F_GETFD, 0); err != nil {
		return nil, fmt.Errorf("descriptor %d: %w", serveFd, err)
	}
	f := os.NewFile(serveFd, "supervisor")
	fc, err := net.FileConn(f)
	f.Close()
	if err != nil {
		return nil, fmt.Errorf("descriptor %d: %w", serveFd, err)
	}
	c, ok := fc.(*net.UnixConn)
	if !ok {
		fc.Close()
		return nil, fmt.Errorf("descriptor %d is not a unix socket", serveFd)
	}
	return c, nil
}

// volumeServer answers a supervisor's requests about the one volume of
// this process.
type volumeServer struct {
	e   engine
	id  string
	c   *net.UnixConn
	log *slog.Logger

	wmu sync.Mutex // one response written at a time
	mu  sync.Mutex
	ho  *attach.Handoff // the handoff under way, if any
	// exit ends the process with its code, after a release or detach.
	exit chan int
}

func (vs *volumeServer) run() int {
	reqs := make(chan request)
	gone := make(chan error, 1)
	go func() {
		for {
			var r request
			if _, err := fdpass.RecvJSON(vs.c, &r, 0, time.Time{}); err != nil {
				gone <- err
				return
			}
			reqs <- r
		}
	}()
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	for {
		select {
		case r := <-reqs:
			go vs.handle(r)
		case code := <-vs.exit:
			return code
		case err := <-gone:
			vs.log.Info("ublk: the supervisor is gone; leaving the device to the next process", "error", err)
			vs.e.releaseVolume(vs.id)
			return 0
		case s := <-sigs:
			vs.log.Info("ublk: leaving the device to the next process", "signal", s.String())
			vs.e.releaseVolume(vs.id)
			return 0
		}
	}
}

// handle answers one request.
func (vs *volumeServer) handle(r request) {
	resp := response{ID: r.ID}
	var err error
	exit := false
	switch r.Op {
	case opHealth:
		var h attach.Health
		if h, err = vs.e.Health(vs.id); err == nil {
			resp.Health = &h
		}
	case opResize:
		ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
		resp.Size, err = vs.e.Resize(ctx, vs.id, r.Size)
		cancel()
	case opHandoff:
		ctx, cancel := context.WithTimeout(context.Background(), teardownTimeout)
		var h *attach.Handoff
		if h, err = vs.e.HandOff(ctx, vs.id); err == nil {
			vs.mu.Lock()
			vs.ho = h
			vs.mu.Unlock()
			resp.Handoff = h
		}
		cancel()
	case opResume:
		vs.mu.Lock()
		h := vs.ho
		vs.ho = nil
		vs.mu.Unlock()
		if h != nil {
			err = h.Resume()
		}
	case opRelease:
		vs.e.releaseVolume(vs.id)
		exit = true
	case opDetach:
		ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
		err = vs.e.Detach(ctx, vs.id)
		cancel()
		exit = err == nil
	default:
		err = fmt.Errorf("%w: ublk: unknown request %q", attach.ErrInvalid, r.Op)
	}
	resp.Error = attach.EncodeError(err)
	vs.wmu.Lock()
	werr := fdpass.SendJSON(vs.c, resp, nil, time.Now().Add(ctlTimeout))
	vs.wmu.Unlock()
	if werr != nil && !errors.Is(werr, net.ErrClosed) {
		vs.log.Warn("ublk: answering the supervisor", "op", r.Op, "error", werr)
	}
	if exit {
		vs.exit <- 0
	}
}
