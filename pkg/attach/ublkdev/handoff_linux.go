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
// Before the commit point nothing changes but a FLUSH, which tells that
// the storage node answers (a volume whose node is away stays here); the
// queues serve on meanwhile, so the writes they acknowledge until the
// release are flushed by the release itself.
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
	b, err := json.Marshal(record{Target: v.target, Options: v.opts, DevID: v.devID, Session: v.sess.ID})
	if err != nil {
		return nil, err
	}
	h := &attach.Handoff{VolumeID: volumeID, Transport: attach.Ublk, Target: v.target, Options: v.opts, Attachment: v.att, State: b}
	h.Resume = func() error { return nil }
	h.Release = func() { a.release(v) }
	return h, nil
}

// release stops serving v and leaves its device to the successor: first
// the queues end (nothing more is acknowledged; what they had in flight
// is requeued by the driver), then the session drains (every write it
// acknowledged, since the handoff's FLUSH too, made durable, through an
// outage and a new incarnation of the storage node if need be), and only
// then does it close: the writes it retains exist nowhere else, and the
// successor, which starts only once this release is over, cannot replay
// them. The drain is bounded only by the volume's own outage policy (the
// relay's FailAfter; none for a hard mount): a successor waits for a
// slow release, never serves beside it.
func (a *Attacher) release(v *volume) {
	a.mu.Lock()
	if a.vols[v.target.VolumeID] == v {
		delete(a.vols, v.target.VolumeID)
	}
	a.mu.Unlock()
	v.dev.Abandon()
	ctx, cancel := releaseContext(v.sess.FailAfter)
	defer cancel()
	if err := v.sess.Drain(ctx); err != nil {
		a.log.Error("ublk: releasing a volume past its outage bound: writes it acknowledged are not durable and are dropped", "volume_id", v.target.VolumeID, "error", err)
	}
	v.sess.Close(teardownTimeout)
	a.log.Info("volume released: the kernel holds its device for the next process", "volume_id", v.target.VolumeID, "ublk_dev", v.devID)
}

// releaseContext bounds a release's drain by a volume's outage bound
// (failAfter; zero: a hard mount, no bound), teardownTimeout at least.
func releaseContext(failAfter time.Duration) (context.Context, context.CancelFunc) {
	if failAfter <= 0 {
		return context.WithCancel(context.Background())
	}
	return context.WithTimeout(context.Background(), max(failAfter, teardownTimeout))
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

// serveVolume attaches, or takes over, the one volume of a volume
// process, as its spec says.
func (a *Attacher) serveVolume(ctx context.Context, sp serveSpec) (*attach.Attachment, error) {
	id := sp.Target.VolumeID
	switch sp.Mode {
	case modeAttach:
		return a.Attach(ctx, sp.Target, sp.Options)
	case modeRecover:
		r, ok := a.loadState(id)
		if !ok {
			return nil, fmt.Errorf("%w: ublk: no state file of volume %s to take over", attach.ErrNotAttached, id)
		}
		// Its last server may still be leaving it (a process whose
		// supervisor died flushes first): wait for the quiesce, bounded.
		a.mu.Lock()
		att, err := a.takeOverFrom(ctx, r, true)
		a.mu.Unlock()
		return att, goneIsNotAttached(err)
	case modeHandoff:
		var r record
		if err := json.Unmarshal(sp.Record, &r); err != nil || r.Target.VolumeID != id {
			return nil, fmt.Errorf("%w: ublk: the handoff of %s: %v", attach.ErrInvalid, id, err)
		}
		return a.takeOverHandedOff(ctx, r)
	}
	return nil, fmt.Errorf("%w: ublk: unknown mode %q", attach.ErrInvalid, sp.Mode)
}

// takeOverHandedOff takes over a device a predecessor handed off and
// released, retrying until ctx ends: kernels whose driver quiesces a
// device only once its server's threads have exited leave it live until
// the predecessor process is gone.
func (a *Attacher) takeOverHandedOff(ctx context.Context, r record) (*attach.Attachment, error) {
	handedOff := true
	for {
		a.mu.Lock()
		att, err := a.takeOverFrom(ctx, r, handedOff)
		a.mu.Unlock()
		if err == nil || errors.Is(err, errGone) || ctx.Err() != nil {
			return att, goneIsNotAttached(err)
		}
		if handedOff {
			a.log.Info("ublk: the device is not quiesced yet; taking it over once its predecessor has exited", "volume_id", r.Target.VolumeID, "ublk_dev", r.DevID, "error", err)
		}
		handedOff = false
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("ublk: take over device %d of %s: %w (%v)", r.DevID, r.Target.VolumeID, ctx.Err(), err)
		case <-time.After(time.Second):
		}
	}
}

// goneIsNotAttached says ErrNotAttached for a device that is gone, the
// sentinel that crosses to a supervisor.
func goneIsNotAttached(err error) error {
	if errors.Is(err, errGone) {
		return fmt.Errorf("%w: %v", attach.ErrNotAttached, err)
	}
	return err
}

// releaseVolume stops serving a volume and leaves its device, held by the
// kernel, to the next process.
func (a *Attacher) releaseVolume(volumeID string) {
	a.mu.Lock()
	v, ok := a.vols[volumeID]
	a.mu.Unlock()
	if ok {
		a.release(v)
	}
}
