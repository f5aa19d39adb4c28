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
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

// Timeouts of the exchanges with server processes.
const (
	// ctlTimeout bounds a status or health request.
	ctlTimeout = 5 * time.Second
	// opTimeout bounds a detach or resize request when the caller's
	// context has no deadline.
	opTimeout = 2 * time.Minute
	// hungTimeout is how long a server that holds its volume's lock may
	// leave the socket unanswered before it counts as hung.
	hungTimeout = 10 * time.Second
	// exitTimeout is how long a server may take to exit once told to (or
	// killed).
	exitTimeout = 10 * time.Second
	// startTimeout bounds a server's start when Attach's context has no
	// deadline.
	startTimeout = 2 * time.Minute
)

// serverProc is a volume's server process, started by this Attacher or
// found in the state directory.
type serverProc struct {
	id    string
	sock  string
	pid   int
	start uint64 // the process's start time, /proc/PID/stat field 22
	// exited is closed once the process, a child of this one, has been
	// waited for; nil for a process another one started.
	exited <-chan struct{}
	att    attach.Attachment
}

// serverState is the state file of a server process, <StateDir>/V.json.
// It is written when the process starts and again once it is ready.
type serverState struct {
	VolumeID  string `json:"volume_id"`
	Pid       int    `json:"pid"`
	StartTime uint64 `json:"start_time"`
	Socket    string `json:"socket"`
	Ready     bool   `json:"ready"`
	Device    string `json:"device,omitempty"`
	// StartDeadline is when a server not yet ready gives up.
	StartDeadline time.Time `json:"start_deadline,omitzero"`
}

// serveSpec is what an Attacher hands its server process on standard
// input.
type serveSpec struct {
	Target         attach.Target  `json:"target"`
	Options        attach.Options `json:"options"`
	StateDir       string         `json:"state_dir"`
	MaxWrite       int            `json:"max_write"`
	MaxBackground  int            `json:"max_background"`
	UnmountTimeout time.Duration  `json:"unmount_timeout"`
	Deadline       time.Time      `json:"deadline"`
	BufferedLoop   bool           `json:"buffered_loop,omitempty"`
	CachedFile     bool           `json:"cached_file,omitempty"`
	SyncDIO        bool           `json:"sync_dio,omitempty"`
	// Handoff makes the process a predecessor's successor: it serves the
	// connection it is given (descriptor 5) once told to start.
	Handoff *successorSpec `json:"handoff,omitempty"`
}

// readyMsg is what a server process writes on descriptor 3 once it is
// ready or has given up.
type readyMsg struct {
	Pid        int                `json:"pid"`
	StartTime  uint64             `json:"start_time"`
	Attachment *attach.Attachment `json:"attachment,omitempty"`
	Error      *attach.WireError  `json:"error,omitempty"`
}

// The files of volume V next to its mount point: V.lock, V.json, V.sock.

func lockPathIn(stateDir, volumeID string) string {
	return filepath.Join(stateDir, volumeName(volumeID)+".lock")
}

func statePathIn(stateDir, volumeID string) string {
	return filepath.Join(stateDir, volumeName(volumeID)+".json")
}

// maxSockPath is the room in sockaddr_un for a socket's path.
const maxSockPath = 107

// sockPathIn is the control socket's path; where <StateDir>/V.sock is too
// long for a socket address, a shorter hidden name stands in.
func sockPathIn(stateDir, volumeID string) string {
	p := filepath.Join(stateDir, volumeName(volumeID)+".sock")
	if len(p) <= maxSockPath {
		return p
	}
	sum := sha256.Sum256([]byte(volumeID))
	return filepath.Join(stateDir, "."+hex.EncodeToString(sum[:8])+".sock")
}

func (a *Attacher) lockPath(id string) string  { return lockPathIn(a.stateDir(), id) }
func (a *Attacher) statePath(id string) string { return statePathIn(a.stateDir(), id) }
func (a *Attacher) sockPath(id string) string  { return sockPathIn(a.stateDir(), id) }

// lockFile takes the lock file at path without waiting. It returns a nil
// file, and no error, when another open file holds the lock: a live
// server process (or an attach in progress) has the volume.
func lockFile(path string) (*os.File, error) {
	for {
		f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
		if err != nil {
			return nil, err
		}
		if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
			f.Close()
			if errors.Is(err, unix.EWOULDBLOCK) {
				return nil, nil
			}
			return nil, err
		}
		// A detach removes the file under the lock; one opened before
		// that locks nothing anymore.
		var held, now unix.Stat_t
		if unix.Fstat(int(f.Fd()), &held) == nil && unix.Stat(path, &now) == nil &&
			held.Dev == now.Dev && held.Ino == now.Ino {
			return f, nil
		}
		f.Close()
	}
}

// dropLock removes the volume's lock file, held in lf, and lets go of it.
func (a *Attacher) dropLock(id string, lf *os.File) {
	if err := os.Remove(a.lockPath(id)); err != nil && !errors.Is(err, os.ErrNotExist) {
		a.cfg.Logger.Warn("fuse: removing a lock file", "volume_id", id, "error", err)
	}
	lf.Close()
}

func readState(path string) (*serverState, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var st serverState
	if err := json.Unmarshal(b, &st); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &st, nil
}

func writeState(path string, st serverState) error {
	b, err := json.Marshal(st)
	if err != nil {
		return err
	}
	return attach.WriteFileAtomic(path, b)
}

func (a *Attacher) setServer(id string, p *serverProc) {
	a.mu.Lock()
	a.servers[id] = p
	a.mu.Unlock()
}

func (a *Attacher) forgetServer(id string) {
	a.mu.Lock()
	delete(a.servers, id)
	a.mu.Unlock()
}

// procFromState returns the server process a state file describes.
func (a *Attacher) procFromState(st *serverState) *serverProc {
	p := &serverProc{id: st.VolumeID, sock: st.Socket, pid: st.Pid, start: st.StartTime}
	if p.sock == "" {
		p.sock = a.sockPath(st.VolumeID)
	}
	a.mu.Lock()
	if q := a.servers[st.VolumeID]; q != nil && q.pid == p.pid && q.start == p.start {
		p.exited = q.exited
	}
	a.mu.Unlock()
	return p
}

// findServer returns the server process the volume's state file
// describes, if it is ready; nil if there is none.
func (a *Attacher) findServer(id string) *serverProc {
	st, err := readState(a.statePath(id))
	if err != nil || !st.Ready || st.VolumeID != id {
		return nil
	}
	p := a.procFromState(st)
	p.att = attach.Attachment{VolumeID: id, Transport: attach.FUSE, Device: st.Device}
	a.mu.Lock()
	if q := a.servers[id]; q != nil && q.pid == p.pid {
		p.att = q.att
	}
	a.mu.Unlock()
	return p
}

// call sends a request to the server; see callServer.
func (p *serverProc) call(ctx context.Context, req ctlRequest, timeout time.Duration) (*ctlResponse, error) {
	resp, err := callServer(ctx, p.sock, req, timeout)
	if err != nil {
		return nil, err
	}
	if resp.Pid != p.pid {
		return nil, fmt.Errorf("%s is answered by pid %d, not %d", p.sock, resp.Pid, p.pid)
	}
	return resp, nil
}

// refresh asks the server for its attachment.
func (p *serverProc) refresh(ctx context.Context) error {
	resp, err := p.call(ctx, ctlRequest{Op: opStatus}, ctlTimeout)
	if err != nil {
		return err
	}
	if resp.Error != nil {
		return resp.Error.Err()
	}
	if resp.Attachment == nil || resp.Attachment.VolumeID != p.id {
		return fmt.Errorf("%s: status without the attachment of volume %s", p.sock, p.id)
	}
	p.att = *resp.Attachment
	if p.start == 0 {
		p.start = resp.StartTime
	}
	return nil
}

// claim finds the volume's server process, waiting for one that is
// starting up. If there is none it takes the volume's lock and removes
// what an earlier attach left behind: exactly one of the results is
// non-nil on success. A server that holds the lock but does not answer
// is an error, or, with kill, is killed and cleaned up after.
func (a *Attacher) claim(ctx context.Context, id string, kill bool, log *slog.Logger) (*serverProc, *os.File, error) {
	var (
		waitUntil time.Time
		killed    bool
	)
	for {
		lf, err := lockFile(a.lockPath(id))
		if err != nil {
			return nil, nil, fmt.Errorf("fuse: lock volume %s: %w", id, err)
		}
		if lf != nil {
			if err := a.cleanupStale(id, log); err != nil {
				lf.Close()
				return nil, nil, fmt.Errorf("fuse: stale attachment of volume %s: %w", id, err)
			}
			return nil, lf, nil
		}
		st, _ := readState(a.statePath(id))
		if st != nil && st.VolumeID != id {
			return nil, nil, fmt.Errorf("%w: %s describes volume %s, not %s", attach.ErrWrongVolume, a.statePath(id), st.VolumeID, id)
		}
		if st != nil && st.Ready {
			p := a.procFromState(st)
			err := p.refresh(ctx)
			if err == nil {
				return p, nil, nil
			}
			if ctx.Err() != nil {
				return nil, nil, fmt.Errorf("fuse: volume %s: asking its server process: %w", id, err)
			}
		}
		now := time.Now()
		if waitUntil.IsZero() {
			waitUntil = now.Add(hungTimeout)
			if st != nil && !st.Ready && st.StartDeadline.After(now) {
				waitUntil = st.StartDeadline.Add(exitTimeout)
			}
		}
		if now.After(waitUntil) {
			if !kill || st == nil || killed {
				return nil, nil, fmt.Errorf("fuse: volume %s: its server process holds %s but does not answer on %s", id, a.lockPath(id), a.sockPath(id))
			}
			log.Warn("fuse: killing the volume's server process, which does not answer", "pid", st.Pid)
			if err := killProc(st.Pid, st.StartTime); err != nil {
				return nil, nil, fmt.Errorf("fuse: volume %s: kill its server process %d: %w", id, st.Pid, err)
			}
			killed = true
			waitUntil = now.Add(exitTimeout)
		}
		select {
		case <-ctx.Done():
			return nil, nil, fmt.Errorf("fuse: volume %s: waiting for its server process: %w", id, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// cleanupStale removes what a dead server left of the volume. The caller holds the volume's lock.
func (a *Attacher) cleanupStale(id string, log *slog.Logger) error {
	for _, p := range []string{a.sockPath(id), a.statePath(id), a.statePath(id) + ".tmp"} {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
	}
	dir, file := a.paths(id)
	return cleanup(dir, file, log)
}

// scrub cleans up after a server process that failed to start, once it
// has let go of the volume's lock.
func (a *Attacher) scrub(id string, log *slog.Logger) {
	deadline := time.Now().Add(exitTimeout)
	for {
		lf, err := lockFile(a.lockPath(id))
		if err != nil {
			log.Error("fuse: cleaning up after a failed attach", "error", err)
			return
		}
		if lf != nil {
			if err := a.cleanupStale(id, log); err != nil {
				log.Error("fuse: cleaning up after a failed attach", "error", err)
			}
			a.dropLock(id, lf)
			return
		}
		if time.Now().After(deadline) {
			log.Error("fuse: cleaning up after a failed attach: the volume is still locked", "lock", a.lockPath(id))
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// detachServer detaches a volume this Attacher does not serve itself:
// through its server process if it has a live one, else by cleaning up
// what is left.
func (a *Attacher) detachServer(ctx context.Context, id string, log *slog.Logger) error {
	if _, err := os.Stat(a.cfg.StateDir); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	for attempt := 0; ; attempt++ {
		p, lf, err := a.claim(ctx, id, true, log)
		if err != nil {
			return err
		}
		if lf != nil {
			a.dropLock(id, lf)
			a.forgetServer(id)
			return nil
		}
		octx, cancel := opContext(ctx)
		resp, err := p.call(octx, ctlRequest{Op: opDetach, UnmountTimeout: a.cfg.UnmountTimeout}, 0)
		cancel()
		if err != nil {
			if attempt == 0 && !attach.ProcAlive(p.pid, p.start) {
				continue // it died meanwhile: clean up after it
			}
			return fmt.Errorf("fuse: detach volume %s: %w", id, err)
		}
		if resp.Error != nil {
			return fmt.Errorf("fuse: detach volume %s: %w", id, resp.Error.Err())
		}
		if err := a.awaitExit(ctx, p, log); err != nil {
			return fmt.Errorf("fuse: detach volume %s: %w", id, err)
		}
		log.Info("fuse: detached", "device", p.att.Device, "pid", p.pid)
		return nil
	}
}

// awaitExit waits for a server that detached its volume to exit, then
// removes the volume's lock file.
func (a *Attacher) awaitExit(ctx context.Context, p *serverProc, log *slog.Logger) error {
	deadline := time.Now().Add(exitTimeout)
	killed := false
	for {
		lf, err := lockFile(a.lockPath(p.id))
		if err != nil {
			return err
		}
		if lf != nil {
			err := a.cleanupStale(p.id, log)
			a.dropLock(p.id, lf)
			if p.exited != nil {
				select {
				case <-p.exited:
				case <-time.After(exitTimeout):
				}
			}
			a.forgetServer(p.id)
			return err
		}
		if time.Now().After(deadline) {
			if killed {
				return fmt.Errorf("server process %d does not exit", p.pid)
			}
			log.Warn("fuse: the server process does not exit after the detach; killing it", "pid", p.pid)
			if err := killProc(p.pid, p.start); err != nil {
				log.Error("fuse: killing the server process", "pid", p.pid, "error", err)
			}
			killed = true
			deadline = time.Now().Add(exitTimeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// opContext bounds a long request when ctx does not.
func opContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, opTimeout)
}

// serverHealth is Health of a volume served by a server process.
func (a *Attacher) serverHealth(id string) (attach.Health, error) {
	p := a.findServer(id)
	if p == nil {
		return attach.Health{}, fmt.Errorf("%w: %s", attach.ErrNotAttached, id)
	}
	resp, err := p.call(context.Background(), ctlRequest{Op: opHealth}, ctlTimeout)
	if err != nil {
		h := attach.Health{MPTCP: p.att.MPTCP}
		if attach.ProcAlive(p.pid, p.start) {
			h.Message = fmt.Sprintf("the FUSE server process (pid %d) does not answer: %v", p.pid, err)
		} else {
			h.Message = fmt.Sprintf("the FUSE server process (pid %d) is gone: I/O to %s fails until the volume is detached and attached again", p.pid, p.att.Device)
		}
		return h, nil
	}
	if resp.Error != nil {
		return attach.Health{}, resp.Error.Err()
	}
	if resp.Health == nil {
		return attach.Health{}, fmt.Errorf("fuse: volume %s: health without an answer", id)
	}
	return *resp.Health, nil
}

// serverResize is Resize of a volume served by a server process.
func (a *Attacher) serverResize(ctx context.Context, id string, newSize uint64) (uint64, error) {
	p := a.findServer(id)
	if p == nil {
		return 0, fmt.Errorf("%w: %s", attach.ErrNotAttached, id)
	}
	octx, cancel := opContext(ctx)
	defer cancel()
	resp, err := p.call(octx, ctlRequest{Op: opResize, Size: newSize}, 0)
	if err != nil {
		return 0, fmt.Errorf("fuse: resize volume %s: %w", id, err)
	}
	if resp.Error != nil {
		return 0, resp.Error.Err()
	}
	a.mu.Lock()
	if q := a.servers[id]; q != nil && q.pid == p.pid {
		q.att.Size = resp.Size
	}
	a.mu.Unlock()
	return resp.Size, nil
}

// Adopt finds the server processes in the state directory, for a process
// that starts while volumes are attached, and returns their attachments,
// sorted by volume ID. Attach, Health, Resize and Detach find them by
// themselves; Adopt lists them. Volumes whose server is gone are not
// listed: their next Attach or Detach cleans up after it.
func (a *Attacher) Adopt(ctx context.Context) ([]*attach.Attachment, error) {
	entries, err := os.ReadDir(a.stateDir())
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("fuse: state directory: %w", err)
	}
	var out []*attach.Attachment
	for _, e := range entries {
		if !strings.HasSuffix(e.Name(), ".json") || !e.Type().IsRegular() {
			continue
		}
		st, err := readState(filepath.Join(a.stateDir(), e.Name()))
		if err != nil || !st.Ready || volumeName(st.VolumeID)+".json" != e.Name() {
			continue
		}
		unlock := a.lock(st.VolumeID)
		p := a.procFromState(st)
		if err := p.refresh(ctx); err == nil {
			a.setServer(st.VolumeID, p)
			att := p.att
			out = append(out, &att)
		} else {
			a.cfg.Logger.Warn("fuse: a volume's server process does not answer", "volume_id", st.VolumeID, "pid", st.Pid, "error", err)
		}
		unlock()
	}
	sort.Slice(out, func(i, j int) bool { return out[i].VolumeID < out[j].VolumeID })
	return out, nil
}

// killProc sends SIGKILL to process pid if it is the one that started at
// start (any, if start is 0). A process that is gone is no error.
func killProc(pid int, start uint64) error {
	if pid <= 0 {
		return nil
	}
	fd, err := unix.PidfdOpen(pid, 0)
	if errors.Is(err, unix.ESRCH) {
		return nil
	}
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	// The descriptor pins the process: checked now, it cannot be another
	// one by the time the signal goes.
	if !attach.ProcAlive(pid, start) {
		return nil
	}
	if err := unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0); err != nil && !errors.Is(err, unix.ESRCH) {
		return err
	}
	return nil
}
