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

package driver

import (
	"context"
	"log/slog"
	"sync"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/attach"
)

// VolumeWatch tells the user what the node's volumes' data paths do:
// Events on their claims (how a stage chose its transport; the storage
// node lost and found; I/O failing; MPTCP paths degraded and restored)
// and this node's entry in each NBDVolume's status.attachments (written
// at stage, updated when transport, subflows or connectivity change,
// removed at unstage).
//
// NodeStageVolume and NodeUnstageVolume only leave it a note (Staged,
// Unstaged) and wake it; Run makes every API call, in one goroutine, so
// a CSI call never waits on the API server, a stage's entry can never be
// written after its unstage removed it, and a failed write is retried on
// the next look. Failures are logged, never fatal.
type VolumeWatch struct {
	// Events records Events on claims; nil records none.
	Events EventSink
	// Status writes the node's status entries; nil writes none.
	Status AttachmentStatus
	// Every is how often the data paths are looked at.
	Every time.Duration
	// Hold is how long a volume's paths must stay degraded (or restored)
	// before the change is recorded, so a dip that a later look no longer
	// finds says nothing.
	Hold time.Duration
	Log  *slog.Logger
	// now is time.Now, but for tests.
	now func() time.Time

	mu    sync.Mutex
	notes []stageNote
	kick  chan struct{}
}

// stageNote is a stage (att set) or unstage of a volume.
type stageNote struct {
	id  string
	att *attach.Attachment
}

var _ StageObserver = (*VolumeWatch)(nil)

// Staged notes a staged volume and wakes Run.
func (w *VolumeWatch) Staged(att *attach.Attachment) {
	w.note(stageNote{id: att.VolumeID, att: att})
}

// Unstaged notes an unstaged volume and wakes Run.
func (w *VolumeWatch) Unstaged(volumeID string) {
	w.note(stageNote{id: volumeID})
}

func (w *VolumeWatch) note(n stageNote) {
	w.mu.Lock()
	w.notes = append(w.notes, n)
	k := w.wake()
	w.mu.Unlock()
	select {
	case k <- struct{}{}:
	default:
	}
}

// wake returns the channel that wakes Run; the caller holds mu.
func (w *VolumeWatch) wake() chan struct{} {
	if w.kick == nil {
		w.kick = make(chan struct{}, 1)
	}
	return w.kick
}

func (w *VolumeWatch) takeNotes() []stageNote {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := w.notes
	w.notes = nil
	return n
}

// watched is what Run knows of an attached volume.
type watched struct {
	looked bool
	health attach.Health
	paths  pathState
	// entry is the status entry last written; nil: none yet.
	entry *v1alpha1.NodeAttachment
	// failing: the last write of the entry failed (logged once).
	failing bool
}

// apiTimeout bounds each API call of the watch, so an API server that
// does not answer delays the next look, never stops the watch.
const apiTimeout = 30 * time.Second

// Run looks at the data path of every volume attached on n each Every
// (and at once after a stage or unstage) until ctx ends.
func (w *VolumeWatch) Run(ctx context.Context, n *Node, vols VolumeLister) {
	if w.now == nil {
		w.now = time.Now
	}
	if w.Log == nil {
		w.Log = slog.Default()
	}
	w.mu.Lock()
	kick := w.wake()
	w.mu.Unlock()
	vs := map[string]*watched{}
	// removals are entries still to remove (unstaged volumes).
	removals := map[string]bool{}
	t := time.NewTicker(w.Every)
	defer t.Stop()
	for {
		for _, note := range w.takeNotes() {
			if note.att == nil {
				delete(vs, note.id)
				removals[note.id] = true
				continue
			}
			delete(removals, note.id)
			if note.att.Choice != nil || vs[note.id] == nil {
				vs[note.id] = &watched{} // a fresh attach
			}
			w.record(ctx, note.id, choiceEvents(note.att))
		}
		for id := range removals {
			if err := w.removeEntry(ctx, id); err != nil {
				w.Log.Warn("removing the node's status entry failed; retrying", "volume_id", id, "error", err)
				continue
			}
			delete(removals, id)
		}
		w.look(ctx, n, vols, vs, removals)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-kick:
		}
	}
}

func (w *VolumeWatch) removeEntry(ctx context.Context, id string) error {
	if w.Status == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, apiTimeout)
	defer cancel()
	return w.Status.Remove(ctx, id)
}

// writeEntry writes the entry of v when it differs from the last written.
func (w *VolumeWatch) writeEntry(ctx context.Context, id string, v *watched, entry v1alpha1.NodeAttachment, now time.Time) {
	if w.Status == nil || (v.entry != nil && sameEntry(*v.entry, entry)) {
		return
	}
	entry.LastUpdateTime = metav1.NewTime(now)
	ctx, cancel := context.WithTimeout(ctx, apiTimeout)
	defer cancel()
	if err := w.Status.Apply(ctx, id, entry); err != nil {
		if !v.failing {
			w.Log.Warn("writing the node's status entry failed; retrying at each look", "volume_id", id, "error", err)
		}
		v.failing = true
		return
	}
	if v.failing {
		w.Log.Info("the node's status entry written again", "volume_id", id)
	}
	v.entry, v.failing = &entry, false
}

// look records what changed in each attached volume's data path since
// the last look, and writes its status entry when it differs from the
// last written.
func (w *VolumeWatch) look(ctx context.Context, n *Node, vols VolumeLister, vs map[string]*watched, removals map[string]bool) {
	now := w.now()
	listed := vols.Volumes()
	for id := range listed {
		if removals[id] {
			continue
		}
		tr, h, err := n.cfg.Attacher.Health(id)
		if err != nil {
			continue
		}
		v := vs[id]
		if v == nil {
			v = &watched{} // attached before this process, or its note is still to come
			vs[id] = v
		}
		if v.looked {
			w.record(ctx, id, healthEvents(v.health, h, tr))
		}
		v.looked, v.health = true, h
		want, known := n.expectedSubflows(id)
		entry := attachmentEntry(tr, h, want, known)
		if h.Connected {
			degraded, msg := false, "every connection has all its MPTCP subflows again ("+entry.Subflows+")"
			for _, e := range n.volumeHealth(id, tr, h, nil).GetHealthStatuses() {
				if e.GetReason() == HealthMissingSubflows {
					degraded, msg = true, e.GetMessage()
				}
			}
			w.record(ctx, id, pathsEvents(&v.paths, degraded, msg, now, w.Hold))
		} else {
			// Subflows mean nothing while disconnected, nor while they
			// come back after a reconnect: the hold starts again.
			v.paths.since = time.Time{}
		}
		w.writeEntry(ctx, id, v, entry, now)
	}
	// A listing that failed (the datapath component restarting) is
	// empty: forget nothing then; unstages are noted anyway.
	if len(listed) == 0 {
		return
	}
	for id := range vs {
		if _, ok := listed[id]; !ok {
			delete(vs, id)
		}
	}
}

func sameEntry(a, b v1alpha1.NodeAttachment) bool {
	return a.Transport == b.Transport && a.Subflows == b.Subflows && a.Connected == b.Connected
}

func (w *VolumeWatch) record(ctx context.Context, id string, evs []volumeEvent) {
	if w.Events == nil {
		return
	}
	for _, e := range evs {
		ctx, cancel := context.WithTimeout(ctx, apiTimeout)
		w.Events.VolumeEvent(ctx, id, e.typ, e.reason, e.message)
		cancel()
	}
}
