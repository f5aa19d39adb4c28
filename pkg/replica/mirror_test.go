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
	"fmt"
	"io"
	"log/slog"
	mrand "math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// memPeer is a replica in memory: a backend whose FLUSH makes writes
// durable, and faults to inject.
type memPeer struct {
	b       *nbd.MemBackend
	failing atomic.Bool   // every call fails
	hang    chan struct{} // non-nil: calls wait for it or for Close
	// holdWrites, when set, holds each write until it is closed; a write
	// held says so on heldWrite first.
	holdWrites chan struct{}
	heldWrite  chan struct{}
	jitter     bool // calls take a random few hundred microseconds
	closed     chan struct{}
	once       sync.Once
	writes     atomic.Int64
	zeroes     atomic.Int64
	flushes    atomic.Int64
}

func newMemPeer(size int64) *memPeer {
	return &memPeer{b: nbd.NewMemBackend(size), closed: make(chan struct{})}
}

var errPeerDown = errors.New("peer down")

func (p *memPeer) enter() error {
	select {
	case <-p.closed:
		return nbd.ErrClosed
	default:
	}
	if h := p.hang; h != nil {
		select {
		case <-h:
		case <-p.closed:
			return nbd.ErrClosed
		}
	}
	if p.failing.Load() {
		return errPeerDown
	}
	if p.jitter {
		time.Sleep(time.Duration(mrand.IntN(300)) * time.Microsecond)
	}
	return nil
}

func (p *memPeer) WriteAt(b []byte, off int64) (int, error) {
	if h := p.holdWrites; h != nil {
		p.heldWrite <- struct{}{}
		<-h
	}
	if err := p.enter(); err != nil {
		return 0, err
	}
	p.writes.Add(1)
	return p.b.WriteAt(b, off)
}

func (p *memPeer) Trim(off, n int64) error {
	if err := p.enter(); err != nil {
		return err
	}
	return p.b.Trim(off, n)
}

func (p *memPeer) WriteZeroes(off, n int64, noHole bool) error {
	if err := p.enter(); err != nil {
		return err
	}
	p.zeroes.Add(1)
	return p.b.Zero(off, n, noHole)
}

func (p *memPeer) Flush() error {
	if err := p.enter(); err != nil {
		return err
	}
	p.flushes.Add(1)
	return nil
}

func (p *memPeer) Close() error {
	p.once.Do(func() { close(p.closed) })
	return nil
}

// fakeArbiter records drops; gate, when set, holds each Drop until a
// value arrives (nil: recorded; an error: returned).
type fakeArbiter struct {
	mu      sync.Mutex
	epoch   int64
	drops   []string
	rejoins []string
	gate    chan error
	calls   atomic.Int64
}

// admit counts a call and, with a gate, waits for its verdict.
func (a *fakeArbiter) admit(ctx context.Context) error {
	a.calls.Add(1)
	if a.gate == nil {
		return nil
	}
	select {
	case err := <-a.gate:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (a *fakeArbiter) Drop(ctx context.Context, epoch int64, name string, cause error) (int64, error) {
	if err := a.admit(ctx); err != nil {
		return 0, err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if epoch != a.epoch {
		return 0, fmt.Errorf("epoch %d is not %d: %w", epoch, a.epoch, nbd.ErrSuperseded)
	}
	a.epoch++
	a.drops = append(a.drops, name)
	return a.epoch, nil
}

func (a *fakeArbiter) Rejoin(ctx context.Context, epoch int64, name string) (int64, error) {
	if err := a.admit(ctx); err != nil {
		return 0, err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if epoch != a.epoch || !slices.Contains(a.drops, name) {
		return 0, fmt.Errorf("epoch %d is not %d, or %s is in sync: %w", epoch, a.epoch, name, nbd.ErrSuperseded)
	}
	a.epoch++
	a.drops = slices.DeleteFunc(a.drops, func(n string) bool { return n == name })
	a.rejoins = append(a.rejoins, name)
	return a.epoch, nil
}

func (a *fakeArbiter) dropped() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return slices.Clone(a.drops)
}

const testSize = 4 << 20

func newTestMirror(t *testing.T, arb *fakeArbiter, deadline time.Duration, logDir string, peers ...string) (*Mirror, *nbd.MemBackend, map[string]*memPeer) {
	t.Helper()
	local := nbd.NewMemBackend(testSize)
	mp := map[string]*memPeer{}
	ps := map[string]Peer{}
	for _, n := range peers {
		mp[n] = newMemPeer(testSize)
		ps[n] = mp[n]
	}
	m, err := New(Config{Local: local, Peers: ps, Epoch: arb.epoch, Arbiter: arb, Deadline: deadline, LogDir: logDir,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m, local, mp
}

func pattern(seed byte, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = seed + byte(i%251)
	}
	return b
}

func readBack(t *testing.T, b nbd.Backend, off int64, n int) []byte {
	t.Helper()
	got := make([]byte, n)
	if _, err := b.ReadAt(got, off); err != nil {
		t.Fatal(err)
	}
	return got
}

// returnsWithin runs f and fails the test unless it returns within d.
func returnsWithin(t *testing.T, d time.Duration, what string, f func() error) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- f() }()
	select {
	case err := <-done:
		return err
	case <-time.After(d):
		t.Fatalf("%s did not return within %v", what, d)
		return nil
	}
}

// TestMirrorChangesReachEveryReplica: writes, trims and write-zeroes are
// on the primary's copy and every replica's when they return; a FLUSH
// flushes every replica.
func TestMirrorChangesReachEveryReplica(t *testing.T) {
	arb := &fakeArbiter{epoch: 3}
	m, local, peers := newTestMirror(t, arb, time.Second, "", "b", "c")
	data := pattern(7, 3*Chunk)
	if _, err := m.WriteAt(data, 5000); err != nil {
		t.Fatal(err)
	}
	if err := m.Trim(5000, Chunk); err != nil {
		t.Fatal(err)
	}
	if err := m.Zero(5000+Chunk, 4096, true); err != nil {
		t.Fatal(err)
	}
	if err := m.Sync(); err != nil {
		t.Fatal(err)
	}
	want := readBack(t, local, 0, testSize)
	if !bytes.Equal(want[5000+2*Chunk:5000+3*Chunk], data[2*Chunk:]) {
		t.Fatal("the primary's copy lacks the write")
	}
	for name, p := range peers {
		if !bytes.Equal(readBack(t, p.b, 0, testSize), want) {
			t.Errorf("replica %s differs from the primary's copy", name)
		}
		if p.flushes.Load() != 1 {
			t.Errorf("replica %s got %d FLUSHes, want 1", name, p.flushes.Load())
		}
	}
	if got := m.InSync(); !slices.Equal(got, []string{"b", "c"}) || arb.calls.Load() != 0 {
		t.Fatalf("in sync %v after %d arbiter calls, want b and c and none", got, arb.calls.Load())
	}
}

// TestMirrorAcknowledgesOnlyAfterTheDropIsRecorded: a replica that fails
// a write leaves the in-sync set, and the write returns only once the
// arbiter recorded that; while the arbiter is unreachable the write, and a
// FLUSH, stay unanswered. The replica then lacks, in its log, the chunks
// of that write, of the writes it acknowledged but never flushed, and of
// the writes after; the chunks it had flushed are not in it.
func TestMirrorAcknowledgesOnlyAfterTheDropIsRecorded(t *testing.T) {
	arb := &fakeArbiter{epoch: 1, gate: make(chan error)}
	m, _, peers := newTestMirror(t, arb, time.Second, t.TempDir(), "b", "c")
	// Flushed on b before it fails: not lacking.
	if _, err := m.WriteAt(pattern(1, 4096), 0); err != nil {
		t.Fatal(err)
	}
	if err := m.Sync(); err != nil {
		t.Fatal(err)
	}
	// Acknowledged by b, never flushed: lacking.
	if _, err := m.WriteAt(pattern(2, 4096), 10*Chunk); err != nil {
		t.Fatal(err)
	}
	peers["b"].failing.Store(true)

	wrote := make(chan error, 1)
	go func() { _, err := m.WriteAt(pattern(3, 4096), 20*Chunk); wrote <- err }()
	flushed := make(chan error, 1)
	go func() {
		time.Sleep(50 * time.Millisecond)
		flushed <- m.Sync()
	}()
	// Unreachable, twice: nothing is acknowledged meanwhile.
	for range 2 {
		select {
		case arb.gate <- errors.New("API server unreachable"):
		case <-time.After(5 * time.Second):
			t.Fatal("the Mirror did not ask the arbiter to drop the failed replica")
		}
	}
	time.Sleep(200 * time.Millisecond)
	select {
	case err := <-wrote:
		t.Fatalf("a write that replica b lacks returned (%v) before the arbiter recorded b's leaving", err)
	case err := <-flushed:
		t.Fatalf("a FLUSH returned (%v) before the arbiter recorded b's leaving", err)
	default:
	}
	arb.gate <- nil
	for what, ch := range map[string]chan error{"the write": wrote, "the FLUSH": flushed} {
		if err := returnsWithin(t, 5*time.Second, what, func() error { return <-ch }); err != nil {
			t.Fatalf("%s after b was dropped: %v", what, err)
		}
	}
	if got := arb.dropped(); !slices.Equal(got, []string{"b"}) {
		t.Fatalf("dropped %v, want [b]", got)
	}
	if m.Epoch() != 2 || !slices.Equal(m.InSync(), []string{"c"}) {
		t.Fatalf("epoch %d, in sync %v; want 2 and [c]", m.Epoch(), m.InSync())
	}
	// After: not forwarded to b, but logged.
	writesBefore := peers["b"].writes.Load()
	if _, err := m.WriteAt(pattern(4, 4096), 30*Chunk+100); err != nil {
		t.Fatal(err)
	}
	if peers["b"].writes.Load() != writesBefore {
		t.Fatal("a write was forwarded to a replica out of the in-sync set")
	}
	want := []nbd.Range{{Off: 10 * Chunk, Len: Chunk}, {Off: 20 * Chunk, Len: Chunk}, {Off: 30 * Chunk, Len: Chunk}}
	if got := m.Lacking("b").Ranges(); !slices.Equal(got, want) {
		t.Fatalf("b lacks %v, want %v", got, want)
	}
	// The log is durable as it was when the last write returned.
	l, err := OpenLog(filepath.Join(m.logDir, "b.dirty"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if got := l.Ranges(); !slices.Equal(got, want) {
		t.Fatalf("b's log file holds %v, want %v", got, want)
	}
	if m.Lacking("c") != nil {
		t.Fatal("c, in sync, has a log of what it lacks")
	}
}

// TestMirrorFlushAheadOfAChangeDoesNotCoverIt: a FLUSH that starts while
// a write is on its way to a replica, and reaches the replica first, does
// not make that write durable there. When the replica later fails (its
// FLUSH: a writeback error, or it lost power), what it lacks must still
// hold the write, whether it failed the write itself or a later FLUSH:
// otherwise a rebuild skips it and the replica rejoins without it.
func TestMirrorFlushAheadOfAChangeDoesNotCoverIt(t *testing.T) {
	for _, failOn := range []string{"a later FLUSH", "the write"} {
		t.Run(failOn, func(t *testing.T) {
			arb := &fakeArbiter{epoch: 1}
			m, _, peers := newTestMirror(t, arb, 5*time.Second, "", "b")
			b := peers["b"]
			b.holdWrites, b.heldWrite = make(chan struct{}), make(chan struct{}, 1)
			wrote := make(chan error, 1)
			go func() { _, err := m.WriteAt(pattern(7, 4096), 3*Chunk); wrote <- err }()
			select {
			case <-b.heldWrite:
			case <-time.After(5 * time.Second):
				t.Fatal("the write was not forwarded to b")
			}
			// The FLUSH reaches b ahead of the write, and completes.
			if err := returnsWithin(t, 5*time.Second, "a FLUSH", m.Sync); err != nil {
				t.Fatal(err)
			}
			if failOn == "the write" {
				b.failing.Store(true)
			}
			close(b.holdWrites)
			if err := returnsWithin(t, 5*time.Second, "the write", func() error { return <-wrote }); err != nil {
				t.Fatal(err)
			}
			if failOn == "a later FLUSH" {
				b.failing.Store(true)
				if err := returnsWithin(t, 5*time.Second, "the FLUSH b fails", m.Sync); err != nil {
					t.Fatal(err)
				}
			}
			if got := arb.dropped(); !slices.Equal(got, []string{"b"}) {
				t.Fatalf("dropped %v, want [b]", got)
			}
			l := m.Lacking("b")
			if l == nil {
				t.Fatal("b left the in-sync set with no log of what it lacks")
			}
			if got, want := l.Ranges(), []nbd.Range{{Off: 3 * Chunk, Len: Chunk}}; !slices.Equal(got, want) {
				t.Fatalf("b lacks %v, want %v: the write it acknowledged after the FLUSH that reached it first was never made durable there", got, want)
			}
		})
	}
}

// TestMirrorFencedWhenSuperseded: when the arbiter refuses a drop because
// a newer epoch exists (another primary), the Mirror acknowledges nothing
// more: the change that waited, the ones after and every FLUSH are
// withheld (the server then closes the node's connection and the node
// replays elsewhere); reads still work.
func TestMirrorFencedWhenSuperseded(t *testing.T) {
	arb := &fakeArbiter{epoch: 5}
	m, _, peers := newTestMirror(t, arb, time.Second, "", "b")
	arb.mu.Lock()
	arb.epoch = 6 // another primary was chosen meanwhile
	arb.mu.Unlock()
	peers["b"].failing.Store(true)
	if _, err := m.WriteAt(pattern(1, 4096), 0); !errors.Is(err, nbd.ErrWithheld) {
		t.Fatalf("the write whose replica's drop was refused: %v, want ErrWithheld", err)
	}
	if _, err := m.WriteAt(pattern(1, 4096), 0); !errors.Is(err, nbd.ErrWithheld) {
		t.Fatalf("a write after the fence: %v, want ErrWithheld", err)
	}
	if err := m.Sync(); !errors.Is(err, nbd.ErrWithheld) {
		t.Fatalf("a FLUSH after the fence: %v, want ErrWithheld", err)
	}
	if err := m.Trim(0, 4096); !errors.Is(err, nbd.ErrWithheld) {
		t.Fatalf("a trim after the fence: %v, want ErrWithheld", err)
	}
	if m.Fenced() == nil {
		t.Fatal("Fenced is nil")
	}
	if _, err := m.ReadAt(make([]byte, 4096), 0); err != nil {
		t.Fatalf("read after the fence: %v", err)
	}
}

// TestMirrorDropsASilentReplica: a replica that never answers (a host
// powered off: no error, no reset) is dropped once its forward is older
// than the deadline, and the write completes then; a FLUSH it never
// answers likewise.
func TestMirrorDropsASilentReplica(t *testing.T) {
	for _, op := range []string{"write", "flush"} {
		t.Run(op, func(t *testing.T) {
			arb := &fakeArbiter{epoch: 1}
			const deadline = 300 * time.Millisecond
			m, local, peers := newTestMirror(t, arb, deadline, "", "b", "c")
			peers["c"].hang = make(chan struct{})
			start := time.Now()
			err := returnsWithin(t, 10*time.Second, op, func() error {
				if op == "flush" {
					return m.Sync()
				}
				_, err := m.WriteAt(pattern(9, 8192), 3*Chunk)
				return err
			})
			if err != nil {
				t.Fatalf("%s with a silent replica: %v", op, err)
			}
			if took := time.Since(start); took < deadline {
				t.Fatalf("the silent replica was dropped after %v, before its deadline %v", took, deadline)
			}
			if got := arb.dropped(); !slices.Equal(got, []string{"c"}) {
				t.Fatalf("dropped %v, want [c]", got)
			}
			if op == "write" {
				if !bytes.Equal(readBack(t, peers["b"].b, 3*Chunk, 8192), readBack(t, local, 3*Chunk, 8192)) {
					t.Fatal("the replica still in sync lacks the write")
				}
				if got := m.Lacking("c").Ranges(); !slices.Equal(got, []nbd.Range{{Off: 3 * Chunk, Len: Chunk}}) {
					t.Fatalf("c lacks %v", got)
				}
			}
		})
	}
}

// TestMirrorChangeWaitsForAnEarlierDrop: a change that arrives while a
// replica's leaving is being recorded is not forwarded to it, is in its
// log, and is acknowledged only after the decision.
func TestMirrorChangeWaitsForAnEarlierDrop(t *testing.T) {
	arb := &fakeArbiter{epoch: 1, gate: make(chan error)}
	m, _, peers := newTestMirror(t, arb, time.Second, "", "b")
	peers["b"].failing.Store(true)
	first := make(chan error, 1)
	go func() { _, err := m.WriteAt(pattern(1, 4096), 0); first <- err }()
	deadline := time.Now().Add(5 * time.Second)
	for arb.calls.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the drop of b did not start")
		}
		time.Sleep(5 * time.Millisecond)
	}
	second := make(chan error, 1)
	go func() { second <- m.Zero(7*Chunk, 4096, false) }()
	time.Sleep(100 * time.Millisecond)
	select {
	case err := <-second:
		t.Fatalf("a change b lacks returned (%v) while b's leaving was not recorded", err)
	default:
	}
	arb.gate <- nil
	for _, ch := range []chan error{first, second} {
		if err := returnsWithin(t, 5*time.Second, "a change", func() error { return <-ch }); err != nil {
			t.Fatal(err)
		}
	}
	if got := m.Lacking("b").Ranges(); !slices.Equal(got, []nbd.Range{{Off: 0, Len: Chunk}, {Off: 7 * Chunk, Len: Chunk}}) {
		t.Fatalf("b lacks %v", got)
	}
}

// TestDirtyLogFile: a log reopened holds what was marked; a file that is
// not a log is refused.
func TestDirtyLogFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "r.dirty")
	l, err := OpenLog(path)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range [][2]int64{{0, 1}, {Chunk - 1, 2}, {100 * Chunk, 3 * Chunk}, {5000 * Chunk, 1}} {
		if err := l.Mark(r[0], r[1]); err != nil {
			t.Fatal(err)
		}
	}
	l.Close()
	l, err = OpenLog(path)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	want := []nbd.Range{{Off: 0, Len: 2 * Chunk}, {Off: 100 * Chunk, Len: 3 * Chunk}, {Off: 5000 * Chunk, Len: Chunk}}
	if got := l.Ranges(); !slices.Equal(got, want) {
		t.Fatalf("reopened log holds %v, want %v", got, want)
	}
	if l.Bytes() != 6*Chunk {
		t.Fatalf("Bytes %d, want %d", l.Bytes(), 6*Chunk)
	}
	bad := filepath.Join(t.TempDir(), "bad.dirty")
	if err := os.WriteFile(bad, []byte("not a log at all"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := OpenLog(bad); !errors.Is(err, ErrLogCorrupt) {
		t.Fatalf("OpenLog of a file that is no log: %v, want ErrLogCorrupt", err)
	}
}

// TestMirrorOverlappingWritesKeepReplicasAlike: in each round, writers
// race on one block (whole writes, write-zeroes and trims that straddle
// it); after each round every replica holds exactly what the primary
// holds: overlapping changes are applied in one order everywhere, even
// when the replicas answer in a different order than they were sent.
func TestMirrorOverlappingWritesKeepReplicasAlike(t *testing.T) {
	arb := &fakeArbiter{epoch: 1}
	m, local, peers := newTestMirror(t, arb, 5*time.Second, "", "b", "c")
	for _, p := range peers {
		p.jitter = true
	}
	for round := range 60 {
		var wg sync.WaitGroup
		start := make(chan struct{})
		for g := range 6 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				var err error
				switch g {
				case 4:
					err = m.Zero(2048, 4096, false)
				case 5:
					err = m.Trim(1024, 2048)
				default:
					_, err = m.WriteAt(pattern(byte(round*7+g), 4096), 0)
				}
				if err != nil {
					t.Error(err)
				}
			}()
		}
		close(start)
		wg.Wait()
		want := readBack(t, local, 0, 8192)
		for name, p := range peers {
			if !bytes.Equal(readBack(t, p.b, 0, 8192), want) {
				t.Fatalf("round %d: replica %s differs from the primary's copy after overlapping changes", round, name)
			}
		}
	}
}
