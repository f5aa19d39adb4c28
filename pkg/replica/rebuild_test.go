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

package replica

import (
	"bytes"
	"context"
	"errors"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// dropReplica makes replica name fail a write, so that it leaves the
// in-sync set, and returns a new connection to the same replica's disk
// (what a replica that comes back offers).
func dropReplica(t *testing.T, m *Mirror, peers map[string]*memPeer, name string) *memPeer {
	t.Helper()
	peers[name].failing.Store(true)
	if _, err := m.WriteAt(pattern(200, 4096), 0); err != nil {
		t.Fatal(err)
	}
	if m.Lacking(name) == nil {
		t.Fatalf("%s did not leave the in-sync set", name)
	}
	back := newMemPeer(testSize)
	back.b = peers[name].b
	return back
}

// TestMirrorRebuildCopiesWhatIsLacking: a replica that comes back gets the
// chunks its log holds, and those only; it is then in sync by the
// arbiter's record, holds what the primary holds, its log file is gone,
// and later writes reach it again.
func TestMirrorRebuildCopiesWhatIsLacking(t *testing.T) {
	arb := &fakeArbiter{epoch: 1}
	dir := t.TempDir()
	m, local, peers := newTestMirror(t, arb, time.Second, dir, "b", "c")
	for i := range 8 {
		if _, err := m.WriteAt(pattern(byte(i), 4096), int64(i)*Chunk); err != nil {
			t.Fatal(err)
		}
	}
	if err := m.Sync(); err != nil {
		t.Fatal(err)
	}
	back := dropReplica(t, m, peers, "b")
	for _, off := range []int64{3 * Chunk, 3*Chunk + 8192, 40 * Chunk} {
		if _, err := m.WriteAt(pattern(byte(off), 4096), off); err != nil {
			t.Fatal(err)
		}
	}
	lacks := m.Lacking("b").Ranges()
	var lackChunks int64
	for _, r := range lacks {
		lackChunks += r.Len / Chunk
	}
	var progress atomic.Int64
	if err := m.Rebuild(context.Background(), "b", back, RebuildOptions{Progress: func(copied, total int64) { progress.Store(copied) }}); err != nil {
		t.Fatal(err)
	}
	if got := back.writes.Load(); got != lackChunks {
		t.Errorf("the rebuild wrote %d chunks, the log held %d (%v)", got, lackChunks, lacks)
	}
	if progress.Load() != lackChunks*Chunk {
		t.Errorf("progress said %d bytes copied, want %d", progress.Load(), lackChunks*Chunk)
	}
	if !slices.Equal(m.InSync(), []string{"b", "c"}) || !slices.Equal(arb.rejoins, []string{"b"}) || m.Epoch() != 3 {
		t.Fatalf("in sync %v, rejoins %v, epoch %d; want b and c, [b], 3", m.InSync(), arb.rejoins, m.Epoch())
	}
	if _, err := os.Stat(m.logPath("b")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the log of a replica back in sync is still there: %v", err)
	}
	if _, err := m.WriteAt(pattern(77, 4096), 50*Chunk); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(readBack(t, back.b, 0, testSize), readBack(t, local, 0, testSize)) {
		t.Fatal("the rebuilt replica differs from the primary's copy")
	}
}

// TestMirrorRebuildUnderWrites: writers keep writing while a slow rebuild
// runs, into the chunks being copied too; when they stop, the rebuilt
// replica holds exactly what the primary holds (a change landing between
// a copy's read and its write would leave it stale).
func TestMirrorRebuildUnderWrites(t *testing.T) {
	arb := &fakeArbiter{epoch: 1}
	m, local, peers := newTestMirror(t, arb, time.Second, "", "b")
	back := dropReplica(t, m, peers, "b")
	// Make it lack every chunk of the volume.
	for off := int64(0); off < testSize; off += Chunk {
		if _, err := m.WriteAt(pattern(byte(off/Chunk), 512), off+Chunk-512); err != nil {
			t.Fatal(err)
		}
	}
	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var writes atomic.Int64
	for g := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ctx.Err() == nil; i++ {
				off := int64((i*7+g*13)%(testSize/4096)) * 4096
				if _, err := m.WriteAt(pattern(byte(i+g), 4096), off); err != nil {
					t.Error(err)
					return
				}
				writes.Add(1)
			}
		}()
	}
	err := m.Rebuild(context.Background(), "b", back, RebuildOptions{Rate: 32 << 20})
	stop()
	wg.Wait()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d writes during the rebuild", writes.Load())
	if writes.Load() == 0 {
		t.Fatal("no write ran during the rebuild: the test proves nothing")
	}
	if got, want := readBack(t, back.b, 0, testSize), readBack(t, local, 0, testSize); !bytes.Equal(got, want) {
		i := 0
		for got[i] == want[i] {
			i++
		}
		t.Fatalf("the replica rebuilt under writes differs from the primary's copy from byte %d (chunk %d, block %d): %x, want %x",
			i, i/Chunk, i/4096, got[i:i+8], want[i:i+8])
	}
}

// TestMirrorRebuildAborted: a replica that fails during its rebuild stays
// out, lacking all it lacked (nothing was taken off its log), and a later
// rebuild brings it back.
func TestMirrorRebuildAborted(t *testing.T) {
	arb := &fakeArbiter{epoch: 1}
	m, local, peers := newTestMirror(t, arb, time.Second, t.TempDir(), "b")
	back := dropReplica(t, m, peers, "b")
	for i := range 6 {
		if _, err := m.WriteAt(pattern(byte(i), 4096), int64(10+i)*Chunk); err != nil {
			t.Fatal(err)
		}
	}
	before := m.Lacking("b").Ranges()
	var copied atomic.Int64
	err := m.Rebuild(context.Background(), "b", back, RebuildOptions{Progress: func(c, _ int64) {
		if copied.Add(1) == 2 {
			back.failing.Store(true)
		}
	}})
	if !errors.Is(err, ErrRebuildAborted) {
		t.Fatalf("a rebuild whose replica failed: %v, want ErrRebuildAborted", err)
	}
	if len(m.InSync()) != 0 || len(arb.rejoins) != 0 {
		t.Fatalf("after an aborted rebuild: in sync %v, rejoins %v", m.InSync(), arb.rejoins)
	}
	if got := m.Lacking("b").Ranges(); !slices.Equal(got, before) {
		t.Fatalf("after an aborted rebuild b lacks %v, before it %v", got, before)
	}
	again := newMemPeer(testSize)
	again.b = back.b
	if err := m.Rebuild(context.Background(), "b", again, RebuildOptions{}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(readBack(t, again.b, 0, testSize), readBack(t, local, 0, testSize)) {
		t.Fatal("the replica rebuilt on the second try differs from the primary's copy")
	}
	if err := m.Rebuild(context.Background(), "b", newMemPeer(testSize), RebuildOptions{}); err == nil {
		t.Fatal("a rebuild of a replica in sync was accepted")
	}
}
