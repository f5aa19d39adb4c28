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
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/access"
)

// TestControllerAPIServer runs the controller's main flows against a real
// kube-apiserver (with the CRDs of deploy/crds) and a simulated storage
// agent.
func TestControllerAPIServer(t *testing.T) {
	// The controller acts as its ServiceAccount, with the deploy tree's
	// RBAC: a call that needs more than it grants fails here.
	c, asController := controllerTestEnv(t)
	ctx := context.Background()
	now := time.Now()
	putStorageNode(t, c, "big", 100*gib, map[string]string{"zone": "a"}, nil, now)
	putStorageNode(t, c, "small", 10*gib, map[string]string{"zone": "b"}, map[string]string{"tier": "fast"}, now)
	putNode(t, c, "worker-1", "10.0.0.1,10.0.1.1")
	putNode(t, c, "worker-2", "10.0.0.2")
	agent := startAgent(t, c)
	ctl := newTestController(t, asController, func(cfg *ControllerConfig) { cfg.PollInterval = 20 * time.Millisecond })

	t.Run("create", func(t *testing.T) {
		params := map[string]string{"fsType": "ext4", "csi.storage.k8s.io/pv/name": "pv-1"}
		resp, err := ctl.CreateVolume(ctx, createReq("api-create", 3*gib+1, params))
		if err != nil {
			t.Fatal(err)
		}
		if resp.GetVolume().GetCapacityBytes() != 3*gib+4096 {
			t.Errorf("capacity %d", resp.GetVolume().GetCapacityBytes())
		}
		v := getVolume(t, c, "api-create")
		if v.Generation != 1 || v.Status.ObservedGeneration != 1 || v.Spec.StorageNode != "big" ||
			!maps.Equal(v.Spec.Parameters, map[string]string{"fsType": "ext4"}) ||
			v.Annotations[access.AnnotationCSIName] != "api-create" || !slices.Contains(v.Finalizers, v1alpha1.Finalizer) {
			t.Errorf("NBDVolume %+v", v)
		}
		again, err := ctl.CreateVolume(ctx, createReq("api-create", 3*gib, params))
		if err != nil || again.GetVolume().GetVolumeId() != "api-create" {
			t.Fatalf("repeated CreateVolume = %v, %v", again, err)
		}
		_, err = ctl.CreateVolume(ctx, createReq("api-create", 3*gib, map[string]string{"fsType": "xfs"}))
		wantStatus(t, err, codes.AlreadyExists, "parameters")
		_, err = ctl.CreateVolume(ctx, createReq("api-create", 4*gib, params))
		wantStatus(t, err, codes.AlreadyExists, "range")

		// A CSI name that is no object name.
		long := "pvc-0123456789012345678901234567890123456789012345678901234567890123456789"
		resp, err = ctl.CreateVolume(ctx, createReq(long, gib, nil))
		if err != nil {
			t.Fatal(err)
		}
		if id := resp.GetVolume().GetVolumeId(); id != VolumeIDForName(long) || getVolume(t, c, id).Annotations[access.AnnotationCSIName] != long {
			t.Errorf("long name got volume %s", id)
		}

		agent.setFail("api-doomed", "ResourceExhausted")
		_, err = ctl.CreateVolume(ctx, createReq("api-doomed", gib, nil))
		wantStatus(t, err, codes.ResourceExhausted, "simulated failure")
	})

	t.Run("publish", func(t *testing.T) {
		if _, err := ctl.CreateVolume(ctx, createReq("api-pub", gib, nil)); err != nil {
			t.Fatal(err)
		}
		resp, err := ctl.ControllerPublishVolume(ctx, publishReq("api-pub", "worker-1", fsCap(rwo), false))
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := getSecret(t, c, "api-pub", "worker-1"); ok {
			t.Error("a publication Secret was made: the node has a token of its own")
		}
		v := getVolume(t, c, "api-pub")
		if got := resp.GetPublishContext(); got[PublishContextExport] != "api-pub" ||
			got[PublishContextAddresses] != "192.0.2.1:10809,192.0.2.2:10809" {
			t.Errorf("publish context %v", got)
		}
		if v.Generation != 2 || v.Status.ObservedGeneration != 2 || len(v.Spec.Publications) != 1 ||
			v.Spec.Publications[0].SecretRef != "" || v.Spec.Publications[0].TokenSHA256 != access.TokenHash(nodeToken("worker-1")) || !slices.Equal(v.Spec.Publications[0].Addresses, []string{"10.0.0.1", "10.0.1.1"}) {
			t.Errorf("NBDVolume after publish: generation %d, status %+v, publications %+v", v.Generation, v.Status, v.Spec.Publications)
		}
		again, err := ctl.ControllerPublishVolume(ctx, publishReq("api-pub", "worker-1", fsCap(rwo), false))
		if err != nil || !maps.Equal(again.GetPublishContext(), resp.GetPublishContext()) {
			t.Fatalf("repeated publish = %v, %v", again, err)
		}
		_, err = ctl.ControllerPublishVolume(ctx, publishReq("api-pub", "worker-1", fsCap(rwo), true))
		wantStatus(t, err, codes.AlreadyExists, "readonly")
		_, err = ctl.ControllerPublishVolume(ctx, publishReq("api-pub", "worker-2", fsCap(rwo), false))
		wantStatus(t, err, codes.FailedPrecondition, "worker-1")
		_, err = ctl.ControllerPublishVolume(ctx, publishReq("api-pub", "no-such-node", fsCap(rwo), false))
		wantStatus(t, err, codes.NotFound, "no-such-node")

		// Status entries of worker-1 (to go with its publication) and of
		// worker-3 (published nowhere, but not this call's to remove).
		for _, n := range []string{"worker-1", "worker-3"} {
			if err := (&KubeAttachmentStatus{Client: c, NodeID: n}).Apply(ctx, "api-pub", v1alpha1.NodeAttachment{Transport: "fuse", Subflows: "2/2", Connected: true, LastUpdateTime: metav1.Now()}); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := ctl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: "api-pub", NodeId: "worker-1"}); err != nil {
			t.Fatal(err)
		}
		v = getVolume(t, c, "api-pub")
		if len(v.Status.Attachments) != 1 || v.Status.Attachments[0].NodeID != "worker-3" {
			t.Errorf("status.attachments after unpublishing worker-1: %+v, want worker-3's alone", v.Status.Attachments)
		}
		if len(v.Spec.Publications) != 0 || v.Status.ObservedGeneration != v.Generation {
			t.Errorf("after unpublish: publications %+v, observed %d of %d", v.Spec.Publications, v.Status.ObservedGeneration, v.Generation)
		}
		if _, ok := getSecret(t, c, "api-pub", "worker-1"); ok {
			t.Error("Secret left after unpublish")
		}
		if _, err := ctl.ControllerPublishVolume(ctx, publishReq("api-pub", "worker-2", fsCap(rwo), true)); err != nil {
			t.Fatalf("publish to the second node after unpublish: %v", err)
		}
		if v := getVolume(t, c, "api-pub"); len(v.Spec.Publications) != 1 || !v.Spec.Publications[0].ReadOnly {
			t.Errorf("publications %+v, want worker-2 read-only", v.Spec.Publications)
		}
		if err := (&KubeAttachmentStatus{Client: c, NodeID: "worker-2"}).Apply(ctx, "api-pub", v1alpha1.NodeAttachment{Transport: "fuse", Connected: true, LastUpdateTime: metav1.Now()}); err != nil {
			t.Fatal(err)
		}
		if _, err := ctl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: "api-pub"}); err != nil {
			t.Fatal(err)
		}
		if v := getVolume(t, c, "api-pub"); len(v.Status.Attachments) != 1 || v.Status.Attachments[0].NodeID != "worker-3" {
			t.Errorf("status.attachments after unpublishing every node: %+v, want worker-3's alone", v.Status.Attachments)
		}
		var secrets corev1.SecretList
		if err := c.List(ctx, &secrets, client.InNamespace(testNamespace), client.MatchingLabels{access.LabelVolume: "api-pub"}); err != nil {
			t.Fatal(err)
		}
		if len(secrets.Items) != 0 {
			t.Errorf("%d Secrets left after unpublishing from every node", len(secrets.Items))
		}
	})

	t.Run("expand", func(t *testing.T) {
		if _, err := ctl.CreateVolume(ctx, createReq("api-grow", gib, nil, rawCap(rwo))); err != nil {
			t.Fatal(err)
		}
		resp, err := ctl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{
			VolumeId: "api-grow", CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * gib}})
		if err != nil {
			t.Fatal(err)
		}
		if resp.GetCapacityBytes() != 2*gib || !resp.GetNodeExpansionRequired() {
			t.Errorf("expand = %v", resp)
		}
		if v := getVolume(t, c, "api-grow"); v.Spec.SizeBytes != 2*gib || v.Status.CapacityBytes != 2*gib || v.Status.ObservedGeneration != v.Generation {
			t.Errorf("after expand: spec %d, status %+v, generation %d", v.Spec.SizeBytes, v.Status, v.Generation)
		}
		agent.setFail("api-grow", "ResourceExhausted")
		_, err = ctl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{
			VolumeId: "api-grow", CapacityRange: &csi.CapacityRange{RequiredBytes: 500 * gib}})
		wantStatus(t, err, codes.ResourceExhausted, "simulated failure")
		agent.setFail("api-grow", "")
	})

	t.Run("delete", func(t *testing.T) {
		if _, err := ctl.CreateVolume(ctx, createReq("api-del", gib, nil)); err != nil {
			t.Fatal(err)
		}
		if _, err := ctl.ControllerPublishVolume(ctx, publishReq("api-del", "worker-1", fsCap(rwo), false)); err != nil {
			t.Fatal(err)
		}
		_, err := ctl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "api-del"})
		wantStatus(t, err, codes.FailedPrecondition, "worker-1")
		if _, err := ctl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: "api-del", NodeId: "worker-1"}); err != nil {
			t.Fatal(err)
		}
		// While the agent keeps its finalizer the volume stays, and
		// DeleteVolume says so.
		agent.setHold("api-del", true)
		short := newTestController(t, asController, func(cfg *ControllerConfig) { cfg.WaitTimeout = 300 * time.Millisecond })
		_, err = short.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "api-del"})
		wantStatus(t, err, codes.DeadlineExceeded, "api-del")
		if v := getVolume(t, c, "api-del"); v.DeletionTimestamp == nil || !v.DeletesData() {
			t.Fatalf("volume not being deleted with its data: deletion %v, annotations %v", v.DeletionTimestamp, v.Annotations)
		}
		agent.setHold("api-del", false)
		if _, err := ctl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "api-del"}); err != nil {
			t.Fatal(err)
		}
		if !volumeGone(t, c, "api-del") {
			t.Fatal("volume still there after DeleteVolume succeeded")
		}
		if _, err := ctl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "api-del"}); err != nil {
			t.Fatalf("second DeleteVolume: %v", err)
		}
		if withData, released := agent.releasedWithData("api-del"); !released || !withData {
			t.Errorf("agent released api-del %t, asked to delete its data %t; want both", released, withData)
		}

		// Deleted by hand first: the API server takes the annotation on
		// an object being deleted.
		if _, err := ctl.CreateVolume(ctx, createReq("api-hand", gib, nil)); err != nil {
			t.Fatal(err)
		}
		agent.setHold("api-hand", true)
		if err := c.Delete(ctx, getVolume(t, c, "api-hand")); err != nil {
			t.Fatal(err)
		}
		_, err = short.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "api-hand"})
		wantStatus(t, err, codes.DeadlineExceeded, "api-hand")
		if v := getVolume(t, c, "api-hand"); !v.DeletesData() {
			t.Fatalf("DeleteVolume of a volume deleted by hand left annotations %v", v.Annotations)
		}
		agent.setHold("api-hand", false)
		if _, err := ctl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "api-hand"}); err != nil {
			t.Fatal(err)
		}
		if withData, released := agent.releasedWithData("api-hand"); !released || !withData {
			t.Errorf("agent released api-hand %t, asked to delete its data %t; want both", released, withData)
		}
	})

	t.Run("list", func(t *testing.T) {
		var want []string
		for _, id := range []string{"api-list-c", "api-list-a", "api-list-b"} {
			if _, err := ctl.CreateVolume(ctx, createReq(id, gib, map[string]string{"storageNode": "small"})); err != nil {
				t.Fatal(err)
			}
		}
		all, err := ctl.ListVolumes(ctx, &csi.ListVolumesRequest{})
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range all.GetEntries() {
			want = append(want, e.GetVolume().GetVolumeId())
		}
		if !slices.IsSorted(want) || !slices.Contains(want, "api-list-b") || slices.Contains(want, "api-del") {
			t.Errorf("ListVolumes = %v", want)
		}
		var got []string
		tok := ""
		for range len(want) + 1 {
			resp, err := ctl.ListVolumes(ctx, &csi.ListVolumesRequest{MaxEntries: 2, StartingToken: tok})
			if err != nil {
				t.Fatal(err)
			}
			for _, e := range resp.GetEntries() {
				got = append(got, e.GetVolume().GetVolumeId())
				if id := e.GetVolume().GetVolumeId(); id == "api-list-a" && !maps.Equal(e.GetVolume().GetAccessibleTopology()[0].GetSegments(), map[string]string{"zone": "b"}) {
					t.Errorf("%s topology %v", id, e.GetVolume().GetAccessibleTopology())
				}
			}
			if tok = resp.GetNextToken(); tok == "" {
				break
			}
		}
		if !slices.Equal(got, want) {
			t.Errorf("paged %v, want %v", got, want)
		}
		_, err = ctl.ListVolumes(ctx, &csi.ListVolumesRequest{StartingToken: "invalid-token"})
		wantStatus(t, err, codes.Aborted, "starting_token")

		capResp, err := ctl.GetCapacity(ctx, &csi.GetCapacityRequest{Parameters: map[string]string{"storageNodeSelector": "tier=fast"}})
		if err != nil || capResp.GetAvailableCapacity() != 10*gib {
			t.Errorf("GetCapacity = %v, %v", capResp, err)
		}
	})
}
