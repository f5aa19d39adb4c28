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
	"slices"
	"strings"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
)

// Failover moves a replicated volume to another replica when its
// primary's storage node is gone (docs/replication.md). A storage node is
// gone when the controller has not seen its agent's lease
// (v1alpha1.StorageLeaseName) renewed for the lease's duration, measured
// on the controller's own clock from the moment it saw the last renewal,
// so that the clocks of the nodes do not matter. A node whose lease it
// has never seen is taken for alive: an agent without a lease is never
// failed over from.
//
// A promotion is two writes, each conditional on the object as it was
// read (resourceVersion): first the record (status.replication: the new
// primary, an in-sync replica whose own lease is alive; the epoch raised
// and primaryEpoch with it; the old primary out of the in-sync set), at
// which the replicas refuse the old primary's forwards and the old
// primary's agent, if it is still there to see it, stops serving; then the
// spec (spec.storageNode the new primary, the old one among
// spec.replicaNodes, labelled for its agent to hold a replica), at which
// the new primary's agent serves the volume. A controller that stops
// between the two leaves a recorded primary that spec.storageNode does not
// name; the next Check moves the spec.
type Failover struct {
	cfg  FailoverConfig
	seen map[string]leaseSeen
}

// FailoverConfig configures a Failover.
type FailoverConfig struct {
	// Client reads Leases in Namespace, NBDVolumes and writes them and
	// their status, and records Events.
	Client client.Client
	// Namespace holds the storage agents' Leases.
	Namespace string
	Logger    *slog.Logger
	// Interval is how often Run checks (default 1s).
	Interval time.Duration
	// Now is the clock (tests); nil means time.Now.
	Now func() time.Time
}

// leaseSeen is a storage node's lease as the controller last saw it
// change.
type leaseSeen struct {
	renew    time.Time     // its renewTime, as written
	at       time.Time     // when this controller saw that renewTime first
	duration time.Duration // its leaseDurationSeconds
}

// NewFailover returns a Failover; Run (or Check) does the work.
func NewFailover(cfg FailoverConfig) *Failover {
	if cfg.Interval <= 0 {
		cfg.Interval = time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	return &Failover{cfg: cfg, seen: map[string]leaseSeen{}}
}

// Run checks every Interval until ctx ends.
func (f *Failover) Run(ctx context.Context) {
	t := time.NewTicker(f.cfg.Interval)
	defer t.Stop()
	for n := 0; ; n++ {
		// Every 10th check looks at the volumes even with every node
		// alive: a promotion a controller recorded and did not finish.
		if _, err := f.Check(ctx, n%10 == 0); err != nil && ctx.Err() == nil {
			f.cfg.Logger.Warn("failover check", "error", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Check reads the storage agents' leases and, when a storage node is gone
// (or always), fails over the replicated volumes whose primary it holds,
// and finishes promotions half made. It returns the volumes it moved.
func (f *Failover) Check(ctx context.Context, always bool) ([]string, error) {
	var leases coordinationv1.LeaseList
	if err := f.cfg.Client.List(ctx, &leases, client.InNamespace(f.cfg.Namespace)); err != nil {
		return nil, fmt.Errorf("listing the storage agents' leases: %w", err)
	}
	now := f.cfg.Now()
	for _, l := range leases.Items {
		node, ok := strings.CutPrefix(l.Name, v1alpha1.StorageLeaseName(""))
		if !ok || l.Spec.RenewTime == nil || l.Spec.LeaseDurationSeconds == nil {
			continue
		}
		renew := l.Spec.RenewTime.Time
		if s, ok := f.seen[node]; !ok || !s.renew.Equal(renew) {
			f.seen[node] = leaseSeen{renew: renew, at: now, duration: time.Duration(*l.Spec.LeaseDurationSeconds) * time.Second}
		}
	}
	gone := map[string]time.Duration{}
	for node, s := range f.seen {
		if d := now.Sub(s.at); d >= s.duration {
			gone[node] = d
		}
	}
	if len(gone) == 0 && !always {
		return nil, nil
	}
	var vols v1alpha1.NBDVolumeList
	if err := f.cfg.Client.List(ctx, &vols); err != nil {
		return nil, fmt.Errorf("listing volumes: %w", err)
	}
	var moved []string
	var errs []error
	for i := range vols.Items {
		v := &vols.Items[i]
		rec := v.Status.Replication
		if rec == nil || len(v.Spec.ReplicaNodes) == 0 || !v.DeletionTimestamp.IsZero() {
			continue
		}
		if rec.Primary != v.Spec.StorageNode {
			if slices.Contains(v.Spec.ReplicaNodes, rec.Primary) {
				if err := f.moveSpec(ctx, v.Name); err != nil {
					errs = append(errs, err)
				} else {
					moved = append(moved, v.Name)
				}
			}
			continue
		}
		away, ok := gone[rec.Primary]
		if !ok {
			continue
		}
		next := f.candidate(v, gone)
		if next == "" {
			f.cfg.Logger.Error("a replicated volume's primary is gone and no replica in sync is alive to take over: the volume waits",
				"volume_id", v.Name, "primary", rec.Primary, "in_sync", rec.InSync, "gone_for", away.Round(time.Second))
			continue
		}
		if err := f.promote(ctx, v, next, away); err != nil {
			errs = append(errs, err)
			continue
		}
		moved = append(moved, v.Name)
	}
	if len(errs) > 0 {
		return moved, fmt.Errorf("%d failover(s) failed, the first: %w", len(errs), errs[0])
	}
	return moved, nil
}

// candidate is the replica of v to promote: in the in-sync set, one of
// spec.replicaNodes, with its lease seen alive; the first by name; "" when
// there is none.
func (f *Failover) candidate(v *v1alpha1.NBDVolume, gone map[string]time.Duration) string {
	for _, n := range slices.Sorted(slices.Values(v.Status.Replication.InSync)) {
		if _, dead := gone[n]; dead || n == v.Status.Replication.Primary || !slices.Contains(v.Spec.ReplicaNodes, n) {
			continue
		}
		if _, alive := f.seen[n]; alive {
			return n
		}
	}
	return ""
}

// promote records next as v's primary, then moves the spec to it.
func (f *Failover) promote(ctx context.Context, v *v1alpha1.NBDVolume, next string, away time.Duration) error {
	rec := v.Status.Replication
	old := rec.Primary
	inSync := slices.DeleteFunc(slices.Clone(rec.InSync), func(n string) bool { return n == old })
	orig := v.DeepCopy()
	v.Status.Replication = &v1alpha1.ReplicationStatus{Epoch: rec.Epoch + 1, Primary: next, PrimaryEpoch: rec.Epoch + 1,
		InSync: inSync, InSyncReplicas: int32(len(inSync))}
	if err := f.cfg.Client.Status().Patch(ctx, v, client.MergeFromWithOptions(orig, client.MergeFromWithOptimisticLock{})); err != nil {
		return fmt.Errorf("volume %s: recording %s its primary: %w", v.Name, next, err)
	}
	f.cfg.Logger.Warn("a replicated volume's primary is gone: another replica promoted", "volume_id", v.Name,
		"gone", old, "gone_for", away.Round(time.Millisecond), "primary", next, "epoch", v.Status.Replication.Epoch, "in_sync", inSync)
	f.event(ctx, v, corev1.EventTypeWarning, "FailedOver", fmt.Sprintf(
		"the storage node %s of the primary is gone (its agent's lease not renewed for %v): the replica on %s is the primary from replica epoch %d",
		old, away.Round(time.Second), next, v.Status.Replication.Epoch))
	return f.moveSpec(ctx, v.Name)
}

// moveSpec makes spec.storageNode the recorded primary of volume name,
// and the node it names now one of spec.replicaNodes (labelled so that
// its agent holds its replica).
func (f *Failover) moveSpec(ctx context.Context, name string) error {
	for attempt := 0; ; attempt++ {
		var v v1alpha1.NBDVolume
		if err := f.cfg.Client.Get(ctx, client.ObjectKey{Name: name}, &v); err != nil {
			return fmt.Errorf("volume %s: %w", name, err)
		}
		rec := v.Status.Replication
		if rec == nil || rec.Primary == v.Spec.StorageNode || !slices.Contains(v.Spec.ReplicaNodes, rec.Primary) {
			return nil
		}
		old := v.Spec.StorageNode
		nodes := slices.DeleteFunc(slices.Clone(v.Spec.ReplicaNodes), func(n string) bool { return n == rec.Primary })
		if v1alpha1.ValidReplicaNode(old) == nil {
			nodes = append(nodes, old)
			if v.Labels == nil {
				v.Labels = map[string]string{}
			}
			v.Labels[v1alpha1.ReplicaLabel(old)] = ""
		}
		v.Spec.StorageNode, v.Spec.ReplicaNodes = rec.Primary, nodes
		err := f.cfg.Client.Update(ctx, &v)
		if apierrors.IsConflict(err) && attempt < 5 {
			continue
		}
		if err != nil {
			return fmt.Errorf("volume %s: moving it to its primary %s: %w", name, rec.Primary, err)
		}
		f.cfg.Logger.Info("volume moved to its recorded primary", "volume_id", name, "storage_node", rec.Primary, "replica_nodes", nodes)
		return nil
	}
}

// event records an Event on v; a failure is logged.
func (f *Failover) event(ctx context.Context, v *v1alpha1.NBDVolume, typ, reason, msg string) {
	now := metav1.Now()
	ev := &corev1.Event{
		ObjectMeta: metav1.ObjectMeta{GenerateName: v.Name + ".", Namespace: metav1.NamespaceDefault},
		InvolvedObject: corev1.ObjectReference{APIVersion: v1alpha1.GroupVersion.String(), Kind: "NBDVolume",
			Name: v.Name, UID: v.UID},
		Reason: reason, Message: msg, Type: typ,
		Source:         corev1.EventSource{Component: "mpnbd-controller"},
		FirstTimestamp: now, LastTimestamp: now, Count: 1,
	}
	if err := f.cfg.Client.Create(ctx, ev); err != nil {
		f.cfg.Logger.Warn("recording an event failed", "reason", reason, "message", msg, "error", err)
	}
}
