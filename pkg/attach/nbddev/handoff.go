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

package nbddev

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/fdpass"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// handoffState is what a successor needs besides the files: the device,
// the session (its connections fence the predecessor's) and, for the
// relay, the bytes of the kernel's socket the predecessor read and did
// not take.
type handoffState struct {
	Index   uint32         `json:"nbd_index"`
	Session nbd.SessionID  `json:"session"`
	Info    nbd.ExportInfo `json:"info"`
	Pending []byte         `json:"pending,omitempty"`
}

var _ attach.HandingOver = (*Attacher)(nil)

// HandOff quiesces a volume for a successor process. With the relay, the
// relay pauses (every request it took answered, every write it
// acknowledged flushed) and the handoff carries a duplicate of its end of
// the kernel's socket: the device never sees the change. The other modes
// run on sockets the kernel holds; their handoff carries no file, and the
// successor takes the device over as a re-adoption does, keeping the
// kernel's connections.
func (a *Attacher) HandOff(ctx context.Context, volumeID string) (*attach.Handoff, error) {
	a.mu.Lock()
	v, ok := a.vols[volumeID]
	a.mu.Unlock()
	if !ok {
		return nil, fmt.Errorf("%w: %s", attach.ErrNotAttached, volumeID)
	}
	v.mu.Lock()
	r, local, reconnecting := v.relay, v.local, v.reconnecting
	st := handoffState{Index: v.index, Session: v.session, Info: v.info}
	v.mu.Unlock()
	h := &attach.Handoff{VolumeID: volumeID, Transport: a.cfg.Mode, Target: v.target, Options: v.opts, Attachment: *v.attachment()}
	if a.cfg.Mode == attach.Relay {
		if r == nil || local == nil || reconnecting {
			return nil, fmt.Errorf("hand off %s: its relay is not running (a reconnect is under way)", volumeID)
		}
		uc, ok := local.(*net.UnixConn)
		if !ok {
			return nil, fmt.Errorf("hand off %s: the relay's socket is a %T", volumeID, local)
		}
		f, err := uc.File()
		if err != nil {
			return nil, fmt.Errorf("hand off %s: %w", volumeID, err)
		}
		pending, err := r.Pause(ctx)
		if err != nil {
			f.Close()
			return nil, fmt.Errorf("hand off %s: %w", volumeID, err)
		}
		st.Pending = pending
		h.Files = []*os.File{f}
		h.Resume = func() error {
			r.Resume()
			return nil
		}
	} else {
		h.Resume = func() error { return nil }
	}
	b, err := json.Marshal(st)
	if err != nil {
		// The copy of the kernel's socket goes too, or it would stay open.
		fdpass.Close(h.Files)
		_ = h.Resume() // ours, above: it cannot fail
		return nil, err
	}
	h.State = b
	h.Release = func() { a.release(v) }
	a.log.Info("volume quiesced for a successor", "volume_id", volumeID, "nbd_index", v.index, "pending_bytes", len(st.Pending))
	return h, nil
}

// release forgets a volume handed to a successor: its relay ends without
// a word to the server or the kernel, reconnects stop, and the state
// file, which the successor rewrites, stays.
func (a *Attacher) release(v *volume) {
	v.mu.Lock()
	r, done := v.relay, v.relayDone
	v.mu.Unlock()
	a.mu.Lock()
	if a.vols[v.target.VolumeID] == v {
		delete(a.vols, v.target.VolumeID)
		delete(a.byIndex, v.index)
	}
	a.mu.Unlock()
	v.end()
	if r != nil {
		r.Release()
		<-done
	}
	v.mu.Lock()
	v.relay, v.local, v.stopRelay, v.relayDone = nil, nil, nil, nil
	for _, c := range v.conns {
		c.Close()
	}
	v.conns = nil
	v.mu.Unlock()
	a.log.Info("volume handed to a successor", "volume_id", v.target.VolumeID, "nbd_index", v.index)
}

// TakeHandoff takes a volume a predecessor handed off; Start begins
// serving it (the relay dials the server afresh, in the same session, and
// reads the kernel's socket from where the predecessor stopped).
func (a *Attacher) TakeHandoff(ctx context.Context, h *attach.Handoff) (*attach.Attachment, error) {
	var st handoffState
	if err := json.Unmarshal(h.State, &st); err != nil {
		return nil, fmt.Errorf("%w: handoff of %s: %v", attach.ErrInvalid, h.VolumeID, err)
	}
	if h.Transport != a.cfg.Mode {
		return nil, fmt.Errorf("%w: handoff of %s is for %s, not %s", attach.ErrInvalid, h.VolumeID, h.Transport, a.cfg.Mode)
	}
	if err := validate(h.Target); err != nil {
		return nil, err
	}
	idx, found, err := a.cfg.Devices.FindByBackend(h.VolumeID)
	if err != nil {
		return nil, fmt.Errorf("handoff of %s: %w", h.VolumeID, err)
	}
	if !found || idx != st.Index {
		return nil, fmt.Errorf("%w: handoff of %s names nbd%d, but the volume's device is not there", attach.ErrWrongVolume, h.VolumeID, st.Index)
	}
	o := withDefaults(h.Options)
	if a.cfg.Mode != attach.Relay {
		h.Start = func() error {
			_, err := a.adopt(context.WithoutCancel(ctx), h.Target, o, idx)
			return err
		}
		h.Abort = func() {}
		att := h.Attachment
		return &att, nil
	}
	if len(h.Files) != 1 {
		return nil, fmt.Errorf("%w: relay handoff of %s carries %d files, want 1", attach.ErrInvalid, h.VolumeID, len(h.Files))
	}
	local, err := net.FileConn(h.Files[0])
	h.Files[0].Close()
	if err != nil {
		return nil, fmt.Errorf("handoff of %s: %w", h.VolumeID, err)
	}
	v := a.newVolume(h.Target, o, st.Session)
	v.index, v.info = idx, st.Info
	h.Start = func() error {
		v.startRelayWith(a, local, nil, st.Pending)
		a.register(v)
		a.log.Info("volume taken from a predecessor", "volume_id", h.VolumeID, "nbd_index", idx, "pending_bytes", len(st.Pending))
		return nil
	}
	h.Abort = func() {
		v.end()
		local.Close()
	}
	att := h.Attachment
	return &att, nil
}
