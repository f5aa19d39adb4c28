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

package v1alpha1

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

func TestSchemeAndDeepCopy(t *testing.T) {
	s := runtime.NewScheme()
	if err := AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	for _, kind := range []string{"NBDVolume", "NBDVolumeList", "NBDStorageNode", "NBDStorageNodeList"} {
		if !s.Recognizes(GroupVersion.WithKind(kind)) {
			t.Errorf("scheme does not know %s", kind)
		}
	}
	v := &NBDVolume{
		ObjectMeta: metav1.ObjectMeta{Name: "pvc-1"},
		Spec: NBDVolumeSpec{SizeBytes: 1 << 30, StorageNode: "n1", AccessType: AccessFilesystem,
			Parameters:   map[string]string{"fsType": "ext4"},
			Publications: []Publication{{NodeID: "a", SecretRef: "s", Addresses: []string{"10.0.0.1"}}}},
		Status: NBDVolumeStatus{Export: &Export{Name: "e", Port: 10809, Addresses: []string{"x"}}},
	}
	c := v.DeepCopy()
	c.Spec.Parameters["fsType"] = "xfs"
	c.Spec.Publications[0].Addresses[0] = "changed"
	c.Status.Export.Addresses[0] = "changed"
	if v.Spec.Parameters["fsType"] != "ext4" || v.Spec.Publications[0].Addresses[0] != "10.0.0.1" || v.Status.Export.Addresses[0] != "x" {
		t.Fatal("DeepCopy shares memory with the original")
	}
}

// TestCRDsAreGenerated checks that the committed CRD manifests match the
// types (run hack/generate.sh after changing api/).
func TestCRDsAreGenerated(t *testing.T) {
	for _, f := range []string{"mpnbd.io_nbdvolumes.yaml", "mpnbd.io_nbdstoragenodes.yaml"} {
		b, err := os.ReadFile(filepath.Join("..", "..", "deploy", "crds", f))
		if err != nil {
			t.Fatal(err)
		}
		for _, want := range []string{"scope: Cluster", "group: mpnbd.io", "name: v1alpha1", "subresources:"} {
			if !strings.Contains(string(b), want) {
				t.Errorf("%s lacks %q", f, want)
			}
		}
	}
}

func TestDeletesData(t *testing.T) {
	for _, tc := range []struct {
		ann  map[string]string
		want bool
	}{
		{nil, false},
		{map[string]string{DeleteDataAnnotation: DeleteDataTrue}, true},
		{map[string]string{DeleteDataAnnotation: "yes"}, false},
		{map[string]string{DeleteDataAnnotation: ""}, false},
	} {
		v := &NBDVolume{ObjectMeta: metav1.ObjectMeta{Name: "pvc-1", Annotations: tc.ann}}
		if got := v.DeletesData(); got != tc.want {
			t.Errorf("annotations %v: DeletesData() = %t, want %t", tc.ann, got, tc.want)
		}
	}
}
