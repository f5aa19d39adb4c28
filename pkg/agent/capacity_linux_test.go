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
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
	"github.com/mpnbd/mpnbd/internal/testenv/loopfs"
	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/snapshot"
)

const (
	kib = int64(1) << 10
	mib = int64(1) << 20
	// fsSlack is how far the free space of a test's own filesystem may
	// move on its own between two measurements (metadata, the log).
	fsSlack = 512 * kib
)

// mountLoop is a 512 MiB loop-mounted fstype (xfs with reflink, or ext4).
func mountLoop(t *testing.T, fstype string) string {
	t.Helper()
	return loopfs.Mount(t, fstype, 512*mib)
}

// randomBytes is n bytes that no filesystem can compress or deduplicate.
func randomBytes(n int64, seed uint64) []byte {
	b := make([]byte, n)
	rand.NewChaCha8([32]byte{byte(seed)}).Read(b)
	return b
}

// writeSynced writes p at off in path (created if missing) and syncs it.
func writeSynced(t *testing.T, path string, p []byte, off int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(p, off); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
}

// measure is diskUsage that fails the test on error.
func measure(t *testing.T, dir string) usage {
	t.Helper()
	u, err := diskUsage(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("free %d reserved %d available %d shared %d snapshots %d snapshotBytes %d files %v",
		u.free, u.reserved, u.available(), u.shared, u.snapshots, u.snapshotBytes, u.files)
	return u
}

// near fails the test unless got is within slack of want.
func near(t *testing.T, what string, got, want, slack int64) {
	t.Helper()
	if got < want-slack || got > want+slack {
		t.Errorf("%s: %d, want %d (±%d)", what, got, want, slack)
	}
}

// TestDiskUsageSnapshots: a snapshot file is counted, by the space it uses
// on its own; a volume whose data a reflink shares reserves that data for
// its copy on write, so that what is available drops by it when the
// snapshot is taken and not again when the volume overwrites shared data.
// A copy shares nothing: the snapshot's bytes are its own.
func TestDiskUsageSnapshots(t *testing.T) {
	const size = 64 << 20
	data := randomBytes(16*mib, 1)
	overwritten := 4 * mib

	for _, fstype := range []string{"xfs", "ext4"} {
		t.Run(fstype, func(t *testing.T) {
			dir := mountLoop(t, fstype)
			ctx := context.Background()
			vol, snap := filepath.Join(dir, "vol-1"+fileSuffix), filepath.Join(dir, "snap-1"+snapshotSuffix)
			if err := os.WriteFile(vol, nil, 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(vol, size); err != nil {
				t.Fatal(err)
			}
			writeSynced(t, vol, data, 8*mib)
			// Files that are neither a volume nor a snapshot, and one
			// being taken under Clone's temporary name: not counted.
			for _, name := range []string{snapshotSuffix, fileSuffix, "notes.txt", ".snap-2" + snapshotSuffix + ".tmp-123"} {
				writeSynced(t, filepath.Join(dir, name), []byte("not a volume"), 0)
			}

			u0 := measure(t, dir)
			if u0.snapshots != 0 || u0.snapshotBytes != 0 || u0.shared != 0 || !slices.Equal(u0.files, []string{"vol-1"}) {
				t.Fatalf("before the snapshot: %+v", u0)
			}
			near(t, "reserve of a volume with 16 MiB of data in 64", u0.reserved, size-int64(len(data)), 256*kib)

			res, err := snapshot.Clone(ctx, vol, snap)
			if err != nil {
				t.Fatal(err)
			}
			want := map[string]snapshot.Method{"xfs": snapshot.Reflink, "ext4": snapshot.Copy}[fstype]
			if res.Method != want {
				t.Fatalf("snapshot method %s, want %s", res.Method, want)
			}
			u1 := measure(t, dir)
			if u1.snapshots != 1 || !slices.Equal(u1.files, []string{"vol-1"}) {
				t.Fatalf("after the snapshot: %d snapshots, volume files %v; want 1 and [vol-1]", u1.snapshots, u1.files)
			}
			if fstype == "xfs" {
				// All the volume's data is shared now: reserved for its
				// copy on write, taken from what is available.
				near(t, "shared bytes", u1.shared, int64(len(data)), 256*kib)
				near(t, "snapshot's own bytes", u1.snapshotBytes, 0, 64*kib)
				near(t, "reserve growth", u1.reserved-u0.reserved, u1.shared, 64*kib)
				near(t, "drop in available space", u0.available()-u1.available(), u1.shared, fsSlack)
			} else {
				// The copy's blocks are the snapshot's own, taken from
				// the free space; the volume's reserve is as it was.
				near(t, "shared bytes", u1.shared, 0, 0)
				near(t, "snapshot's own bytes", u1.snapshotBytes, int64(len(data)), 256*kib)
				near(t, "reserve growth", u1.reserved-u0.reserved, 0, 0)
				near(t, "drop in available space", u0.available()-u1.available(), u1.snapshotBytes, fsSlack)
			}

			// The volume overwrites 4 MiB of its data: a reflinked volume
			// takes new blocks, from its reserve; the snapshot now holds
			// the old ones alone. What is available stays.
			writeSynced(t, vol, randomBytes(overwritten, 2), 8*mib)
			u2 := measure(t, dir)
			near(t, "available space after the overwrite", u2.available(), u1.available(), fsSlack)
			if fstype == "xfs" {
				near(t, "shared bytes after the overwrite", u2.shared, u1.shared-overwritten, 64*kib)
				near(t, "snapshot's own bytes after the overwrite", u2.snapshotBytes, u1.snapshotBytes+overwritten, 64*kib)
			} else {
				near(t, "shared bytes after the overwrite", u2.shared, 0, 0)
				near(t, "snapshot's own bytes after the overwrite", u2.snapshotBytes, u1.snapshotBytes, 0)
			}

			// A restore from the snapshot, grown to the volume size: by
			// reflink it shares all the snapshot's data, and may need a
			// new block for every byte of it.
			restored := filepath.Join(dir, "vol-2"+fileSuffix)
			if _, err := snapshot.Clone(ctx, snap, restored); err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(restored, size); err != nil {
				t.Fatal(err)
			}
			u3 := measure(t, dir)
			if u3.snapshots != 1 || !slices.Equal(u3.files, []string{"vol-1", "vol-2"}) {
				t.Fatalf("after the restore: %d snapshots, volume files %v", u3.snapshots, u3.files)
			}
			if fstype == "xfs" {
				near(t, "shared bytes after the restore", u3.shared, u2.shared+int64(len(data)), 256*kib)
				near(t, "snapshot's own bytes after the restore", u3.snapshotBytes, 0, 64*kib)
				near(t, "drop in available space for the restore", u2.available()-u3.available(), size, fsSlack)
			} else {
				near(t, "shared bytes after the restore", u3.shared, 0, 0)
				near(t, "snapshot's own bytes after the restore", u3.snapshotBytes, u2.snapshotBytes, 0)
				near(t, "drop in available space for the restore", u2.available()-u3.available(), size, fsSlack)
			}

			// The snapshot goes: it is no longer counted.
			if err := os.Remove(snap); err != nil {
				t.Fatal(err)
			}
			if u4 := measure(t, dir); u4.snapshots != 0 || u4.snapshotBytes != 0 {
				t.Errorf("after removing the snapshot: %d snapshots of %d bytes", u4.snapshots, u4.snapshotBytes)
			}
		})
	}
}

// TestStorageNodeSnapshots: the agent's NBDStorageNode status says how
// many snapshots the node holds, what they use on their own and how much
// of the volumes' data they share, and what is available accounts for it.
func TestStorageNodeSnapshots(t *testing.T) {
	for _, fstype := range []string{"xfs", "ext4"} {
		t.Run(fstype, func(t *testing.T) { testStorageNodeSnapshots(t, fstype) })
	}
}

func testStorageNodeSnapshots(t *testing.T, fstype string) {
	dir := mountLoop(t, fstype)
	cfg, c := apiserver.Start(t)
	ctx := context.Background()
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: testNamespace}}); err != nil {
		t.Fatal(err)
	}
	r := startAgent(t, cfg, dir)
	const size = 64 << 20
	data := randomBytes(16*mib, 3)

	if err := c.Create(ctx, newVolume("vol-1", size)); err != nil {
		t.Fatal(err)
	}
	waitObserved(t, c, "vol-1")
	cl := mustDial(t, r, access.NodeExport("vol-1", publish(t, c, "vol-1", "node-1", false)))
	if _, err := cl.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	if err := cl.Flush(); err != nil {
		t.Fatal(err)
	}

	// Two reports after the flush agree: the volume's data is settled.
	var before v1alpha1.NBDStorageNodeStatus
	eventually(t, "storage node reports the volume's data", func() string {
		n := storageNode(t, c)
		if n == nil {
			return "no NBDStorageNode"
		}
		st := n.Status
		if st.Snapshots != 0 || st.SnapshotBytes != 0 || st.SharedBytes != 0 {
			return fmt.Sprintf("before any snapshot: %+v", st)
		}
		if !before.Heartbeat.IsZero() && st.Heartbeat.After(before.Heartbeat.Time) && st.AvailableBytes == before.AvailableBytes {
			return ""
		}
		before = st
		return fmt.Sprintf("available %d, waiting for a later report", st.AvailableBytes)
	})
	t.Logf("before the snapshot: available %d", before.AvailableBytes)

	if err := c.Create(ctx, newSnapshot("snap-1", "vol-1", testNode)); err != nil {
		t.Fatal(err)
	}
	eventually(t, "snap-1 ready", func() string {
		if s := getSnapshot(t, c, "snap-1").Status; !s.ReadyToUse {
			return fmt.Sprintf("status %+v", s)
		}
		return ""
	})
	method := getSnapshot(t, c, "snap-1").Status.Method
	if want := map[string]string{"xfs": "reflink", "ext4": "copy"}[fstype]; method != want {
		t.Fatalf("snapshot method %s, want %s", method, want)
	}

	n := int64(len(data))
	var after v1alpha1.NBDStorageNodeStatus
	eventually(t, "storage node reports the snapshot", func() string {
		after = storageNode(t, c).Status
		drop := before.AvailableBytes - after.AvailableBytes
		var ok bool
		if fstype == "xfs" {
			// Shared with the volume, which reserves it for copy on write.
			ok = after.SharedBytes >= n && after.SharedBytes <= n+256*kib &&
				after.SnapshotBytes <= 64*kib &&
				drop >= after.SharedBytes-fsSlack && drop <= after.SharedBytes+fsSlack
		} else {
			// A copy: its blocks are its own, gone from the free space.
			ok = after.SharedBytes == 0 &&
				after.SnapshotBytes >= n && after.SnapshotBytes <= n+256*kib &&
				drop >= after.SnapshotBytes-fsSlack && drop <= after.SnapshotBytes+fsSlack
		}
		if after.Snapshots != 1 || !ok {
			return fmt.Sprintf("snapshots %d, snapshotBytes %d, sharedBytes %d, available %d -> %d (drop %d), %d bytes of data",
				after.Snapshots, after.SnapshotBytes, after.SharedBytes, before.AvailableBytes, after.AvailableBytes, drop, n)
		}
		return ""
	})
	t.Logf("after the snapshot: snapshots %d, snapshotBytes %d, sharedBytes %d, available %d (drop %d)",
		after.Snapshots, after.SnapshotBytes, after.SharedBytes, after.AvailableBytes, before.AvailableBytes-after.AvailableBytes)

	// The volume overwrites 4 MiB: with a reflink the snapshot keeps the
	// old blocks alone, the volume's new ones came out of its reserve.
	if _, err := cl.WriteAt(bytes.Repeat([]byte{0x5a}, int(4*mib)), 0); err != nil {
		t.Fatal(err)
	}
	if err := cl.Flush(); err != nil {
		t.Fatal(err)
	}
	eventually(t, "storage node reports the overwrite", func() string {
		st := storageNode(t, c).Status
		wantShared, wantOwn := after.SharedBytes, after.SnapshotBytes
		if fstype == "xfs" {
			wantShared, wantOwn = after.SharedBytes-4*mib, after.SnapshotBytes+4*mib
		}
		if st.Snapshots != 1 || st.SharedBytes < wantShared-64*kib || st.SharedBytes > wantShared+64*kib ||
			st.SnapshotBytes < wantOwn-64*kib || st.SnapshotBytes > wantOwn+64*kib ||
			st.AvailableBytes < after.AvailableBytes-fsSlack || st.AvailableBytes > after.AvailableBytes+fsSlack {
			return fmt.Sprintf("snapshots %d, snapshotBytes %d (want %d), sharedBytes %d (want %d), available %d (was %d)",
				st.Snapshots, st.SnapshotBytes, wantOwn, st.SharedBytes, wantShared, st.AvailableBytes, after.AvailableBytes)
		}
		return ""
	})

	// The snapshot goes: the status says so.
	if err := c.Delete(ctx, getSnapshot(t, c, "snap-1")); err != nil {
		t.Fatal(err)
	}
	eventually(t, "storage node reports no snapshot", func() string {
		if st := storageNode(t, c).Status; st.Snapshots != 0 || st.SnapshotBytes != 0 || st.SharedBytes != 0 {
			return fmt.Sprintf("snapshots %d, snapshotBytes %d, sharedBytes %d", st.Snapshots, st.SnapshotBytes, st.SharedBytes)
		}
		return ""
	})
}
