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

// Snapshots: an NBDSnapshot of a volume this node serves is taken here,
// as a file beside the volume's: a reflink where the data directory's
// filesystem can, with the volume's export held at a flush point
// meanwhile, else a sparse copy made while writes flow, the ranges they
// change copied again and last with the export held at a flush point
// (crash-consistent either way: every write the export acknowledged
// before the snapshot is in it, none after).

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"syscall"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/predicate"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/nbd"
	"github.com/mpnbd/mpnbd/pkg/snapshot"
)

const (
	// snapshotSuffix ends every snapshot file's name.
	snapshotSuffix = ".snap"
	// quiesceTimeout bounds the wait for a source's writes in flight.
	quiesceTimeout = 30 * time.Second
	// snapshotRetry is how soon a snapshot that could not be taken is
	// tried again.
	snapshotRetry = 10 * time.Second
)

// snapshots reconciles the NBDSnapshots of the agent's node.
type snapshots struct{ a *Agent }

func (a *Agent) snapshotPath(name string) string {
	return filepath.Join(a.cfg.DataDir, name+snapshotSuffix)
}

// setupSnapshots registers the NBDSnapshot reconciler with mgr; without
// the NBDSnapshot CRD (a cluster upgraded without it) snapshots are off
// and volumes are served all the same.
func (a *Agent) setupSnapshots(mgr ctrl.Manager) error {
	if !a.cfg.Snapshots {
		a.log.Warn("the NBDSnapshot CRD is not installed: snapshots are off on this storage node until it is and the agent restarts")
		return nil
	}
	ours := predicate.NewPredicateFuncs(func(o client.Object) bool {
		s, ok := o.(*v1alpha1.NBDSnapshot)
		return ok && s.Spec.StorageNode == a.cfg.NodeName
	})
	return ctrl.NewControllerManagedBy(mgr).
		Named("nbdsnapshot").
		For(&v1alpha1.NBDSnapshot{}, builder.WithPredicates(ours)).
		WithOptions(controller.Options{MaxConcurrentReconciles: 1, SkipNameValidation: ptr.To(true)}).
		Complete(snapshots{a})
}

// Reconcile takes a snapshot that is not taken yet, or removes the file of
// one being deleted.
func (s snapshots) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	a := s.a
	log := a.log.With("snapshot_id", req.Name)
	var snap v1alpha1.NBDSnapshot
	if err := a.client.Get(ctx, req.NamespacedName, &snap); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if snap.Spec.StorageNode != a.cfg.NodeName {
		return ctrl.Result{}, nil
	}
	log = log.With("volume_id", snap.Spec.SourceVolume)
	if !snap.DeletionTimestamp.IsZero() {
		return ctrl.Result{}, a.removeSnapshot(ctx, log, &snap)
	}
	if !controllerutil.ContainsFinalizer(&snap, v1alpha1.SnapshotFinalizer) {
		patch := client.MergeFromWithOptions(snap.DeepCopy(), client.MergeFromWithOptimisticLock{})
		controllerutil.AddFinalizer(&snap, v1alpha1.SnapshotFinalizer)
		if err := a.client.Patch(ctx, &snap, patch); err != nil {
			return ctrl.Result{}, fmt.Errorf("adding the finalizer: %w", err)
		}
	}
	if snap.Status.ReadyToUse {
		if _, err := os.Stat(a.snapshotPath(snap.Name)); err != nil {
			return ctrl.Result{}, a.snapshotStatus(ctx, &snap, func(st *v1alpha1.NBDSnapshotStatus) {
				st.ReadyToUse, st.Code, st.Message = false, "Internal", fmt.Sprintf("the snapshot's file is gone: %v", err)
			})
		}
		return ctrl.Result{}, nil
	}
	st, f := a.takeSnapshot(ctx, log, &snap)
	if f != nil {
		log.Warn("snapshot not taken", "code", f.code, "message", f.message)
		err := a.snapshotStatus(ctx, &snap, func(st *v1alpha1.NBDSnapshotStatus) {
			st.Code, st.Message = f.code, f.message
		})
		return ctrl.Result{RequeueAfter: f.retry}, err
	}
	return ctrl.Result{}, a.snapshotStatus(ctx, &snap, func(s *v1alpha1.NBDSnapshotStatus) { *s = st })
}

// takeSnapshot makes the snapshot's file and says what it is.
func (a *Agent) takeSnapshot(ctx context.Context, log *slog.Logger, snap *v1alpha1.NBDSnapshot) (v1alpha1.NBDSnapshotStatus, *failure) {
	src, dst := snap.Spec.SourceVolume, a.snapshotPath(snap.Name)
	if fi, err := os.Stat(dst); err == nil {
		// Taken before its status was written: Clone renames a synced
		// file into place, so what is there is whole.
		return v1alpha1.NBDSnapshotStatus{
			ReadyToUse: true, SizeBytes: fi.Size(), UsedBytes: allocated(fi),
			CreationTime: &metav1.Time{Time: fi.ModTime()},
		}, nil
	}
	a.mu.RLock()
	v := a.vols[src]
	a.mu.RUnlock()
	e, served := a.srv.Export(src)
	if v == nil || v.backend == nil || !served {
		return v1alpha1.NBDSnapshotStatus{}, &failure{code: "NotFound", retry: snapshotRetry,
			message: fmt.Sprintf("volume %s is not served by storage node %s", src, a.cfg.NodeName)}
	}
	var at time.Time
	res, err := snapshot.Clone(ctx, a.path(src), dst, heldAt(e, &at), tracked(e))
	switch {
	case errors.Is(err, syscall.ENOSPC):
		return v1alpha1.NBDSnapshotStatus{}, &failure{code: "ResourceExhausted", retry: exhaustedRetry,
			message: fmt.Sprintf("no room for the snapshot of %s on storage node %s: %v", src, a.cfg.NodeName, err)}
	case errors.Is(err, fs.ErrNotExist):
		return v1alpha1.NBDSnapshotStatus{}, &failure{code: "NotFound", retry: snapshotRetry,
			message: fmt.Sprintf("volume %s has no backing file on storage node %s", src, a.cfg.NodeName)}
	case err != nil:
		return v1alpha1.NBDSnapshotStatus{}, internal("snapshot of %s: %v", src, err)
	}
	log.Info("snapshot taken", "method", res.Method, "size", res.Size, "used", res.Allocated,
		"copied_again", res.Recopied, "writes_held", res.Held, "took", res.Duration)
	a.kickCapacity()
	return v1alpha1.NBDSnapshotStatus{
		ReadyToUse: true, SizeBytes: res.Size, UsedBytes: res.Allocated, Method: string(res.Method),
		CreationTime: &metav1.Time{Time: at}, HeldMilliseconds: res.Held.Milliseconds(),
	}, nil
}

// heldAt makes Clone hold export e at a flush point while it reads the
// source (bounded by quiesceTimeout), and record in *at, if set, when the
// hold began.
func heldAt(e *nbd.Export, at *time.Time) snapshot.Option {
	return snapshot.WithQuiesce(func(ctx context.Context) (func(), error) {
		qctx, cancel := context.WithTimeout(ctx, quiesceTimeout)
		defer cancel()
		resume, err := e.Quiesce(qctx)
		if at != nil {
			*at = time.Now()
		}
		return resume, err
	})
}

// tracked lets a copy of export e's backing file run while its writes
// flow: e records the ranges they change, which Clone copies again, last
// with the writes held (see package snapshot).
func tracked(e *nbd.Export) snapshot.Option {
	return snapshot.WithChanges(func() (func() []snapshot.Range, func()) {
		t := e.TrackChanges()
		take := func() []snapshot.Range {
			rs := t.Take()
			out := make([]snapshot.Range, len(rs))
			for i, r := range rs {
				out[i] = snapshot.Range{Off: r.Off, Len: r.Len}
			}
			return out
		}
		return take, t.Stop
	})
}

// removeSnapshot deletes a deleted snapshot's file, then its finalizer.
// Volumes restored from it have files of their own: nothing else refers
// to it.
func (a *Agent) removeSnapshot(ctx context.Context, log *slog.Logger, snap *v1alpha1.NBDSnapshot) error {
	if !controllerutil.ContainsFinalizer(snap, v1alpha1.SnapshotFinalizer) {
		return nil
	}
	path := a.snapshotPath(snap.Name)
	switch err := os.Remove(path); {
	case err == nil:
		log.Info("snapshot file removed", "path", path)
		a.kickCapacity()
	case !errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("removing %s: %w", path, err)
	}
	patch := client.MergeFromWithOptions(snap.DeepCopy(), client.MergeFromWithOptimisticLock{})
	controllerutil.RemoveFinalizer(snap, v1alpha1.SnapshotFinalizer)
	if err := a.client.Patch(ctx, snap, patch); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("removing the finalizer: %w", err)
	}
	return nil
}

// snapshotStatus applies set to the snapshot's status and writes it.
func (a *Agent) snapshotStatus(ctx context.Context, snap *v1alpha1.NBDSnapshot, set func(*v1alpha1.NBDSnapshotStatus)) error {
	orig := snap.DeepCopy()
	set(&snap.Status)
	if err := a.client.Status().Patch(ctx, snap, client.MergeFrom(orig)); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("writing status: %w", err)
	}
	return nil
}

// fill makes a new volume's backing file at path from its content source:
// a copy of a snapshot of this node, or of a volume this node serves (held
// at a flush point, as for a snapshot). The file is then at most want
// bytes; the caller grows it. Nothing is left at path on failure.
func (a *Agent) fill(ctx context.Context, log *slog.Logger, path string, cs *v1alpha1.ContentSource, want int64) *failure {
	var src, what string
	var opts []snapshot.Option
	switch {
	case cs.Snapshot != "" && cs.Volume == "":
		if f := invalidName("contentSource.snapshot", cs.Snapshot); f != nil {
			return f
		}
		src, what = a.snapshotPath(cs.Snapshot), "snapshot "+cs.Snapshot
	case cs.Volume != "" && cs.Snapshot == "":
		if f := invalidName("contentSource.volume", cs.Volume); f != nil {
			return f
		}
		src, what = a.path(cs.Volume), "volume "+cs.Volume
		e, served := a.srv.Export(cs.Volume)
		if !served {
			return &failure{code: "NotFound", retry: snapshotRetry,
				message: fmt.Sprintf("source volume %s is not served by storage node %s", cs.Volume, a.cfg.NodeName)}
		}
		opts = append(opts, heldAt(e, nil), tracked(e))
	default:
		return &failure{code: "InvalidArgument", retry: exhaustedRetry,
			message: "contentSource names both a volume and a snapshot, or neither"}
	}
	opts = append(opts, snapshot.WithMaxSize(want))
	res, err := snapshot.Clone(ctx, src, path, opts...)
	var tooLarge *snapshot.TooLargeError
	switch {
	case errors.As(err, &tooLarge):
		return &failure{code: "OutOfRange", retry: exhaustedRetry,
			message: fmt.Sprintf("%s holds %d bytes, more than the %d the volume asks for", what, tooLarge.Size, want)}
	case errors.Is(err, fs.ErrNotExist):
		return &failure{code: "NotFound", retry: snapshotRetry,
			message: fmt.Sprintf("%s is not on storage node %s", what, a.cfg.NodeName)}
	case errors.Is(err, syscall.ENOSPC):
		return &failure{code: "ResourceExhausted", retry: exhaustedRetry,
			message: fmt.Sprintf("no room to copy %s on storage node %s: %v", what, a.cfg.NodeName, err)}
	case err != nil:
		return internal("copying %s: %v", what, err)
	}
	log.Info("backing file made from "+what, "path", path, "method", res.Method, "size", res.Size, "writes_held", res.Held, "took", res.Duration)
	return nil
}
