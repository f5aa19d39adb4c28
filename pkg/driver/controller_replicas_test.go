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
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
)

// TestPickStorageNodesForReplicas: the replicas of a volume go to
// distinct storage nodes, in distinct zones among the nodes that carry
// one, the first as for one replica (storageNode pins it alone), the
// others by available bytes, each fresh, with room and in a requisite
// topology; too few is ResourceExhausted, saying why.
func TestPickStorageNodesForReplicas(t *testing.T) {
	ctx := context.Background()
	c := newFakeClient(t)
	ctl := newTestController(t, c)
	const gb = int64(1) << 30
	now := time.Now()
	z := func(zone string) map[string]string { return map[string]string{ZoneLabel: zone} }
	long := strings.Repeat("l", 70) + ".example"
	for _, n := range []struct {
		name  string
		avail int64
		topo  map[string]string
		hb    time.Time
	}{
		{"a1", 100 * gb, z("a"), now},
		{"a2", 90 * gb, z("a"), now},
		{"b1", 50 * gb, z("b"), now},
		{"plain", 10 * gb, nil, now},
		{"stale", 500 * gb, z("c"), now.Add(-time.Hour)},
		// A name longer than a label name: it may hold a volume, never
		// a replica (its agent could not be told by label).
		{long, 80 * gb, z("c"), now},
	} {
		putStorageNode(t, c, n.name, n.avail, n.topo, nil, n.hb)
	}
	names := func(ns []*v1alpha1.NBDStorageNode) []string {
		var out []string
		for _, n := range ns {
			out = append(out, n.Name)
		}
		return out
	}
	requisite := func(zones ...string) *csi.TopologyRequirement {
		tr := &csi.TopologyRequirement{}
		for _, zn := range zones {
			tr.Requisite = append(tr.Requisite, &csi.Topology{Segments: z(zn)})
		}
		return tr
	}
	for _, tc := range []struct {
		name     string
		replicas int
		pin      string
		size     int64
		tr       *csi.TopologyRequirement
		want     []string
		code     codes.Code
	}{
		{"one", 1, "", gb, nil, []string{"a1"}, codes.OK},
		{"two in two zones", 2, "", gb, nil, []string{"a1", "b1"}, codes.OK},
		{"three: a node without a zone is a zone of its own", 3, "", gb, nil, []string{"a1", "b1", "plain"}, codes.OK},
		{"the pin names the first only", 2, "b1", gb, nil, []string{"b1", "a1"}, codes.OK},
		{"no room for the third", 3, "", 20 * gb, nil, nil, codes.ResourceExhausted},
		{"one zone cannot hold two", 2, "", gb, requisite("a"), nil, codes.ResourceExhausted},
		{"a stale node is never a replica", 4, "", gb, nil, nil, codes.ResourceExhausted},
		{"a long-named node holds the first copy", 2, long, gb, nil, []string{long, "a1"}, codes.OK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ctl.pickStorageNodes(ctx, Params{Replicas: tc.replicas, StorageNode: tc.pin}, tc.tr, tc.size)
			if tc.code != codes.OK {
				wantStatus(t, toStatus(err), tc.code, ZoneLabel)
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(names(got), tc.want) {
				t.Fatalf("placed on %v, want %v", names(got), tc.want)
			}
		})
	}
}

// TestPublishContextReplicas: a replicated volume's publish context names
// its other replicas where their nodes serve, so that the node can reach
// whichever becomes the primary; a replica whose node reports no address
// yet is left out, and an unreplicated volume's context has no key.
func TestPublishContextReplicas(t *testing.T) {
	ctx := context.Background()
	ctl, c, _ := setup(t)
	putStorageNode(t, c, "r2", gib, nil, nil, time.Now())
	if err := c.Create(ctx, &v1alpha1.NBDStorageNode{ObjectMeta: metav1.ObjectMeta{Name: "r3"}}); err != nil {
		t.Fatal(err)
	}
	v := &v1alpha1.NBDVolume{ObjectMeta: metav1.ObjectMeta{Name: "rv"}, Spec: v1alpha1.NBDVolumeSpec{
		StorageNode: "big", ReplicaNodes: []string{"r2", "r3"}, Replicas: 3, SizeBytes: gib}}
	pc, err := ctl.publishContext(ctx, v, "worker-1", "")
	if err != nil {
		t.Fatal(err)
	}
	if want := fmt.Sprintf("r2=198.51.100.1:%d", testPort); pc[PublishContextReplicas] != want {
		t.Errorf("replicas %q, want %q", pc[PublishContextReplicas], want)
	}
	spec, err := parseAttachSpec("rv", pc, nil, "", nodeToken("worker-1"))
	if err != nil || len(spec.Target.Replicas) != 1 || spec.Target.Replicas[0].StorageNode != "r2" {
		t.Errorf("node side: %+v, %v", spec.Target, err)
	}
	v.Spec.ReplicaNodes = nil
	if pc, err := ctl.publishContext(ctx, v, "worker-1", ""); err != nil || pc[PublishContextReplicas] != "" {
		t.Errorf("unreplicated: %v, %v", pc, err)
	}
}
