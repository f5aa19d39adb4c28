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

package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/source"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/nbd"
	"github.com/mpnbd/mpnbd/pkg/nodeid"
	"github.com/mpnbd/mpnbd/pkg/replica"
)

// A replicated volume (docs/replication.md) is served to nodes by its
// primary, the agent of spec.storageNode, which forwards every change to
// the agents of spec.replicaNodes. This file is the other side: the agent
// of a node in spec.replicaNodes keeps a copy of the volume and serves it
// to the recorded primary's forwards alone.
//
// The controller labels a replicated volume with v1alpha1.ReplicaLabel of
// each of its replica nodes; each agent watches, in a cache of its own,
// the volumes that carry its label (the manager's cache holds those whose
// spec.storageNode is the node). The agent keeps its finalizer
// (v1alpha1.ReplicaFinalizer) on them until its copy is closed and, when
// the volume's deletion asks for it, deleted.
//
// A forward opens the export "<volume>@<epoch>" over TLS with the
// primary's storage certificate. It is served when the certificate names
// the recorded primary (status.replication.primary) and its epoch lies
// from the record's primaryEpoch to its epoch; an older epoch is refused
// as superseded, which is final for the primary that sent it; a newer one
// is refused for now (this agent's watch has not seen that record yet,
// and the primary dials again). When the record changes, the connections
// it no longer allows are closed: an earlier primary's forwards end the
// moment the agent sees a newer one recorded.

// replicaRecord is the part of a volume's status.replication by which its
// replica is served.
type replicaRecord struct {
	primary      string
	primaryEpoch int64
	epoch        int64
}

// replicaTagPrefix begins the connection tag of a primary's forwards.
const replicaTagPrefix = "replica-of:"

// setupReplicas registers the replica reconciler over its own cache of
// the volumes labelled for this node.
func (a *Agent) setupReplicas(mgr ctrl.Manager) error {
	label := v1alpha1.ReplicaLabel(a.cfg.NodeName)
	if err := v1alpha1.ValidReplicaNode(a.cfg.NodeName); err != nil {
		a.log.Warn("this storage node holds no replicas", "error", err)
		return nil
	}
	req, err := labels.NewRequirement(label, selection.Exists, nil)
	if err != nil {
		return fmt.Errorf("the replica label %q: %w", label, err)
	}
	c, err := cache.New(mgr.GetConfig(), cache.Options{
		Scheme: mgr.GetScheme(),
		Mapper: mgr.GetRESTMapper(),
		ByObject: map[client.Object]cache.ByObject{
			&v1alpha1.NBDVolume{}: {Label: labels.NewSelector().Add(*req)},
		},
	})
	if err != nil {
		return fmt.Errorf("the replicas' cache: %w", err)
	}
	if err := mgr.Add(c); err != nil {
		return err
	}
	a.replicas = c
	return ctrl.NewControllerManagedBy(mgr).
		Named("nbdvolume-replica").
		WatchesRawSource(source.Kind(c, &v1alpha1.NBDVolume{}, &handler.TypedEnqueueRequestForObject[*v1alpha1.NBDVolume]{})).
		WithOptions(controller.Options{
			MaxConcurrentReconciles: volumeWorkers,
			SkipNameValidation:      ptr.To(true),
		}).
		Complete(reconcile.Func(a.reconcileReplica))
}

// reconcileReplica keeps this node's copy of a replicated volume whose
// spec.replicaNodes hold it: its file and export, its finalizer, and the
// record its forwards are served by; it closes and (as the deletion asks)
// deletes the copy when the volume is deleted or the node is no longer
// one of its replicas.
func (a *Agent) reconcileReplica(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	log := a.log.With("volume_id", req.Name, "role", "replica")
	var vol v1alpha1.NBDVolume
	if err := a.replicas.Get(ctx, req.NamespacedName, &vol); err != nil {
		if apierrors.IsNotFound(err) {
			a.releaseReplica(log, req.Name, "replica's volume out of this node's watch: its export closed, its file kept")
			return ctrl.Result{}, nil
		}
		return ctrl.Result{}, err
	}
	self := a.cfg.NodeName
	if vol.Spec.StorageNode == self {
		// This node holds the primary's copy (promoted, if it held a
		// replica): Reconcile serves it.
		a.releaseReplica(log, req.Name, "this node is the volume's primary now: its replica's export closed, its file kept for the primary")
		return ctrl.Result{}, nil
	}
	if !vol.DeletionTimestamp.IsZero() || !slices.Contains(vol.Spec.ReplicaNodes, self) {
		return a.removeReplica(ctx, log, &vol)
	}
	if fin := v1alpha1.ReplicaFinalizer(self); !controllerutil.ContainsFinalizer(&vol, fin) {
		patch := client.MergeFromWithOptions(vol.DeepCopy(), client.MergeFromWithOptimisticLock{})
		controllerutil.AddFinalizer(&vol, fin)
		if err := a.client.Patch(ctx, &vol, patch); err != nil {
			return ctrl.Result{}, fmt.Errorf("adding the replica finalizer: %w", err)
		}
		log.Info("replica finalizer added")
	}
	v, f := a.ensureStore(ctx, log, &vol, true)
	switch {
	case f == errOtherRole:
		log.Info("volume held here as the primary; waiting for it to be released")
		return ctrl.Result{RequeueAfter: f.retry}, nil
	case v == nil:
		// The primary's forwards fail, and it drops this replica
		// from the in-sync set: that is what the failure costs.
		log.Warn("replica not served", "code", f.code, "message", f.message)
		return ctrl.Result{RequeueAfter: f.retry}, nil
	}
	if err := a.applyRecord(ctx, log, &vol, v); err != nil {
		return ctrl.Result{}, err
	}
	if f != nil {
		log.Warn("replica not grown", "code", f.code, "message", f.message)
		return ctrl.Result{RequeueAfter: f.retry}, nil
	}
	return ctrl.Result{}, nil
}

// applyRecord makes vol's status.replication the record v's forwards are
// served by, and closes the connections it no longer allows.
func (a *Agent) applyRecord(ctx context.Context, log *slog.Logger, vol *v1alpha1.NBDVolume, v *volume) error {
	var rec *replicaRecord
	if r := vol.Status.Replication; r != nil && r.Primary != a.cfg.NodeName {
		rec = &replicaRecord{primary: r.Primary, primaryEpoch: r.PrimaryEpoch, epoch: r.Epoch}
	}
	a.mu.RLock()
	prev := v.record
	a.mu.RUnlock()
	if prev == nil && rec == nil || prev != nil && rec != nil && *prev == *rec {
		return nil
	}
	dctx, cancel := context.WithTimeout(ctx, a.cfg.DrainTimeout)
	defer cancel()
	// The connections the new record refuses (an earlier primary's) are
	// drained before it is applied, so that none of their forwards runs
	// once a new primary's are let in; then once more, for any that came
	// in meanwhile.
	refused := func(rec *replicaRecord) func(c nbd.ConnInfo) bool {
		return func(c nbd.ConnInfo) bool {
			_, token, epoch, ok := access.ParseExport(c.Requested)
			if !ok {
				return true
			}
			a.mu.RLock()
			defer a.mu.RUnlock()
			_, err := a.resolveReplicaBy(c, v, rec, token, epoch)
			return err != nil
		}
	}
	n, err := a.srv.CloseConns(dctx, v.name, refused(rec))
	a.mu.Lock()
	v.record = rec
	a.mu.Unlock()
	if err == nil {
		var m int
		m, err = a.srv.CloseConns(dctx, v.name, refused(rec))
		n += m
	}
	if err != nil && !errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("closing the forwards the record no longer allows: %w", err)
	}
	if rec == nil {
		log.Info("replica has no record to serve by", "connections_closed", n)
	} else {
		log.Info("replica serves by the record", "primary", rec.primary, "primary_epoch", rec.primaryEpoch,
			"epoch", rec.epoch, "connections_closed", n, "drain_error", err)
	}
	return nil
}

// resolveReplica is resolve for a volume held here as a replica (called
// with a.mu read-locked): the recorded primary's forwards, named with an
// epoch from the record's primaryEpoch to its epoch, over TLS with its
// storage certificate.
func (a *Agent) resolveReplica(c nbd.ConnInfo, v *volume, token string, epoch int64) (nbd.Grant, error) {
	return a.resolveReplicaBy(c, v, v.record, token, epoch)
}

// resolveReplicaBy is resolveReplica by record rec.
func (a *Agent) resolveReplicaBy(c nbd.ConnInfo, v *volume, rec *replicaRecord, token string, epoch int64) (nbd.Grant, error) {
	switch {
	case token != "":
		return nbd.Grant{}, fmt.Errorf("volume %q is a replica here: opened with a storage node's certificate, not a token", v.name)
	case a.cfg.NodeRoots == nil:
		return nbd.Grant{}, fmt.Errorf("volume %q is a replica here, and storage certificates are not in use", v.name)
	case rec == nil:
		return nbd.Grant{}, fmt.Errorf("volume %q is a replica here with no replication record yet", v.name)
	}
	peer, err := nodeid.PeerStorageNode(c.TLS, a.cfg.NodeRoots())
	switch {
	case err != nil:
		return nbd.Grant{}, fmt.Errorf("volume %q is a replica here: %w", v.name, err)
	case epoch < rec.primaryEpoch:
		// Whoever sends it: a primary of that epoch has been
		// replaced since.
		return nbd.Grant{}, fmt.Errorf("volume %q: a forward of replica epoch %d, before the primary's, %d: %w",
			v.name, epoch, rec.primaryEpoch, nbd.ErrSuperseded)
	case peer != rec.primary:
		// Perhaps a primary this agent's watch has not seen recorded
		// yet: refused for now.
		return nbd.Grant{}, fmt.Errorf("volume %q is a replica here: storage node %s is not its recorded primary %s", v.name, peer, rec.primary)
	case epoch > rec.epoch:
		return nbd.Grant{}, fmt.Errorf("volume %q: a forward of replica epoch %d, newer than the record applied here (%d)", v.name, epoch, rec.epoch)
	}
	g := nbd.Grant{Export: v.name, Tag: replicaTagPrefix + peer, RequireTLS: true}
	if l := a.ledgers[v.name]; l != nil {
		// What the primary's forwards may have left unsettled, for a
		// primary about to serve (docs/replication.md).
		g.Info = func(t uint16) []byte {
			if t == replica.InfoUnsettled {
				return l.Info()
			}
			return nil
		}
	}
	return g, nil
}

// removeReplica closes this node's copy of vol (deleted, or no longer on
// this node), deletes its file when the volume's deletion asks for it
// (v1alpha1.NBDVolume.DeletesData) or the copy moved elsewhere, and
// releases the replica finalizer.
func (a *Agent) removeReplica(ctx context.Context, log *slog.Logger, vol *v1alpha1.NBDVolume) (ctrl.Result, error) {
	fin := v1alpha1.ReplicaFinalizer(a.cfg.NodeName)
	a.mu.Lock()
	v := a.vols[vol.Name]
	if v != nil && !v.asReplica {
		a.mu.Unlock()
		return ctrl.Result{RequeueAfter: errOtherRole.retry}, nil
	}
	delete(a.vols, vol.Name)
	delete(a.ledgers, vol.Name)
	a.mu.Unlock()
	if v != nil {
		if err := a.closeVolume(v); err != nil {
			log.Warn("closing the replica's file", "error", err)
		}
	}
	if !controllerutil.ContainsFinalizer(vol, fin) {
		return ctrl.Result{}, nil
	}
	path := a.path(vol.Name)
	moved := vol.DeletionTimestamp.IsZero()
	if vol.DeletesData() || moved {
		if why := a.connected(vol.Name); why != "" {
			return ctrl.Result{RequeueAfter: connectionsRetry}, nil
		}
		if err := a.removeFile(log, path, "replica's file removed", "moved_away", moved); err != nil {
			return ctrl.Result{}, err
		}
	} else if _, err := os.Stat(path); err == nil {
		log.Warn("volume deleted without the annotation "+v1alpha1.DeleteDataAnnotation+"="+v1alpha1.DeleteDataTrue+
			": the replica's file and its data kept, reported in the storage node's status.orphans", "path", path)
	}
	patch := client.MergeFromWithOptions(vol.DeepCopy(), client.MergeFromWithOptimisticLock{})
	controllerutil.RemoveFinalizer(vol, fin)
	if err := a.client.Patch(ctx, vol, patch); err != nil && !apierrors.IsNotFound(err) {
		return ctrl.Result{}, fmt.Errorf("removing the replica finalizer: %w", err)
	}
	log.Info("replica released", "data_deleted", vol.DeletesData() || moved)
	return ctrl.Result{}, nil
}

// releaseReplica closes the copy of a volume this node held as a replica
// once its object is out of the replicas' cache (gone, or its label
// removed) or this node is its primary now, and logs why; the file stays
// (removeReplica deletes it while the object, and its finalizer, are
// still there).
func (a *Agent) releaseReplica(log *slog.Logger, name, why string) {
	a.mu.Lock()
	v := a.vols[name]
	if v == nil || !v.asReplica {
		a.mu.Unlock()
		return
	}
	delete(a.vols, name)
	a.mu.Unlock()
	log.Info(why)
	if err := a.closeVolume(v); err != nil {
		log.Warn("closing the replica's file", "error", err)
	}
	a.kickCapacity()
}
