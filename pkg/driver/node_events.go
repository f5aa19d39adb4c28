package driver

import (
	"context"
	"fmt"
	"log/slog"
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
	if n := cur.Resent - prev.Resent; n > 0 {
		out = append(out, volumeEvent{corev1.EventTypeWarning, EventWritesResent,
			fmt.Sprintf("%d acknowledged writes sent again to a storage server that may have lost them (it restarted, or cannot tell); nothing was lost", n)})
	}
	return out
}

// WatchVolumeHealth looks at the data path of every attached volume each
// interval and records Events on transitions (healthEvents) until ctx
// ends.
func WatchVolumeHealth(ctx context.Context, n *Node, vols VolumeLister, sink EventSink, every time.Duration) {
	last := map[string]attach.Health{}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		seen := map[string]bool{}
		for id, tr := range vols.Volumes() {
			_, h, err := n.cfg.Attacher.Health(id)
			if err != nil {
				continue
			}
			seen[id] = true
			if prev, ok := last[id]; ok {
				for _, e := range healthEvents(prev, h, tr) {
					sink.VolumeEvent(ctx, id, e.typ, e.reason, e.message)
				}
			}
			last[id] = h
		}
		for id := range last {
			if !seen[id] {
				delete(last, id)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
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
