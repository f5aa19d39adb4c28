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
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
	"github.com/mpnbd/mpnbd/pkg/access"
)

func newSnapshot(name, source, node string) *v1alpha1.NBDSnapshot {
	return &v1alpha1.NBDSnapshot{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       v1alpha1.NBDSnapshotSpec{SourceVolume: source, StorageNode: node},
	}
}

func getSnapshot(t *testing.T, c client.Client, name string) *v1alpha1.NBDSnapshot {
	t.Helper()
	var s v1alpha1.NBDSnapshot
	if err := c.Get(context.Background(), types.NamespacedName{Name: name}, &s); err != nil {
		t.Fatal(err)
	}
	return &s
}

// TestAgentSnapshots: a snapshot of a served volume holds what the volume
// held when it was taken and not what was written after; it outlives its
// source; a snapshot of a volume the node does not serve fails NotFound;
// one of another storage node is left alone; a deleted snapshot's file
// goes.
func TestAgentSnapshots(t *testing.T) {
	cfg, c := apiserver.Start(t)
	ctx := context.Background()
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: testNamespace}}); err != nil {
		t.Fatal(err)
	}
	if ok, err := SnapshotsServed(cfg); err != nil || !ok {
		t.Fatalf("SnapshotsServed with the CRD installed: %v, %v", ok, err)
	}
	dir := t.TempDir()
	r := startAgent(t, cfg, dir)
	const size = 8 << 20

	if err := c.Create(ctx, newVolume("vol-s", size)); err != nil {
		t.Fatal(err)
	}
	waitObserved(t, c, "vol-s")
	tok := publish(t, c, "vol-s", "node-1", false)
	cl := mustDial(t, r, access.NodeExport("vol-s", tok))
	before := bytes.Repeat([]byte("before the snapshot "), size/20+1)[:size]
	if _, err := cl.WriteAt(before, 0); err != nil {
		t.Fatal(err)
	}
	// Not flushed by the client: the snapshot's hold flushes.

	if err := c.Create(ctx, newSnapshot("snap-1", "vol-s", testNode)); err != nil {
		t.Fatal(err)
	}
	eventually(t, "snap-1 ready", func() string {
		s := getSnapshot(t, c, "snap-1").Status
		if !s.ReadyToUse {
			return fmt.Sprintf("status %+v", s)
		}
		return ""
	})
	snap := getSnapshot(t, c, "snap-1")
	st := snap.Status
	if st.SizeBytes != size || st.CreationTime == nil || (st.Method != "copy" && st.Method != "reflink") || st.UsedBytes <= 0 || st.Code != "" {
		t.Errorf("snapshot status %+v", st)
	}
	if len(snap.Finalizers) != 1 || snap.Finalizers[0] != v1alpha1.SnapshotFinalizer {
		t.Errorf("snapshot finalizers %v", snap.Finalizers)
	}
	after := bytes.Repeat([]byte("after "), size/6+1)[:size]
	if _, err := cl.WriteAt(after, 0); err != nil {
		t.Fatal(err)
	}
	if err := cl.Flush(); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, "snap-1"+snapshotSuffix)
	if got, err := os.ReadFile(file); err != nil || !bytes.Equal(got, before) {
		t.Fatalf("snapshot file: %v; holds what was written before it: %v", err, bytes.Equal(got, before))
	}
	got := make([]byte, size)
	if _, err := cl.ReadAt(got, 0); err != nil || !bytes.Equal(got, after) {
		t.Fatalf("the volume after the snapshot: %v; holds the later writes: %v", err, bytes.Equal(got, after))
	}

	// A restore, larger than its source: the snapshot's data, then zeros.
	restore := newVolume("vol-r", 2*size)
	restore.Spec.ContentSource = &v1alpha1.ContentSource{Snapshot: "snap-1"}
	// A clone of the source as it is now.
	clone := newVolume("vol-c", size)
	clone.Spec.ContentSource = &v1alpha1.ContentSource{Volume: "vol-s"}
	for _, v := range []*v1alpha1.NBDVolume{restore, clone} {
		if err := c.Create(ctx, v); err != nil {
			t.Fatal(err)
		}
		if w := waitObserved(t, c, v.Name); w.Status.Phase != v1alpha1.VolumeAvailable || w.Status.CapacityBytes != v.Spec.SizeBytes {
			t.Fatalf("%s: phase %s, capacity %d, want Available, %d (%s)", v.Name, w.Status.Phase, w.Status.CapacityBytes, v.Spec.SizeBytes, w.Status.Message)
		}
	}
	rcl := mustDial(t, r, access.NodeExport("vol-r", publish(t, c, "vol-r", "node-1", false)))
	want := append(append([]byte{}, before...), make([]byte, size)...)
	got = make([]byte, 2*size)
	if _, err := rcl.ReadAt(got, 0); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("restored volume: %v; holds the snapshot's data then zeros: %v", err, bytes.Equal(got, want))
	}
	ccl := mustDial(t, r, access.NodeExport("vol-c", publish(t, c, "vol-c", "node-1", false)))
	got = make([]byte, size)
	if _, err := ccl.ReadAt(got, 0); err != nil || !bytes.Equal(got, after) {
		t.Fatalf("cloned volume: %v; holds the source's current data: %v", err, bytes.Equal(got, after))
	}
	// Writes to the copies stay theirs.
	if _, err := rcl.WriteAt([]byte("restored"), 0); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(file); err != nil || !bytes.Equal(b, before) {
		t.Fatalf("the snapshot changed after a write to its restore: %v", err)
	}
	// Sources that are not there, or a size smaller than the source.
	for _, tc := range []struct {
		name string
		size int64
		cs   v1alpha1.ContentSource
		code string
	}{
		{"vol-nosnap", size, v1alpha1.ContentSource{Snapshot: "no-such-snapshot"}, "NotFound"},
		{"vol-novol", size, v1alpha1.ContentSource{Volume: "no-such-volume"}, "NotFound"},
		{"vol-small", size / 2, v1alpha1.ContentSource{Snapshot: "snap-1"}, "OutOfRange"},
	} {
		v := newVolume(tc.name, tc.size)
		v.Spec.ContentSource = &tc.cs
		if err := c.Create(ctx, v); err != nil {
			t.Fatal(err)
		}
		eventually(t, tc.name+" fails "+tc.code, func() string {
			if st := getVolume(t, c, tc.name).Status; st.Phase != v1alpha1.VolumeFailed || st.Code != tc.code {
				return fmt.Sprintf("phase %s, code %s: %s", st.Phase, st.Code, st.Message)
			}
			return ""
		})
		if _, err := os.Stat(filepath.Join(dir, tc.name+".img")); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s: a backing file was left: %v", tc.name, err)
		}
	}

	// No volume of that name here: NotFound, said in the status.
	if err := c.Create(ctx, newSnapshot("snap-missing", "no-such-volume", testNode)); err != nil {
		t.Fatal(err)
	}
	eventually(t, "snap-missing fails NotFound", func() string {
		if s := getSnapshot(t, c, "snap-missing").Status; s.Code != "NotFound" || s.ReadyToUse {
			return fmt.Sprintf("status %+v", s)
		}
		return ""
	})
	// Another node's snapshot: not ours to touch.
	if err := c.Create(ctx, newSnapshot("snap-other", "vol-s", "storage-2")); err != nil {
		t.Fatal(err)
	}

	// The source goes; the snapshot stays.
	unpublish(t, c, "vol-s", "node-1")
	deleteWithData(t, c, "vol-s")
	waitGone(t, c, "vol-s")
	if _, err := os.Stat(filepath.Join(dir, "vol-s.img")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("backing file of vol-s after its deletion: %v", err)
	}
	if got, err := os.ReadFile(file); err != nil || !bytes.Equal(got, before) {
		t.Fatalf("snapshot file after its source was deleted: %v (unchanged %v)", err, bytes.Equal(got, before))
	}
	if s := getSnapshot(t, c, "snap-other"); len(s.Finalizers) != 0 || s.Status.ReadyToUse || s.Status.Code != "" {
		t.Errorf("another node's snapshot was touched: %+v", s)
	}

	for _, name := range []string{"snap-1", "snap-missing", "snap-other"} {
		if err := c.Delete(ctx, getSnapshot(t, c, name)); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, "snapshots gone", func() string {
		var l v1alpha1.NBDSnapshotList
		if err := c.List(ctx, &l); err != nil || len(l.Items) != 0 {
			return fmt.Sprintf("%d left (%v)", len(l.Items), err)
		}
		return ""
	})
	if _, err := os.Stat(file); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("snapshot file after the delete: %v", err)
	}
}
