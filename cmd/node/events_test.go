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

package main

import (
	"context"
	"log/slog"
	"net/netip"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// TestPathEventsOnNode: the slow-path watch's flags and recoveries are
// Events on the Node, written as the node plugin's ServiceAccount with the
// deploy tree's RBAC; a path flagged again is one Event counted twice.
func TestPathEventsOnNode(t *testing.T) {
	cfg, c := apiserver.Start(t)
	ctx := context.Background()
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: apiserver.DeployNamespace}}); err != nil {
		t.Fatal(err)
	}
	if err := apiserver.Apply(ctx, c, "deploy/rbac-node.yaml"); err != nil {
		t.Fatal(err)
	}
	o := &options{nodeID: "worker-1", kubeconfig: apiserver.WriteKubeconfig(t, apiserver.As(cfg, "mpnbd-node", "worker-1"))}
	rec, stop := pathEventRecorder(o, slog.New(slog.DiscardHandler))
	if rec == nil {
		t.Fatal("no recorder")
	}
	defer stop()
	a := netip.MustParseAddr("10.77.3.1")
	rec(mptcp.PathEvent{Addr: a, Kind: mptcp.PathSlow, Rate: 1.5e6, Best: 110e6, NextProbe: 5 * time.Second})
	rec(mptcp.PathEvent{Addr: a, Kind: mptcp.PathProbe})
	rec(mptcp.PathEvent{Addr: a, Kind: mptcp.PathSlow, Rate: 1.5e6, Best: 110e6, NextProbe: 5 * time.Second})
	rec(mptcp.PathEvent{Addr: a, Kind: mptcp.PathRecovered, Rate: 100e6, Best: 110e6})
	deadline := time.Now().Add(20 * time.Second)
	for {
		var evs corev1.EventList
		if err := c.List(ctx, &evs); err != nil {
			t.Fatal(err)
		}
		got := map[string]int32{}
		for _, e := range evs.Items {
			if e.InvolvedObject.Kind == "Node" && e.InvolvedObject.Name == "worker-1" {
				got[e.Type+"/"+e.Reason] += max(e.Count, 1)
			}
		}
		if got["Warning/SlowPathFlagged"] == 2 && got["Normal/SlowPathRecovered"] == 1 && len(got) == 2 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("Events on the Node: %v, want SlowPathFlagged counted twice and one SlowPathRecovered (%d Events in all)", got, len(evs.Items))
		}
		time.Sleep(200 * time.Millisecond)
	}
}
