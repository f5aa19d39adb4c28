package ublkdev

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

// startTimeout bounds the start of a handed-off volume (the recovery's
// dial included): past it the device stays quiesced, its I/O held, for
// the next Attach or Adopt.
const startTimeout = 2 * time.Minute

var _ attach.HandingOver = (*Attacher)(nil)

// HandOff readies a volume for a successor process. The kernel, not a
// file, carries a ublk device across: once this process stops serving
// (Release), the driver holds the device's I/O, requeueing what was in
// flight, until the successor ends the recovery (user recovery, the path a
// crash takes, but with the session flushed on both sides of the stop).
// Before the commit point nothing changes but a FLUSH.
func (a *Attacher) HandOff(ctx context.Context, volumeID string) (*attach.Handoff, error) {
	a.mu.Lock()
	v, ok := a.vols[volumeID]
	a.mu.Unlock()
	if !ok {
		return nil, fmt.Errorf("%w: %s", attach.ErrNotAttached, volumeID)
	}
	timeout := teardownTimeout
	if dl, ok := ctx.Deadline(); ok {
		timeout = time.Until(dl)
	}
	if err := v.sess.Flush(timeout); err != nil {
		return nil, fmt.Errorf("hand off %s: flush: %w", volumeID, err)
	}
	b, err := json.Marshal(record{Target: v.target, Options: v.opts, DevID: v.dev.ID, Session: v.sess.ID})
	if err != nil {
		return nil, err
	}
	h := &attach.Handoff{VolumeID: volumeID, Transport: attach.Ublk, Target: v.target, Options: v.opts, Attachment: v.att, State: b}
	h.Resume = func() error { return nil }
	h.Release = func() { a.release(v) }
	return h, nil
}

// release stops serving v and leaves its device to the successor: the
// queues end (what they had in flight is requeued by the driver), then
// the session flushes what the stopped queues had acknowledged and
// closes; its connections are superseded by the successor's anyway.
func (a *Attacher) release(v *volume) {
	a.mu.Lock()
	if a.vols[v.target.VolumeID] == v {
		delete(a.vols, v.target.VolumeID)
	}
	a.mu.Unlock()
	v.dev.Abandon()
	if err := v.sess.Flush(teardownTimeout); err != nil {
		a.log.Error("flush after handing a volume off: writes it acknowledged may exist only here", "volume_id", v.target.VolumeID, "error", err)
	}
	v.sess.Close(teardownTimeout)
	a.log.Info("volume handed to a successor", "volume_id", v.target.VolumeID, "ublk_dev", v.dev.ID)
}

// TakeHandoff prepares to take a device a predecessor hands off; Start
// ends its recovery once the predecessor has stopped serving it.
func (a *Attacher) TakeHandoff(ctx context.Context, h *attach.Handoff) (*attach.Attachment, error) {
	var r record
	if err := json.Unmarshal(h.State, &r); err != nil {
		return nil, fmt.Errorf("%w: handoff of %s: %v", attach.ErrInvalid, h.VolumeID, err)
	}
	if r.Target.VolumeID != h.VolumeID {
		return nil, fmt.Errorf("%w: handoff of %s describes %s", attach.ErrInvalid, h.VolumeID, r.Target.VolumeID)
	}
	for _, f := range h.Files {
		f.Close()
	}
	h.Start = func() error {
		tctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), startTimeout)
		a.mu.Lock()
		_, err := a.takeOverFrom(tctx, r, true)
		a.mu.Unlock()
		cancel()
		if err == nil {
			return nil
		}
		// Kernels whose driver quiesces a device only once its server's
		// threads have exited (not when it closes the queues) leave the
		// device live until the predecessor process ends: take it over
		// then.
		a.log.Warn("ublk: the device is not quiesced yet; taking it over once the predecessor has exited", "volume_id", r.Target.VolumeID, "ublk_dev", r.DevID, "error", err)
		go a.takeOverLater(r)
		return nil
	}
	h.Abort = func() {}
	att := h.Attachment
	return &att, nil
}

// takeOverLater retries the takeover of a handed-off device until it
// succeeds, the device is gone, or its state file is (a detach).
func (a *Attacher) takeOverLater(r record) {
	for {
		time.Sleep(time.Second)
		if _, ok := a.loadState(r.Target.VolumeID); !ok {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
		a.mu.Lock()
		_, have := a.vols[r.Target.VolumeID]
		var err error
		if !have {
			_, err = a.takeOverFrom(ctx, r, false)
		}
		a.mu.Unlock()
		cancel()
		if have || err == nil || errors.Is(err, errGone) {
			return
		}
	}
}
