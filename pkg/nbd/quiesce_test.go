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
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestQuiesce: while writers run on several connections, Quiesce holds
// the export at a flush point: the backend then has, for each writer,
// every write acknowledged before Quiesce returned and at most the one it
// had in flight; acknowledgements stop (writes are held, not failed) until
// resume, and flow again after it.
func TestQuiesce(t *testing.T) {
	const writers, blocks, bs = 4, 16, 4096
	mem := NewMemBackend(writers * blocks * bs)
	e := &Export{Name: "disk", Backend: mem}
	s := newTestServer(t, e)
	cl := dialPipe(t, s, "disk", 3)

	var acked [writers]atomic.Uint64
	stop := make(chan struct{})
	errs := make(chan error, writers)
	var wg sync.WaitGroup
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, bs)
			for seq := uint64(1); ; seq++ {
				select {
				case <-stop:
					return
				default:
				}
				binary.LittleEndian.PutUint64(buf, seq)
				off := int64(w*blocks+int(seq%blocks)) * bs
				if _, err := cl.WriteAt(buf, off); err != nil {
					errs <- fmt.Errorf("writer %d seq %d: %w", w, seq, err)
					return
				}
				acked[w].Store(seq)
			}
		}()
	}
	defer func() {
		close(stop)
		wg.Wait()
	}()
	time.Sleep(50 * time.Millisecond)

	resume, err := e.Quiesce(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var atQuiesce [writers]uint64
	for w := range writers {
		atQuiesce[w] = acked[w].Load()
	}
	image := make([]byte, writers*blocks*bs)
	if _, err := mem.ReadAt(image, 0); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	for w := range writers {
		if now := acked[w].Load(); now > atQuiesce[w]+1 {
			t.Errorf("writer %d: %d writes acknowledged while the export was held (%d -> %d)", w, now-atQuiesce[w], atQuiesce[w], now)
		}
		var newest uint64
		for b := range blocks {
			off := (w*blocks + b) * bs
			newest = max(newest, binary.LittleEndian.Uint64(image[off:]))
		}
		if newest < atQuiesce[w] || newest > atQuiesce[w]+1 {
			t.Errorf("writer %d: newest write in the held image %d, acknowledged before the hold %d", w, newest, atQuiesce[w])
		}
	}
	resume()
	resume() // twice is fine
	time.Sleep(50 * time.Millisecond)
	for w := range writers {
		if acked[w].Load() <= atQuiesce[w]+1 {
			t.Errorf("writer %d made no progress after resume", w)
		}
	}
	select {
	case err := <-errs:
		t.Fatal(err)
	default:
	}
}

// stuckBackend holds writes until release is closed.
type stuckBackend struct {
	*MemBackend
	entered chan struct{}
	release chan struct{}
	once    sync.Once
}

func (b *stuckBackend) WriteAt(p []byte, off int64) (int, error) {
	b.once.Do(func() { close(b.entered) })
	<-b.release
	return b.MemBackend.WriteAt(p, off)
}

// TestQuiesceBounded: a write stuck in the backend makes Quiesce fail
// when its context ends, and leaves the export usable: once the write
// finishes, writes flow and a later Quiesce succeeds.
func TestQuiesceBounded(t *testing.T) {
	b := &stuckBackend{MemBackend: NewMemBackend(1 << 20), entered: make(chan struct{}), release: make(chan struct{})}
	e := &Export{Name: "disk", Backend: b}
	s := newTestServer(t, e)
	cl := dialPipe(t, s, "disk", 1)
	done := make(chan error, 1)
	go func() {
		_, err := cl.WriteAt(make([]byte, 4096), 0)
		done <- err
	}()
	<-b.entered
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, err := e.Quiesce(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Quiesce with a write stuck: %v, want DeadlineExceeded", err)
	}
	close(b.release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, err := cl.WriteAt(make([]byte, 4096), 4096); err != nil {
		t.Fatal(err)
	}
	resume, err := e.Quiesce(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	resume()
	if _, err := cl.WriteAt(make([]byte, 4096), 8192); err != nil {
		t.Fatal(err)
	}
}
