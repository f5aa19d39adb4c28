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
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
	"github.com/mpnbd/mpnbd/internal/testenv/loopfs"
	"github.com/mpnbd/mpnbd/pkg/access"
)

// measureEnv turns on the measurements of this file (hack/bench-snapshots.sh):
// they write gigabytes, which the test suite leaves to the benchmarks.
const measureEnv = "MPNBD_MEASURE"

// TestSnapshotRestoreTimes measures, through the storage agent and a real
// API server, how long a snapshot of a 1 GiB volume holding 512 MiB of data
// (1 MiB data, 1 MiB hole) takes to become ready, and a 1 GiB volume
// restored from it to become available: by reflink on XFS and by copy on
// ext4, side by side in one run. The restore must hold the snapshot's data;
// nothing is asserted about the times.
func TestSnapshotRestoreTimes(t *testing.T) {
	if os.Getenv(measureEnv) != "1" {
		t.Skipf("skipping: a measurement that writes 3 GiB; %s=1 runs it (hack/bench-snapshots.sh)", measureEnv)
	}
	type took struct{ snap, held, restore time.Duration }
	got := map[string]took{}
	for _, tc := range []struct{ fs, method string }{{"xfs", "reflink"}, {"ext4", "copy"}} {
		t.Run(tc.fs, func(t *testing.T) {
			dir := loopfs.Mount(t, tc.fs, 4<<30)
			cfg, c := apiserver.Start(t)
			ctx := context.Background()
			if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: testNamespace}}); err != nil {
				t.Fatal(err)
			}
			r := startAgent(t, cfg, dir)
			const size = 1 << 30
			if err := c.Create(ctx, newVolume("vol-t", size)); err != nil {
				t.Fatal(err)
			}
			waitObserved(t, c, "vol-t")
			cl := mustDial(t, r, access.NodeExport("vol-t", publish(t, c, "vol-t", "node-1", false)))
			chunk := randomBytes(mib, 9)
			for off := int64(0); off < size; off += 2 * mib {
				chunk[0], chunk[1] = byte(off>>20), byte(off>>28) // no two chunks alike
				if _, err := cl.WriteAt(chunk, off); err != nil {
					t.Fatal(err)
				}
			}
			if err := cl.Flush(); err != nil {
				t.Fatal(err)
			}
			dropCaches(t)

			start := time.Now()
			if err := c.Create(ctx, newSnapshot("snap-t", "vol-t", testNode)); err != nil {
				t.Fatal(err)
			}
			var st v1alpha1.NBDSnapshotStatus
			eventually(t, "snap-t ready", func() string {
				if st = getSnapshot(t, c, "snap-t").Status; !st.ReadyToUse {
					return fmt.Sprintf("status %+v", st)
				}
				return ""
			})
			snapTook := time.Since(start)
			if st.Method != tc.method {
				t.Fatalf("snapshot by %s, want %s", st.Method, tc.method)
			}
			dropCaches(t)

			start = time.Now()
			restore := newVolume("vol-r", size)
			restore.Spec.ContentSource = &v1alpha1.ContentSource{Snapshot: "snap-t"}
			if err := c.Create(ctx, restore); err != nil {
				t.Fatal(err)
			}
			if w := waitObserved(t, c, "vol-r"); w.Status.Phase != v1alpha1.VolumeAvailable {
				t.Fatalf("restore: phase %s (%s)", w.Status.Phase, w.Status.Message)
			}
			restoreTook := time.Since(start)
			snapFile, restored := filepath.Join(dir, "snap-t"+snapshotSuffix), filepath.Join(dir, "vol-r"+fileSuffix)
			if loopfs.Checksum(t, snapFile) != loopfs.Checksum(t, restored) {
				t.Fatal("the restored volume does not hold the snapshot's data")
			}
			got[tc.fs] = took{snapTook, time.Duration(st.HeldMilliseconds) * time.Millisecond, restoreTook}
			t.Logf("%s on %s: 1 GiB volume, 512 MiB data: snapshot ready in %v (writes held %v), restore available in %v",
				st.Method, tc.fs, snapTook.Round(time.Millisecond), got[tc.fs].held, restoreTook.Round(time.Millisecond))
		})
	}
	if x, e := got["xfs"], got["ext4"]; x.snap > 0 && e.snap > 0 {
		t.Logf("copy on ext4 / reflink on XFS, same run: snapshot %.1fx, restore %.1fx",
			float64(e.snap)/float64(x.snap), float64(e.restore)/float64(x.restore))
	}
}

// dropCaches writes dirty pages back and drops the page cache, so that a
// measurement reads from the disk.
func dropCaches(t *testing.T) {
	t.Helper()
	syscall.Sync()
	if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3"), 0); err != nil {
		t.Logf("page cache not dropped: %v", err)
	}
}
