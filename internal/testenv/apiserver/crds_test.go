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

package apiserver

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
)

func validVolume(name string) *v1alpha1.NBDVolume {
	return &v1alpha1.NBDVolume{
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"mpnbd.io/test": name}},
		Spec: v1alpha1.NBDVolumeSpec{
			SizeBytes:   1 << 30,
			StorageNode: "node-a",
			AccessType:  v1alpha1.AccessFilesystem,
			Parameters:  map[string]string{"fsType": "ext4"},
			Publications: []v1alpha1.Publication{
				{NodeID: "node-b", SecretRef: "pvc-1-node-b", TokenSHA256: strings.Repeat("0f", 32), Addresses: []string{"10.0.0.2"}},
			},
		},
	}
}

func TestCRDsAgainstRealAPIServer(t *testing.T) {
	_, c := Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	t.Run("PrinterColumns", func(t *testing.T) {
		crd := &apiextensionsv1.CustomResourceDefinition{}
		if err := c.Get(ctx, client.ObjectKey{Name: "nbdvolumes.mpnbd.io"}, crd); err != nil {
			t.Fatal(err)
		}
		if crd.Spec.Scope != apiextensionsv1.ClusterScoped {
			t.Errorf("scope %q, want Cluster", crd.Spec.Scope)
		}
		var served *apiextensionsv1.CustomResourceDefinitionVersion
		for i := range crd.Spec.Versions {
			if crd.Spec.Versions[i].Name == v1alpha1.GroupVersion.Version {
				served = &crd.Spec.Versions[i]
			}
		}
		if served == nil || !served.Served || !served.Storage {
			t.Fatalf("v1alpha1 is not served and stored: %+v", crd.Spec.Versions)
		}
		if served.Subresources == nil || served.Subresources.Status == nil {
			t.Error("no status subresource")
		}
		var names []string
		for _, col := range served.AdditionalPrinterColumns {
			names = append(names, col.Name)
		}
		for _, want := range []string{"Node", "Size", "Phase", "Published"} {
			if !slices.Contains(names, want) {
				t.Errorf("printer column %q missing; have %v", want, names)
			}
		}
		if !slices.Contains(crd.Spec.Names.ShortNames, "nbdvol") {
			t.Errorf("short names %v lack nbdvol", crd.Spec.Names.ShortNames)
		}
	})

	t.Run("VolumeLifecycle", func(t *testing.T) {
		v := validVolume("pvc-life")
		if err := c.Create(ctx, v); err != nil {
			t.Fatalf("create: %v", err)
		}
		got := &v1alpha1.NBDVolume{}
		if err := c.Get(ctx, client.ObjectKey{Name: v.Name}, got); err != nil {
			t.Fatalf("get: %v", err)
		}
		if got.Spec.SizeBytes != 1<<30 || got.Spec.StorageNode != "node-a" || got.Spec.AccessType != v1alpha1.AccessFilesystem ||
			got.Spec.Parameters["fsType"] != "ext4" || len(got.Spec.Publications) != 1 || got.Spec.Publications[0].NodeID != "node-b" {
			t.Fatalf("read back a different spec: %+v", got.Spec)
		}
		if got.Generation != 1 {
			t.Fatalf("generation %d after create, want 1", got.Generation)
		}

		// Status through the status subresource: generation stays.
		got.Status = v1alpha1.NBDVolumeStatus{
			Phase:              v1alpha1.VolumeAvailable,
			CapacityBytes:      1 << 30,
			Export:             &v1alpha1.Export{Name: "pvc-life", Port: 10809, Addresses: []string{"10.0.0.1", "10.0.1.1"}},
			ObservedGeneration: got.Generation,
			Conditions: []metav1.Condition{{
				Type: "Ready", Status: metav1.ConditionTrue, Reason: "Exported", Message: "serving",
				ObservedGeneration: got.Generation, LastTransitionTime: metav1.Now(),
			}},
		}
		if err := c.Status().Update(ctx, got); err != nil {
			t.Fatalf("status update: %v", err)
		}
		after := &v1alpha1.NBDVolume{}
		if err := c.Get(ctx, client.ObjectKey{Name: v.Name}, after); err != nil {
			t.Fatal(err)
		}
		if after.Generation != 1 {
			t.Errorf("generation %d after a status update, want 1", after.Generation)
		}
		if after.Status.Phase != v1alpha1.VolumeAvailable || after.Status.Export == nil || after.Status.Export.Port != 10809 ||
			len(after.Status.Conditions) != 1 {
			t.Errorf("status not stored: %+v", after.Status)
		}

		// A spec change bumps generation; status written through the main
		// resource is ignored.
		after.Spec.SizeBytes = 2 << 30
		after.Status.Phase = v1alpha1.VolumeFailed
		if err := c.Update(ctx, after); err != nil {
			t.Fatalf("spec update: %v", err)
		}
		final := &v1alpha1.NBDVolume{}
		if err := c.Get(ctx, client.ObjectKey{Name: v.Name}, final); err != nil {
			t.Fatal(err)
		}
		if final.Generation != 2 || final.Spec.SizeBytes != 2<<30 {
			t.Errorf("after a spec change: generation %d size %d, want 2 and %d", final.Generation, final.Spec.SizeBytes, 2<<30)
		}
		if final.Status.Phase != v1alpha1.VolumeAvailable {
			t.Errorf("status changed through the main resource: phase %q", final.Status.Phase)
		}
	})

	t.Run("Validation", func(t *testing.T) {
		cases := map[string]func(*v1alpha1.NBDVolume){
			"tape":       func(v *v1alpha1.NBDVolume) { v.Spec.AccessType = "Tape" },
			"zero-size":  func(v *v1alpha1.NBDVolume) { v.Spec.SizeBytes = 0 },
			"no-access":  func(v *v1alpha1.NBDVolume) { v.Spec.AccessType = "" },
			"dup-nodeid": func(v *v1alpha1.NBDVolume) { v.Spec.Publications = append(v.Spec.Publications, v.Spec.Publications[0]) },
			"encryption": func(v *v1alpha1.NBDVolume) { v.Spec.Encryption = "always" },
			"token hash": func(v *v1alpha1.NBDVolume) { v.Spec.Publications[0].TokenSHA256 = strings.Repeat("0F", 32) },
			"a token":    func(v *v1alpha1.NBDVolume) { v.Spec.Publications[0].TokenSHA256 = strings.Repeat("0f", 16) },
			// The storage agent finds a content source's file by name
			// under its data directory: a path is no name.
			"snapshot path": func(v *v1alpha1.NBDVolume) {
				v.Spec.ContentSource = &v1alpha1.ContentSource{Snapshot: "../../etc/x"}
			},
			"snapshot absolute": func(v *v1alpha1.NBDVolume) { v.Spec.ContentSource = &v1alpha1.ContentSource{Snapshot: "/etc/x"} },
			"snapshot dots":     func(v *v1alpha1.NBDVolume) { v.Spec.ContentSource = &v1alpha1.ContentSource{Snapshot: ".."} },
			"snapshot case":     func(v *v1alpha1.NBDVolume) { v.Spec.ContentSource = &v1alpha1.ContentSource{Snapshot: "Snap-1"} },
			"snapshot long": func(v *v1alpha1.NBDVolume) {
				v.Spec.ContentSource = &v1alpha1.ContentSource{Snapshot: strings.Repeat("s", 254)}
			},
			"volume path": func(v *v1alpha1.NBDVolume) { v.Spec.ContentSource = &v1alpha1.ContentSource{Volume: "a/../../x"} },
		}
		for name, mutate := range cases {
			// Valid object names, so that only the case is wrong.
			v := validVolume("bad-" + strings.ReplaceAll(name, " ", "-"))
			mutate(v)
			err := c.Create(ctx, v)
			if !apierrors.IsInvalid(err) {
				t.Errorf("%s: got %v, want an Invalid error", name, err)
			} else {
				t.Logf("%s rejected: %v", name, err)
			}
		}
		// Required names may not be empty.
		for name, mutate := range map[string]func(*v1alpha1.NBDVolume){
			"empty storageNode": func(v *v1alpha1.NBDVolume) { v.Spec.StorageNode = "" },
			"empty nodeID":      func(v *v1alpha1.NBDVolume) { v.Spec.Publications[0].NodeID = "" },
		} {
			v := validVolume("pvc-empty")
			mutate(v)
			if err := c.Create(ctx, v); !apierrors.IsInvalid(err) {
				t.Errorf("%s: got %v, want an Invalid error", name, err)
			}
		}
		// A publication without a Secret is one by node certificate, on
		// an encrypted volume.
		cert := validVolume("pvc-by-certificate")
		cert.Spec.Encryption = v1alpha1.EncryptionRequired
		cert.Spec.Publications[0].SecretRef = ""
		if err := c.Create(ctx, cert); err != nil {
			t.Errorf("a publication by certificate: %v", err)
		}

		// Content sources that are object names pass.
		for i, cs := range []v1alpha1.ContentSource{{Snapshot: "snapshot-0a1b.2"}, {Volume: "pvc-" + strings.Repeat("0", 249)}} {
			v := validVolume(fmt.Sprintf("pvc-source-%d", i))
			v.Spec.ContentSource = &cs
			if err := c.Create(ctx, v); err != nil {
				t.Errorf("content source %+v: %v", cs, err)
			}
		}
		for i, src := range []string{"../x", "/var/lib/mpnbd/volumes/x"} {
			s := &v1alpha1.NBDSnapshot{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("snap-bad-source-%d", i)},
				Spec: v1alpha1.NBDSnapshotSpec{SourceVolume: src, StorageNode: "node-a"}}
			if err := c.Create(ctx, s); !apierrors.IsInvalid(err) {
				t.Errorf("a snapshot of %q: got %v, want an Invalid error", src, err)
			}
		}

		// An invalid value is rejected on update too.
		v := validVolume("pvc-update-invalid")
		if err := c.Create(ctx, v); err != nil {
			t.Fatal(err)
		}
		v.Spec.AccessType = "Tape"
		if err := c.Update(ctx, v); !apierrors.IsInvalid(err) {
			t.Errorf("update to Tape: got %v, want an Invalid error", err)
		}
	})

	t.Run("ListSelectors", func(t *testing.T) {
		for _, n := range []string{"pvc-list-1", "pvc-list-2"} {
			if err := c.Create(ctx, validVolume(n)); err != nil {
				t.Fatal(err)
			}
		}
		var byLabel v1alpha1.NBDVolumeList
		if err := c.List(ctx, &byLabel, client.MatchingLabels{"mpnbd.io/test": "pvc-list-2"}); err != nil {
			t.Fatal(err)
		}
		if len(byLabel.Items) != 1 || byLabel.Items[0].Name != "pvc-list-2" {
			t.Errorf("label selector returned %d items", len(byLabel.Items))
		}
		var byField v1alpha1.NBDVolumeList
		if err := c.List(ctx, &byField, client.MatchingFieldsSelector{Selector: fields.OneTermEqualSelector("metadata.name", "pvc-list-1")}); err != nil {
			t.Fatal(err)
		}
		if len(byField.Items) != 1 || byField.Items[0].Name != "pvc-list-1" {
			t.Errorf("field selector returned %d items", len(byField.Items))
		}
		var all v1alpha1.NBDVolumeList
		sel, _ := labels.Parse("mpnbd.io/test in (pvc-list-1,pvc-list-2)")
		if err := c.List(ctx, &all, client.MatchingLabelsSelector{Selector: sel}); err != nil {
			t.Fatal(err)
		}
		if len(all.Items) != 2 {
			t.Errorf("set-based selector returned %d items, want 2", len(all.Items))
		}
		// spec.storageNode is a selectable field, so an agent can watch
		// only the volumes of its node.
		var onNode v1alpha1.NBDVolumeList
		if err := c.List(ctx, &onNode, client.MatchingFields{"spec.storageNode": "node-a"}); err != nil {
			t.Fatalf("spec.storageNode field selector: %v", err)
		}
		var elsewhere v1alpha1.NBDVolumeList
		if err := c.List(ctx, &elsewhere, client.MatchingFields{"spec.storageNode": "no-such-node"}); err != nil {
			t.Fatal(err)
		}
		if len(onNode.Items) < 2 || len(elsewhere.Items) != 0 {
			t.Errorf("field selector on spec.storageNode: %d on node-a, %d on no-such-node", len(onNode.Items), len(elsewhere.Items))
		}
	})

	t.Run("StorageNode", func(t *testing.T) {
		n := &v1alpha1.NBDStorageNode{ObjectMeta: metav1.ObjectMeta{Name: "node-a"}}
		if err := c.Create(ctx, n); err != nil {
			t.Fatalf("create: %v", err)
		}
		hb := metav1.NewTime(time.Now().Truncate(time.Second))
		n.Status = v1alpha1.NBDStorageNodeStatus{
			CapacityBytes:  100 << 30,
			AvailableBytes: 60 << 30,
			Addresses:      []string{"10.0.0.1", "10.0.1.1"},
			Port:           10809,
			Topology:       map[string]string{"topology.mpnbd.io/node": "node-a"},
			Heartbeat:      hb,
			Orphans:        []string{"pvc-gone.img"},
		}
		if err := c.Status().Update(ctx, n); err != nil {
			t.Fatalf("status update: %v", err)
		}
		got := &v1alpha1.NBDStorageNode{}
		if err := c.Get(ctx, client.ObjectKey{Name: "node-a"}, got); err != nil {
			t.Fatal(err)
		}
		if got.Status.AvailableBytes != 60<<30 || got.Status.Port != 10809 || !got.Status.Heartbeat.Equal(&hb) ||
			len(got.Status.Addresses) != 2 || got.Status.Topology["topology.mpnbd.io/node"] != "node-a" {
			t.Errorf("status read back differs: %+v", got.Status)
		}
		if got.Generation != 1 {
			t.Errorf("generation %d after a status update, want 1", got.Generation)
		}

		// A zero Heartbeat serialises as null, which the required field
		// refuses.
		got.Status.Heartbeat = metav1.Time{}
		if err := c.Status().Update(ctx, got); err != nil {
			t.Logf("status with a zero heartbeat refused: %v", err)
		} else {
			t.Log("status with a zero heartbeat accepted")
		}
	})
}
