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
	"k8s.io/client-go/tools/record"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/kubeevents"
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
//
// A replica (not the primary) whose storage node is lost for good, its
// lease unrenewed for ReplicaLostAfter or its NBDStorageNode deleted, is
// replaced: another storage node, fresh, with room, matching the
// volume's StorageClass parameters and in a zone of its own (as placement
// chooses), takes its place in spec.replicaNodes; the lost node's label
// and replica finalizer go with it (its copy is abandoned: its agent, if
// it ever comes back, reports the file as an orphan). The primary's agent
// then drops the lost node from the in-sync set, if it is still there,
// and fills the new replica by a full copy while it serves. A volume being
// deleted loses the lost nodes' replica finalizers, so that its deletion
// does not wait for a node that will not come back.
type Failover struct {
	cfg  FailoverConfig
	seen map[string]leaseSeen
	// told is when each volume's unplaceable replacement was last
	// logged.
	told map[string]time.Time
	// lastState is the nodes' states (gone, lost) at the last listing
	// of the volumes, at lastList.
	lastState string
	lastList  time.Time
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
	// ReplicaLostAfter is how long a replica's storage node may stay gone
	// before the replica is replaced on another node (default
	// DefaultReplicaLostAfter).
	ReplicaLostAfter time.Duration
	// StaleAfter: a storage node whose heartbeat is older takes no new
	// replica (default DefaultStaleAfter).
	StaleAfter time.Duration
	// Events records the Events on volumes and storage nodes; nil: one
	// of kubeevents.NewRecorder over Client.
	Events record.EventRecorder
	// Metrics counts the storage nodes Ready and the primaries moved
	// (nil: none).
	Metrics *Metrics
}

// DefaultReplicaLostAfter is FailoverConfig.ReplicaLostAfter's default.
const DefaultReplicaLostAfter = 10 * time.Minute

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
	if cfg.ReplicaLostAfter <= 0 {
		cfg.ReplicaLostAfter = DefaultReplicaLostAfter
	}
	if cfg.StaleAfter <= 0 {
		cfg.StaleAfter = DefaultStaleAfter
	}
	if cfg.Events == nil {
		cfg.Events, _ = kubeevents.NewRecorder(cfg.Client, "mpnbd-controller", cfg.Logger)
	}
	return &Failover{cfg: cfg, seen: map[string]leaseSeen{}, told: map[string]time.Time{}}
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
	leased := map[string]bool{}
	for _, l := range leases.Items {
		node, ok := strings.CutPrefix(l.Name, v1alpha1.StorageLeaseName(""))
		if !ok {
			continue
		}
		leased[node] = true
		if l.Spec.RenewTime == nil || l.Spec.LeaseDurationSeconds == nil {
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
	// The volumes are listed when a node's state changed (gone, or lost
	// for good), and at most every 10 s while nothing changes: a node
	// that stays dead for days must not have every volume listed each
	// second.
	var storage v1alpha1.NBDStorageNodeList
	if err := f.cfg.Client.List(ctx, &storage); err != nil {
		return nil, fmt.Errorf("listing storage nodes: %w", err)
	}
	nodes := map[string]*v1alpha1.NBDStorageNode{}
	draining := false
	for i := range storage.Items {
		nodes[storage.Items[i].Name] = &storage.Items[i]
		draining = draining || storage.Items[i].Spec.Drain
	}
	ready := f.markNodes(ctx, nodes, gone, now)
	f.cfg.Metrics.storageNodes(ready)
	// released: a storage node lost for good by an administrator's word
	// (its NBDStorageNode deleted) and the agent's own (no lease renewed
	// for its duration, or none at all): its volumes' publications and
	// backing-store finalizers are let go without its agent.
	released := func(n string) bool {
		if _, ok := nodes[n]; ok {
			return false
		}
		_, away := gone[n]
		return away || !leased[n]
	}
	var state []string
	for n, d := range gone {
		st := n + "=gone"
		if d >= f.cfg.ReplicaLostAfter {
			st = n + "=lost"
		}
		if released(n) {
			st = n + "=released"
		}
		state = append(state, st)
	}
	for n, r := range ready {
		if _, away := gone[n]; !r && !away {
			state = append(state, n+"=stale")
		}
	}
	slices.Sort(state)
	key := strings.Join(state, ",")
	// A drain is step by step (a copy in sync, then a switch): the
	// volumes are looked at every check while one goes on. A change of
	// the nodes' states is looked at at once (the volumes' conditions
	// follow it), and a state that stays no more than every 10 s.
	if !always && !draining && key == f.lastState && (len(gone) == 0 || now.Sub(f.lastList) < 10*time.Second) {
		return nil, nil
	}
	f.lastState, f.lastList = key, now
	var vols v1alpha1.NBDVolumeList
	if err := f.cfg.Client.List(ctx, &vols); err != nil {
		return nil, fmt.Errorf("listing volumes: %w", err)
	}
	// lost: gone for good (ReplicaLostAfter), or no NBDStorageNode.
	lost := func(n string) bool {
		_, ok := nodes[n]
		return !ok || gone[n] >= f.cfg.ReplicaLostAfter
	}
	var moved []string
	var errs []error
	for i := range vols.Items {
		v := &vols.Items[i]
		rec := v.Status.Replication
		if len(v.Spec.ReplicaNodes) > 0 && slices.ContainsFunc(v.Spec.ReplicaNodes, lost) {
			if err := f.replaceLost(ctx, v.Name, lost, nodes); err != nil {
				errs = append(errs, err)
			}
		}
		if err := f.dropStaleLabels(ctx, v); err != nil {
			errs = append(errs, err)
		}
		if !v.DeletionTimestamp.IsZero() {
			if released(v.Spec.StorageNode) {
				if err := f.writeOff(ctx, v); err != nil {
					errs = append(errs, err)
				}
			}
			continue
		}
		if err := f.markVolume(ctx, v, ready, released); err != nil {
			errs = append(errs, err)
		}
		if len(v.Spec.ReplicaNodes) == 0 {
			// An unreplicated volume on a draining node moves as a
			// replicated one does: a copy first (a replica, while it is
			// made), then the switch.
			if sn := nodes[v.Spec.StorageNode]; sn != nil && sn.Spec.Drain {
				if _, away := gone[v.Spec.StorageNode]; !away {
					step, err := f.drainStep(ctx, v, nodes, gone)
					if err != nil {
						errs = append(errs, err)
					} else if step {
						moved = append(moved, v.Name)
					}
				}
			}
			continue
		}
		if rec == nil {
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
			step, err := f.drainStep(ctx, v, nodes, gone)
			if err != nil {
				errs = append(errs, err)
			} else if step {
				moved = append(moved, v.Name)
			}
			continue
		}
		next := f.candidate(v, gone, rec.Primary)
		if next == "" {
			f.cfg.Logger.Error("a replicated volume's primary is gone and no replica in sync is alive to take over: the volume waits",
				"volume_id", v.Name, "primary", rec.Primary, "in_sync", rec.InSync, "gone_for", away.Round(time.Second))
			continue
		}
		err := f.promote(ctx, v, next, "a replicated volume's primary is gone: another replica promoted", "FailedOver", fmt.Sprintf(
			"the storage node %s of the primary is gone (its agent's lease not renewed for %v): the replica on %s is the primary from replica epoch %d",
			rec.Primary, away.Round(time.Second), next, rec.Epoch+1), "gone_for", away.Round(time.Millisecond))
		if err != nil {
			errs = append(errs, err)
			continue
		}
		moved = append(moved, v.Name)
	}
	if len(errs) > 0 {
		f.lastState = "" // the next check lists again
		return moved, fmt.Errorf("%d failover(s) failed, the first: %w", len(errs), errs[0])
	}
	return moved, nil
}

// candidate is the replica of v to promote: in the in-sync set, one of
// spec.replicaNodes, with its lease seen alive; the first by name; "" when
// there is none.
func (f *Failover) candidate(v *v1alpha1.NBDVolume, gone map[string]time.Duration, skip ...string) string {
	for _, n := range slices.Sorted(slices.Values(v.Status.Replication.InSync)) {
		if _, dead := gone[n]; dead || slices.Contains(skip, n) || !slices.Contains(v.Spec.ReplicaNodes, n) {
			continue
		}
		if _, alive := f.seen[n]; alive {
			return n
		}
	}
	return ""
}

// promote records next as v's primary, then moves the spec to it; it
// logs logMsg (with args) and records an Event of reason and eventMsg.
func (f *Failover) promote(ctx context.Context, v *v1alpha1.NBDVolume, next, logMsg, reason, eventMsg string, args ...any) error {
	rec := v.Status.Replication
	old := rec.Primary
	inSync := slices.DeleteFunc(slices.Clone(rec.InSync), func(n string) bool { return n == old })
	orig := v.DeepCopy()
	v.Status.Replication = &v1alpha1.ReplicationStatus{Epoch: rec.Epoch + 1, Primary: next, PrimaryEpoch: rec.Epoch + 1,
		InSync: inSync, InSyncReplicas: int32(len(inSync))}
	if err := f.cfg.Client.Status().Patch(ctx, v, client.MergeFromWithOptions(orig, client.MergeFromWithOptimisticLock{})); err != nil {
		return fmt.Errorf("volume %s: recording %s its primary: %w", v.Name, next, err)
	}
	f.cfg.Logger.Warn(logMsg, append([]any{"volume_id", v.Name, "was", old, "primary", next, "epoch", v.Status.Replication.Epoch, "in_sync", inSync}, args...)...)
	f.event(ctx, v, corev1.EventTypeWarning, reason, eventMsg)
	f.cfg.Metrics.primaryChanged(reason)
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

// replaceLost replaces, in volume name, each replica (not the primary)
// on a lost node by one on another storage node; for a volume being
// deleted it only releases the lost nodes' replica finalizers.
func (f *Failover) replaceLost(ctx context.Context, name string, lost func(string) bool, nodes map[string]*v1alpha1.NBDStorageNode) error {
	for attempt := 0; ; attempt++ {
		var v v1alpha1.NBDVolume
		if err := f.cfg.Client.Get(ctx, client.ObjectKey{Name: name}, &v); err != nil {
			return client.IgnoreNotFound(err)
		}
		if rec := v.Status.Replication; rec != nil && rec.Primary != v.Spec.StorageNode {
			return nil // a promotion half made: moveSpec first
		}
		deleting := !v.DeletionTimestamp.IsZero()
		var replaced [][2]string
		var unplaced []string
		for i, n := range v.Spec.ReplicaNodes {
			if !lost(n) {
				continue
			}
			if !deleting {
				next := f.replacement(&v, n, nodes)
				if next == "" {
					unplaced = append(unplaced, n)
					continue
				}
				v.Spec.ReplicaNodes[i] = next
				if v.Labels == nil {
					v.Labels = map[string]string{}
				}
				v.Labels[v1alpha1.ReplicaLabel(next)] = ""
				delete(v.Labels, v1alpha1.ReplicaLabel(n))
			}
			controllerutil.RemoveFinalizer(&v, v1alpha1.ReplicaFinalizer(n))
			replaced = append(replaced, [2]string{n, v.Spec.ReplicaNodes[i]})
		}
		if len(unplaced) > 0 {
			f.tell(name, "a replica's storage node is lost for good and no other storage node can take its replica (fresh, with room, schedulable, matching the StorageClass, in a zone of its own): the volume stays with fewer replicas",
				"volume_id", name, "lost", unplaced)
		}
		if len(replaced) == 0 {
			return nil
		}
		err := f.cfg.Client.Update(ctx, &v)
		if apierrors.IsConflict(err) && attempt < 5 {
			continue
		}
		if err != nil {
			return fmt.Errorf("volume %s: replacing the replicas of lost storage nodes: %w", name, err)
		}
		for _, r := range replaced {
			if deleting {
				f.cfg.Logger.Warn("a deleted volume's replica on a storage node lost for good is released", "volume_id", name, "lost", r[0])
				continue
			}
			f.cfg.Logger.Warn("a replica on a storage node lost for good is replaced", "volume_id", name, "lost", r[0], "replica", r[1])
			f.event(ctx, &v, corev1.EventTypeWarning, "ReplicaReplaced", fmt.Sprintf(
				"the storage node %s of a replica is lost for good (gone for %v or deleted): the replica moves to %s, copied whole from the primary",
				r[0], f.cfg.ReplicaLostAfter, r[1]))
		}
		return nil
	}
}

// replacement picks the storage node to take v's replica on lost: fresh,
// with room, its lease not gone, matching v's StorageClass parameters,
// neither the primary nor a replica of v, in a zone none of the others
// is in (when it carries one); the most room first. "" when none fits.
func (f *Failover) replacement(v *v1alpha1.NBDVolume, lost string, nodes map[string]*v1alpha1.NBDStorageNode) string {
	p, err := ParseParams(v.Spec.Parameters)
	if err != nil {
		p = Params{}
	}
	p.StorageNode = ""
	keep := append([]string{v.Spec.StorageNode}, v.Spec.ReplicaNodes...)
	zones := map[string]bool{}
	for _, n := range keep {
		if sn := nodes[n]; sn != nil && n != lost {
			if z := nodeZone(sn); z != "" {
				zones[z] = true
			}
		}
	}
	// An unreplicated volume that moves (a drain) stays in its zone when
	// a node there can take it: its PersistentVolume's topology names
	// that zone.
	home := ""
	if sn := nodes[v.Spec.StorageNode]; sn != nil && len(v.Spec.ReplicaNodes) == 0 {
		home = nodeZone(sn)
	}
	better := func(a, b *v1alpha1.NBDStorageNode) bool {
		if ah, bh := home != "" && nodeZone(a) == home, home != "" && nodeZone(b) == home; ah != bh {
			return ah
		}
		return a.Status.AvailableBytes > b.Status.AvailableBytes ||
			a.Status.AvailableBytes == b.Status.AvailableBytes && a.Name < b.Name
	}
	now := f.cfg.Now()
	var best *v1alpha1.NBDStorageNode
	for _, sn := range nodes {
		s, seen := f.seen[sn.Name]
		switch {
		case slices.Contains(keep, sn.Name), v1alpha1.ValidReplicaNode(sn.Name) != nil, !paramsMatch(sn, p), !sn.Schedulable(),
			sn.Status.AvailableBytes < v.Spec.SizeBytes, sn.Status.Heartbeat.IsZero(), now.Sub(sn.Status.Heartbeat.Time) > f.cfg.StaleAfter,
			seen && now.Sub(s.at) >= s.duration, zones[nodeZone(sn)] && nodeZone(sn) != "":
			continue
		}
		if best == nil || better(sn, best) {
			best = sn
		}
	}
	if best == nil {
		return ""
	}
	return best.Name
}

// drainStep takes volume v one step off the first draining
// storage node that holds it, make before break, and reports whether it
// changed v:
//
//  1. fewer copies off the draining node than the volume keeps: a
//     replica is added on another node (chosen as a replacement is; an
//     unreplicated volume gets one too, for the move), and the primary
//     copies the volume to it whole while it serves;
//  2. a copy off the draining node is not in sync yet: wait;
//  3. the draining node holds the primary: an in-sync replica whose
//     agent is alive is promoted (a switchover: the nodes' sessions
//     replay what the old primary had not acknowledged, as after a
//     failover), and the old primary becomes a replica;
//  4. the draining node holds a replica: it leaves spec.replicaNodes (its
//     agent deletes its copy and releases the volume).
//
// The volume keeps as many copies in sync as it had all along, and one
// more while the new one is made.
func (f *Failover) drainStep(ctx context.Context, v *v1alpha1.NBDVolume, nodes map[string]*v1alpha1.NBDStorageNode, gone map[string]time.Duration) (bool, error) {
	draining := func(n string) bool { sn := nodes[n]; return sn != nil && sn.Spec.Drain }
	holders := append([]string{v.Spec.StorageNode}, v.Spec.ReplicaNodes...)
	i := slices.IndexFunc(holders, draining)
	if i < 0 {
		return false, nil
	}
	node, rec := holders[i], v.Status.Replication
	others := slices.DeleteFunc(slices.Clone(holders), draining)
	// The copies the volume keeps: spec.replicas, one when unset (an
	// unreplicated volume, given a replica while it moves).
	want := max(int(v.Spec.Replicas), 1)
	if len(others) >= want && rec == nil {
		return false, nil // the primary's agent has not made the record yet
	}
	switch {
	case len(others) < want:
		next := f.replacement(v, node, nodes)
		if next == "" {
			f.tell("drain/"+v.Name, "no storage node can take a replica off a draining node (fresh, with room, schedulable, matching the StorageClass, in a zone of its own): the drain waits",
				"volume_id", v.Name, "draining", node)
			return false, nil
		}
		v.Spec.ReplicaNodes = append(v.Spec.ReplicaNodes, next)
		if v.Labels == nil {
			v.Labels = map[string]string{}
		}
		v.Labels[v1alpha1.ReplicaLabel(next)] = ""
		// An update (of the object as read: a conflict if it changed
		// since), which the controller's RBAC grants; no patch.
		if err := f.cfg.Client.Update(ctx, v); err != nil {
			return false, ignoreConflict(fmt.Errorf("volume %s: adding a replica on %s for the drain of %s: %w", v.Name, next, node, err))
		}
		f.cfg.Logger.Info("a replica added for a drain", "volume_id", v.Name, "draining", node, "replica", next)
		f.event(ctx, v, corev1.EventTypeNormal, "DrainCopying", fmt.Sprintf(
			"the storage node %s is draining: a replica is added on %s, copied whole from the primary; %s lets its copy go once it is in sync", node, next, node))
		return true, nil
	case slices.ContainsFunc(others, func(n string) bool { return !slices.Contains(rec.InSync, n) }):
		return false, nil // a copy is being made
	case node == v.Spec.StorageNode:
		next := f.candidate(v, gone, append([]string{rec.Primary}, slices.DeleteFunc(slices.Clone(holders), func(n string) bool { return !draining(n) })...)...)
		if next == "" {
			f.tell("drain/"+v.Name, "the primary of a volume is on a draining node and no replica in sync is alive to take over: the drain waits",
				"volume_id", v.Name, "draining", node, "in_sync", rec.InSync)
			return false, nil
		}
		err := f.promote(ctx, v, next, "a replicated volume's primary handed over for a drain", "SwitchedOver", fmt.Sprintf(
			"the storage node %s of the primary is draining: the replica on %s is the primary from replica epoch %d", node, next, rec.Epoch+1))
		return err == nil, ignoreConflict(err)
	}
	v.Spec.ReplicaNodes = slices.DeleteFunc(v.Spec.ReplicaNodes, func(n string) bool { return n == node })
	if err := f.cfg.Client.Update(ctx, v); err != nil {
		return false, ignoreConflict(fmt.Errorf("volume %s: taking the replica off draining %s: %w", v.Name, node, err))
	}
	f.cfg.Logger.Info("a replica taken off a draining node", "volume_id", v.Name, "draining", node, "replicas", v.Spec.ReplicaNodes)
	f.event(ctx, v, corev1.EventTypeNormal, "Drained", fmt.Sprintf(
		"the storage node %s is draining: its replica goes, the volume's copies in sync on %s", node, strings.Join(others, ", ")))
	return true, nil
}

// ignoreConflict drops an error of a write that lost to another: a drain
// step is taken again at the next check, from the object as it is then.
func ignoreConflict(err error) error {
	if apierrors.IsConflict(err) {
		return nil
	}
	return err
}

// tell logs msg about key at most once a minute.
func (f *Failover) tell(key, msg string, args ...any) {
	if f.cfg.Now().Sub(f.told[key]) < time.Minute {
		return
	}
	f.told[key] = f.cfg.Now()
	f.cfg.Logger.Warn(msg, args...)
}

// dropStaleLabels takes off v the replica labels of nodes that hold no
// replica of it any more (not in spec.replicaNodes, not its primary) and
// whose agents have released it (their replica finalizer is gone): a
// label is how an agent finds the volumes it holds a replica of, so it
// stays as long as the agent's finalizer does.
func (f *Failover) dropStaleLabels(ctx context.Context, v *v1alpha1.NBDVolume) error {
	var stale []string
	for k := range v.Labels {
		n, ok := strings.CutPrefix(k, v1alpha1.ReplicaLabel(""))
		if !ok || n == v.Spec.StorageNode || slices.Contains(v.Spec.ReplicaNodes, n) || controllerutil.ContainsFinalizer(v, v1alpha1.ReplicaFinalizer(n)) {
			continue
		}
		stale = append(stale, k)
	}
	if len(stale) == 0 {
		return nil
	}
	for _, k := range stale {
		delete(v.Labels, k)
	}
	// Conditional on the object listed; a conflict waits for the next
	// check.
	if err := f.cfg.Client.Update(ctx, v); err != nil && !apierrors.IsConflict(err) {
		return fmt.Errorf("volume %s: taking off the labels %v of nodes that no longer hold a replica: %w", v.Name, stale, err)
	}
	return nil
}

// writeOff lets a deleted volume go whose storage node is lost for good:
// the backing-store finalizer its agent would have removed (with the
// node's replica finalizer) is removed by the controller, and the data on
// that node is abandoned (its agent, if it ever comes back, reports the
// file as an orphan). Conditional on v as listed: a conflict waits for the
// next check.
func (f *Failover) writeOff(ctx context.Context, v *v1alpha1.NBDVolume) error {
	n := v.Spec.StorageNode
	a := controllerutil.RemoveFinalizer(v, v1alpha1.Finalizer)
	b := controllerutil.RemoveFinalizer(v, v1alpha1.ReplicaFinalizer(n))
	if !a && !b {
		return nil
	}
	err := f.cfg.Client.Update(ctx, v)
	switch {
	case apierrors.IsConflict(err) || apierrors.IsNotFound(err):
		return nil
	case err != nil:
		return fmt.Errorf("volume %s: releasing the backing store on %s, a storage node lost for good: %w", v.Name, n, err)
	}
	f.cfg.Logger.Warn("a deleted volume's backing store on a storage node lost for good is written off", "volume_id", v.Name, "storage_node", n)
	f.event(ctx, v, corev1.EventTypeWarning, "BackingStoreWrittenOff", fmt.Sprintf(
		"the storage node %s is lost for good (its NBDStorageNode deleted, its agent's lease gone): the deleted volume's data there is written off", n))
	return nil
}

// event records an Event on v (aggregated with its repeats).
func (f *Failover) event(_ context.Context, v *v1alpha1.NBDVolume, typ, reason, msg string) {
	f.cfg.Events.Event(v, typ, reason, msg)
}
