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

// The Controller's snapshots: NBDSnapshots taken by the source volume's
// storage agent, and volumes made from them or from other volumes.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/access"
)

// SnapshotIDForName is the snapshot ID (the NBDSnapshot's name) for a CSI
// snapshot name: the name itself when it can name an object, else a
// hash of it.
func SnapshotIDForName(name string) string {
	if validVolumeID(name) {
		return name
	}
	sum := sha256.Sum256([]byte(name))
	return "snap-" + hex.EncodeToString(sum[:16])
}

// errSnapshotFailed marks a wait that ended with the agent's failure.
var errSnapshotFailed = errors.New("storage agent reports the snapshot failed")

func (c *Controller) CreateSnapshot(ctx context.Context, req *csi.CreateSnapshotRequest) (*csi.CreateSnapshotResponse, error) {
	s, err := c.createSnapshot(ctx, req)
	if err != nil {
		return nil, toStatus(err)
	}
	return &csi.CreateSnapshotResponse{Snapshot: s}, nil
}

func (c *Controller) createSnapshot(ctx context.Context, req *csi.CreateSnapshotRequest) (*csi.Snapshot, error) {
	name, src := req.GetName(), req.GetSourceVolumeId()
	if name == "" {
		return nil, invalid("name is required")
	}
	if src == "" {
		return nil, invalid("source_volume_id is required")
	}
	id := SnapshotIDForName(name)
	unlock, ok := c.lock("snapshot/" + id)
	if !ok {
		return nil, aborted("CreateSnapshot", id)
	}
	defer unlock()

	var s v1alpha1.NBDSnapshot
	err := c.c.Get(ctx, client.ObjectKey{Name: id}, &s)
	switch {
	case err == nil:
		if got := s.Annotations[access.AnnotationCSIName]; got != name {
			return nil, fmt.Errorf("%w: snapshot ID %s belongs to CSI name %q, not %q", ErrAlreadyExists, id, got, name)
		}
		if s.Spec.SourceVolume != src {
			return nil, fmt.Errorf("%w: snapshot %s exists of volume %s, not %s", ErrAlreadyExists, name, s.Spec.SourceVolume, src)
		}
		if s.DeletionTimestamp != nil {
			return nil, fmt.Errorf("%w: snapshot %s is being deleted; retry once it is gone", ErrAborted, id)
		}
	case apierrors.IsNotFound(err):
		if !validVolumeID(src) {
			return nil, fmt.Errorf("%w: source volume %s", ErrNotFound, src)
		}
		var v v1alpha1.NBDVolume
		if err := c.c.Get(ctx, client.ObjectKey{Name: src}, &v); err != nil {
			if apierrors.IsNotFound(err) {
				return nil, fmt.Errorf("%w: source volume %s", ErrNotFound, src)
			}
			return nil, kubeErr(err, "reading NBDVolume "+src)
		}
		if v.DeletionTimestamp != nil {
			return nil, fmt.Errorf("%w: source volume %s is being deleted", ErrPrecondition, src)
		}
		ann := map[string]string{access.AnnotationCSIName: name}
		// With --extra-create-metadata the snapshotter names the
		// VolumeSnapshot it takes this for: kept, for whoever looks.
		p := req.GetParameters()
		if vs := p["csi.storage.k8s.io/volumesnapshot/name"]; vs != "" {
			ann[access.AnnotationVolumeSnapshot] = p["csi.storage.k8s.io/volumesnapshot/namespace"] + "/" + vs
		}
		s = v1alpha1.NBDSnapshot{
			ObjectMeta: metav1.ObjectMeta{
				Name:        id,
				Finalizers:  []string{v1alpha1.SnapshotFinalizer},
				Annotations: ann,
			},
			Spec: v1alpha1.NBDSnapshotSpec{SourceVolume: src, StorageNode: v.Spec.StorageNode},
		}
		if err := c.c.Create(ctx, &s); err != nil {
			return nil, kubeErr(err, "creating NBDSnapshot "+id)
		}
		c.log.Info("snapshot requested", "snapshot_id", id, "csi_name", name, "volume_id", src, "storage_node", v.Spec.StorageNode)
	default:
		return nil, kubeErr(err, "reading NBDSnapshot "+id)
	}

	w, err := c.waitSnapshot(ctx, id, func(s *v1alpha1.NBDSnapshot) (bool, error) {
		switch {
		case s == nil:
			return false, fmt.Errorf("%w: snapshot %s was deleted while being taken; retry", ErrAborted, id)
		case s.Status.Code != "" && !s.Status.ReadyToUse:
			return false, errSnapshotFailed
		}
		return s.Status.ReadyToUse, nil
	})
	switch {
	case errors.Is(err, errSnapshotFailed):
		failure := snapshotError(w)
		c.log.Warn("storage agent failed to take the snapshot; deleting it", "snapshot_id", id, "code", w.Status.Code, "message", w.Status.Message)
		if err := c.c.Delete(ctx, w, client.Preconditions{UID: &w.UID}); err != nil && !apierrors.IsNotFound(err) {
			c.log.Error("deleting a failed snapshot", "snapshot_id", id, "error", err)
		}
		return nil, failure
	case errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil && w != nil:
		// Still being taken (a long copy): the CO asks again.
		return csiSnapshot(w), nil
	case err != nil:
		return nil, err
	}
	return csiSnapshot(w), nil
}

// waitSnapshot reads snapshot id until done reports true (done gets nil
// once the snapshot is gone) or an error, for at most WaitTimeout, paced
// as waitVolume. When the time runs out it returns the snapshot as last
// read with the context's error; errSnapshotFailed comes with the
// snapshot.
func (c *Controller) waitSnapshot(ctx context.Context, id string, done func(*v1alpha1.NBDSnapshot) (bool, error)) (*v1alpha1.NBDSnapshot, error) {
	wctx, cancel := context.WithTimeout(ctx, c.cfg.WaitTimeout)
	defer cancel()
	tick, release := c.waitTicks(SnapshotKey(id))
	defer release()
	var last *v1alpha1.NBDSnapshot
	for {
		s := &v1alpha1.NBDSnapshot{}
		err := c.c.Get(wctx, client.ObjectKey{Name: id}, s)
		if err == nil || apierrors.IsNotFound(err) {
			if err != nil {
				s = nil
			}
			ok, err := done(s)
			if err != nil {
				return s, err
			}
			if ok {
				return s, nil
			}
			last = s
		}
		select {
		case <-wctx.Done():
			return last, wctx.Err()
		case <-tick:
		}
	}
}

// snapshotError is the agent's failure as a gRPC error.
func snapshotError(s *v1alpha1.NBDSnapshot) error {
	code, ok := codeByName(s.Status.Code)
	if !ok || code == codes.OK {
		code = codes.Internal
	}
	return status.Errorf(code, "storage node %s: snapshot %s of volume %s: %s", s.Spec.StorageNode, s.Name, s.Spec.SourceVolume, s.Status.Message)
}

// csiSnapshot is the CSI view of an NBDSnapshot.
func csiSnapshot(s *v1alpha1.NBDSnapshot) *csi.Snapshot {
	created := s.CreationTimestamp.Time
	if t := s.Status.CreationTime; t != nil {
		created = t.Time
	}
	return &csi.Snapshot{
		SnapshotId:     s.Name,
		SourceVolumeId: s.Spec.SourceVolume,
		SizeBytes:      s.Status.SizeBytes,
		CreationTime:   timestamppb.New(created),
		ReadyToUse:     s.Status.ReadyToUse,
	}
}

func (c *Controller) DeleteSnapshot(ctx context.Context, req *csi.DeleteSnapshotRequest) (*csi.DeleteSnapshotResponse, error) {
	if err := c.deleteSnapshot(ctx, req.GetSnapshotId()); err != nil {
		return nil, toStatus(err)
	}
	return &csi.DeleteSnapshotResponse{}, nil
}

// deleteSnapshot deletes a snapshot and waits until its agent removed the
// file. Volumes restored from it have files of their own.
func (c *Controller) deleteSnapshot(ctx context.Context, id string) error {
	if id == "" {
		return invalid("snapshot_id is required")
	}
	if !validVolumeID(id) {
		return nil
	}
	unlock, ok := c.lock("snapshot/" + id)
	if !ok {
		return aborted("DeleteSnapshot", id)
	}
	defer unlock()
	var s v1alpha1.NBDSnapshot
	if err := c.c.Get(ctx, client.ObjectKey{Name: id}, &s); err != nil {
		if apierrors.IsNotFound(err) {
			return nil
		}
		return kubeErr(err, "reading NBDSnapshot "+id)
	}
	if s.DeletionTimestamp == nil {
		if err := c.c.Delete(ctx, &s, client.Preconditions{UID: &s.UID}); err != nil && !apierrors.IsNotFound(err) {
			return kubeErr(err, "deleting NBDSnapshot "+id)
		}
		c.log.Info("snapshot deleted", "snapshot_id", id, "volume_id", s.Spec.SourceVolume)
	}
	_, err := c.waitSnapshot(ctx, id, func(s *v1alpha1.NBDSnapshot) (bool, error) { return s == nil, nil })
	if err != nil {
		return fmt.Errorf("snapshot %s: the storage agent did not remove its file in time: %w", id, err)
	}
	return nil
}

func (c *Controller) ListSnapshots(ctx context.Context, req *csi.ListSnapshotsRequest) (*csi.ListSnapshotsResponse, error) {
	resp, err := c.listSnapshots(ctx, req)
	if err != nil {
		return nil, toStatus(err)
	}
	return resp, nil
}

// listSnapshots lists the snapshots not being deleted, in ID order, with
// the same paging as ListVolumes.
func (c *Controller) listSnapshots(ctx context.Context, req *csi.ListSnapshotsRequest) (*csi.ListSnapshotsResponse, error) {
	start, err := listStart(req.GetMaxEntries(), req.GetStartingToken(), "ListSnapshots")
	if err != nil {
		return nil, err
	}
	var list v1alpha1.NBDSnapshotList
	if err := c.c.List(ctx, &list); err != nil {
		return nil, kubeErr(err, "listing NBDSnapshots")
	}
	snaps := slices.DeleteFunc(list.Items, func(s v1alpha1.NBDSnapshot) bool {
		return s.DeletionTimestamp != nil || s.Name < start ||
			(req.GetSnapshotId() != "" && s.Name != req.GetSnapshotId()) ||
			(req.GetSourceVolumeId() != "" && s.Spec.SourceVolume != req.GetSourceVolumeId())
	})
	slices.SortFunc(snaps, func(a, b v1alpha1.NBDSnapshot) int { return strings.Compare(a.Name, b.Name) })
	snaps, next := listPage(snaps, req.GetMaxEntries(), func(s v1alpha1.NBDSnapshot) string { return s.Name })
	resp := &csi.ListSnapshotsResponse{NextToken: next}
	for i := range snaps {
		resp.Entries = append(resp.Entries, &csi.ListSnapshotsResponse_Entry{Snapshot: csiSnapshot(&snaps[i])})
	}
	return resp, nil
}

// contentSource checks a CreateVolume's content source and returns what
// the new volume is made from, the storage node that holds it and its
// size (the smallest the new volume may be).
func (c *Controller) contentSource(ctx context.Context, src *csi.VolumeContentSource) (*v1alpha1.ContentSource, string, int64, error) {
	switch {
	case src.GetSnapshot() != nil:
		id := src.GetSnapshot().GetSnapshotId()
		if id == "" {
			return nil, "", 0, invalid("volume_content_source.snapshot.snapshot_id is required")
		}
		var s v1alpha1.NBDSnapshot
		if !validVolumeID(id) {
			return nil, "", 0, fmt.Errorf("%w: snapshot %s", ErrNotFound, id)
		}
		if err := c.c.Get(ctx, client.ObjectKey{Name: id}, &s); err != nil {
			if apierrors.IsNotFound(err) {
				return nil, "", 0, fmt.Errorf("%w: snapshot %s", ErrNotFound, id)
			}
			return nil, "", 0, kubeErr(err, "reading NBDSnapshot "+id)
		}
		if s.DeletionTimestamp != nil {
			return nil, "", 0, fmt.Errorf("%w: snapshot %s", ErrNotFound, id)
		}
		if !s.Status.ReadyToUse {
			return nil, "", 0, fmt.Errorf("%w: snapshot %s is not ready yet", ErrUnavailable, id)
		}
		return &v1alpha1.ContentSource{Snapshot: id}, s.Spec.StorageNode, s.Status.SizeBytes, nil
	case src.GetVolume() != nil:
		id := src.GetVolume().GetVolumeId()
		if id == "" {
			return nil, "", 0, invalid("volume_content_source.volume.volume_id is required")
		}
		var v v1alpha1.NBDVolume
		if !validVolumeID(id) {
			return nil, "", 0, fmt.Errorf("%w: volume %s", ErrNotFound, id)
		}
		if err := c.c.Get(ctx, client.ObjectKey{Name: id}, &v); err != nil {
			if apierrors.IsNotFound(err) {
				return nil, "", 0, fmt.Errorf("%w: volume %s", ErrNotFound, id)
			}
			return nil, "", 0, kubeErr(err, "reading NBDVolume "+id)
		}
		if v.DeletionTimestamp != nil {
			return nil, "", 0, fmt.Errorf("%w: volume %s", ErrNotFound, id)
		}
		return &v1alpha1.ContentSource{Volume: id}, v.Spec.StorageNode, max(v.Spec.SizeBytes, v.Status.CapacityBytes), nil
	}
	return nil, "", 0, invalid("volume_content_source names neither a snapshot nor a volume")
}

// csiContentSource is the CSI form of a volume's content source.
func csiContentSource(cs *v1alpha1.ContentSource) *csi.VolumeContentSource {
	switch {
	case cs == nil:
		return nil
	case cs.Snapshot != "":
		return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
			Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: cs.Snapshot}}}
	default:
		return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
			Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: cs.Volume}}}
	}
}
