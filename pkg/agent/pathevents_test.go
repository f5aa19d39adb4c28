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
	"fmt"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// TestPathEventsOnStorageNode: the slow-path watch's flags and recoveries
// are Events on the agent's NBDStorageNode, written as the storage agent's
// ServiceAccount with the deploy tree's RBAC and found as kubectl describe
// finds them (kind, name and the object's UID); a path flagged again is
// one Event counted twice; Config.OnPathEvent (the metrics) hears of every
// decision.
func TestPathEventsOnStorageNode(t *testing.T) {
	cfg, c := apiserver.Start(t)
	ctx := context.Background()
	l, err := mptcp.Listen(ctx, "tcp", "127.0.0.1:0", true)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var told []mptcp.PathEventKind
	r := startAgentOn(t, cfg, t.TempDir(), l, "127.0.0.1", func(_ *nbd.Server, c *Config) {
		c.OnPathEvent = func(e mptcp.PathEvent) {
			mu.Lock()
			defer mu.Unlock()
			told = append(told, e.Kind)
		}
	})
	var node v1alpha1.NBDStorageNode
	eventually(t, "the storage node reported", func() string {
		if err := c.Get(ctx, types.NamespacedName{Name: testNode}, &node); err != nil {
			return err.Error()
		}
		return ""
	})

	rec, stop := r.agent.pathEvents()
	defer stop()
	a := netip.MustParseAddr("10.77.3.1")
	rec(mptcp.PathEvent{Addr: a, Kind: mptcp.PathSlow, Rate: 1.5e6, Best: 110e6, NextProbe: 5 * time.Second})
	rec(mptcp.PathEvent{Addr: a, Kind: mptcp.PathProbe})
	rec(mptcp.PathEvent{Addr: a, Kind: mptcp.PathSlow, Rate: 1.5e6, Best: 110e6, NextProbe: 5 * time.Second})
	rec(mptcp.PathEvent{Addr: a, Kind: mptcp.PathRecovered, Rate: 100e6, Best: 110e6})

	mu.Lock()
	if got := fmt.Sprint(told); got != "[slow probe slow recovered]" {
		t.Errorf("OnPathEvent heard %s, want every decision", got)
	}
	mu.Unlock()

	// What kubectl describe nbdnode asks for.
	selector := client.MatchingFields{
		"involvedObject.kind": "NBDStorageNode",
		"involvedObject.name": testNode,
		"involvedObject.uid":  string(node.UID),
	}
	eventually(t, "the Events on the storage node", func() string {
		var evs corev1.EventList
		if err := c.List(ctx, &evs, selector); err != nil {
			return err.Error()
		}
		got := map[string][]int32{}
		for _, e := range evs.Items {
			if e.InvolvedObject.APIVersion != v1alpha1.GroupVersion.String() {
				return fmt.Sprintf("Event %s names apiVersion %q", e.Name, e.InvolvedObject.APIVersion)
			}
			if e.Source.Component != "mpnbd-storage-agent" {
				return fmt.Sprintf("Event %s comes from %q", e.Name, e.Source.Component)
			}
			if !strings.Contains(e.Message, "this node's address 10.77.3.1") {
				return fmt.Sprintf("Event %s says %q", e.Name, e.Message)
			}
			got[e.Type+"/"+e.Reason] = append(got[e.Type+"/"+e.Reason], max(e.Count, 1))
		}
		if fmt.Sprint(got["Warning/SlowPathFlagged"]) != "[2]" || fmt.Sprint(got["Normal/SlowPathRecovered"]) != "[1]" || len(got) != 2 {
			return fmt.Sprintf("Events (their counts) %v, want one SlowPathFlagged counted twice and one SlowPathRecovered", got)
		}
		return ""
	})
}
