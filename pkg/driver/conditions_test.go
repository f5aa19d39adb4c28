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
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
)

// TestStorageNodeConditions runs Failover.Check against a real API server
// with a clock of its own: every storage node gets a Ready condition and
// every volume Reachable (and, replicated, ReplicasInSync) and Degraded;
// a storage node whose lease stops is not Ready, the volumes it serves
// not Reachable, and that is one Event on the node however many checks
// and volumes there are, written once (no status write while nothing
// changes); when it is back, Ready again and one Event saying so. An agent
// that holds its lease and stops reporting is HeartbeatStale.
func TestStorageNodeConditions(t *testing.T) {
	const ns = testNamespace
	c, ctl := controllerTestEnv(t)
	ctx := context.Background()
	now := time.Now()
	renew := func(node string) { renewLease(t, c, ns, node, now) }
	for _, n := range []string{"s1", "s2", "s3"} {
		putStorageNode(t, c, n, 10*gib, nil, nil, now)
		renew(n)
	}
	volume := func(name, primary string, replicas []string, attachments ...v1alpha1.NodeAttachment) {
		t.Helper()
		v := &v1alpha1.NBDVolume{ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: v1alpha1.NBDVolumeSpec{StorageNode: primary, SizeBytes: 1 << 20, AccessType: v1alpha1.AccessBlock, Replicas: int32(len(replicas) + 1), ReplicaNodes: replicas}}
		if err := c.Create(ctx, v); err != nil {
			t.Fatal(err)
		}
		v.Status.Attachments = attachments
		if len(replicas) > 0 {
			inSync := append([]string{primary}, replicas[1:]...)
			v.Status.Replication = &v1alpha1.ReplicationStatus{Epoch: 2, Primary: primary, PrimaryEpoch: 1, InSync: inSync, InSyncReplicas: int32(len(inSync))}
		}
		if err := c.Status().Update(ctx, v); err != nil {
			t.Fatal(err)
		}
	}
	at := metav1.NewTime(now)
	// Many unreplicated volumes on s1, one of them attached on two nodes
	// (one short of a subflow, one with its path down).
	for i := range 5 {
		volume(fmt.Sprintf("u%d", i), "s1", nil)
	}
	volume("ua", "s1", nil,
		v1alpha1.NodeAttachment{NodeID: "w1", Transport: "fuse", Subflows: "4/4,3/4", Connected: true, LastUpdateTime: at},
		v1alpha1.NodeAttachment{NodeID: "w2", Transport: "fuse", Subflows: "4/4", Connected: true, LastUpdateTime: at})
	volume("ub", "s2", nil,
		v1alpha1.NodeAttachment{NodeID: "w1", Transport: "relay", Connected: false, LastUpdateTime: at})
	// Replicated on s2 and s3, s3 out of sync.
	volume("r", "s2", []string{"s3"})

	node := func(name string) *v1alpha1.NBDStorageNode {
		t.Helper()
		var n v1alpha1.NBDStorageNode
		if err := c.Get(ctx, client.ObjectKey{Name: name}, &n); err != nil {
			t.Fatal(err)
		}
		return &n
	}
	cond := func(obj string, conds []metav1.Condition, typ string, status metav1.ConditionStatus, reason string, words ...string) {
		t.Helper()
		c := meta.FindStatusCondition(conds, typ)
		if c == nil {
			t.Errorf("%s: no %s condition in %+v", obj, typ, conds)
			return
		}
		if c.Status != status || c.Reason != reason {
			t.Errorf("%s: %s %s (%s: %s), want %s (%s)", obj, typ, c.Status, c.Reason, c.Message, status, reason)
		}
		for _, w := range words {
			if !strings.Contains(c.Message, w) {
				t.Errorf("%s: %s message %q does not say %q", obj, typ, c.Message, w)
			}
		}
	}
	vol := func(name string) []metav1.Condition {
		t.Helper()
		var v v1alpha1.NBDVolume
		if err := c.Get(ctx, client.ObjectKey{Name: name}, &v); err != nil {
			t.Fatal(err)
		}
		return v.Status.Conditions
	}

	f := NewFailover(FailoverConfig{Client: ctl, Namespace: ns, Now: func() time.Time { return now }, StaleAfter: time.Minute})
	if _, err := f.Check(ctx, true); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"s1", "s2", "s3"} {
		cond(n, node(n).Status.Conditions, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonAgentReporting)
	}
	cond("u0", vol("u0"), v1alpha1.ConditionReachable, metav1.ConditionTrue, v1alpha1.ReasonStorageNodeReady, "s1")
	cond("u0", vol("u0"), v1alpha1.ConditionDegraded, metav1.ConditionFalse, v1alpha1.ReasonPathsUp)
	cond("ua", vol("ua"), v1alpha1.ConditionDegraded, metav1.ConditionTrue, v1alpha1.ReasonPathsDown, "w1 4/4,3/4")
	cond("ub", vol("ub"), v1alpha1.ConditionDegraded, metav1.ConditionTrue, v1alpha1.ReasonDisconnected, "w1")
	cond("r", vol("r"), v1alpha1.ConditionReplicasInSync, metav1.ConditionFalse, v1alpha1.ReasonReplicasOut, "1 of 2", "s3")
	if meta.FindStatusCondition(vol("u0"), v1alpha1.ConditionReplicasInSync) != nil {
		t.Error("an unreplicated volume has a ReplicasInSync condition")
	}

	// s1's lease stops; s2 and s3 renew. 7 s on (lease 6 s), s1 is gone.
	// checks moves the clock by step n times, s2 and s3 renewing, and
	// checks after each.
	checks := func(n int, step time.Duration, always bool) {
		t.Helper()
		for range n {
			now = now.Add(step)
			renew("s2")
			renew("s3")
			if _, err := f.Check(ctx, always); err != nil {
				t.Fatal(err)
			}
		}
	}
	checks(2, 3500*time.Millisecond, false)
	cond("s1", node("s1").Status.Conditions, v1alpha1.ConditionReady, metav1.ConditionFalse, v1alpha1.ReasonAgentNotReporting, "lease")
	cond("s2", node("s2").Status.Conditions, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonAgentReporting)
	for _, v := range []string{"u0", "u4", "ua"} {
		cond(v, vol(v), v1alpha1.ConditionReachable, metav1.ConditionFalse, v1alpha1.ReasonStorageNodeDown, "s1", "I/O waits")
	}
	cond("ub", vol("ub"), v1alpha1.ConditionReachable, metav1.ConditionTrue, v1alpha1.ReasonStorageNodeReady)
	// More checks while s1 stays away: nothing is written again.
	rv := node("s1").ResourceVersion
	vrv := func() string {
		var v v1alpha1.NBDVolume
		if err := c.Get(ctx, client.ObjectKey{Name: "u0"}, &v); err != nil {
			t.Fatal(err)
		}
		return v.ResourceVersion
	}
	urv := vrv()
	checks(4, 3*time.Second, true)
	if got := node("s1").ResourceVersion; got != rv {
		t.Errorf("s1 written while its state stayed (resourceVersion %s, then %s)", rv, got)
	}
	if got := vrv(); got != urv {
		t.Errorf("u0 written while its state stayed (resourceVersion %s, then %s)", urv, got)
	}
	nodeEvents := func(reason string) []corev1.Event {
		var evs corev1.EventList
		if err := c.List(ctx, &evs); err != nil {
			t.Fatal(err)
		}
		var out []corev1.Event
		for _, e := range evs.Items {
			if e.InvolvedObject.Kind == "NBDStorageNode" && e.InvolvedObject.Name == "s1" && e.Reason == reason {
				out = append(out, e)
			}
		}
		return out
	}
	waitEvents(t, c, func([]corev1.Event) string {
		if evs := nodeEvents("StorageNodeNotReady"); len(evs) != 1 || evs[0].Type != corev1.EventTypeWarning || evs[0].Count != 1 {
			return fmt.Sprintf("StorageNodeNotReady Events on s1: %+v, want one Warning", evs)
		}
		return ""
	})

	// s1 back.
	now = now.Add(time.Second)
	for _, n := range []string{"s1", "s2", "s3"} {
		renew(n)
	}
	if _, err := f.Check(ctx, false); err != nil {
		t.Fatal(err)
	}
	cond("s1", node("s1").Status.Conditions, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonAgentReporting)
	cond("u0", vol("u0"), v1alpha1.ConditionReachable, metav1.ConditionTrue, v1alpha1.ReasonStorageNodeReady)
	waitEvents(t, c, func([]corev1.Event) string {
		if evs := nodeEvents("StorageNodeReady"); len(evs) != 1 || evs[0].Type != corev1.EventTypeNormal || !strings.Contains(evs[0].Message, v1alpha1.ReasonAgentNotReporting) {
			return fmt.Sprintf("StorageNodeReady Events on s1: %+v, want one saying what it was", evs)
		}
		return ""
	})

	// s3 holds its lease and reports nothing for more than StaleAfter.
	now = now.Add(2 * time.Minute)
	for _, n := range []string{"s1", "s2", "s3"} {
		renew(n)
	}
	for _, n := range []string{"s1", "s2"} {
		sn := node(n)
		sn.Status.Heartbeat = metav1.NewTime(now)
		if err := c.Status().Update(ctx, sn); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := f.Check(ctx, false); err != nil {
		t.Fatal(err)
	}
	cond("s3", node("s3").Status.Conditions, v1alpha1.ConditionReady, metav1.ConditionFalse, v1alpha1.ReasonHeartbeatStale, "1m0s")
	cond("s1", node("s1").Status.Conditions, v1alpha1.ConditionReady, metav1.ConditionTrue, v1alpha1.ReasonAgentReporting)
}

// TestStorageNodeLostForGood: a storage node whose agent's lease is gone
// holds its volumes' publications and deletions (hard mount: it may come
// back) until its NBDStorageNode is deleted too; then the controller
// releases them without it: ControllerUnpublishVolume returns, a deleted
// volume loses its backing-store finalizer (an Event says its data is
// written off), and the volumes it still serves say Reachable False,
// StorageNodeDeleted. A node whose NBDStorageNode is deleted while its
// agent renews its lease releases nothing. When the lost node's agent comes
// back, its volume is Reachable again.
func TestStorageNodeLostForGood(t *testing.T) {
	c, asController := controllerTestEnv(t)
	ctx := context.Background()
	now := time.Now()
	for _, n := range []string{"s1", "s2"} {
		putStorageNode(t, c, n, 10*gib, nil, nil, now)
		renewLease(t, c, testNamespace, n, now)
	}
	// Volumes as their agents left them: applied (observedGeneration),
	// under the agent's finalizer; pub* published to w1.
	volume := func(name, node string) {
		t.Helper()
		v := &v1alpha1.NBDVolume{ObjectMeta: metav1.ObjectMeta{Name: name, Finalizers: []string{v1alpha1.Finalizer}},
			Spec: v1alpha1.NBDVolumeSpec{StorageNode: node, SizeBytes: 1 << 20, AccessType: v1alpha1.AccessBlock, Replicas: 1}}
		if strings.HasPrefix(name, "pub") {
			v.Spec.Publications = []v1alpha1.Publication{{NodeID: "w1", Addresses: []string{"10.0.0.1"}}}
		}
		if err := c.Create(ctx, v); err != nil {
			t.Fatal(err)
		}
		v.Status.ObservedGeneration = v.Generation
		if err := c.Status().Update(ctx, v); err != nil {
			t.Fatal(err)
		}
	}
	for _, n := range []string{"pub1", "del1", "keep1"} {
		volume(n, "s1")
	}
	for _, n := range []string{"pub2", "del2"} {
		volume(n, "s2")
	}
	ctl := newTestController(t, asController)
	f := NewFailover(FailoverConfig{Client: asController, Namespace: testNamespace, Now: func() time.Time { return now }, StaleAfter: time.Minute})
	check := func() {
		t.Helper()
		if _, err := f.Check(ctx, true); err != nil {
			t.Fatal(err)
		}
	}
	// waits: calls that must still wait for the storage agent.
	waits := func(what string) {
		t.Helper()
		for _, id := range []string{"pub1", "pub2"} {
			wctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
			_, err := ctl.ControllerUnpublishVolume(wctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "w1"})
			cancel()
			if status.Code(err) != codes.DeadlineExceeded {
				t.Errorf("%s: unpublishing %s: %v, want DeadlineExceeded (waiting for its agent)", what, id, err)
			}
		}
		for _, id := range []string{"del1", "del2"} {
			wctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
			_, err := ctl.DeleteVolume(wctx, &csi.DeleteVolumeRequest{VolumeId: id})
			cancel()
			if status.Code(err) != codes.DeadlineExceeded {
				t.Errorf("%s: deleting %s: %v, want DeadlineExceeded (waiting for its agent)", what, id, err)
			}
		}
	}
	check()
	// s1's agent stops renewing; s2's NBDStorageNode is deleted while
	// its agent renews (an administrator's mistake, or the agent about to
	// make it anew).
	deleteNode := func(name string) {
		t.Helper()
		if err := c.Delete(ctx, &v1alpha1.NBDStorageNode{ObjectMeta: metav1.ObjectMeta{Name: name}}); err != nil {
			t.Fatal(err)
		}
	}
	deleteNode("s2")
	now = now.Add(7 * time.Second)
	renewLease(t, c, testNamespace, "s2", now)
	check()
	waits("s1 gone, s2 deleted but renewing")

	// s1's NBDStorageNode deleted: lost for good.
	deleteNode("s1")
	now = now.Add(time.Second)
	renewLease(t, c, testNamespace, "s2", now)
	check()
	var keep v1alpha1.NBDVolume
	if err := c.Get(ctx, client.ObjectKey{Name: "keep1"}, &keep); err != nil {
		t.Fatal(err)
	}
	if r := meta.FindStatusCondition(keep.Status.Conditions, v1alpha1.ConditionReachable); r == nil || r.Status != metav1.ConditionFalse || r.Reason != v1alpha1.ReasonStorageNodeDeleted {
		t.Errorf("keep1's Reachable condition %+v, want False (%s)", r, v1alpha1.ReasonStorageNodeDeleted)
	}
	bctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := ctl.ControllerUnpublishVolume(bctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: "pub1", NodeId: "w1"}); err != nil {
		t.Errorf("unpublishing pub1 of the lost s1: %v", err)
	}
	if _, err := ctl.DeleteVolume(bctx, &csi.DeleteVolumeRequest{VolumeId: "del1"}); err != nil {
		t.Errorf("deleting del1 of the lost s1: %v", err)
	}
	var pub1 v1alpha1.NBDVolume
	if err := c.Get(ctx, client.ObjectKey{Name: "pub1"}, &pub1); err != nil || len(pub1.Spec.Publications) != 0 {
		t.Errorf("pub1 after its unpublish: %v, publications %+v", err, pub1.Spec.Publications)
	}
	waitEvents(t, c, func(evs []corev1.Event) string {
		for _, e := range evs {
			if e.InvolvedObject.Name == "del1" && e.Reason == "BackingStoreWrittenOff" && e.Type == corev1.EventTypeWarning && strings.Contains(e.Message, "s1") {
				return ""
			}
		}
		return "no BackingStoreWrittenOff Event on del1"
	})
	// s2's volumes still wait: its agent renews.
	for _, id := range []string{"pub2", "del2"} {
		var v v1alpha1.NBDVolume
		if err := c.Get(ctx, client.ObjectKey{Name: id}, &v); err != nil {
			t.Fatal(err)
		}
		if !slices.Contains(v.Finalizers, v1alpha1.Finalizer) {
			t.Errorf("%s of s2, whose agent renews, lost its finalizer", id)
		}
	}

	// s1 back: its agent makes its NBDStorageNode anew.
	now = now.Add(time.Second)
	putStorageNode(t, c, "s1", 10*gib, nil, nil, now)
	renewLease(t, c, testNamespace, "s1", now)
	renewLease(t, c, testNamespace, "s2", now)
	check()
	if err := c.Get(ctx, client.ObjectKey{Name: "keep1"}, &keep); err != nil {
		t.Fatal(err)
	}
	if r := meta.FindStatusCondition(keep.Status.Conditions, v1alpha1.ConditionReachable); r == nil || r.Status != metav1.ConditionTrue {
		t.Errorf("keep1's Reachable condition %+v after s1 is back, want True", r)
	}
}
