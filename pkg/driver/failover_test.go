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
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
)

// TestFailoverCheck runs Failover.Check against a real API server with
// a clock of its own: a storage node is gone only once the controller
// has not seen its lease renewed for the lease's duration; then each
// replicated volume whose primary it held moves to the first replica in
// sync whose lease is alive (record first, epoch raised, then spec),
// and no other volume moves: not one with no live replica in sync, not
// one whose primary never had a lease, not an unreplicated one. A
// promotion recorded and not moved is finished.
func TestFailoverCheck(t *testing.T) {
	const ns = testNamespace
	c, ctl := controllerTestEnv(t)
	ctx := context.Background()
	now := time.Now()
	clock := func() time.Time { return now }
	renew := func(node string) { renewLease(t, c, ns, node, now) }
	volume := func(name, primary string, replicas, inSync []string, recorded string) {
		t.Helper()
		v := &v1alpha1.NBDVolume{ObjectMeta: metav1.ObjectMeta{Name: name},
			Spec: v1alpha1.NBDVolumeSpec{StorageNode: primary, SizeBytes: 1 << 20, AccessType: v1alpha1.AccessBlock, Replicas: int32(len(replicas) + 1), ReplicaNodes: replicas}}
		if err := c.Create(ctx, v); err != nil {
			t.Fatal(err)
		}
		if inSync == nil {
			return
		}
		v.Status.Replication = &v1alpha1.ReplicationStatus{Epoch: 3, Primary: recorded, PrimaryEpoch: 3, InSync: inSync, InSyncReplicas: int32(len(inSync))}
		if err := c.Status().Update(ctx, v); err != nil {
			t.Fatal(err)
		}
	}
	get := func(name string) *v1alpha1.NBDVolume {
		t.Helper()
		var v v1alpha1.NBDVolume
		if err := c.Get(ctx, client.ObjectKey{Name: name}, &v); err != nil {
			t.Fatal(err)
		}
		return &v
	}
	for _, n := range []string{"s1", "s2", "s3"} {
		renew(n)
	}
	// Primary s1, both replicas in sync: moves to s2 (s3's lease is
	// alive too, s2 comes first).
	volume("va", "s1", []string{"s2", "s3"}, []string{"s1", "s2", "s3"}, "s1")
	// Only the primary in sync: nobody may take over.
	volume("vb", "s1", []string{"s2"}, []string{"s1"}, "s1")
	// Its replica in sync is s3, which is gone too.
	volume("vc", "s1", []string{"s3"}, []string{"s1", "s3"}, "s1")
	// Its primary never had a lease (an older agent): never moved.
	volume("vd", "old", []string{"s2"}, []string{"old", "s2"}, "old")
	// Unreplicated.
	volume("ve", "s1", nil, nil, "")
	// A promotion recorded (s3) and not moved.
	volume("vf", "s2", []string{"s3"}, []string{"s3"}, "s3")

	metrics, err := NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	f := NewFailover(FailoverConfig{Client: ctl, Namespace: ns, Now: clock, Metrics: metrics})
	if moved, err := f.Check(ctx, false); err != nil || len(moved) != 0 {
		t.Fatalf("with every lease fresh: moved %v, %v", moved, err)
	}
	if get("vf").Spec.StorageNode != "s2" {
		t.Fatal("a check that looks at no volume moved one")
	}
	// 5s on, s2 and s3 renewed, s1 not: not gone yet.
	now = now.Add(5 * time.Second)
	renew("s2")
	renew("s3")
	if moved, err := f.Check(ctx, false); err != nil || len(moved) != 0 {
		t.Fatalf("s1 5s unrenewed (lease 6s): moved %v, %v", moved, err)
	}
	// 7s after s1's last renewal: s1 gone, s2 and s3 alive.
	now = now.Add(2 * time.Second)
	renew("s2")
	moved, err := f.Check(ctx, false)
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(moved)
	if !slices.Equal(moved, []string{"va", "vc", "vf"}) {
		t.Fatalf("moved %v, want va, vc (to s3, alive still) and vf (the half-made promotion)", moved)
	}
	// Two promotions (vf's was made before): counted as failovers.
	if n := testutil.ToFloat64(metrics.failovers.WithLabelValues("FailedOver")); n != 2 {
		t.Errorf("mpnbd_controller_primary_changes_total{reason=FailedOver} %v, want 2", n)
	}
	va := get("va")
	if r := va.Status.Replication; r.Primary != "s2" || r.Epoch != 4 || r.PrimaryEpoch != 4 || !slices.Equal(r.InSync, []string{"s2", "s3"}) || r.InSyncReplicas != 2 {
		t.Errorf("va's record: %+v", r)
	}
	if va.Spec.StorageNode != "s2" || !slices.Equal(va.Spec.ReplicaNodes, []string{"s3", "s1"}) {
		t.Errorf("va's spec: %s, %v", va.Spec.StorageNode, va.Spec.ReplicaNodes)
	}
	if _, ok := va.Labels[v1alpha1.ReplicaLabel("s1")]; !ok {
		t.Errorf("va's labels: %v", va.Labels)
	}
	if vc := get("vc"); vc.Spec.StorageNode != "s3" || vc.Status.Replication.Primary != "s3" {
		t.Errorf("vc: %s, %+v", vc.Spec.StorageNode, vc.Status.Replication)
	}
	if vf := get("vf"); vf.Spec.StorageNode != "s3" || !slices.Equal(vf.Spec.ReplicaNodes, []string{"s2"}) || vf.Status.Replication.Epoch != 3 {
		t.Errorf("vf: %s %v, %+v", vf.Spec.StorageNode, vf.Spec.ReplicaNodes, vf.Status.Replication)
	}
	for _, name := range []string{"vb", "vd", "ve"} {
		v := get(name)
		if (v.Spec.StorageNode != "s1" && v.Spec.StorageNode != "old") || v.Status.Replication != nil && v.Status.Replication.Epoch != 3 {
			t.Errorf("%s moved: %s, %+v", name, v.Spec.StorageNode, v.Status.Replication)
		}
	}
	// Checked again: nothing more moves (va's primary s2 is alive).
	if moved, err := f.Check(ctx, true); err != nil || len(moved) != 0 {
		t.Fatalf("checked again: moved %v, %v", moved, err)
	}
	// An Event on the moved volume says what happened.
	waitEvents(t, c, func(evs []corev1.Event) string {
		for _, e := range evs {
			if e.InvolvedObject.Name == "va" && e.Reason == "FailedOver" && e.Namespace == metav1.NamespaceDefault {
				return ""
			}
		}
		return "no FailedOver Event on va"
	})
}

// waitEvents waits (up to 10 s: the recorder writes in the background)
// until cond, given every Event, returns "".
func waitEvents(t *testing.T, c client.Client, cond func([]corev1.Event) string) {
	t.Helper()
	for end := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		var evs corev1.EventList
		if err := c.List(context.Background(), &evs); err != nil {
			t.Fatal(err)
		}
		msg := cond(evs.Items)
		if msg == "" {
			return
		}
		if time.Now().After(end) {
			t.Fatal(msg)
		}
	}
}

// TestFailoverReplacesLost: a replica whose storage node's lease stays
// unrenewed for ReplicaLostAfter is replaced by a fresh storage node with
// room, in a zone of its own, not already holding the volume; its label
// and replica finalizer go. A node gone for less is not replaced; a
// volume being deleted only loses the lost node's finalizer; a replica
// whose NBDStorageNode was deleted is lost at once; with no node to take
// it, the replica stays.
func TestFailoverReplacesLost(t *testing.T) {
	const ns = testNamespace
	c, ctl := controllerTestEnv(t)
	ctx := context.Background()
	now := time.Now()
	renew := func(node string) { renewLease(t, c, ns, node, now) }
	storageNode := func(name, zone string, avail int64) {
		t.Helper()
		n := &v1alpha1.NBDStorageNode{ObjectMeta: metav1.ObjectMeta{Name: name}}
		if err := c.Create(ctx, n); err != nil {
			t.Fatal(err)
		}
		n.Status = v1alpha1.NBDStorageNodeStatus{AvailableBytes: avail, CapacityBytes: 2 * avail, Addresses: []string{"192.0.2.1"}, Port: 10809,
			Topology: map[string]string{ZoneLabel: zone}, Heartbeat: metav1.NewTime(now)}
		if err := c.Status().Update(ctx, n); err != nil {
			t.Fatal(err)
		}
	}
	const gi = int64(1) << 30
	storageNode("s1", "a", 100*gi)
	storageNode("s2", "b", 100*gi)
	storageNode("s3", "c", 100*gi)
	storageNode("s4", "a", 500*gi) // the most room, but s1's zone
	storageNode("s5", "d", 50*gi)
	storageNode("s6", "e", 10*gi)
	storageNode("tiny", "f", 1)
	for _, n := range []string{"s1", "s2", "s3", "s4", "s5", "s6", "tiny"} {
		renew(n)
	}
	volume := func(name string, replicas []string, finalizers ...string) {
		t.Helper()
		labels := map[string]string{}
		for _, r := range replicas {
			labels[v1alpha1.ReplicaLabel(r)] = ""
		}
		v := &v1alpha1.NBDVolume{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels, Finalizers: finalizers},
			Spec: v1alpha1.NBDVolumeSpec{StorageNode: "s1", SizeBytes: gi, AccessType: v1alpha1.AccessBlock, Replicas: int32(len(replicas) + 1), ReplicaNodes: replicas}}
		if err := c.Create(ctx, v); err != nil {
			t.Fatal(err)
		}
		in := append([]string{"s1"}, replicas...)
		v.Status.Replication = &v1alpha1.ReplicationStatus{Epoch: 1, Primary: "s1", PrimaryEpoch: 1, InSync: in, InSyncReplicas: int32(len(in))}
		if err := c.Status().Update(ctx, v); err != nil {
			t.Fatal(err)
		}
	}
	volume("va", []string{"s2", "s3"}, v1alpha1.ReplicaFinalizer("s2"), v1alpha1.ReplicaFinalizer("s3"))
	volume("vdel", []string{"s3"}, v1alpha1.ReplicaFinalizer("s3"), "test.mpnbd.io/hold")
	if err := c.Delete(ctx, &v1alpha1.NBDVolume{ObjectMeta: metav1.ObjectMeta{Name: "vdel"}}); err != nil {
		t.Fatal(err)
	}
	f := NewFailover(FailoverConfig{Client: ctl, Namespace: ns, Now: func() time.Time { return now }, ReplicaLostAfter: time.Minute, StaleAfter: time.Hour})
	get := func(name string) *v1alpha1.NBDVolume {
		t.Helper()
		var v v1alpha1.NBDVolume
		if err := c.Get(ctx, client.ObjectKey{Name: name}, &v); err != nil {
			t.Fatal(err)
		}
		return &v
	}
	step := func(d time.Duration) {
		t.Helper()
		now = now.Add(d)
		for _, n := range []string{"s1", "s2", "s4", "s5", "s6", "tiny"} {
			renew(n)
		}
		if _, err := f.Check(ctx, true); err != nil {
			t.Fatal(err)
		}
	}
	// Labels of nodes that hold no replica: taken off once their
	// agent's finalizer is gone.
	volume("vlab", []string{"s2"}, v1alpha1.ReplicaFinalizer("s2"), v1alpha1.ReplicaFinalizer("held"))
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		v := get("vlab")
		v.Labels[v1alpha1.ReplicaLabel("released")] = ""
		v.Labels[v1alpha1.ReplicaLabel("held")] = ""
		return c.Update(ctx, v)
	})
	if err != nil {
		t.Fatal(err)
	}
	step(0)
	if l := get("vlab").Labels; !maps.Equal(l, map[string]string{v1alpha1.ReplicaLabel("s2"): "", v1alpha1.ReplicaLabel("held"): ""}) {
		t.Errorf("vlab's labels: %v, want the released node's taken off", l)
	}
	// s3 gone 30s: not lost yet.
	step(30 * time.Second)
	if v := get("va"); !slices.Equal(v.Spec.ReplicaNodes, []string{"s2", "s3"}) {
		t.Fatalf("s3 gone 30s: replicas %v", v.Spec.ReplicaNodes)
	}
	// Gone 61s: lost. s4 has the most room but sits in s1's zone; s5
	// is next.
	step(31 * time.Second)
	va := get("va")
	if !slices.Equal(va.Spec.ReplicaNodes, []string{"s2", "s5"}) {
		t.Fatalf("s3 lost: replicas %v, want s2 and s5", va.Spec.ReplicaNodes)
	}
	if _, ok := va.Labels[v1alpha1.ReplicaLabel("s5")]; !ok {
		t.Errorf("va's labels %v: no s5", va.Labels)
	}
	if _, ok := va.Labels[v1alpha1.ReplicaLabel("s3")]; ok {
		t.Errorf("va's labels %v: s3's kept", va.Labels)
	}
	if slices.Contains(va.Finalizers, v1alpha1.ReplicaFinalizer("s3")) || !slices.Contains(va.Finalizers, v1alpha1.ReplicaFinalizer("s2")) {
		t.Errorf("va's finalizers %v", va.Finalizers)
	}
	if va.Status.Replication.Epoch != 1 {
		t.Errorf("the controller changed va's record: %+v (the primary's agent drops the lost node)", va.Status.Replication)
	}
	vdel := get("vdel")
	if slices.Contains(vdel.Finalizers, v1alpha1.ReplicaFinalizer("s3")) || !slices.Equal(vdel.Spec.ReplicaNodes, []string{"s3"}) {
		t.Errorf("the deleted volume: finalizers %v, replicas %v (want s3's finalizer gone, nothing placed)", vdel.Finalizers, vdel.Spec.ReplicaNodes)
	}
	// s2's NBDStorageNode deleted: lost at once. Left: s6 (zone e,
	// room), not s4 (zone a), not tiny (no room).
	if err := c.Delete(ctx, &v1alpha1.NBDStorageNode{ObjectMeta: metav1.ObjectMeta{Name: "s2"}}); err != nil {
		t.Fatal(err)
	}
	step(time.Second)
	if va := get("va"); !slices.Equal(va.Spec.ReplicaNodes, []string{"s6", "s5"}) {
		t.Fatalf("s2 deleted: replicas %v, want s6 and s5", va.Spec.ReplicaNodes)
	}
	// s6 deleted too: nobody left to take it; the replica stays.
	if err := c.Delete(ctx, &v1alpha1.NBDStorageNode{ObjectMeta: metav1.ObjectMeta{Name: "s6"}}); err != nil {
		t.Fatal(err)
	}
	step(time.Second)
	if va := get("va"); !slices.Equal(va.Spec.ReplicaNodes, []string{"s6", "s5"}) {
		t.Fatalf("no node to take s6's replica: replicas %v", va.Spec.ReplicaNodes)
	}
	vlab := get("vlab")
	vlab.Finalizers = nil
	if err := c.Update(ctx, vlab); err != nil {
		t.Fatal(err)
	}
	// Release the test's hold on vdel.
	vdel = get("vdel")
	vdel.Finalizers = nil
	if err := c.Update(ctx, vdel); err != nil {
		t.Fatal(err)
	}
}

// controllerTestEnv starts a real API server with the controller's namespace
// (testNamespace), in which the storage agents' leases are, and the deploy
// tree's RBAC of the controller. It returns an admin client, for what the
// agents and the test do, and one acting as the controller's
// ServiceAccount, for the Failover: a call it makes that the RBAC does not
// grant fails the test.
func controllerTestEnv(t *testing.T) (admin, asController client.Client) {
	t.Helper()
	cfg, c := apiserver.Start(t)
	ctx := context.Background()
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: testNamespace}}); err != nil {
		t.Fatal(err)
	}
	if err := apiserver.Apply(ctx, c, "deploy/rbac-controller.yaml"); err != nil {
		t.Fatal(err)
	}
	ctl, err := client.New(apiserver.As(cfg, "mpnbd-controller", ""), client.Options{Scheme: c.Scheme()})
	if err != nil {
		t.Fatal(err)
	}
	return c, ctl
}

// renewLease renews (or makes) storage node's lease in ns at now, for 6s,
// as its agent does.
func renewLease(t *testing.T, c client.Client, ns, node string, now time.Time) {
	t.Helper()
	ctx := context.Background()
	name := v1alpha1.StorageLeaseName(node)
	rt := metav1.NewMicroTime(now)
	var l coordinationv1.Lease
	err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, &l)
	l.Spec = coordinationv1.LeaseSpec{HolderIdentity: ptr.To(node), LeaseDurationSeconds: ptr.To(int32(6)), RenewTime: &rt}
	if err != nil {
		l.ObjectMeta = metav1.ObjectMeta{Namespace: ns, Name: name}
		err = c.Create(ctx, &l)
	} else {
		err = c.Update(ctx, &l)
	}
	if err != nil {
		t.Fatal(err)
	}
}

// TestFailoverDrain: a draining storage node's replicas move off it make
// before break, one check at a time: a copy is added elsewhere (never on
// a cordoned node, whatever its room), the drain waits for it to be in
// sync, then a primary on the draining node is handed to an in-sync
// replica and a replica on it leaves the volume; an unreplicated volume
// stays. A cordoned node takes no new volume.
func TestFailoverDrain(t *testing.T) {
	const ns = testNamespace
	c, ctl := controllerTestEnv(t)
	ctx := context.Background()
	now := time.Now()
	const gi = int64(1) << 30
	storageNode := func(name, zone string, avail int64, spec v1alpha1.NBDStorageNodeSpec) {
		t.Helper()
		n := &v1alpha1.NBDStorageNode{ObjectMeta: metav1.ObjectMeta{Name: name}, Spec: spec}
		if err := c.Create(ctx, n); err != nil {
			t.Fatal(err)
		}
		n.Status = v1alpha1.NBDStorageNodeStatus{AvailableBytes: avail, CapacityBytes: 2 * avail, Addresses: []string{"192.0.2.1"}, Port: 10809,
			Topology: map[string]string{ZoneLabel: zone}, Heartbeat: metav1.NewTime(now)}
		if err := c.Status().Update(ctx, n); err != nil {
			t.Fatal(err)
		}
		renewLease(t, c, ns, name, now)
	}
	storageNode("s1", "a", 100*gi, v1alpha1.NBDStorageNodeSpec{})
	storageNode("s2", "b", 100*gi, v1alpha1.NBDStorageNodeSpec{})
	storageNode("s3", "c", 200*gi, v1alpha1.NBDStorageNodeSpec{})
	storageNode("s4", "d", 100*gi, v1alpha1.NBDStorageNodeSpec{})
	storageNode("s5", "e", 900*gi, v1alpha1.NBDStorageNodeSpec{Unschedulable: true})
	storageNode("s6", "a", 50*gi, v1alpha1.NBDStorageNodeSpec{}) // s1's zone
	volume := func(name, primary string, replicas ...string) {
		t.Helper()
		labels := map[string]string{}
		for _, r := range replicas {
			labels[v1alpha1.ReplicaLabel(r)] = ""
		}
		v := &v1alpha1.NBDVolume{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels},
			Spec: v1alpha1.NBDVolumeSpec{StorageNode: primary, SizeBytes: gi, AccessType: v1alpha1.AccessBlock, Replicas: int32(len(replicas) + 1), ReplicaNodes: replicas}}
		if err := c.Create(ctx, v); err != nil {
			t.Fatal(err)
		}
		in := slices.Sorted(slices.Values(append([]string{primary}, replicas...)))
		v.Status.Replication = &v1alpha1.ReplicationStatus{Epoch: 1, Primary: primary, PrimaryEpoch: 1, InSync: in, InSyncReplicas: int32(len(in))}
		if err := c.Status().Update(ctx, v); err != nil {
			t.Fatal(err)
		}
	}
	volume("vp", "s1", "s2")       // its primary on the draining node
	volume("vr", "s2", "s1")       // a replica on it
	volume("vu", "s1")             // unreplicated: moved as well
	volume("v3", "s1", "s2", "s4") // three replicas: four holders while one moves
	get := func(name string) *v1alpha1.NBDVolume {
		t.Helper()
		var v v1alpha1.NBDVolume
		if err := c.Get(ctx, client.ObjectKey{Name: name}, &v); err != nil {
			t.Fatal(err)
		}
		return &v
	}
	// The agents' part: a replica's copy in sync (recorded by the
	// primary's agent).
	inSync := func(name string, nodes ...string) {
		t.Helper()
		err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
			v := get(name)
			v.Status.Replication.Epoch++
			v.Status.Replication.InSync = slices.Sorted(slices.Values(nodes))
			v.Status.Replication.InSyncReplicas = int32(len(nodes))
			return c.Status().Update(ctx, v)
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	want := func(name, primary string, replicas ...string) {
		t.Helper()
		v := get(name)
		if v.Spec.StorageNode != primary || !slices.Equal(v.Spec.ReplicaNodes, replicas) {
			t.Fatalf("%s: on %s with replicas %v; want %s with %v", name, v.Spec.StorageNode, v.Spec.ReplicaNodes, primary, replicas)
		}
		for _, r := range replicas {
			if _, ok := v.Labels[v1alpha1.ReplicaLabel(r)]; !ok {
				t.Fatalf("%s: no label for replica %s: %v", name, r, v.Labels)
			}
		}
	}
	f := NewFailover(FailoverConfig{Client: ctl, Namespace: ns, Now: func() time.Time { return now }, StaleAfter: time.Hour})
	check := func() []string {
		t.Helper()
		now = now.Add(time.Second)
		for _, n := range []string{"s1", "s2", "s3", "s4", "s5", "s6"} {
			renewLease(t, c, ns, n, now)
		}
		moved, err := f.Check(ctx, false)
		if err != nil {
			t.Fatal(err)
		}
		slices.Sort(moved)
		return moved
	}
	if moved := check(); len(moved) != 0 {
		t.Fatalf("nothing draining: moved %v", moved)
	}
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		var n v1alpha1.NBDStorageNode
		if err := c.Get(ctx, client.ObjectKey{Name: "s1"}, &n); err != nil {
			return err
		}
		n.Spec.Drain = true
		return c.Update(ctx, &n)
	})
	if err != nil {
		t.Fatal(err)
	}
	// 1: a copy each on s3 (the most room of the schedulable nodes in a
	// zone of their own; s5, cordoned, has more).
	if moved := check(); !slices.Equal(moved, []string{"v3", "vp", "vr", "vu"}) {
		t.Fatalf("drain, first check: moved %v", moved)
	}
	want("vu", "s1", "s6") // its zone kept
	want("v3", "s1", "s2", "s4", "s3")
	want("vp", "s1", "s2", "s3")
	want("vr", "s2", "s1", "s3")
	// 2: s3 not in sync yet: nothing moves.
	if moved := check(); len(moved) != 0 {
		t.Fatalf("copies not in sync yet: moved %v", moved)
	}
	// 3: in sync; vp's primary is handed to s2 (in sync, alive, first),
	// vr lets s1's replica go.
	inSync("vp", "s1", "s2", "s3")
	inSync("vr", "s1", "s2", "s3")
	inSync("v3", "s1", "s2", "s3", "s4")
	inSync("vu", "s1", "s6")
	if moved := check(); !slices.Equal(moved, []string{"v3", "vp", "vr", "vu"}) {
		t.Fatalf("copies in sync: moved %v", moved)
	}
	want("v3", "s2", "s4", "s3", "s1")
	want("vu", "s6", "s1")
	vp := get("vp")
	if r := vp.Status.Replication; r.Primary != "s2" || r.PrimaryEpoch != r.Epoch || slices.Contains(r.InSync, "s1") {
		t.Fatalf("vp's record after the switchover: %+v", r)
	}
	want("vp", "s2", "s3", "s1")
	want("vr", "s2", "s3")
	// 4: s1, now vp's replica out of sync, goes.
	if moved := check(); !slices.Equal(moved, []string{"v3", "vp", "vu"}) {
		t.Fatalf("after the switchover: moved %v", moved)
	}
	want("vu", "s6")
	want("vp", "s2", "s3")
	want("v3", "s2", "s4", "s3")
	if moved := check(); len(moved) != 0 {
		t.Fatalf("drained: moved %v", moved)
	}
	waitEvents(t, c, func(evs []corev1.Event) string {
		reasons := map[string][]string{}
		for _, e := range evs {
			reasons[e.InvolvedObject.Name] = append(reasons[e.InvolvedObject.Name], e.Reason)
		}
		for name, want := range map[string][]string{"vp": {"DrainCopying", "Drained", "SwitchedOver"}, "v3": {"DrainCopying", "Drained", "SwitchedOver"}, "vu": {"DrainCopying", "Drained", "SwitchedOver"}, "vr": {"DrainCopying", "Drained"}} {
			if got := slices.Sorted(slices.Values(reasons[name])); !slices.Equal(got, want) {
				return fmt.Sprintf("%s's events: %v, want %v", name, got, want)
			}
		}
		return ""
	})

	// A cordoned or draining node takes no new volume.
	csi, err := NewController(ControllerConfig{Client: ctl, Namespace: ns, StaleAfter: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"s5", "s1"} {
		if _, err := csi.pickStorageNode(ctx, Params{StorageNode: name}, nil, gi); !errors.Is(err, ErrExhausted) || !strings.Contains(err.Error(), "cordoned or draining") {
			t.Errorf("a volume pinned to %s: %v, want ResourceExhausted naming the cordon", name, err)
		}
	}
}
