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

package nbd

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"
)

const kib, mib = int64(1) << 10, int64(1) << 20

// TestChangeTracker: writes, trims and write-zeroes made through the
// server are recorded as whole 64 KiB chunks, merged and sorted by Take,
// which forgets them; reads are not recorded.
func TestChangeTracker(t *testing.T) {
	e := &Export{Name: "disk", Backend: NewMemBackend(16 * mib)}
	s := newTestServer(t, e)
	cl := dialPipe(t, s, "disk", 2)
	tr := e.TrackChanges()
	defer tr.Stop()

	if _, err := cl.WriteAt(make([]byte, 100*kib), mib+8*kib); err != nil { // chunks 16 and 17
		t.Fatal(err)
	}
	if err := cl.Trim(4*mib, 128*kib); err != nil { // chunks 64 and 65
		t.Fatal(err)
	}
	if err := cl.WriteZeroes(8*mib+60*kib, 8*kib, false); err != nil { // chunks 128 and 129
		t.Fatal(err)
	}
	if err := cl.WriteZeroes(12*mib, 4*kib, true); err != nil { // chunk 192
		t.Fatal(err)
	}
	if _, err := cl.WriteAt(make([]byte, 4*kib), 64*kib); err != nil { // chunk 1
		t.Fatal(err)
	}
	if _, err := cl.WriteAt(make([]byte, 4*kib), 0); err != nil { // chunk 0, beside 1
		t.Fatal(err)
	}
	if _, err := cl.ReadAt(make([]byte, mib), 14*mib); err != nil {
		t.Fatal(err)
	}
	want := []Range{{0, 128 * kib}, {mib, 128 * kib}, {4 * mib, 128 * kib}, {8 * mib, 128 * kib}, {12 * mib, 64 * kib}}
	if got := tr.Take(); !slices.Equal(got, want) {
		t.Errorf("Take = %v, want %v", got, want)
	}
	if got := tr.Take(); len(got) != 0 {
		t.Errorf("second Take = %v, want nothing", got)
	}
	if _, err := cl.WriteAt(make([]byte, 4*kib), 16*mib-4*kib); err != nil { // the last chunk
		t.Fatal(err)
	}
	if got, want := tr.Take(), []Range{{16*mib - 64*kib, 64 * kib}}; !slices.Equal(got, want) {
		t.Errorf("Take after a write to the end = %v, want %v", got, want)
	}
}

// TestChangeTrackers: two trackers at once each see every change; one
// stopped records nothing more while the other goes on; once both are
// stopped the export keeps none.
func TestChangeTrackers(t *testing.T) {
	e := &Export{Name: "disk", Backend: NewMemBackend(4 * mib)}
	s := newTestServer(t, e)
	cl := dialPipe(t, s, "disk", 1)
	a, b := e.TrackChanges(), e.TrackChanges()

	if _, err := cl.WriteAt(make([]byte, 4*kib), 2*mib); err != nil {
		t.Fatal(err)
	}
	want := []Range{{2 * mib, 64 * kib}}
	if got := a.Take(); !slices.Equal(got, want) {
		t.Errorf("first tracker: %v, want %v", got, want)
	}
	if got := b.Take(); !slices.Equal(got, want) {
		t.Errorf("second tracker: %v, want %v", got, want)
	}

	a.Stop()
	a.Stop() // twice is fine
	if err := cl.Trim(3*mib, 64*kib); err != nil {
		t.Fatal(err)
	}
	if got := a.Take(); len(got) != 0 {
		t.Errorf("stopped tracker recorded %v", got)
	}
	if got, want := b.Take(), []Range{{3 * mib, 64 * kib}}; !slices.Equal(got, want) {
		t.Errorf("running tracker after the other stopped: %v, want %v", got, want)
	}
	b.Stop()
	if e.trackers.Load() != nil {
		t.Error("the export still has trackers after both stopped")
	}
	if _, err := cl.WriteAt(make([]byte, 4*kib), 0); err != nil {
		t.Fatal(err)
	}
	if got := b.Take(); len(got) != 0 {
		t.Errorf("stopped tracker recorded %v", got)
	}
}

// TestChangeTrackerLanded: a write still on its way to the backend is not
// reported yet, but by the first Take after it landed: a Take that reported
// it early would let a copy read the range before the write is there, and
// the next Take would not report it again.
func TestChangeTrackerLanded(t *testing.T) {
	b := &stuckBackend{MemBackend: NewMemBackend(mib), entered: make(chan struct{}), release: make(chan struct{})}
	e := &Export{Name: "disk", Backend: b}
	s := newTestServer(t, e)
	cl := dialPipe(t, s, "disk", 1)
	tr := e.TrackChanges()
	defer tr.Stop()
	done := make(chan error, 1)
	go func() {
		_, err := cl.WriteAt(make([]byte, 4*kib), 256*kib)
		done <- err
	}()
	<-b.entered
	if got := tr.Take(); len(got) != 0 {
		t.Errorf("Take while the write is stuck before the backend = %v, want nothing", got)
	}
	close(b.release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got, want := tr.Take(), []Range{{256 * kib, 64 * kib}}; !slices.Equal(got, want) {
		t.Errorf("Take once the write landed = %v, want %v", got, want)
	}
}

// TestChangeTrackerMark: ranges across bitmap words and a whole large
// export come back as one range each.
func TestChangeTrackerMark(t *testing.T) {
	e := &Export{Name: "disk", Backend: NewMemBackend(0)}
	tr := e.TrackChanges()
	defer tr.Stop()
	tr.mark(60*ChangeChunk+1, 70*ChangeChunk) // chunks 60..130
	tr.mark(200*ChangeChunk, 1)               // chunk 200
	tr.mark(131*ChangeChunk, 0)               // nothing
	want := []Range{{60 * ChangeChunk, 71 * ChangeChunk}, {200 * ChangeChunk, ChangeChunk}}
	if got := tr.Take(); !slices.Equal(got, want) {
		t.Errorf("Take = %v, want %v", got, want)
	}
	const tib = int64(1) << 40
	tr.mark(0, tib)
	tr.mark(tib/2, 4*kib)
	if got, want := tr.Take(), []Range{{0, tib}}; !slices.Equal(got, want) {
		t.Errorf("Take after marking 1 TiB = %v, want %v", got, want)
	}
	if n := len(tr.words) * 8; n > 2*int(mib) {
		t.Errorf("the bitmap of a 1 TiB export takes %d bytes", n)
	}
}

// TestChangeTrackerCopy copies an export's backend while writers change it
// through the server, copies again what the tracker reports changed, and
// a last time under Quiesce: the copy is then the backend byte for byte,
// as the snapshot package relies on.
func TestChangeTrackerCopy(t *testing.T) {
	const size, writers = 8 * mib, 3
	mem := NewMemBackend(size)
	e := &Export{Name: "disk", Backend: slowWrites{mem}}
	s := newTestServer(t, e)
	cl := dialPipe(t, s, "disk", writers)

	ctx, cancel := context.WithCancel(context.Background())
	errs := make(chan error, writers)
	var wg sync.WaitGroup
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 1))
			buf := make([]byte, 64*kib)
			for ctx.Err() == nil {
				n := (1 + rng.Int64N(16)) * 4 * kib
				off := rng.Int64N((size-n)/(4*kib)) * 4 * kib
				var err error
				switch rng.IntN(8) {
				case 0:
					err = cl.Trim(off, n)
				case 1:
					err = cl.WriteZeroes(off, n, rng.IntN(2) == 0)
				default:
					for i := range buf[:n] {
						buf[i] = byte(rng.Uint32())
					}
					_, err = cl.WriteAt(buf[:n], off)
				}
				if err != nil {
					errs <- fmt.Errorf("writer %d: %w", w, err)
					return
				}
			}
		}()
	}
	defer func() {
		cancel()
		wg.Wait()
		select {
		case err := <-errs:
			t.Error(err)
		default:
		}
	}()
	time.Sleep(20 * time.Millisecond)

	tr := e.TrackChanges()
	defer tr.Stop()
	img := make([]byte, size)
	copyRange := func(off, n int64) {
		n = min(n, size-off)
		for pos := off; pos < off+n; pos += 64 * kib {
			if _, err := mem.ReadAt(img[pos:min(pos+64*kib, off+n)], pos); err != nil {
				t.Fatal(err)
			}
			time.Sleep(50 * time.Microsecond) // let the writers interleave
		}
	}
	copyRange(0, size)
	recopied := 0
	for range 3 {
		for _, r := range tr.Take() {
			copyRange(r.Off, r.Len)
			recopied++
		}
	}
	resume, err := e.Quiesce(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	last := tr.Take()
	for _, r := range last {
		copyRange(r.Off, r.Len)
	}
	held := make([]byte, size)
	if _, err := mem.ReadAt(held, 0); err != nil {
		t.Fatal(err)
	}
	resume()
	t.Logf("%d ranges copied again while writes flowed, %d under Quiesce", recopied, len(last))
	if recopied == 0 {
		t.Error("the tracker reported no change while writers ran")
	}
	if !bytes.Equal(img, held) {
		i := 0
		for img[i] == held[i] {
			i++
		}
		t.Fatalf("the copy differs from the held backend at byte %d", i)
	}
}

// slowWrites takes a while before each write reaches the memory, as a
// disk would: a change recorded before it is made would be copied before
// it is there.
type slowWrites struct{ *MemBackend }

func (b slowWrites) WriteAt(p []byte, off int64) (int, error) {
	time.Sleep(200 * time.Microsecond)
	return b.MemBackend.WriteAt(p, off)
}
