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
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/access"
)

// TestSnapshots: CreateSnapshot is idempotent by name, refuses a second
// source under one name and an unknown source; volumes made from a
// snapshot or a volume land on the source's storage node, at least as
// large as the source (a smaller size asked is raised to it, a smaller
// limit is OutOfRange), and say their
// source; ListSnapshots filters and pages; DeleteSnapshot is idempotent;
// an agent failure reaches the caller with its code.
func TestSnapshots(t *testing.T) {
	ctl, c, agent := setup(t)
	ctx := context.Background()
	src, err := ctl.CreateVolume(ctx, createReq("src", 2*gib, map[string]string{"storageNode": "small"}))
	if err != nil {
		t.Fatal(err)
	}
	srcID := src.GetVolume().GetVolumeId()

	req := &csi.CreateSnapshotRequest{Name: "snap-a", SourceVolumeId: srcID, Parameters: map[string]string{
		"csi.storage.k8s.io/volumesnapshot/name": "nightly", "csi.storage.k8s.io/volumesnapshot/namespace": "apps"}}
	first, err := ctl.CreateSnapshot(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	s := first.GetSnapshot()
	if !s.GetReadyToUse() || s.GetSizeBytes() != 2*gib || s.GetSourceVolumeId() != srcID || s.GetCreationTime() == nil || s.GetSnapshotId() == "" {
		t.Fatalf("snapshot %v", s)
	}
	again, err := ctl.CreateSnapshot(ctx, req)
	if err != nil || again.GetSnapshot().GetSnapshotId() != s.GetSnapshotId() {
		t.Fatalf("repeated CreateSnapshot: %v, %v", again, err)
	}
	var obj v1alpha1.NBDSnapshot
	if err := c.Get(ctx, client.ObjectKey{Name: s.GetSnapshotId()}, &obj); err != nil || obj.Spec.StorageNode != "small" ||
		obj.Annotations[access.AnnotationVolumeSnapshot] != "apps/nightly" {
		t.Fatalf("NBDSnapshot: %v, storage node %q, annotations %v", err, obj.Spec.StorageNode, obj.Annotations)
	}
	other, err := ctl.CreateVolume(ctx, createReq("other", gib, nil))
	if err != nil {
		t.Fatal(err)
	}
	_, err = ctl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap-a", SourceVolumeId: other.GetVolume().GetVolumeId()})
	wantStatus(t, err, codes.AlreadyExists, "snap-a")
	_, err = ctl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap-x", SourceVolumeId: "no-such-volume"})
	wantStatus(t, err, codes.NotFound, "no-such-volume")
	_, err = ctl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap-x"})
	wantStatus(t, err, codes.InvalidArgument, "source_volume_id")
	_, err = ctl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{SourceVolumeId: srcID})
	wantStatus(t, err, codes.InvalidArgument, "name")

	fromSnap := func(name string, required int64) *csi.CreateVolumeRequest {
		r := createReq(name, required, nil)
		r.VolumeContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
			Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: s.GetSnapshotId()}}}
		return r
	}
	restored, err := ctl.CreateVolume(ctx, fromSnap("restored", 3*gib))
	if err != nil {
		t.Fatal(err)
	}
	rv := restored.GetVolume()
	if rv.GetCapacityBytes() != 3*gib || rv.GetContentSource().GetSnapshot().GetSnapshotId() != s.GetSnapshotId() {
		t.Fatalf("restored volume %v", rv)
	}
	var robj v1alpha1.NBDVolume
	if err := c.Get(ctx, client.ObjectKey{Name: rv.GetVolumeId()}, &robj); err != nil || robj.Spec.StorageNode != "small" ||
		robj.Spec.ContentSource == nil || robj.Spec.ContentSource.Snapshot != s.GetSnapshotId() {
		t.Fatalf("restored NBDVolume: %v, %+v", err, robj.Spec)
	}
	// No size asked: the source's.
	if v, err := ctl.CreateVolume(ctx, fromSnap("restored-default", 0)); err != nil || v.GetVolume().GetCapacityBytes() != 2*gib {
		t.Fatalf("restore without a size: %v, %v", v, err)
	}
	// Less asked than the source holds: the source's size (as the xfs
	// minimum raises a claim); a limit below it is OutOfRange.
	if v, err := ctl.CreateVolume(ctx, fromSnap("restored-small", gib)); err != nil || v.GetVolume().GetCapacityBytes() != 2*gib {
		t.Fatalf("restore asking less than the source holds: %v, %v", v, err)
	}
	limited := fromSnap("restored-limited", gib)
	limited.CapacityRange.LimitBytes = gib + gib/2
	_, err = ctl.CreateVolume(ctx, limited)
	wantStatus(t, err, codes.OutOfRange, "limit_bytes")
	// The same name again with another source.
	clone := createReq("restored", 3*gib, nil)
	clone.VolumeContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
		Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: srcID}}}
	_, err = ctl.CreateVolume(ctx, clone)
	wantStatus(t, err, codes.AlreadyExists, "content source")
	clone.Name = "clone"
	cv, err := ctl.CreateVolume(ctx, clone)
	if err != nil || cv.GetVolume().GetContentSource().GetVolume().GetVolumeId() != srcID {
		t.Fatalf("clone: %v, %v", cv, err)
	}

	// Listing.
	if _, err := ctl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap-b", SourceVolumeId: other.GetVolume().GetVolumeId()}); err != nil {
		t.Fatal(err)
	}
	all, err := ctl.ListSnapshots(ctx, &csi.ListSnapshotsRequest{})
	if err != nil || len(all.GetEntries()) != 2 {
		t.Fatalf("ListSnapshots: %v, %v", all, err)
	}
	bySource, err := ctl.ListSnapshots(ctx, &csi.ListSnapshotsRequest{SourceVolumeId: srcID})
	if err != nil || len(bySource.GetEntries()) != 1 || bySource.GetEntries()[0].GetSnapshot().GetSnapshotId() != s.GetSnapshotId() {
		t.Fatalf("ListSnapshots by source: %v, %v", bySource, err)
	}
	byID, err := ctl.ListSnapshots(ctx, &csi.ListSnapshotsRequest{SnapshotId: "no-such-snapshot"})
	if err != nil || len(byID.GetEntries()) != 0 {
		t.Fatalf("ListSnapshots of an unknown ID: %v, %v", byID, err)
	}
	page, err := ctl.ListSnapshots(ctx, &csi.ListSnapshotsRequest{MaxEntries: 1})
	if err != nil || len(page.GetEntries()) != 1 || page.GetNextToken() == "" {
		t.Fatalf("first page: %v, %v", page, err)
	}
	rest, err := ctl.ListSnapshots(ctx, &csi.ListSnapshotsRequest{StartingToken: page.GetNextToken()})
	if err != nil || len(rest.GetEntries()) != 1 || rest.GetEntries()[0].GetSnapshot().GetSnapshotId() == page.GetEntries()[0].GetSnapshot().GetSnapshotId() {
		t.Fatalf("second page: %v, %v", rest, err)
	}
	_, err = ctl.ListSnapshots(ctx, &csi.ListSnapshotsRequest{StartingToken: "bogus"})
	wantStatus(t, err, codes.Aborted, "starting_token")

	// Deletion, twice; the source and the restore stay.
	for range 2 {
		if _, err := ctl.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: s.GetSnapshotId()}); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Get(ctx, client.ObjectKey{Name: s.GetSnapshotId()}, &v1alpha1.NBDSnapshot{}); err == nil {
		t.Fatal("the snapshot object is still there")
	}
	_, err = ctl.CreateVolume(ctx, fromSnap("after-delete", 0))
	wantStatus(t, err, codes.NotFound, s.GetSnapshotId())

	// The agent's failure, with its code; the failed object goes.
	agent.setFail("snap-c", "ResourceExhausted")
	_, err = ctl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap-c", SourceVolumeId: srcID})
	wantStatus(t, err, codes.ResourceExhausted, "simulated failure")
}

// TestSnapshotStillBeingTaken: a snapshot the agent has not finished
// (a long copy) is returned not ready instead of failing; asked again
// once it is taken, it is ready.
func TestSnapshotStillBeingTaken(t *testing.T) {
	ctl, _, agent := setup(t, func(cfg *ControllerConfig) { cfg.WaitTimeout = 300 * time.Millisecond })
	ctx := context.Background()
	src, err := ctl.CreateVolume(ctx, createReq("src", gib, nil))
	if err != nil {
		t.Fatal(err)
	}
	req := &csi.CreateSnapshotRequest{Name: "slow", SourceVolumeId: src.GetVolume().GetVolumeId()}
	agent.setHold(SnapshotIDForName("slow"), true)
	first, err := ctl.CreateSnapshot(ctx, req)
	if err != nil || first.GetSnapshot().GetReadyToUse() || first.GetSnapshot().GetCreationTime() == nil {
		t.Fatalf("while being taken: %v, %v; want not ready, with a creation time, no error", first, err)
	}
	agent.setHold(SnapshotIDForName("slow"), false)
	again, err := ctl.CreateSnapshot(ctx, req)
	if err != nil || !again.GetSnapshot().GetReadyToUse() || again.GetSnapshot().GetSizeBytes() != gib {
		t.Fatalf("once taken: %v, %v", again, err)
	}
}
