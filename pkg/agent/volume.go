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
	"io/fs"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/predicate"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

const (
	// fileSuffix ends every backing file's name.
	fileSuffix = ".img"
	// hashRetry is how soon a publication without its token hash is
	// looked at again (the controller's update to it wakes the volume
	// sooner).
	hashRetry = 5 * time.Second
	// deletionRetry is how often a volume deleted while in use looks
	// again (a publication change requeues it at once).
	deletionRetry = 10 * time.Second
	// connectionsRetry is how soon a deleted volume whose export was
	// closed, but still has connections, looks again before its backing
	// file goes.
	connectionsRetry = time.Second
	// exhaustedRetry and internalRetry are how soon a failed volume is
	// tried again without a change to it.
	exhaustedRetry = time.Minute
	internalRetry  = 10 * time.Second
)

// failure is why a volume cannot be served; Code is a gRPC code name.
type failure struct {
	code    string
	message string
	retry   time.Duration
	// passing: a state that passes by itself (a conflicting write, a
	// role changing hands): tried again, not reported in the status.
	passing bool
}

func internal(format string, args ...any) *failure {
	return &failure{code: "Internal", message: fmt.Sprintf(format, args...), retry: internalRetry}
}

// SetupWithManager registers the NBDVolume and NBDSnapshot reconcilers and the capacity
// heartbeat (and, with Config.SignalNICs, the MPTCP endpoint keeper) with
// mgr. The manager's cache should come from CacheOptions; volumes of other
// nodes are ignored either way.
func (a *Agent) SetupWithManager(mgr ctrl.Manager) error {
	a.mgrCache = mgr.GetCache()
	ours := predicate.NewPredicateFuncs(func(o client.Object) bool {
		v, ok := o.(*v1alpha1.NBDVolume)
		return ok && v.Spec.StorageNode == a.cfg.NodeName
	})
	err := ctrl.NewControllerManagedBy(mgr).
		Named("nbdvolume").
		For(&v1alpha1.NBDVolume{}, builder.WithPredicates(ours)).
		WithOptions(controller.Options{
			// Several workers, so that one volume draining its
			// connections after a publication change (up to
			// DrainTimeout) or filling from a snapshot does not hold up
			// the others; a volume is never reconciled twice at once,
			// and the check of free space and the allocation it admits
			// run under roomMu.
			MaxConcurrentReconciles: volumeWorkers,
			// A restarted agent in the same process registers again.
			SkipNameValidation: ptr.To(true),
		}).
		Complete(a)
	if err != nil {
		return fmt.Errorf("agent: %w", err)
	}
	if err := a.setupReplicas(mgr); err != nil {
		return fmt.Errorf("agent: %w", err)
	}
	if err := a.setupSnapshots(mgr); err != nil {
		return fmt.Errorf("agent: %w", err)
	}
	if err := mgr.Add(runnable(a.runHeartbeat)); err != nil {
		return fmt.Errorf("agent: %w", err)
	}
	if a.cfg.LeaseNamespace != "" {
		if err := mgr.Add(runnable(a.runLease)); err != nil {
			return fmt.Errorf("agent: %w", err)
		}
	}
	if err := mgr.Add(runnable(a.runJoinGuard)); err != nil {
		return fmt.Errorf("agent: %w", err)
	}
	if len(a.cfg.SignalNICs) > 0 {
		if err := mgr.Add(runnable(a.runEndpoints)); err != nil {
			return fmt.Errorf("agent: %w", err)
		}
	}
	return nil
}

// runnable is a manager Runnable that runs on every agent, leader or not.
type runnable func(context.Context) error

func (r runnable) Start(ctx context.Context) error { return r(ctx) }
func (r runnable) NeedLeaderElection() bool        { return false }

// path is the backing file of a volume.
func (a *Agent) path(name string) string {
	return filepath.Join(a.cfg.DataDir, name+fileSuffix)
}

// Reconcile makes one NBDVolume's backing store, export and publications
// match its spec, or removes them when it is being deleted.
func (a *Agent) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	log := a.log.With("volume_id", req.Name)
	var vol v1alpha1.NBDVolume
	if err := a.client.Get(ctx, req.NamespacedName, &vol); err != nil {
		if apierrors.IsNotFound(err) {
			a.forget(log, req.Name)
			return ctrl.Result{}, nil
		}
		return ctrl.Result{}, err
	}
	if vol.Spec.StorageNode != a.cfg.NodeName {
		return ctrl.Result{}, nil
	}
	if !vol.DeletionTimestamp.IsZero() {
		return a.remove(ctx, log, &vol)
	}
	if a.replicasChanged(log, &vol) {
		return ctrl.Result{RequeueAfter: 100 * time.Millisecond}, nil
	}
	if r := vol.Status.Replication; r != nil && r.Primary != a.cfg.NodeName && replicatedVolume(&vol) {
		// Another primary is recorded: this one serves nothing more
		// (its forwards are refused from now on anyway).
		a.closeMirror(log, vol.Name, func(*replicated) bool { return true },
			"another primary is recorded: this one stops serving", "primary", r.Primary, "epoch", r.Epoch)
	}
	// A replica this node held until it was promoted is served as the
	// primary from now on.
	a.releaseReplica(log, vol.Name, "this node is the volume's primary now: its replica's export closed, its file kept for the primary")
	// The finalizer of the primary's copy; that of a replica this node
	// held before it became the primary goes (its copy is this one).
	if replicaFin := v1alpha1.ReplicaFinalizer(a.cfg.NodeName); !controllerutil.ContainsFinalizer(&vol, v1alpha1.Finalizer) ||
		controllerutil.ContainsFinalizer(&vol, replicaFin) {
		patch := client.MergeFromWithOptions(vol.DeepCopy(), client.MergeFromWithOptimisticLock{})
		controllerutil.AddFinalizer(&vol, v1alpha1.Finalizer)
		controllerutil.RemoveFinalizer(&vol, replicaFin)
		if err := a.client.Patch(ctx, &vol, patch); err != nil {
			return ctrl.Result{}, fmt.Errorf("adding the finalizer: %w", err)
		}
		log.Info("finalizer added")
	}
	v, f := a.ensureStore(ctx, log, &vol, false)
	if f != nil && f.passing {
		// Held as a replica (its reconciler lets it go first), or a
		// write that met another.
		log.Info("volume not served yet", "reason", f.message)
		return ctrl.Result{RequeueAfter: f.retry}, nil
	}
	if f != nil && v == nil {
		return a.reportFailure(ctx, log, &vol, f)
	}
	// A volume that could not grow still serves at its size: its
	// publications are applied (a revoked node loses access whatever
	// else fails) and the failure is reported with it.
	waiting, err := a.applyPublications(ctx, log, &vol, v)
	if err != nil {
		return ctrl.Result{}, err
	}
	if waiting != "" {
		log.Info("a publication waits", "reason", waiting)
		return ctrl.Result{RequeueAfter: hashRetry}, nil
	}
	if err := a.reportAvailable(ctx, &vol, v, f); err != nil {
		return ctrl.Result{}, err
	}
	if f != nil {
		log.Warn("volume not grown", "code", f.code, "message", f.message)
		return ctrl.Result{RequeueAfter: f.retry}, nil
	}
	return ctrl.Result{}, nil
}

// errOtherRole: the volume is held here in the other role (primary or
// replica) until that role's reconciler lets it go.
var errOtherRole = &failure{code: "Unavailable", message: "the volume is held here in its other role", retry: time.Second, passing: true}

// ensureStore opens (or creates, or grows) the backing file and exports
// it: as the volume's primary copy, or asReplica as a copy another node's
// primary forwards to (created empty, never filled from a content source:
// the primary's rebuild fills it; served over TLS only). A failure with
// a nil volume means there is nothing to serve; with a volume, the volume
// is exported but could not grow to its spec's size.
func (a *Agent) ensureStore(ctx context.Context, log *slog.Logger, vol *v1alpha1.NBDVolume, asReplica bool) (*volume, *failure) {
	name := vol.Name
	if f := invalidName("volume name", name); f != nil {
		return nil, f
	}
	a.mu.Lock()
	v := a.vols[name]
	if v == nil {
		v = &volume{name: name, grants: map[string]grant{}, asReplica: asReplica}
		a.vols[name] = v
	}
	a.mu.Unlock()
	if v.asReplica != asReplica {
		return nil, errOtherRole
	}

	want := vol.Spec.SizeBytes
	changed, created := false, false
	if v.backend == nil && asReplica {
		// Logs of what other replicas lacked, kept while this node was
		// the primary of an earlier reign, say nothing of what they
		// lack now: were this node promoted again, they would leave
		// out what changed under other primaries.
		if err := os.RemoveAll(a.logDir(name)); err != nil {
			return nil, internal("removing the replicas' logs of an earlier reign: %v", err)
		}
	}
	if v.backend == nil {
		path := a.path(name)
		var b *nbd.FileBackend
		_, err := os.Stat(path)
		switch {
		case err == nil:
			// A restart: the file is the volume; never recreate it.
			if b, err = nbd.OpenFile(path, 0, false, false); err != nil {
				return nil, internal("opening %s: %v", path, err)
			}
			log.Info("backing file reopened", "path", path, "size", b.Size())
		case errors.Is(err, fs.ErrNotExist):
			// Free space checked and taken in one step: concurrent
			// creations must not both count the same bytes.
			a.roomMu.Lock()
			defer a.roomMu.Unlock()
			if f := a.checkRoom(want, fmt.Sprintf("creating %d bytes", want)); f != nil {
				return nil, f
			}
			if cs := vol.Spec.ContentSource; cs != nil && !asReplica {
				if f := a.fill(ctx, log, path, cs, want); f != nil {
					return nil, f
				}
				if b, err = nbd.OpenFile(path, 0, false, false); err != nil {
					return nil, internal("opening %s: %v", path, err)
				}
			} else {
				if b, err = nbd.OpenFile(path, want, true, false); err != nil {
					os.Remove(path)
					return nil, internal("creating %s with %d bytes: %v", path, want, err)
				}
				log.Info("backing file created", "path", path, "size", want)
			}
			changed, created = true, true
		default:
			return nil, internal("%v", err)
		}
		a.mu.Lock()
		v.backend = b
		a.mu.Unlock()
	}
	var growFailure *failure
	if size := v.backend.Size(); size < want {
		if !changed {
			a.roomMu.Lock()
			defer a.roomMu.Unlock()
		}
		if f := a.checkRoom(want-size, fmt.Sprintf("growing from %d to %d bytes", size, want)); f != nil {
			growFailure = f
		} else if f := a.replicasGrown(ctx, vol, v, want); f != nil {
			growFailure = f
		} else if err := v.backend.Resize(want); err != nil {
			growFailure = internal("growing %s from %d to %d bytes: %v", a.path(name), size, want, err)
		} else {
			changed = true
			log.Info("backing file grown", "from", size, "to", want)
		}
	}
	if changed {
		a.kickCapacity()
	}
	if _, ok := a.srv.Export(name); !ok {
		var backend nbd.Backend = v.backend
		if !asReplica && !replicatedVolume(vol) && vol.Status.Replication != nil {
			if f := a.leaveReplicated(ctx, log, vol); f != nil {
				return nil, f
			}
		}
		if !asReplica && replicatedVolume(vol) {
			m, f := a.primaryBackend(ctx, log, vol, v)
			if f != nil {
				return nil, f
			}
			backend = m
		}
		exp := &nbd.Export{Name: name, Description: "mpnbd volume " + name, Backend: backend,
			RequireTLS: vol.Spec.Encryption == v1alpha1.EncryptionRequired || asReplica}
		if asReplica {
			// The primary's settle marks (docs/replication.md,
			// "Unsettled writes").
			l := a.ledgerFor(name, v.backend.Size())
			if created {
				// Made by this process: nothing was forwarded
				// to it before its ledger.
				l.Fresh()
			}
			exp.Ledger = l
		}
		err := a.srv.AddExport(exp)
		if err != nil {
			return nil, internal("exporting: %v", err)
		}
		if a.cfg.Exports != nil {
			a.cfg.Exports.ExportAdded(name)
		}
	}
	return v, growFailure
}

// invalidName fails with InvalidArgument when name, which the agent joins
// into a path under its data directory, is not an object name (a DNS-1123
// subdomain: lower-case letters and digits in labels joined by '.', at
// most 253 characters, so no '/' and no name of dots alone). The CRDs
// refuse other values too; this check is what keeps every path the agent
// makes inside its data directory, whatever an object holds.
func invalidName(what, name string) *failure {
	errs := validation.IsDNS1123Subdomain(name)
	if len(errs) == 0 {
		return nil
	}
	return &failure{code: "InvalidArgument", message: fmt.Sprintf("%s %q: %s", what, name, strings.Join(errs, "; ")), retry: exhaustedRetry}
}

// checkRoom fails with ResourceExhausted when need bytes more would not fit
// if every volume filled up (thick accounting).
func (a *Agent) checkRoom(need int64, what string) *failure {
	u, err := diskUsage(a.cfg.DataDir)
	if err != nil {
		return internal("measuring %s: %v", a.cfg.DataDir, err)
	}
	if avail := u.available(); need > avail {
		return &failure{
			code:    "ResourceExhausted",
			message: fmt.Sprintf("%s needs %d bytes, but node %s has only %d bytes available", what, need, a.cfg.NodeName, avail),
			retry:   exhaustedRetry,
		}
	}
	return nil
}

// applyPublications makes the volume's grants those of spec.publications
// and closes the connections no longer allowed. It returns a reason when a
// publication cannot be applied yet (it grants nothing then).
func (a *Agent) applyPublications(ctx context.Context, log *slog.Logger, vol *v1alpha1.NBDVolume, v *volume) (string, error) {
	next := make(map[string]grant, len(vol.Spec.Publications))
	var waiting []string
	var unbound []string
	for _, p := range vol.Spec.Publications {
		addrs := parseAddrs(log, p)
		switch {
		case access.ValidTokenHash(p.TokenSHA256):
			// The agent holds the token's hash, never the token. A
			// token is good only from its node's addresses: a
			// publication of the node's own token that lists none
			// grants nothing. One made by an earlier controller, with
			// a per-(volume, node) Secret, keeps the terms it was made
			// under (its node's session lives on them) until the
			// controller adds the addresses its node announces.
			legacy := p.SecretRef != ""
			if len(addrs) == 0 && !legacy {
				unbound = append(unbound, p.NodeID)
				waiting = append(waiting, p.NodeID)
				continue
			}
			next[p.NodeID] = grant{nodeID: p.NodeID, tokenHash: p.TokenSHA256, readOnly: p.ReadOnly,
				limited: len(p.Addresses) > 0 || !legacy, addrs: addrs, epoch: p.Epoch}
		case p.SecretRef != "":
			// A token in a Secret, without its hash (made by an older
			// controller): it grants nothing until the controller
			// adds the hash.
			waiting = append(waiting, p.NodeID)
		default:
			// No token: the node shows its certificate over TLS.
			next[p.NodeID] = grant{nodeID: p.NodeID, readOnly: p.ReadOnly, limited: len(p.Addresses) > 0, addrs: addrs, epoch: p.Epoch}
		}
	}

	a.mu.Lock()
	prev := v.grants
	v.grants = next
	v.generation = vol.Generation
	a.updateKnownSourcesLocked()
	a.mu.Unlock()

	// Nodes still published but with other terms (read-only now, other
	// addresses) lose their connections too; they reconnect under the
	// new terms.
	changed := map[string]bool{}
	for id, og := range prev {
		if ng, ok := next[id]; !ok || !ng.equal(og) {
			changed[id] = true
		}
	}
	for id := range next {
		if _, ok := prev[id]; !ok {
			log.Info("published", "node_id", id, "read_only", next[id].readOnly)
		}
	}
	dctx, cancel := context.WithTimeout(ctx, a.cfg.DrainTimeout)
	defer cancel()
	n, err := a.srv.CloseConns(dctx, v.name, func(c nbd.ConnInfo) bool {
		if changed[c.Tag] {
			return true
		}
		_, err := a.resolve(c, c.Requested)
		return err != nil
	})
	if err != nil && !errors.Is(err, context.DeadlineExceeded) {
		return "", fmt.Errorf("closing revoked connections: %w", err)
	}
	if n > 0 || len(changed) > 0 {
		log.Info("publications changed; connections closed", "nodes", len(changed), "connections_closed", n, "drain_error", err)
	}
	if len(unbound) > 0 {
		return "no storage address in the token publications to " + strings.Join(unbound, ", ") +
			" (a token is good only from its node's addresses; the controller adds those the node announces)", nil
	}
	if len(waiting) > 0 {
		return "no token hash yet in the publications to " + strings.Join(waiting, ", ") + " (the controller adds it)", nil
	}
	return "", nil
}

// reportAvailable writes the Available status for vol's generation. grow,
// when set, is why the volume is smaller than its spec: its code and
// message go into the status (capacityBytes stays the served size).
func (a *Agent) reportAvailable(ctx context.Context, vol *v1alpha1.NBDVolume, v *volume, grow *failure) error {
	orig := vol.DeepCopy()
	st := &vol.Status
	st.Phase = v1alpha1.VolumeAvailable
	st.CapacityBytes = v.backend.Size()
	st.Export = &v1alpha1.Export{Name: vol.Name, Port: a.cfg.Port, Addresses: append([]string(nil), a.cfg.Addresses...)}
	st.Code, st.Message = "", ""
	if grow != nil {
		st.Code, st.Message = grow.code, grow.message
	}
	st.ObservedGeneration = vol.Generation
	meta.SetStatusCondition(&st.Conditions, metav1.Condition{
		Type:               ConditionReady,
		Status:             metav1.ConditionTrue,
		Reason:             "Available",
		Message:            fmt.Sprintf("exported with %d bytes, published to %d node(s)", st.CapacityBytes, len(vol.Spec.Publications)),
		ObservedGeneration: vol.Generation,
	})
	grown := metav1.Condition{Type: ConditionGrown, Status: metav1.ConditionTrue, Reason: "Grown",
		Message: fmt.Sprintf("%d bytes of %d", st.CapacityBytes, vol.Spec.SizeBytes), ObservedGeneration: vol.Generation}
	if grow != nil {
		grown.Status, grown.Reason, grown.Message = metav1.ConditionFalse, grow.code, grow.message
	}
	meta.SetStatusCondition(&st.Conditions, grown)
	if equality.Semantic.DeepEqual(orig.Status, vol.Status) {
		return nil
	}
	if err := a.client.Status().Patch(ctx, vol, client.MergeFrom(orig)); err != nil {
		return fmt.Errorf("writing status: %w", err)
	}
	return nil
}

// reportFailure writes a Failed status for vol's generation: the
// controller, waiting for that generation, gets the code and message.
func (a *Agent) reportFailure(ctx context.Context, log *slog.Logger, vol *v1alpha1.NBDVolume, f *failure) (ctrl.Result, error) {
	log.Warn("volume failed", "code", f.code, "message", f.message)
	orig := vol.DeepCopy()
	st := &vol.Status
	st.Phase = v1alpha1.VolumeFailed
	st.Code, st.Message = f.code, f.message
	st.ObservedGeneration = vol.Generation
	a.mu.RLock()
	if v := a.vols[vol.Name]; v != nil && v.backend != nil {
		st.CapacityBytes = v.backend.Size()
	}
	a.mu.RUnlock()
	meta.SetStatusCondition(&st.Conditions, metav1.Condition{
		Type:               ConditionReady,
		Status:             metav1.ConditionFalse,
		Reason:             f.code,
		Message:            f.message,
		ObservedGeneration: vol.Generation,
	})
	if !equality.Semantic.DeepEqual(orig.Status, vol.Status) {
		if err := a.client.Status().Patch(ctx, vol, client.MergeFrom(orig)); err != nil {
			return ctrl.Result{}, fmt.Errorf("writing status: %w", err)
		}
	}
	return ctrl.Result{RequeueAfter: f.retry}, nil
}

// remove tears a deleted volume down: export drained and removed, file
// closed, then the finalizer released. A volume still published to a node
// is not: deleting its object by hand, or its CRD, must not take a mounted
// filesystem's blocks away. It keeps serving, says why in the
// DeletionBlocked condition, and goes once the last node is unpublished
// (ControllerUnpublishVolume; by hand, removing the node's entry from
// spec.publications). Connections of nodes no longer published do not hold
// it: they are drained with the export.
//
// The backing file is deleted only when DeleteVolume asked for it
// (v1alpha1.DeleteDataAnnotation), and only once no connection to the
// export is left. Without the annotation the object was deleted by hand
// or with its CRD: the file stays, and is reported as an orphan.
func (a *Agent) remove(ctx context.Context, log *slog.Logger, vol *v1alpha1.NBDVolume) (ctrl.Result, error) {
	if !controllerutil.ContainsFinalizer(vol, v1alpha1.Finalizer) {
		a.forget(log, vol.Name)
		return ctrl.Result{}, nil
	}
	if why := a.inUse(vol); why != "" {
		// Serve it (after an agent restart too) to the nodes still
		// published, and to them only.
		if v, f := a.ensureStore(ctx, log, vol, false); v != nil {
			if _, err := a.applyPublications(ctx, log, vol, v); err != nil {
				return ctrl.Result{}, err
			}
		} else if f != nil {
			log.Warn("a volume deleted while in use cannot be served", "code", f.code, "message", f.message)
		}
		return ctrl.Result{RequeueAfter: deletionRetry}, a.blockDeletion(ctx, log, vol, reasonInUse, why)
	}
	a.mu.Lock()
	v := a.vols[vol.Name]
	delete(a.vols, vol.Name)
	delete(a.ledgers, vol.Name)
	a.updateKnownSourcesLocked()
	a.mu.Unlock()
	if v != nil {
		if err := a.closeVolume(v); err != nil {
			log.Warn("closing the backing file", "error", err)
		}
	}
	path := a.path(vol.Name)
	if vol.DeletesData() {
		if why := a.connected(vol.Name); why != "" {
			return ctrl.Result{RequeueAfter: connectionsRetry}, a.blockDeletion(ctx, log, vol, reasonConnected, why)
		}
		if err := os.RemoveAll(a.logDir(vol.Name)); err != nil {
			return ctrl.Result{}, fmt.Errorf("removing the replicas' logs: %w", err)
		}
		if err := a.removeFile(log, path, "backing file removed"); err != nil {
			return ctrl.Result{}, err
		}
	} else if _, err := os.Stat(path); err == nil {
		// The report that lists the orphan comes once the object is
		// gone (forget).
		log.Warn("volume deleted without the annotation "+v1alpha1.DeleteDataAnnotation+"="+v1alpha1.DeleteDataTrue+
			" that DeleteVolume sets (by hand, or with its CRD): export closed, backing file and its data kept, "+
			"reported in the storage node's status.orphans; to remove the data, delete the file on the storage node",
			"path", path)
	}
	patch := client.MergeFromWithOptions(vol.DeepCopy(), client.MergeFromWithOptimisticLock{})
	controllerutil.RemoveFinalizer(vol, v1alpha1.Finalizer)
	controllerutil.RemoveFinalizer(vol, v1alpha1.ReplicaFinalizer(a.cfg.NodeName))
	if err := a.client.Patch(ctx, vol, patch); err != nil && !apierrors.IsNotFound(err) {
		return ctrl.Result{}, fmt.Errorf("removing the finalizer: %w", err)
	}
	log.Info("volume deleted", "data_deleted", vol.DeletesData())
	return ctrl.Result{}, nil
}

// inUse says why a volume being deleted must stay: the nodes it is
// published to; empty when none.
func (a *Agent) inUse(vol *v1alpha1.NBDVolume) string {
	if len(vol.Spec.Publications) == 0 {
		return ""
	}
	nodes := make([]string, 0, len(vol.Spec.Publications))
	for _, p := range vol.Spec.Publications {
		nodes = append(nodes, p.NodeID)
	}
	return "published to " + strings.Join(nodes, ", ")
}

// connected says why the backing file of a volume whose export was
// removed must not go yet: the connections to that export the NBD server
// still has (they end once their handlers finish); empty when none.
func (a *Agent) connected(name string) string {
	if n := a.srv.ExportConns(name); n > 0 {
		return fmt.Sprintf("%d connection(s) to its export still open", n)
	}
	return ""
}

// Reasons of the DeletionBlocked condition.
const (
	// reasonInUse: the volume is published; it keeps serving.
	reasonInUse = "InUse"
	// reasonConnected: the export is closed, but connections to it are
	// still open; the backing file goes once they are gone.
	reasonConnected = "ConnectionsOpen"
)

// blockDeletion records why a deleted volume stays (once per reason).
func (a *Agent) blockDeletion(ctx context.Context, log *slog.Logger, vol *v1alpha1.NBDVolume, reason, why string) error {
	msg := "deletion waits until the volume is no longer in use: " + why
	if c := meta.FindStatusCondition(vol.Status.Conditions, ConditionDeletionBlocked); c != nil && c.Status == metav1.ConditionTrue && c.Reason == reason && c.Message == msg {
		return nil
	}
	if reason == reasonConnected {
		log.Warn("the volume's export is closed, but connections to it are still open: its backing file is deleted once they are gone", "reason", why)
	} else {
		log.Warn("the volume was deleted while in use: it keeps serving, and goes once it is not", "reason", why)
	}
	orig := vol.DeepCopy()
	meta.SetStatusCondition(&vol.Status.Conditions, metav1.Condition{
		Type: ConditionDeletionBlocked, Status: metav1.ConditionTrue, Reason: reason, Message: msg,
		ObservedGeneration: vol.Generation,
	})
	if err := a.client.Status().Patch(ctx, vol, client.MergeFrom(orig)); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("writing status: %w", err)
	}
	return nil
}

// forget stops serving a volume whose object is gone, or going without the
// agent's finalizer (removed by hand): its file stays. A backing file still
// there is an orphan once the object is gone, also after remove released a
// volume deleted without DeleteDataAnnotation: the capacity report that
// lists it is asked for at once (the cache this reconcile read no longer
// has the object).
func (a *Agent) forget(log *slog.Logger, name string) {
	a.mu.Lock()
	v := a.vols[name]
	if v != nil && v.asReplica {
		// Held as a replica now (the primary moved away): the replica's
		// reconciler has it.
		a.mu.Unlock()
		return
	}
	delete(a.vols, name)
	a.updateKnownSourcesLocked()
	a.mu.Unlock()
	if v != nil {
		log.Warn("volume object gone without its finalizer; export closed, backing file kept")
		if err := a.closeVolume(v); err != nil {
			log.Warn("closing the backing file", "error", err)
		}
	}
	if _, err := os.Stat(a.path(name)); v != nil || err == nil {
		a.kickCapacity()
	}
}

// parseAddrs is a publication's addresses; an invalid one is left out
// (it matches no connection; the others still may).
func parseAddrs(log *slog.Logger, p v1alpha1.Publication) []netip.Addr {
	var addrs []netip.Addr
	for _, s := range p.Addresses {
		ip, err := netip.ParseAddr(strings.TrimSpace(s))
		if err != nil {
			log.Warn("ignoring an invalid publication address", "node_id", p.NodeID, "address", s)
			continue
		}
		addrs = append(addrs, ip.Unmap())
	}
	return addrs
}

// removeFile removes a volume's file (one already gone is no error),
// logs what, and has the capacity reported again.
func (a *Agent) removeFile(log *slog.Logger, path, what string, args ...any) error {
	switch err := os.Remove(path); {
	case err == nil:
		log.Info(what, append([]any{"path", path}, args...)...)
		a.kickCapacity()
	case !errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("removing %s: %w", path, err)
	}
	return nil
}
