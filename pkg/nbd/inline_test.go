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
	"io"
	"runtime"
	"sync"
	"testing"
	"time"
)

// whereBackend records, for every write and read, whether the goroutine
// reading the connection executed it, and can hold writes: the first
// `slow` ones sleep past the inline budget, and while hold is set every
// later one waits for release.
type whereBackend struct {
	*MemBackend
	slow int

	mu       sync.Mutex
	inReader []bool
	reads    []bool // inReader of the reads
	inside   int
	maxIn    int
	hold     bool
	release  chan struct{}
}

// onReader reports whether the calling goroutine reads a connection.
func onReader() bool {
	stack := make([]byte, 8<<10)
	stack = stack[:runtime.Stack(stack, false)]
	return bytes.Contains(stack, []byte("(*serverConn).transmit("))
}

func (b *whereBackend) ReadAt(p []byte, off int64) (int, error) {
	r := onReader()
	b.mu.Lock()
	b.reads = append(b.reads, r)
	b.mu.Unlock()
	return b.MemBackend.ReadAt(p, off)
}

func (b *whereBackend) WriteAt(p []byte, off int64) (int, error) {
	r := onReader()
	b.mu.Lock()
	n := len(b.inReader)
	b.inReader = append(b.inReader, r)
	b.inside++
	b.maxIn = max(b.maxIn, b.inside)
	hold := b.hold
	b.mu.Unlock()
	defer func() {
		b.mu.Lock()
		b.inside--
		b.mu.Unlock()
	}()
	if n < b.slow {
		time.Sleep(5 * inlineBase)
	}
	if hold {
		<-b.release
	}
	return b.MemBackend.WriteAt(p, off)
}

func (b *whereBackend) where() []bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]bool(nil), b.inReader...)
}

func (b *whereBackend) whereReads() []bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]bool(nil), b.reads...)
}

func writeAndWait(t *testing.T, s *Server, export string, reqs ...Request) {
	t.Helper()
	c := rawSession(t, s, export)
	for _, r := range reqs {
		sendReq(t, c, r, bytes.Repeat([]byte{byte(r.Handle)}, int(r.Length)))
		if rep := readRep(t, c); rep.Errno != 0 || rep.Handle != r.Handle {
			t.Fatalf("write %d: reply %+v", r.Handle, rep)
		}
	}
}

// A stream of writes, each sent after the reply of the one before, runs
// on the reader: nothing else is in flight and the backend is fast.
// A FUA write (the last: the reply of a worker is in flight until the
// worker wrote it) goes to the workers, and so does everything with
// NoInline.
func TestInlineWrites(t *testing.T) {
	for _, noInline := range []bool{false, true} {
		b := &whereBackend{MemBackend: NewMemBackend(1 << 20)}
		s := newTestServer(t, &Export{Name: "d", Backend: b})
		s.NoInline = noInline
		s.inlineBase = time.Minute // no pause on a loaded machine
		var reqs []Request
		for i := range 8 {
			r := Request{Type: CmdWrite, Handle: uint64(i + 1), Offset: uint64(i) * 4096, Length: 4096}
			if i == 7 {
				r.Flags = CmdFlagFUA
			}
			reqs = append(reqs, r)
		}
		writeAndWait(t, s, "d", reqs...)
		for i, inReader := range b.where() {
			want := !noInline && i != 7
			if inReader != want {
				t.Errorf("NoInline %v: write %d (FUA %v) ran on the reader: %v, want %v", noInline, i, i == 7, inReader, want)
			}
		}
		for i := range 8 {
			if got := b.data[i*4096]; got != byte(i+1) {
				t.Errorf("NoInline %v: block %d holds %d, want %d", noInline, i, got, i+1)
			}
		}
	}
}

// Reads of inlineReadMin bytes and more, each sent after the reply of
// the one before, run on the reader and answer with the right bytes;
// smaller reads go to the workers (their replies are batched), and so
// does everything with NoInline.
func TestInlineReads(t *testing.T) {
	for _, noInline := range []bool{false, true} {
		const size = 4 << 20
		b := &whereBackend{MemBackend: NewMemBackend(size)}
		for i := range b.data {
			b.data[i] = byte(i*7 + i>>12)
		}
		s := newTestServer(t, &Export{Name: "d", Backend: b})
		s.NoInline = noInline
		s.inlineBase = time.Minute // no pause on a loaded machine
		c := rawSession(t, s, "d")
		// The small ones last: a request right after a worker's reply may
		// find that worker not yet done with it, so not idle.
		lengths := []uint32{inlineReadMin, 1 << 20, 2 << 20, 4096, inlineReadMin - 512}
		off := uint64(0)
		for i, n := range lengths {
			sendReq(t, c, Request{Type: CmdRead, Handle: uint64(i + 1), Offset: off, Length: n}, nil)
			if rep := readRep(t, c); rep.Errno != 0 || rep.Handle != uint64(i+1) {
				t.Fatalf("read %d: reply %+v", i, rep)
			}
			got := make([]byte, n)
			if _, err := io.ReadFull(c, got); err != nil {
				t.Fatalf("read %d payload: %v", i, err)
			}
			if !bytes.Equal(got, b.data[off:off+uint64(n)]) {
				t.Fatalf("NoInline %v: read %d (%d bytes at %d) returned other bytes", noInline, i, n, off)
			}
			off += uint64(n)
		}
		for i, inReader := range b.whereReads() {
			want := !noInline && lengths[i] >= inlineReadMin
			if inReader != want {
				t.Errorf("NoInline %v: read %d of %d bytes ran on the reader: %v, want %v", noInline, i, lengths[i], inReader, want)
			}
		}
	}
}

// After a write that took longer than its budget, the writes that follow
// run on the workers, in parallel: a slow backend does not hold up the
// reading of the requests behind one.
func TestInlineWritesSlowBackend(t *testing.T) {
	b := &whereBackend{MemBackend: NewMemBackend(1 << 20), slow: 1, release: make(chan struct{})}
	s := newTestServer(t, &Export{Name: "d", Backend: b})
	c := rawSession(t, s, "d")
	sendReq(t, c, Request{Type: CmdWrite, Handle: 1, Length: 4096}, make([]byte, 4096))
	if rep := readRep(t, c); rep.Errno != 0 {
		t.Fatalf("slow write: %+v", rep)
	}
	b.mu.Lock()
	b.hold = true
	b.mu.Unlock()
	const n = 4
	sent := make(chan error, 1)
	go func() {
		for i := range n {
			b := make([]byte, requestHeaderSize+4096)
			(&Request{Type: CmdWrite, Handle: uint64(10 + i), Offset: uint64(i+1) * 4096, Length: 4096}).Encode(b)
			if _, err := c.Write(b); err != nil {
				sent <- err
				return
			}
		}
		sent <- nil
	}()
	deadline := time.Now().Add(5 * time.Second)
	for {
		b.mu.Lock()
		inside := b.inside
		b.mu.Unlock()
		if inside == n {
			break
		}
		if time.Now().After(deadline) {
			close(b.release)
			t.Fatalf("%d of %d held writes reached the backend after a slow one; want all at once (ran on the reader: %v)", inside, n, b.where())
		}
		time.Sleep(5 * time.Millisecond)
	}
	close(b.release)
	if err := <-sent; err != nil {
		t.Fatal(err)
	}
	for range n {
		if rep := readRep(t, c); rep.Errno != 0 {
			t.Fatalf("held write: %+v", rep)
		}
	}
	if w := b.where(); !w[0] || w[1] || w[2] || w[3] || w[4] {
		t.Errorf("ran on the reader: %v, want only the first (slow) write", w)
	}
}

func TestInlinePolicy(t *testing.T) {
	t0 := time.Now()
	w := func(typ uint16, flags uint16, length uint32, at time.Duration) work {
		return work{req: Request{Type: typ, Flags: flags, Length: length}, start: t0.Add(at)}
	}
	p := inlineRequests{base: inlineBase}
	for _, x := range []work{w(CmdWrite, 0, 1<<20, 0), w(CmdWrite, 0, 512, 0), w(CmdRead, 0, 1<<20, 0), w(CmdRead, 0, inlineReadMin, 0)} {
		if !p.ok(x) {
			t.Fatalf("%s of %d bytes on a fresh connection is not inline", CmdName(x.req.Type), x.req.Length)
		}
	}
	for _, x := range []work{w(CmdRead, 0, 4096, 0), w(CmdRead, 0, inlineReadMin-1, 0), w(CmdWrite, CmdFlagFUA, 4096, 0),
		w(CmdFlush, 0, 0, 0), w(CmdTrim, 0, 4096, 0), w(CmdWriteZeroes, 0, 1<<20, 0)} {
		if p.ok(x) {
			t.Errorf("%s flags %#x is inline", CmdName(x.req.Type), x.req.Flags)
		}
	}
	// 1 MiB at 1 GiB/s is about 1 ms on top of the base.
	mib := w(CmdWrite, 0, 1<<20, 0)
	p.took(mib, t0, t0.Add(inlineBase+900*time.Microsecond))
	if !p.ok(w(CmdWrite, 0, 4096, 2*time.Millisecond)) {
		t.Fatal("a write within its budget paused inline writes")
	}
	p.took(mib, t0, t0.Add(inlineBase+1100*time.Microsecond))
	if p.ok(w(CmdWrite, 0, 4096, 2*time.Millisecond)) {
		t.Fatal("a write over its budget did not pause inline writes")
	}
	if p.ok(w(CmdRead, 0, 1<<20, 2*time.Millisecond)) {
		t.Fatal("a slow write did not pause inline reads")
	}
	if !p.ok(w(CmdWrite, 0, 4096, inlineBase+1100*time.Microsecond+inlinePause+time.Millisecond)) {
		t.Fatal("inline writes did not resume after the pause")
	}
	// A read's budget is a write's: 1 MiB read in 1.6 ms pauses.
	p.took(w(CmdRead, 0, 1<<20, 0), t0, t0.Add(inlineBase+1100*time.Microsecond))
	if p.ok(w(CmdRead, 0, 1<<20, 2*time.Millisecond)) {
		t.Fatal("a read over its budget did not pause inline reads")
	}
	p = inlineRequests{off: true, base: inlineBase}
	if p.ok(w(CmdWrite, 0, 4096, 0)) || p.ok(w(CmdRead, 0, 1<<20, 0)) {
		t.Fatal("inline with NoInline")
	}
}
