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
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

// Reasons of the Events the node plugin records on a volume's claim.
const (
	EventStorageUnreachable = "StorageUnreachable"
	EventStorageReconnected = "StorageReconnected"
	EventWritesResent       = "WritesResent"
	// EventIOFailing: the outage outlasted the volume's deadConnTimeout;
	// I/O fails until the storage node is back.
	EventIOFailing = "IOFailing"
	// EventTransportChosen names the transport a stage attached the
	// volume with, and why; EventTransportFallback, one per transport
	// passed over before it, says why that one was not used.
	EventTransportChosen   = "TransportChosen"
	EventTransportFallback = "TransportFallback"
	// EventPathsDegraded: a connection has fewer MPTCP subflows than the
	// storage node has addresses (the node plugin's DEGRADED health);
	// EventPathsRestored: every connection has them all again. Both only
	// once the state has held for VolumeWatch.Hold.
	EventPathsDegraded = "PathsDegraded"
	EventPathsRestored = "PathsRestored"
)

// EventSink records an Event about the claim of a volume.
type EventSink interface {
	VolumeEvent(ctx context.Context, volumeID, eventType, reason, message string)
}

// volumeEvent is one Event to record.
type volumeEvent struct {
	typ, reason, message string
}

// healthEvents says what a user should hear about a change of a volume's
// data path between two looks: the storage node lost (I/O waits), found
// again, and acknowledged writes sent again to a server that may have
// lost them.
func healthEvents(prev, cur attach.Health, tr attach.Transport) []volumeEvent {
	var out []volumeEvent
	switch {
	case prev.Connected && !cur.Connected:
		msg := fmt.Sprintf("the storage node is unreachable (transport %s); I/O waits until it is back", tr)
		if cur.Message != "" {
			msg += ": " + cur.Message
		}
		out = append(out, volumeEvent{corev1.EventTypeWarning, EventStorageUnreachable, msg})
	case !prev.Connected && cur.Connected:
		out = append(out, volumeEvent{corev1.EventTypeNormal, EventStorageReconnected,
			fmt.Sprintf("reconnected to the storage node after %v; I/O resumed (%d reconnects since attach)", prev.Outage.Round(time.Second), cur.Reconnects)})
	case cur.Reconnects > prev.Reconnects:
		// An outage shorter than the interval between looks.
		out = append(out, volumeEvent{corev1.EventTypeNormal, EventStorageReconnected,
			fmt.Sprintf("reconnected to the storage node (%d reconnects since attach)", cur.Reconnects)})
	}
	if cur.Failing && !prev.Failing && !cur.Connected {
		out = append(out, volumeEvent{corev1.EventTypeWarning, EventIOFailing,
			fmt.Sprintf("%s (transport %s); the data path keeps reconnecting", cur.OutageMessage(), tr)})
	}
	if n := cur.Resent - prev.Resent; n > 0 {
		out = append(out, volumeEvent{corev1.EventTypeWarning, EventWritesResent,
			fmt.Sprintf("%d acknowledged writes sent again to a storage server that may have lost them (it restarted, or cannot tell); nothing was lost", n)})
	}
	return out
}

// choiceEvents says how a stage's attach came to its transport: a
// TransportFallback per transport passed over, then TransportChosen. A
// repeated stage (no Choice) says nothing.
func choiceEvents(att *attach.Attachment) []volumeEvent {
	c := att.Choice
	if c == nil {
		return nil
	}
	var out []volumeEvent
	var refused []string
	for _, f := range c.Skipped {
		out = append(out, volumeEvent{corev1.EventTypeWarning, EventTransportFallback,
			fmt.Sprintf("transport %s not used, %s tried next: %s", f.From, f.To, f.Reason)})
		refused = append(refused, string(f.From))
	}
	var why []string
	switch {
	case c.Requested != attach.Auto && c.Requested != "":
		why = append(why, "the transport the volume's StorageClass asks for")
	case len(refused) == 0 && len(c.Missing) == 0:
		why = append(why, "auto's first choice")
	default:
		if len(refused) > 0 {
			why = append(why, fmt.Sprintf("auto, after %s refused (see TransportFallback)", strings.Join(refused, ", ")))
		} else {
			why = append(why, "auto")
		}
		if len(c.Missing) > 0 {
			var m []string
			for _, t := range c.Missing {
				m = append(m, string(t))
			}
			why = append(why, fmt.Sprintf("this node has no %s transport", strings.Join(m, ", ")))
		}
	}
	path := "over MPTCP"
	if !att.MPTCP {
		path = "without MPTCP"
	}
	out = append(out, volumeEvent{corev1.EventTypeNormal, EventTransportChosen,
		fmt.Sprintf("attached with transport %s, %s, device %s: %s", att.Transport, path, att.Device, strings.Join(why, "; "))})
	return out
}

// pathState is what a volume's MPTCP paths were last reported as, and
// since when the looks have disagreed with it.
type pathState struct {
	degraded bool
	since    time.Time
}

// pathsEvents reports a change of a connected volume's paths once it has
// held for hold: PathsDegraded when this look finds a connection with
// fewer subflows than expected (msg says which), PathsRestored when all
// have them again. A dip that is gone by a later look within hold says
// nothing, nor does one that comes and goes on every look.
func pathsEvents(s *pathState, degraded bool, msg string, now time.Time, hold time.Duration) []volumeEvent {
	if degraded == s.degraded {
		s.since = time.Time{}
		return nil
	}
	if s.since.IsZero() {
		s.since = now
	}
	if now.Sub(s.since) < hold {
		return nil
	}
	s.degraded, s.since = degraded, time.Time{}
	if degraded {
		return []volumeEvent{{corev1.EventTypeWarning, EventPathsDegraded, msg + "; I/O goes on over the other paths"}}
	}
	return []volumeEvent{{corev1.EventTypeNormal, EventPathsRestored, msg}}
}

// KubeEvents records volume Events on the claim bound to the volume's PV
// (found by the PV named after the volume, whose CSI handle it is).
type KubeEvents struct {
	Client client.Client
	NodeID string
	Log    *slog.Logger

	mu   sync.Mutex
	refs map[string]*corev1.ObjectReference
}

func (k *KubeEvents) claimOf(ctx context.Context, volumeID string) (*corev1.ObjectReference, error) {
	k.mu.Lock()
	ref, ok := k.refs[volumeID]
	k.mu.Unlock()
	if ok {
		return ref, nil
	}
	var pv corev1.PersistentVolume
	if err := k.Client.Get(ctx, client.ObjectKey{Name: volumeID}, &pv); err != nil {
		return nil, err
	}
	c := pv.Spec.ClaimRef
	if pv.Spec.CSI == nil || pv.Spec.CSI.VolumeHandle != volumeID || c == nil {
		return nil, fmt.Errorf("PV %s is not bound to a claim with this volume", volumeID)
	}
	ref = &corev1.ObjectReference{APIVersion: "v1", Kind: "PersistentVolumeClaim", Namespace: c.Namespace, Name: c.Name, UID: c.UID}
	k.mu.Lock()
	if k.refs == nil {
		k.refs = map[string]*corev1.ObjectReference{}
	}
	k.refs[volumeID] = ref
	k.mu.Unlock()
	return ref, nil
}

// VolumeEvent records the Event; failures are logged, never fatal.
func (k *KubeEvents) VolumeEvent(ctx context.Context, volumeID, eventType, reason, message string) {
	log := k.Log.With("volume_id", volumeID, "reason", reason)
	ref, err := k.claimOf(ctx, volumeID)
	if err != nil {
		log.Info("no claim to record the event on", "message", message, "error", err)
		return
	}
	now := metav1.Now()
	ev := &corev1.Event{
		ObjectMeta:     metav1.ObjectMeta{GenerateName: ref.Name + ".", Namespace: ref.Namespace},
		InvolvedObject: *ref,
		Reason:         reason,
		Message:        message,
		Type:           eventType,
		Source:         corev1.EventSource{Component: "mpnbd-node", Host: k.NodeID},
		FirstTimestamp: now,
		LastTimestamp:  now,
		Count:          1,
	}
	if err := k.Client.Create(ctx, ev); err != nil {
		log.Warn("recording an event failed", "message", message, "error", err)
		return
	}
	log.Info("event recorded", "claim", ref.Namespace+"/"+ref.Name, "message", message)
}
