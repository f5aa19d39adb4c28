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
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
	"github.com/mpnbd/mpnbd/internal/testenv/loopfs"
	"github.com/mpnbd/mpnbd/pkg/access"
)

// stampBlock is block's content as write seq leaves it: the block's index
// and seq, then bytes that follow from both.
func stampBlock(block, seq int64, bs int) []byte {
	b := make([]byte, bs)
	binary.LittleEndian.PutUint64(b[0:], uint64(block))
	binary.LittleEndian.PutUint64(b[8:], uint64(seq))
	rand.NewChaCha8([32]byte{byte(seq), byte(seq >> 8), byte(seq >> 16), byte(block), byte(block >> 8)}).Read(b[16:])
	return b
}

// TestSnapshotUnderWriter: the storage agent snapshots a volume while a
// client writes to it over NBD, one write at a time, each stamped with its
// sequence number; by reflink on XFS and by copy (with writes flowing) on
// ext4. The snapshot must be the volume exactly as it was after one write
// k of the sequence, byte for byte: every block holds the last of writes
// 1..k to it (zeros if none), so it is a flush point, neither older than a
// write acknowledged before the snapshot's creation time nor holding a
// write the writer sent after the snapshot was ready.
func TestSnapshotUnderWriter(t *testing.T) {
	for _, tc := range []struct{ fs, method string }{{"xfs", "reflink"}, {"ext4", "copy"}} {
		t.Run(tc.fs, func(t *testing.T) { testSnapshotUnderWriter(t, tc.fs, tc.method) })
	}
}

func testSnapshotUnderWriter(t *testing.T, fstype, method string) {
	dir := loopfs.Mount(t, fstype, 1<<30)
	cfg, c := apiserver.Start(t)
	ctx := context.Background()
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: testNamespace}}); err != nil {
		t.Fatal(err)
	}
	r := startAgent(t, cfg, dir)
	const (
		bs     = 4096
		size   = 64 << 20
		blocks = size / bs
		filled = blocks / 2 // written in order first: the copy has data to copy
	)
	if err := c.Create(ctx, newVolume("vol-w", size)); err != nil {
		t.Fatal(err)
	}
	waitObserved(t, c, "vol-w")
	cl := mustDial(t, r, access.NodeExport("vol-w", publish(t, c, "vol-w", "node-1", false)))

	// log[seq] is the block write seq went to, and when it was
	// acknowledged; seq 0 is no write.
	type write struct {
		block int64
		acked time.Time
	}
	var mu sync.Mutex
	log := []write{{block: -1}}
	writeOne := func(block int64) error {
		mu.Lock()
		seq := int64(len(log))
		mu.Unlock()
		if _, err := cl.WriteAt(stampBlock(block, seq, bs), block*bs); err != nil {
			return err
		}
		mu.Lock()
		log = append(log, write{block, time.Now()})
		mu.Unlock()
		return nil
	}
	written := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(log) - 1
	}
	for b := range int64(filled) {
		if err := writeOne(b); err != nil {
			t.Fatal(err)
		}
	}
	wctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		rng := rand.New(rand.NewPCG(7, 8))
		for wctx.Err() == nil {
			if err := writeOne(rng.Int64N(blocks)); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	defer func() {
		stop()
		if err := <-done; err != nil {
			t.Errorf("writer: %v", err)
		}
	}()
	waitFor := func(n int) {
		t.Helper()
		eventually(t, fmt.Sprintf("%d writes", n), func() string {
			if w := written(); w < n {
				return fmt.Sprintf("%d writes", w)
			}
			return ""
		})
	}
	waitFor(filled + 200)

	if err := c.Create(ctx, newSnapshot("snap-w", "vol-w", testNode)); err != nil {
		t.Fatal(err)
	}
	eventually(t, "snap-w ready", func() string {
		if s := getSnapshot(t, c, "snap-w").Status; !s.ReadyToUse {
			return fmt.Sprintf("status %+v", s)
		}
		return ""
	})
	// The write in flight now may be in the snapshot (its reply can
	// trail it); the writer sends any later one after the snapshot was
	// ready.
	newest := written() + 1
	st := getSnapshot(t, c, "snap-w").Status
	if st.Method != method {
		t.Fatalf("snapshot by %s, want %s", st.Method, method)
	}
	waitFor(newest + 200)
	stop()
	if err := <-done; err != nil {
		t.Fatalf("writer: %v", err)
	}
	done <- nil // for the deferred check

	snap, err := os.ReadFile(filepath.Join(dir, "snap-w"+snapshotSuffix))
	if err != nil {
		t.Fatal(err)
	}
	if len(snap) != size {
		t.Fatalf("snapshot of %d bytes, want %d", len(snap), size)
	}
	// k is the newest write the snapshot holds.
	var k int64
	for b := range int64(blocks) {
		if seq := int64(binary.LittleEndian.Uint64(snap[b*bs+8:])); seq > k {
			k = seq
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if k == 0 || k > int64(newest) {
		t.Fatalf("the snapshot's newest write is %d; only writes 1..%d were sent before it was ready", k, newest)
	}
	// The volume as it was after write k.
	last := make([]int64, blocks)
	for seq := int64(1); seq <= k; seq++ {
		last[log[seq].block] = seq
	}
	zero := make([]byte, bs)
	for b := range int64(blocks) {
		want := zero
		if last[b] > 0 {
			want = stampBlock(b, last[b], bs)
		}
		if got := snap[b*bs : (b+1)*bs]; !bytes.Equal(got, want) {
			t.Fatalf("block %d of the snapshot holds write %d, want the volume after write %d: write %d",
				b, binary.LittleEndian.Uint64(got[8:]), k, last[b])
		}
	}
	// Not older than what was acknowledged before its creation time (to
	// the second, as the status keeps it).
	acked := 0
	for _, w := range log[1:] {
		if w.acked.Before(st.CreationTime.Time) {
			acked++
		}
	}
	if int64(acked) > k {
		t.Fatalf("%d writes were acknowledged before the snapshot's creation time %v, but it holds only 1..%d", acked, st.CreationTime, k)
	}
	t.Logf("%s on %s: the snapshot is the volume after write %d of %d (%d sent before it was ready); writes held %d ms",
		st.Method, fstype, k, len(log)-1, newest, st.HeldMilliseconds)
}
