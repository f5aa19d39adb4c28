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
	"slices"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
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
	_, c := apiserver.Start(t)
	ctx := context.Background()
	const ns = "mpnbd-failover"
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	clock := func() time.Time { return now }
	renew := func(node string) {
		t.Helper()
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

	f := NewFailover(FailoverConfig{Client: c, Namespace: ns, Now: clock})
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
	var evs corev1.EventList
	if err := c.List(ctx, &evs, client.InNamespace(metav1.NamespaceDefault)); err != nil {
		t.Fatal(err)
	}
	found := false
	for _, e := range evs.Items {
		if e.InvolvedObject.Name == "va" && e.Reason == "FailedOver" {
			found = true
		}
	}
	if !found {
		t.Error("no FailedOver Event on va")
	}
}
