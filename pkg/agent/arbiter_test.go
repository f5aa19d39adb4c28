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
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// createReplicated creates a volume whose replication record has epoch 1,
// primary s1 and s1, s2, s3 in sync.
func createReplicated(t *testing.T, c client.Client, name string) {
	t.Helper()
	ctx := context.Background()
	v := newVolume(name, 1<<20)
	v.Spec.StorageNode = "s1"
	v.Spec.Replicas = 3
	v.Spec.ReplicaNodes = []string{"s2", "s3"}
	if err := c.Create(ctx, v); err != nil {
		t.Fatal(err)
	}
	v.Status.Replication = &v1alpha1.ReplicationStatus{Epoch: 1, Primary: "s1", PrimaryEpoch: 1, InSync: []string{"s1", "s2", "s3"}, InSyncReplicas: 3}
	if err := c.Status().Update(ctx, v); err != nil {
		t.Fatal(err)
	}
}

// TestVolumeArbiter drops replicas in a real API server's NBDVolume:
// each drop raises the epoch and shrinks the in-sync set; a drop naming
// an old epoch, made by a primary that is not the recorded one, or of a
// replica already out is refused as superseded; of two drops racing on
// one epoch exactly one is recorded; an API server that cannot be reached
// is a passing error, not a refusal. A rebuilt replica rejoins likewise.
func TestVolumeArbiter(t *testing.T) {
	cfg, c := apiserver.Start(t)
	ctx := context.Background()
	createReplicated(t, c, "rv")
	a := &VolumeArbiter{Client: c, Volume: "rv", Self: "s1"}
	record := func() v1alpha1.ReplicationStatus {
		t.Helper()
		r := getVolume(t, c, "rv").Status.Replication
		if r == nil {
			t.Fatal("the replication record is gone")
		}
		return *r
	}

	epoch, err := a.Drop(ctx, 1, "s3", errors.New("test"))
	if err != nil {
		t.Fatal(err)
	}
	if r := record(); epoch != 2 || r.Epoch != 2 || !slices.Equal(r.InSync, []string{"s1", "s2"}) || r.InSyncReplicas != 2 || r.Primary != "s1" {
		t.Fatalf("after dropping s3: epoch %d, record %+v", epoch, r)
	}
	for _, tc := range []struct {
		what  string
		a     *VolumeArbiter
		epoch int64
		name  string
	}{
		{"an old epoch", a, 1, "s2"},
		{"a primary that is not the recorded one", &VolumeArbiter{Client: c, Volume: "rv", Self: "s2"}, 2, "s1"},
		{"a replica already out", a, 2, "s3"},
		{"the primary itself", a, 2, "s1"},
		{"a volume that does not exist", &VolumeArbiter{Client: c, Volume: "nope", Self: "s1"}, 2, "s2"},
	} {
		if _, err := tc.a.Drop(ctx, tc.epoch, tc.name, nil); !errors.Is(err, nbd.ErrSuperseded) {
			t.Errorf("a drop with %s: %v, want ErrSuperseded", tc.what, err)
		}
	}
	if r := record(); r.Epoch != 2 || len(r.InSync) != 2 {
		t.Fatalf("refused drops changed the record: %+v", r)
	}

	// s3 comes back: recorded in sync at the current epoch only, and only
	// a replica of the volume that is out.
	if _, err := a.Rejoin(ctx, 1, "s3"); !errors.Is(err, nbd.ErrSuperseded) {
		t.Errorf("a rejoin at an old epoch: %v, want ErrSuperseded", err)
	}
	for _, name := range []string{"s2", "s9"} {
		if _, err := a.Rejoin(ctx, 2, name); !errors.Is(err, nbd.ErrSuperseded) {
			t.Errorf("a rejoin of %s (in sync, or no replica of the volume): %v, want ErrSuperseded", name, err)
		}
	}
	epoch, err = a.Rejoin(ctx, 2, "s3")
	if err != nil {
		t.Fatal(err)
	}
	if r := record(); epoch != 3 || r.Epoch != 3 || !slices.Equal(r.InSync, []string{"s1", "s2", "s3"}) || r.InSyncReplicas != 3 {
		t.Fatalf("after s3 rejoined: epoch %d, record %+v", epoch, r)
	}

	// Two drops racing on one epoch: one wins.
	createReplicated(t, c, "race")
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i, name := range []string{"s2", "s3"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = (&VolumeArbiter{Client: c, Volume: "race", Self: "s1"}).Drop(ctx, 1, name, nil)
		}()
	}
	wg.Wait()
	won := 0
	for _, err := range errs {
		switch {
		case err == nil:
			won++
		case !errors.Is(err, nbd.ErrSuperseded):
			t.Fatalf("a racing drop failed otherwise: %v", err)
		}
	}
	r := getVolume(t, c, "race").Status.Replication
	if won != 1 || r.Epoch != 2 || len(r.InSync) != 2 {
		t.Fatalf("racing drops: %d won (%v), record %+v; want exactly one and epoch 2", won, errs, r)
	}

	// Unreachable: not a refusal.
	dead := rest.CopyConfig(cfg)
	dead.Host = "https://127.0.0.1:1"
	dead.Timeout = 2 * time.Second
	dc, err := client.New(dead, client.Options{Scheme: c.Scheme()})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := (&VolumeArbiter{Client: dc, Volume: "rv", Self: "s1"}).Drop(ctx, 3, "s2", nil); err == nil || errors.Is(err, nbd.ErrSuperseded) {
		t.Fatalf("a drop through an unreachable API server: %v, want a passing error", err)
	}
}
