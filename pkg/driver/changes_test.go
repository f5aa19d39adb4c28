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
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
)

func TestChanges(t *testing.T) {
	c := NewChanges()
	a, cancelA := c.Subscribe(VolumeKey("v"))
	b, cancelB := c.Subscribe(VolumeKey("v"))
	other, cancelOther := c.Subscribe(SnapshotKey("v"))
	defer cancelOther()
	// A burst collapses into one pending receive per subscriber; Notify
	// never blocks.
	for range 3 {
		c.Notify(VolumeKey("v"))
	}
	for _, ch := range []<-chan struct{}{a, b} {
		select {
		case <-ch:
		default:
			t.Fatal("a subscriber was not woken")
		}
		select {
		case <-ch:
			t.Fatal("a burst woke a subscriber twice")
		default:
		}
	}
	select {
	case <-other:
		t.Fatal("the snapshot of the same name was woken by the volume")
	default:
	}
	cancelA()
	c.Notify(VolumeKey("v"))
	select {
	case <-a:
		t.Fatal("an ended subscription was woken")
	default:
	}
	<-b
	cancelB()
	if n := c.subscribers(VolumeKey("v")); n != 0 {
		t.Fatalf("%d subscriptions left", n)
	}
}

// countingClient counts the reads of each NBDVolume.
type countingClient struct {
	client.Client
	mu    sync.Mutex
	reads map[string]int
}

func (c *countingClient) Get(ctx context.Context, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
	if _, ok := obj.(*v1alpha1.NBDVolume); ok {
		c.mu.Lock()
		c.reads[key.Name]++
		c.mu.Unlock()
	}
	return c.Client.Get(ctx, key, obj, opts...)
}

func (c *countingClient) readsOf(name string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.reads[name]
}

// TestControllerWaitsOnWatch: with the watch of WatchChanges on a real API
// server and polling switched off (an hour between reads), every call
// that waits for the storage agent completes, woken by the agent's status
// changes; a volume the agent holds for a second costs a few reads, not
// one per poll.
func TestControllerWaitsOnWatch(t *testing.T) {
	cfg, c := apiserver.Start(t)
	ctx := context.Background()
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: testNamespace}}); err != nil {
		t.Fatal(err)
	}
	putStorageNode(t, c, "big", 100*gib, map[string]string{"zone": "a"}, nil, time.Now())
	agent := startAgent(t, c)
	wctx, stop := context.WithCancel(ctx)
	t.Cleanup(stop)
	changes := NewChanges()
	if err := WatchChanges(wctx, cfg, c.Scheme(), changes, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	cc := &countingClient{Client: c, reads: map[string]int{}}
	ctl := newTestController(t, cc, func(cfg *ControllerConfig) {
		cfg.Changes, cfg.PollInterval, cfg.ResyncInterval = changes, time.Hour, time.Hour
	})

	if _, err := ctl.CreateVolume(ctx, createReq("watch-a", gib, nil)); err != nil {
		t.Fatalf("CreateVolume woken by the watch: %v", err)
	}
	if _, err := ctl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{
		VolumeId: "watch-a", CapacityRange: &csi.CapacityRange{RequiredBytes: 2 * gib},
	}); err != nil {
		t.Fatalf("ControllerExpandVolume woken by the watch: %v", err)
	}
	snap, err := ctl.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "watch-snap", SourceVolumeId: "watch-a"})
	if err != nil || !snap.GetSnapshot().GetReadyToUse() {
		t.Fatalf("CreateSnapshot woken by the watch: %v, %v", snap, err)
	}
	if _, err := ctl.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: snap.GetSnapshot().GetSnapshotId()}); err != nil {
		t.Fatalf("DeleteSnapshot: %v", err)
	}
	if _, err := ctl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "watch-a"}); err != nil {
		t.Fatalf("DeleteVolume woken by the watch: %v", err)
	}

	// Held for a second: polling every 20 ms would read it about 50
	// times; the watch reads it once at the start and once per change.
	agent.setHold("watch-held", true)
	go func() {
		time.Sleep(time.Second)
		agent.setHold("watch-held", false)
	}()
	if _, err := ctl.CreateVolume(ctx, createReq("watch-held", gib, nil)); err != nil {
		t.Fatalf("CreateVolume of a held volume: %v", err)
	}
	n := cc.readsOf("watch-held")
	t.Logf("a volume held for 1 s was read %d times while waited for", n)
	if n > 8 {
		t.Fatalf("a volume held for 1 s was read %d times: the wait polls instead of following the watch", n)
	}
}
