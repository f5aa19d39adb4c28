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
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
)

// What on-call sees of a storage node and of its volumes: the controller
// keeps a Ready condition on every NBDStorageNode (an agent that is gone
// cannot report its own absence) and Reachable, ReplicasInSync and
// Degraded conditions on every NBDVolume, each written only when it
// changes; a storage node going and coming back is one Event on its
// NBDStorageNode, not one per volume.

// nodeReady is the Ready condition storage node n carries now: not
// ready while its agent's lease is gone, or while its heartbeat is older
// than StaleAfter (an agent that holds its lease and reports nothing).
func (f *Failover) nodeReady(n *v1alpha1.NBDStorageNode, gone map[string]time.Duration, now time.Time) metav1.Condition {
	c := metav1.Condition{Type: v1alpha1.ConditionReady, Status: metav1.ConditionTrue, Reason: v1alpha1.ReasonAgentReporting,
		Message: "the storage agent renews its lease and reports", ObservedGeneration: n.Generation}
	if _, away := gone[n.Name]; away {
		c.Status, c.Reason = metav1.ConditionFalse, v1alpha1.ReasonAgentNotReporting
		c.Message = "the storage agent's lease is not renewed: the node, its agent or its network is down; its unreplicated volumes wait (I/O resumes when it is back), replicated ones fail over to another replica"
	} else if hb := n.Status.Heartbeat.Time; !hb.IsZero() && now.Sub(hb) > f.cfg.StaleAfter {
		c.Status, c.Reason = metav1.ConditionFalse, v1alpha1.ReasonHeartbeatStale
		c.Message = fmt.Sprintf("the storage agent holds its lease but has not reported for more than %v: no new volume is placed on the node", f.cfg.StaleAfter)
	}
	return c
}

// markNodes sets each storage node's Ready condition where it changed
// and records an Event on the node when it goes or comes back. It
// returns the nodes ready.
func (f *Failover) markNodes(ctx context.Context, nodes map[string]*v1alpha1.NBDStorageNode, gone map[string]time.Duration, now time.Time) map[string]bool {
	ready := map[string]bool{}
	for _, name := range slices.Sorted(maps.Keys(nodes)) {
		n := nodes[name]
		want := f.nodeReady(n, gone, now)
		ready[name] = want.Status == metav1.ConditionTrue
		var was *metav1.Condition
		if c := meta.FindStatusCondition(n.Status.Conditions, v1alpha1.ConditionReady); c != nil {
			// A copy: setting the condition changes it in place.
			prev := *c
			was = &prev
		}
		if was != nil && was.Status == want.Status && was.Reason == want.Reason {
			continue
		}
		orig := n.DeepCopy()
		meta.SetStatusCondition(&n.Status.Conditions, want)
		if err := f.cfg.Client.Status().Patch(ctx, n, client.MergeFromWithOptions(orig, client.MergeFromWithOptimisticLock{})); err != nil {
			// A conflict (the agent reported meanwhile) or a failure:
			// the next check tries again.
			if !apierrors.IsConflict(err) && !apierrors.IsNotFound(err) {
				f.tell("ready/"+name, "setting a storage node's Ready condition", "storage_node", name, "error", err)
			}
			continue
		}
		switch {
		case want.Status != metav1.ConditionTrue:
			f.cfg.Logger.Warn("storage node not ready", "storage_node", name, "reason", want.Reason)
			f.cfg.Events.Event(n, corev1.EventTypeWarning, "StorageNodeNotReady", want.Message)
		case was != nil:
			f.cfg.Logger.Info("storage node ready again", "storage_node", name, "was", was.Reason)
			f.cfg.Events.Event(n, corev1.EventTypeNormal, "StorageNodeReady", "the storage agent reports again (it was "+was.Reason+")")
		}
	}
	return ready
}

// volumeConditions are the conditions the controller keeps on v, given
// the storage nodes ready (one not named, with no NBDStorageNode, is not)
// and those released (lost for good: Failover.Check).
func volumeConditions(v *v1alpha1.NBDVolume, ready map[string]bool, released func(string) bool) []metav1.Condition {
	primary := v.Spec.StorageNode
	if r := v.Status.Replication; r != nil && r.Primary != "" {
		primary = r.Primary
	}
	reach := metav1.Condition{Type: v1alpha1.ConditionReachable, Status: metav1.ConditionTrue, Reason: v1alpha1.ReasonStorageNodeReady,
		Message: "the storage node " + primary + " serving the volume is ready"}
	if !ready[primary] {
		reach.Status, reach.Reason = metav1.ConditionFalse, v1alpha1.ReasonStorageNodeDown
		reach.Message = "the storage node " + primary + " serving the volume is not ready (see its NBDStorageNode)"
		if len(v.Spec.ReplicaNodes) == 0 {
			reach.Message += ": I/O waits until it is back"
		} else {
			reach.Message += ": the volume fails over to a replica in sync"
		}
		if released(primary) {
			reach.Reason = v1alpha1.ReasonStorageNodeDeleted
			reach.Message = "the storage node " + primary + " serving the volume has no NBDStorageNode and its agent's lease is gone: it is taken as lost for good; " +
				"its publications are released without it, and deleting the volume writes its data there off"
		}
	}
	out := []metav1.Condition{reach}
	if len(v.Spec.ReplicaNodes) > 0 && v.Status.Replication != nil {
		sync := metav1.Condition{Type: v1alpha1.ConditionReplicasInSync, Status: metav1.ConditionTrue, Reason: v1alpha1.ReasonAllInSync,
			Message: fmt.Sprintf("%d of %d replicas in sync", len(v.Status.Replication.InSync), 1+len(v.Spec.ReplicaNodes))}
		var out2 []string
		for _, n := range append([]string{v.Spec.StorageNode}, v.Spec.ReplicaNodes...) {
			if !slices.Contains(v.Status.Replication.InSync, n) {
				out2 = append(out2, n)
			}
		}
		if len(out2) > 0 {
			sync.Status, sync.Reason = metav1.ConditionFalse, v1alpha1.ReasonReplicasOut
			sync.Message += ": out of sync on " + strings.Join(out2, ", ")
		}
		out = append(out, sync)
	}
	deg := metav1.Condition{Type: v1alpha1.ConditionDegraded, Status: metav1.ConditionFalse, Reason: v1alpha1.ReasonPathsUp,
		Message: "every node's data path is connected with all its subflows"}
	var disconnected, short []string
	for _, a := range v.Status.Attachments {
		switch {
		case !a.Connected:
			disconnected = append(disconnected, a.NodeID)
		case fewerSubflows(a.Subflows):
			short = append(short, a.NodeID+" "+a.Subflows)
		}
	}
	switch {
	case len(disconnected) > 0:
		deg.Status, deg.Reason = metav1.ConditionTrue, v1alpha1.ReasonDisconnected
		deg.Message = "not connected to the storage node from " + strings.Join(disconnected, ", ") + " (I/O waits there)"
	case len(short) > 0:
		deg.Status, deg.Reason = metav1.ConditionTrue, v1alpha1.ReasonPathsDown
		deg.Message = "fewer MPTCP subflows than the storage node has addresses: " + strings.Join(short, ", ")
	}
	return append(out, deg)
}

// fewerSubflows reports whether a NodeAttachment's subflows ("4/4",
// "4/4,3/4") name a connection with fewer than it should have.
func fewerSubflows(s string) bool {
	for _, c := range strings.Split(s, ",") {
		have, want, ok := strings.Cut(strings.TrimSpace(c), "/")
		if !ok {
			continue
		}
		h, err1 := strconv.Atoi(have)
		w, err2 := strconv.Atoi(want)
		if err1 == nil && err2 == nil && h < w {
			return true
		}
	}
	return false
}

// markVolume sets v's controller conditions where they changed.
// Conditional on v as listed: a conflict waits for the next check.
func (f *Failover) markVolume(ctx context.Context, v *v1alpha1.NBDVolume, ready map[string]bool, released func(string) bool) error {
	want := volumeConditions(v, ready, released)
	changed := false
	for _, c := range want {
		was := meta.FindStatusCondition(v.Status.Conditions, c.Type)
		if was == nil || was.Status != c.Status || was.Reason != c.Reason || was.Message != c.Message {
			changed = true
		}
	}
	if !changed {
		return nil
	}
	orig := v.DeepCopy()
	for _, c := range want {
		c.ObservedGeneration = v.Generation
		meta.SetStatusCondition(&v.Status.Conditions, c)
	}
	err := f.cfg.Client.Status().Patch(ctx, v, client.MergeFromWithOptions(orig, client.MergeFromWithOptimisticLock{}))
	if err != nil && !apierrors.IsConflict(err) && !apierrors.IsNotFound(err) {
		return fmt.Errorf("volume %s: setting its conditions: %w", v.Name, err)
	}
	return nil
}

// storageNodeReleased reports whether v's Reachable condition says its
// storage node is lost for good (v1alpha1.ReasonStorageNodeDeleted): no
// agent will close its nodes' connections, and none needs to (an agent
// that comes back serves the publications of the spec it reads then).
func storageNodeReleased(v *v1alpha1.NBDVolume) bool {
	c := meta.FindStatusCondition(v.Status.Conditions, v1alpha1.ConditionReachable)
	return c != nil && c.Status == metav1.ConditionFalse && c.Reason == v1alpha1.ReasonStorageNodeDeleted
}
