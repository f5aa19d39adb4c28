package fuse

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/fdpass"
)

// handOffInProcess is HandOff of a volume this process serves
// (Config.InProcess). Such a volume holds no lock file once attached;
// the handoff takes it, so that the successor holds it as one of its
// own. The caller holds the volume's lock.
func (a *Attacher) handOffInProcess(v *volume) (*attach.Handoff, error) {
	id := v.target.VolumeID
	log := a.cfg.Logger.With("volume_id", id, "transport", string(attach.FUSE))
	lf, err := lockFile(a.lockPath(id))
	if err != nil || lf == nil {
		return nil, fmt.Errorf("fuse: handoff of volume %s: its lock is held elsewhere (%v)", id, err)
	}
	st, err := v.quiesce(handoffFlushTimeout)
	if err != nil {
		lf.Close()
		return nil, err
	}
	fd, err := fdpass.RawFd(v.server.dev)
	if err == nil {
		fd, err = unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	}
	var state []byte
	if err == nil {
		st.StateDir = a.stateDir()
		state, err = json.Marshal(st)
		if err != nil {
			unix.Close(fd)
		}
	}
	if err != nil {
		lf.Close()
		v.resume()
		return nil, fmt.Errorf("fuse: handoff of volume %s: %w", id, err)
	}
	h := &attach.Handoff{
		VolumeID:   id,
		Transport:  attach.FUSE,
		Target:     v.target,
		Options:    v.opts,
		Attachment: v.att,
		State:      state,
		Files:      []*os.File{os.NewFile(uintptr(fd), "/dev/fuse"), lf},
	}
	var once sync.Once
	h.Resume = func() error {
		err := errors.New("handoff already ended")
		once.Do(func() {
			unlock := a.lock(id)
			defer unlock()
			fdpass.Close(h.Files)
			v.resume()
			err = nil
			log.Info("fuse: serving the volume again")
		})
		return err
	}
	h.Release = func() {
		once.Do(func() {
			unlock := a.lock(id)
			defer unlock()
			fdpass.Close(h.Files)
			// Everything is flushed; the mount and the loop device stay.
			v.path.Close(a.cfg.UnmountTimeout)
			v.closed = true
			v.server.dev.Close()
			a.mu.Lock()
			delete(a.vols, id)
			a.mu.Unlock()
			log.Info("fuse: handed the volume off")
		})
	}
	log.Info("fuse: quiesced the volume for a handoff")
	return h, nil
}

// takeInProcess is TakeHandoff for an InProcess Attacher: the volume is
// served from this process once started, and holds no lock file then,
// as one it attached itself.
func (a *Attacher) takeInProcess(ctx context.Context, h *attach.Handoff, st handoffState, files []*os.File, log *slog.Logger) (*attach.Attachment, error) {
	id := h.VolumeID
	if err := unix.Flock(int(files[fileLock].Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		return nil, fmt.Errorf("fuse: volume %s: the lock handed over is not held: %w", id, err)
	}
	fd, err := fdpass.RawFd(files[fileFUSE])
	if err == nil {
		fd, err = unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	}
	if err != nil {
		return nil, err
	}
	// Non-blocking, for the runtime's poller: or a stop would wait for
	// the next request.
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("fuse: volume %s: /dev/fuse: %w", id, err)
	}
	dev := os.NewFile(uintptr(fd), "/dev/fuse")
	cfg := a.cfg
	cfg.StateDir = a.stateDir()
	v, err := volumeFromHandoff(ctx, cfg, h.Target, h.Options, &successorSpec{State: st, Attachment: h.Attachment}, dev, log)
	if err != nil {
		dev.Close()
		return nil, err
	}
	// The lock stays taken (by this process's copy) until the volume is
	// ours: Start.
	lf, err := dupFile(files[fileLock])
	if err != nil {
		v.path.Close(a.cfg.UnmountTimeout)
		dev.Close()
		return nil, err
	}
	var once sync.Once
	h.Abort = func() {
		once.Do(func() {
			v.path.Close(a.cfg.UnmountTimeout)
			dev.Close()
			lf.Close()
		})
	}
	h.Start = func() error {
		err := errors.New("handoff already started or aborted")
		once.Do(func() {
			unlock := a.lock(id)
			defer unlock()
			v.server.start()
			// A server process that handed off leaves its socket and
			// state file to the successor; a volume served in process
			// has neither.
			for _, p := range []string{a.sockPath(id), a.statePath(id)} {
				if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
					log.Warn("fuse: removing the predecessor's file", "path", p, "error", err)
				}
			}
			a.mu.Lock()
			a.vols[id] = v
			a.mu.Unlock()
			lf.Close()
			err = nil
			log.Info("fuse: serving the volume handed off, in process", "device", v.att.Device)
		})
		return err
	}
	att := v.att
	return &att, nil
}

func dupFile(f *os.File) (*os.File, error) {
	fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), f.Name()), nil
}
