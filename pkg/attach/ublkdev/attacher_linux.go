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
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
	"github.com/mpnbd/mpnbd/pkg/relay"
	"github.com/mpnbd/mpnbd/pkg/ublk"
)

// teardownTimeout bounds the FLUSH and DISC of a detach when the storage
// node does not answer.
var teardownTimeout = 10 * time.Second

// Attacher is the ublk transport.
type Attacher struct {
	cfg  Config
	log  *slog.Logger
	ctrl *ublk.Control

	mu   sync.Mutex
	vols map[string]*volume
}

type volume struct {
	target attach.Target
	opts   attach.Options
	sess   *attach.Session
	dev    device
	devID  uint32
	att    attach.Attachment
	// devGone: the device was deleted by a detach whose last flush did
	// not succeed; the session stays for the next detach to flush.
	devGone bool
}

// device is what a volume needs of its ublk device: a *ublk.Device, or a
// fake in the tests, which run without ublk.
type device interface {
	BlockPath() string
	// Abandon stops serving and leaves the device to a successor.
	Abandon()
	// Delete stops and removes the device (the kernel flushes it first).
	Delete() error
}

// New opens the ublk control device; without ublk in the kernel it fails
// with attach.ErrUnsupported.
func New(cfg Config) (*Attacher, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Queues <= 0 {
		// One queue per CPU, up to 4: every queue feeds the same NBD
		// session, and each holds Depth request buffers.
		cfg.Queues = min(runtime.NumCPU(), 4)
	}
	if cfg.Depth <= 0 {
		cfg.Depth = 64
	}
	ctrl, err := ublk.OpenControl()
	if err != nil {
		if errors.Is(err, ublk.ErrUnavailable) {
			return nil, fmt.Errorf("%w: %v", attach.ErrUnsupported, err)
		}
		return nil, err
	}
	return &Attacher{cfg: cfg, log: cfg.Logger.With("transport", string(attach.Ublk)), ctrl: ctrl, vols: map[string]*volume{}}, nil
}

// Close releases the control device; devices stay (they outlive the
// process, held by the kernel until the next one takes them over).
func (a *Attacher) Close() { a.ctrl.Close() }

// Attach connects the target and serves it as a ublk device. A volume
// attached already is returned as is; one that an earlier process served
// is taken over.
func (a *Attacher) Attach(ctx context.Context, t attach.Target, o attach.Options) (*attach.Attachment, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if v, ok := a.vols[t.VolumeID]; ok {
		att := v.att
		return &att, nil
	}
	if r, ok := a.loadState(t.VolumeID); ok {
		if att, err := a.takeOver(ctx, r); err == nil || !errors.Is(err, errGone) {
			return att, err
		}
	}
	log := a.log.With("volume_id", t.VolumeID)
	sess, err := attach.OpenSession(ctx, attach.SessionConfig{Logger: log}, t, o)
	if err != nil {
		return nil, err
	}
	info := sess.Info
	dev, err := ublk.Create(ctx, a.ctrl, a.deviceConfig(info, o, log), newHandler(sess))
	if err != nil {
		sess.Close(teardownTimeout)
		return nil, fmt.Errorf("ublk device for %s: %w", t.VolumeID, err)
	}
	v := &volume{target: t, opts: o, sess: sess, dev: dev, devID: dev.ID}
	if err := a.saveState(v); err != nil {
		err = fmt.Errorf("ublk: state of %s: %w", t.VolumeID, err)
		if rerr := a.remove(ctx, v); rerr != nil {
			// The device stays, served, with no state to find it by.
			err = errors.Join(err, rerr)
		}
		return nil, err
	}
	att := a.register(v)
	log.Info("volume attached", "device", att.Device, "size", att.Size, "mptcp", att.MPTCP, "queues", a.cfg.Queues, "depth", a.cfg.Depth)
	return &att, nil
}

func (a *Attacher) deviceConfig(info nbd.ExportInfo, o attach.Options, log *slog.Logger) ublk.Config {
	shift := uint8(9)
	for bs := o.BlockSize; bs > 512; bs >>= 1 {
		shift++
	}
	return ublk.Config{
		Size:              info.Size,
		LogicalBlockShift: shift,
		Queues:            a.cfg.Queues,
		Depth:             a.cfg.Depth,
		ReadOnly:          o.ReadOnly || info.Flags&nbd.FlagReadOnly != 0,
		Discard:           info.Flags&nbd.FlagSendTrim != 0,
		WriteZeroes:       true, // written as zeroes where the server cannot
		Logger:            log,
	}
}

// register records v as attached. Called with mu held.
func (a *Attacher) register(v *volume) attach.Attachment {
	v.att = attach.Attachment{
		VolumeID:  v.target.VolumeID,
		Transport: attach.Ublk,
		Device:    v.dev.BlockPath(),
		Size:      v.sess.Info.Size,
		MPTCP:     v.sess.Multipath,
	}
	a.vols[v.target.VolumeID] = v
	return v.att
}

// errGone: the device a state file names no longer exists.
var errGone = errors.New("ublk device gone")

// takeOver serves a device an earlier process left: the kernel holds its
// I/O until a new server ends the recovery. Called with mu held.
func (a *Attacher) takeOver(ctx context.Context, r record) (*attach.Attachment, error) {
	return a.takeOverFrom(ctx, r, false)
}

// takeOverFrom is takeOver; handedOff says the server is a live
// predecessor that stopped serving the device, which the driver then
// quiesces.
func (a *Attacher) takeOverFrom(ctx context.Context, r record, handedOff bool) (*attach.Attachment, error) {
	log := a.log.With("volume_id", r.Target.VolumeID, "ublk_dev", r.DevID)
	st, err := a.waitQuiesced(ctx, r.DevID, handedOff)
	if errors.Is(err, syscall.ENODEV) {
		log.Info("the device of the state file is gone; dropping it")
		a.dropState(r.Target.VolumeID)
		return nil, errGone
	}
	if err != nil {
		return nil, fmt.Errorf("ublk: device %d of %s: %w", r.DevID, r.Target.VolumeID, err)
	}
	if st != ublk.StateQuiesced {
		return nil, fmt.Errorf("ublk: device %d of %s is served by a live process (state %d): not taking it over", r.DevID, r.Target.VolumeID, st)
	}
	sess, err := attach.OpenSession(ctx, attach.SessionConfig{ID: r.Session, Logger: log}, r.Target, r.Options)
	if err != nil {
		// The device stays quiesced, its I/O held, for the next try.
		return nil, err
	}
	dev, err := ublk.Recover(ctx, a.ctrl, r.DevID, newHandler(sess), log)
	if err != nil {
		sess.Close(teardownTimeout)
		return nil, fmt.Errorf("ublk: take over device %d of %s: %w", r.DevID, r.Target.VolumeID, err)
	}
	v := &volume{target: r.Target, opts: r.Options, sess: sess, dev: dev, devID: dev.ID}
	att := a.register(v)
	log.Info("volume taken over from an earlier process", "device", att.Device)
	return &att, nil
}

// waitQuiesced returns the state of device id, waiting (bounded) for a
// device whose server died to be quiesced by the kernel.
func (a *Attacher) waitQuiesced(ctx context.Context, id uint32, handedOff bool) (int, error) {
	deadline := time.Now().Add(15 * time.Second)
	for {
		st, err := a.ctrl.State(id)
		if err != nil || st != ublk.StateLive {
			return st, err
		}
		pid, err := a.ctrl.Server(id)
		if err != nil {
			return st, err
		}
		if pid > 0 && attach.ProcAlive(pid, 0) && !handedOff || time.Now().After(deadline) {
			return st, nil
		}
		select {
		case <-ctx.Done():
			return st, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// Adopt takes over every device the state directory lists.
func (a *Attacher) Adopt(ctx context.Context) ([]*attach.Attachment, error) {
	return adoptAll(a.cfg.StateDir, func(r record) (*attach.Attachment, error) {
		a.mu.Lock()
		defer a.mu.Unlock()
		if _, have := a.vols[r.Target.VolumeID]; have {
			return nil, nil
		}
		att, err := a.takeOver(ctx, r)
		return att, goneIsNotAttached(err)
	})
}

// adoptAll adopts the record of every state file of dir with one. A
// volume one returns no attachment for, or ErrNotAttached (its device is
// gone), is left out; the other errors are joined.
func adoptAll(dir string, one func(record) (*attach.Attachment, error)) ([]*attach.Attachment, error) {
	files, err := filepath.Glob(filepath.Join(dir, "*.json"))
	if err != nil || dir == "" {
		return nil, err
	}
	var out []*attach.Attachment
	var errs []error
	for _, f := range files {
		var r record
		b, err := os.ReadFile(f)
		if err == nil {
			err = json.Unmarshal(b, &r)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", f, err))
			continue
		}
		att, err := one(r)
		switch {
		case errors.Is(err, attach.ErrNotAttached):
		case err != nil:
			errs = append(errs, err)
		case att != nil:
			out = append(out, att)
		}
	}
	return out, errors.Join(errs...)
}

// Detach removes the volume's device and ends its session. Unknown
// volumes succeed. What the session acknowledged is made durable first,
// within ctx: if the storage node does not answer in time, the detach
// fails with ErrUnflushed and changes nothing (the volume stays attached
// and served, its session redialing), so that the caller's retry, not a
// success, follows. Dropping the writes would lose them for good should
// the storage node have lost its cache; waiting without bound would hold
// the caller (a NodeUnstage) past its own deadline.
func (a *Attacher) Detach(ctx context.Context, volumeID string) error {
	a.mu.Lock()
	v, ok := a.vols[volumeID]
	if !ok {
		defer a.mu.Unlock()
		r, found := a.loadState(volumeID)
		if !found {
			return nil
		}
		// A device an earlier process served and nobody took over.
		if err := a.ctrl.Remove(r.DevID); err != nil && !errors.Is(err, syscall.ENODEV) {
			return fmt.Errorf("ublk: remove device %d of %s: %w", r.DevID, volumeID, err)
		}
		a.dropState(volumeID)
		return nil
	}
	a.mu.Unlock()
	// Outside mu: the drain may wait for the storage node.
	if err := v.sess.Drain(ctx); err != nil {
		return fmt.Errorf("ublk: detach %s: %w", volumeID, err)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.vols[volumeID] != v {
		return nil // detached or released meanwhile
	}
	if err := a.remove(ctx, v); err != nil {
		return err
	}
	delete(a.vols, volumeID)
	a.dropState(volumeID)
	a.log.Info("volume detached", "volume_id", volumeID)
	return nil
}

// remove deletes v's device (the kernel flushes it first) and, once what
// the session acknowledged is durable (within ctx), closes the session.
// A drain that fails leaves the session, and v marked devGone, for the
// next try.
func (a *Attacher) remove(ctx context.Context, v *volume) error {
	if !v.devGone {
		if err := v.dev.Delete(); err != nil {
			return fmt.Errorf("ublk: delete device %d of %s: %w", v.devID, v.target.VolumeID, err)
		}
		v.devGone = true
	}
	if err := v.sess.Drain(ctx); err != nil {
		return fmt.Errorf("ublk: detach %s: its device is removed, but %w", v.target.VolumeID, err)
	}
	v.sess.Close(teardownTimeout)
	return nil
}

// Health reports the volume's session.
func (a *Attacher) Health(volumeID string) (attach.Health, error) {
	a.mu.Lock()
	v, ok := a.vols[volumeID]
	a.mu.Unlock()
	if !ok {
		return attach.Health{}, fmt.Errorf("%w: %s", attach.ErrNotAttached, volumeID)
	}
	st := v.sess.Relay.Stats()
	h := attach.SessionHealth(st)
	h.MPTCP = v.att.MPTCP
	if !st.Connected {
		h.Message = h.OutageMessage()
	} else if st.Remote != nil && nbd.IsMultipathTCP(st.Remote) {
		if info, err := mptcp.GetInfo(st.Remote); err == nil {
			h.Subflows = []int{info.TotalSubflows()}
			h.Paths = attach.ConnPaths(0, st.Remote)
		}
	}
	return h, nil
}

// Resize picks up a grown export (UBLK_F_UPDATE_SIZE: Linux 6.14 and
// later).
func (a *Attacher) Resize(ctx context.Context, volumeID string, newSize uint64) (uint64, error) {
	a.mu.Lock()
	v, ok := a.vols[volumeID]
	a.mu.Unlock()
	if !ok {
		return 0, fmt.Errorf("%w: %s", attach.ErrNotAttached, volumeID)
	}
	size, err := v.sess.ProbeSize(ctx, v.target)
	if err != nil {
		return 0, err
	}
	if size < newSize {
		return 0, fmt.Errorf("ublk: resize %s: %w: the export has %d bytes, less than %d", volumeID, attach.ErrTooSmall, size, newSize)
	}
	if size == v.att.Size {
		return size, nil
	}
	if f, err := a.ctrl.Features(); err != nil || f&ublk.FlagUpdateSize == 0 {
		return 0, fmt.Errorf("%w: ublk: online resize needs a kernel whose ublk driver can update a device's size (Linux 6.14 or later)", attach.ErrUnsupported)
	}
	if err := a.ctrl.UpdateSize(v.devID, size); err != nil {
		return 0, err
	}
	a.mu.Lock()
	v.att.Size = size
	a.mu.Unlock()
	return size, nil
}

func (a *Attacher) statePath(volumeID string) string {
	return filepath.Join(a.cfg.StateDir, strings.NewReplacer("/", "_", "\x00", "_").Replace(volumeID)+".json")
}

func (a *Attacher) saveState(v *volume) error {
	if a.cfg.StateDir == "" {
		return nil
	}
	b, err := json.Marshal(record{Target: v.target, Options: v.opts, DevID: v.devID, Session: v.sess.ID})
	if err != nil {
		return err
	}
	return attach.WriteFileAtomic(a.statePath(v.target.VolumeID), b)
}

func (a *Attacher) loadState(volumeID string) (record, bool) {
	var r record
	if a.cfg.StateDir == "" {
		return r, false
	}
	b, err := os.ReadFile(a.statePath(volumeID))
	if err != nil || json.Unmarshal(b, &r) != nil {
		return r, false
	}
	return r, true
}

func (a *Attacher) dropState(volumeID string) {
	if a.cfg.StateDir == "" {
		return
	}
	if err := os.Remove(a.statePath(volumeID)); err != nil && !errors.Is(err, os.ErrNotExist) {
		a.log.Warn("remove state file", "volume_id", volumeID, "error", err)
	}
}

// handler serves a device's requests through the NBD session. It is a
// ublk.Keeper: the session keeps every acknowledged write until a FLUSH
// covers it, so a large write's buffer goes to the session as it is
// rather than being copied into one of the session's; and a ublk.Starter:
// a queue's thread starts its reads and writes in the session itself.
type handler struct {
	c    *nbd.Client
	r    *relay.Relay
	info nbd.ExportInfo
}

func newHandler(s *attach.Session) handler { return handler{s.Client, s.Relay, s.Info} }

func (h handler) Buffer(n int) *[]byte {
	b := relay.Buffer(n)
	*b = (*b)[:cap(*b)]
	return b
}

// StartIO starts a read or write that goes to the server as one request
// through the session, without a goroutine waiting for it.
func (h handler) StartIO(write bool, p []byte, kept *[]byte, off int64, fua bool, done func(error)) bool {
	if !h.c.OneRequest(off, int64(len(p))) {
		return false
	}
	req := nbd.Request{Type: nbd.CmdRead, Offset: uint64(off), Length: uint32(len(p))}
	if !write {
		h.r.Start(req, nil, nil, p, done)
		return true
	}
	req.Type = nbd.CmdWrite
	if fua {
		if h.info.Flags&nbd.FlagSendFUA == 0 {
			return false // a write and then a flush: the Handler's way
		}
		req.Flags |= nbd.CmdFlagFUA
	}
	h.r.Start(req, p, kept, nil, done)
	return true
}

func (h handler) Push() { h.r.Push() }

func (h handler) KeepWrite(buf *[]byte, n int, off int64, fua bool) error {
	if !h.c.OneRequest(off, int64(n)) {
		// A server with small limits: split (or refuse) as usual.
		return h.WriteAt((*buf)[:n], off, fua)
	}
	req := nbd.Request{Type: nbd.CmdWrite, Offset: uint64(off), Length: uint32(n)}
	flushAfter := false
	if fua {
		if h.info.Flags&nbd.FlagSendFUA != 0 {
			req.Flags |= nbd.CmdFlagFUA
		} else {
			flushAfter = true
		}
	}
	if err := h.r.WriteOwned(req, buf); err != nil {
		return err
	}
	if flushAfter {
		return h.c.Flush()
	}
	return nil
}

func (h handler) ReadAt(p []byte, off int64) error {
	_, err := h.c.ReadAt(p, off)
	return err
}

func (h handler) WriteAt(p []byte, off int64, fua bool) error {
	if !fua {
		_, err := h.c.WriteAt(p, off)
		return err
	}
	if h.info.Flags&nbd.FlagSendFUA != 0 {
		_, err := h.c.WriteAtFlags(p, off, nbd.CmdFlagFUA)
		return err
	}
	if _, err := h.c.WriteAt(p, off); err != nil {
		return err
	}
	return h.c.Flush()
}

func (h handler) Flush() error { return h.c.Flush() }

func (h handler) Trim(off, n int64) error { return h.c.Trim(off, n) }

// zeroChunk is what WriteZeroes writes at a time to a server without
// NBD_CMD_WRITE_ZEROES.
var zeroChunk = make([]byte, 256<<10)

func (h handler) WriteZeroes(off, n int64, noUnmap bool) error {
	if h.info.Flags&nbd.FlagSendWriteZeroes != 0 {
		return h.c.WriteZeroes(off, n, noUnmap)
	}
	for n > 0 {
		k := min(n, int64(len(zeroChunk)))
		if _, err := h.c.WriteAt(zeroChunk[:k], off); err != nil {
			return err
		}
		off += k
		n -= k
	}
	return nil
}
