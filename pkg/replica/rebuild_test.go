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
	"io"
	"log/slog"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
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

// TestMirrorOutAtStart: a primary that starts (again) over a record with
// replicas out of the in-sync set finds what each lacks: the log kept in
// LogDir since it left, or the whole volume for one without a log. It
// forwards nothing to them and drops nobody for it; Rebuild brings each
// back with exactly what it lacked, after which each holds the primary's
// copy.
func TestMirrorOutAtStart(t *testing.T) {
	arb := &fakeArbiter{epoch: 1}
	dir := t.TempDir()
	m1, local, peers := newTestMirror(t, arb, time.Second, dir, "b", "c")
	for i := range 4 {
		if _, err := m1.WriteAt(pattern(byte(i), 4096), int64(i)*Chunk); err != nil {
			t.Fatal(err)
		}
	}
	if err := m1.Sync(); err != nil {
		t.Fatal(err)
	}
	back := dropReplica(t, m1, peers, "b")
	if _, err := m1.WriteAt(pattern(9, 4096), 10*Chunk); err != nil {
		t.Fatal(err)
	}
	want := m1.Lacking("b").Ranges()
	if err := m1.Close(); err != nil {
		t.Fatal(err)
	}

	// The primary again, over its copy: c in sync, b out with its log,
	// d out without one.
	c := newMemPeer(testSize)
	c.b = peers["c"].b
	var changes atomic.Int64
	var mu sync.Mutex
	var states []string
	m2, err := New(Config{Local: local, Peers: map[string]Peer{"c": c}, Out: []string{"b", "d"}, Epoch: arb.epoch,
		Arbiter: arb, Deadline: time.Second, LogDir: dir, Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		OnChange: func(st ReplicaState) {
			changes.Add(1)
			mu.Lock()
			states = append(states, st.Name+":"+st.State)
			mu.Unlock()
		}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m2.Close() })
	var wantBytes int64
	for _, r := range want {
		wantBytes += r.Len
	}
	if got := m2.Replicas(); !slices.Equal(got, []ReplicaState{{Name: "b", State: "Out", Lacking: wantBytes}, {Name: "c", State: "InSync"},
		{Name: "d", State: "Out", Lacking: testSize}}) {
		t.Errorf("replicas at the start: %+v", got)
	}
	if got := m2.Lacking("b").Ranges(); !slices.Equal(got, want) {
		t.Errorf("b lacks %v after the restart, %v before", got, want)
	}
	if got := m2.Lacking("d").Bytes(); got != testSize {
		t.Errorf("d, out with no log, lacks %d bytes, want the whole %d", got, testSize)
	}
	if _, err := New(Config{Local: local, Peers: map[string]Peer{"c": c}, Out: []string{"c"}, Arbiter: arb}); err == nil {
		t.Error("a replica both in sync and out was accepted")
	}
	if _, err := m2.WriteAt(pattern(33, 4096), 20*Chunk); err != nil {
		t.Fatal(err)
	}
	if err := m2.Sync(); err != nil {
		t.Fatal(err)
	}
	if d := arb.dropped(); !slices.Equal(d, []string{"b"}) {
		t.Errorf("drops after writing with replicas out: %v, want only b's earlier one", d)
	}
	if !slices.Equal(m2.InSync(), []string{"c"}) {
		t.Errorf("in sync: %v", m2.InSync())
	}

	if err := m2.Rebuild(context.Background(), "b", back, RebuildOptions{}); err != nil {
		t.Fatal(err)
	}
	arb.mu.Lock()
	arb.drops = append(arb.drops, "d") // as the record has it
	arb.mu.Unlock()
	// d holds stale data everywhere (a node that held the volume long
	// ago): the chunks of zeroes go as WRITE_ZEROES, and zero it.
	d := newMemPeer(testSize)
	if _, err := d.b.WriteAt(bytes.Repeat([]byte{0xee}, testSize), 0); err != nil {
		t.Fatal(err)
	}
	if err := m2.Rebuild(context.Background(), "d", d, RebuildOptions{}); err != nil {
		t.Fatal(err)
	}
	const data = 6 // the chunks written: 0-3, 10 and 20
	if w, z := d.writes.Load(), d.zeroes.Load(); w != data || z != testSize/Chunk-data {
		t.Errorf("d's rebuild wrote %d chunks and zeroed %d, want %d and %d", w, z, data, testSize/Chunk-data)
	}
	whole := readBack(t, local, 0, testSize)
	for name, b := range map[string]*nbd.MemBackend{"b": back.b, "c": c.b, "d": d.b} {
		if !bytes.Equal(readBack(t, b, 0, testSize), whole) {
			t.Errorf("%s differs from the primary's copy", name)
		}
	}
	if !slices.Equal(m2.InSync(), []string{"b", "c", "d"}) {
		t.Errorf("in sync after the rebuilds: %v", m2.InSync())
	}
	for _, r := range m2.Replicas() {
		if r.State != "InSync" || r.Lacking != 0 {
			t.Errorf("after the rebuilds: %+v", r)
		}
	}
	// Each rebuild's start and return, in order.
	mu.Lock()
	defer mu.Unlock()
	if n := changes.Load(); n != 4 || !slices.Equal(states, []string{"b:Rebuilding", "b:InSync", "d:Rebuilding", "d:InSync"}) {
		t.Errorf("OnChange called %d times: %v", n, states)
	}
}

// TestMirrorRebuildRacesAChange: a change that found the replica out of
// the set, and has not marked its log yet when a rebuild of it starts,
// is in what the rebuild copies: the replica rejoins holding it.
func TestMirrorRebuildRacesAChange(t *testing.T) {
	arb := &fakeArbiter{epoch: 1}
	m, local, peers := newTestMirror(t, arb, time.Second, "", "b")
	back := dropReplica(t, m, peers, "b")
	// The next change stops as it starts marking b's log.
	marking, release := make(chan struct{}), make(chan struct{})
	testHookMarkLacking = func() {
		testHookMarkLacking = nil
		close(marking)
		<-release
	}
	t.Cleanup(func() { testHookMarkLacking = nil })
	wrote := make(chan error, 1)
	go func() { _, err := m.WriteAt(pattern(77, 4096), 9*Chunk); wrote <- err }()
	<-marking
	rebuilt := make(chan error, 1)
	go func() { rebuilt <- m.Rebuild(context.Background(), "b", back, RebuildOptions{}) }()
	time.Sleep(50 * time.Millisecond) // the rebuild starts, or waits for the change
	close(release)
	if err := <-wrote; err != nil {
		t.Fatal(err)
	}
	if err := <-rebuilt; err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(m.InSync(), []string{"b"}) {
		t.Fatalf("in sync: %v", m.InSync())
	}
	if !bytes.Equal(readBack(t, back.b, 9*Chunk, Chunk), readBack(t, local, 9*Chunk, Chunk)) {
		t.Fatal("b rejoined without the change that found it out as its rebuild began")
	}
}
