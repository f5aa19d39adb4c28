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

package snapshot

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/internal/testenv/loopfs"
)

// pattern is a source of 64 MiB and 4 KiB with data at its start, in
// the middle, across a MiB boundary and just before a hole at its end.
var (
	patternSize = 64*mib + 4*kib
	pattern     = []span{
		{0, 1 * mib},
		{4 * mib, 2 * mib},
		{20*mib - 64*kib, 128 * kib},
		{40 * mib, 4 * kib},
		{63 * mib, 512 * kib},
	}
)

func TestCloneReflinkXFS(t *testing.T) {
	mnt := loopfs.Mount(t, "xfs", 512*mib)
	src, dst := filepath.Join(mnt, "vol.img"), filepath.Join(mnt, "snap.img")
	data := makeFile(t, src, patternSize, pattern, 1)

	res, err := Clone(context.Background(), src, dst)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%+v", res)
	if res.Method != Reflink {
		t.Fatalf("method %s, want %s", res.Method, Reflink)
	}
	if res.Size != patternSize || res.Copied != 0 {
		t.Errorf("size %d copied %d, want %d and 0", res.Size, res.Copied, patternSize)
	}
	if res.Allocated < data {
		t.Errorf("allocated %d, less than the %d bytes of data shared", res.Allocated, data)
	}
	sameContent(t, src, dst)
	if s, d := dataSpans(t, src), dataSpans(t, dst); !slices.Equal(s, d) {
		t.Fatalf("data ranges: source %v, snapshot %v", s, d)
	}
	if d := dataSpans(t, dst); !slices.Equal(d, pattern) {
		t.Errorf("snapshot data ranges %v, want %v", d, pattern)
	}

	// Copy on write: overwriting the source's shared blocks and filling
	// one of its holes leaves the snapshot as it was.
	before := loopfs.Checksum(t, dst)
	f, err := os.OpenFile(src, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	junk := make([]byte, mib)
	for i := range junk {
		junk[i] = 0xa5
	}
	for _, off := range []int64{0, 4*mib + 512*kib, 10 * mib} {
		if _, err := f.WriteAt(junk, off); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if after := loopfs.Checksum(t, dst); after != before {
		t.Fatal("the snapshot changed when the source was written")
	}
	if d := dataSpans(t, dst); !slices.Equal(d, pattern) {
		t.Errorf("snapshot data ranges after source writes %v, want %v", d, pattern)
	}
}

func TestCloneCopyExt4(t *testing.T) {
	mnt := loopfs.Mount(t, "ext4", 512*mib)
	src, dst := filepath.Join(mnt, "vol.img"), filepath.Join(mnt, "snap.img")
	data := makeFile(t, src, patternSize, pattern, 2)

	res, err := Clone(context.Background(), src, dst)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%+v", res)
	if res.Method != Copy {
		t.Fatalf("method %s, want %s", res.Method, Copy)
	}
	if res.Size != patternSize || res.Copied != data {
		t.Errorf("size %d copied %d, want %d and %d", res.Size, res.Copied, patternSize, data)
	}
	fi, err := os.Stat(dst)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Size() != patternSize {
		t.Errorf("snapshot size %d, want %d", fi.Size(), patternSize)
	}
	// Sparse: the blocks of data plus a little for the extent tree, far
	// from the 64 MiB of the file.
	if res.Allocated < data || res.Allocated > data+256*kib {
		t.Errorf("snapshot allocates %d bytes for %d bytes of data in a %d-byte file", res.Allocated, data, patternSize)
	}
	sameContent(t, src, dst)
	if d := dataSpans(t, dst); !slices.Equal(d, pattern) {
		t.Errorf("snapshot data ranges %v, want %v", d, pattern)
	}
}

// TestCloneTempDir runs on whatever filesystem holds the test's temporary
// directory, without root.
func TestCloneTempDir(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "vol.img")
	data := makeFile(t, src, patternSize, pattern, 3)
	for _, tc := range []struct {
		name string
		opts []Option
	}{
		{"default", nil},
		{"copy", []Option{WithoutReflink(), WithChunkSize(256 * kib)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dst := filepath.Join(dir, tc.name+".img")
			res, err := Clone(context.Background(), src, dst, tc.opts...)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%+v", res)
			if res.Method == Copy && res.Copied != data {
				t.Errorf("copied %d bytes, want %d", res.Copied, data)
			}
			sameContent(t, src, dst)
		})
	}
}

// export stands in for an NBD export: writes and trims go through it, and
// its quiesce holds them while the snapshot is made. It logs every change,
// so that the source at a flush point can be rebuilt afterwards, and
// records the ranges changed for WithChanges as the real export does: once
// the change is in the file, before a hold can begin.
type export struct {
	mu     sync.Mutex
	f      *os.File
	writes atomic.Int64
	log    []logged // every write, in order

	atFlush  int // writes in the log at the last Quiesce
	quiesced int // Quiesce calls
	resumed  int // resume calls

	tmu      sync.Mutex
	trackers map[*changes]struct{}
}

// logged is one write: n bytes made by fillWrite(seq) at off, or n
// zeroes punched at off for seq 0.
type logged struct {
	off, n int64
	seq    uint64
}

// fillWrite fills p with the content of write seq: seq stamped at the
// start, pseudo-random bytes after.
func fillWrite(p []byte, seq uint64) {
	rng := rand.NewChaCha8([32]byte{byte(seq), byte(seq >> 8), byte(seq >> 16), byte(seq >> 24), 0xfe})
	rng.Read(p)
	binary.LittleEndian.PutUint64(p, seq)
}

func (e *export) write(p []byte, off int64, seq uint64) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if _, err := e.f.WriteAt(p, off); err != nil {
		return err
	}
	e.changed(logged{off, int64(len(p)), seq})
	return nil
}

// trim punches n bytes at off, as the export does for a trim.
func (e *export) trim(off, n int64) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := unix.Fallocate(int(e.f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n); err != nil {
		return err
	}
	e.changed(logged{off, n, 0})
	return nil
}

// changed logs a change made to the file and records it in the trackers.
func (e *export) changed(l logged) {
	e.log = append(e.log, l)
	e.tmu.Lock()
	for c := range e.trackers {
		c.add(l.off, l.n)
	}
	e.tmu.Unlock()
	e.writes.Add(1)
}

// quiesce holds new writes (the mutex also waits for the one in flight)
// and syncs the source.
func (e *export) quiesce(t *testing.T) func(context.Context) (func(), error) {
	return func(context.Context) (func(), error) {
		e.mu.Lock()
		e.quiesced++
		if err := e.f.Sync(); err != nil {
			t.Errorf("sync: %v", err)
		}
		e.atFlush = len(e.log)
		return func() {
			e.resumed++
			e.mu.Unlock()
		}, nil
	}
}

// track is the export's WithChanges hook.
func (e *export) track() (take func() []Range, stop func()) {
	c := &changes{}
	e.tmu.Lock()
	if e.trackers == nil {
		e.trackers = make(map[*changes]struct{})
	}
	e.trackers[c] = struct{}{}
	e.tmu.Unlock()
	return c.take, func() {
		e.tmu.Lock()
		delete(e.trackers, c)
		e.tmu.Unlock()
	}
}

// changes records changed ranges in 64 KiB chunks, as the NBD export does.
type changes struct {
	mu     sync.Mutex
	chunks map[int64]bool
}

const changeChunk = 64 * kib

func (c *changes) add(off, n int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.chunks == nil {
		c.chunks = make(map[int64]bool)
	}
	for i := off / changeChunk; i <= (off+n-1)/changeChunk; i++ {
		c.chunks[i] = true
	}
}

func (c *changes) take() []Range {
	c.mu.Lock()
	chunks := slices.Sorted(maps.Keys(c.chunks))
	c.chunks = nil
	c.mu.Unlock()
	var rs []Range
	for _, i := range chunks {
		if n := len(rs); n > 0 && rs[n-1].Off+rs[n-1].Len == i*changeChunk {
			rs[n-1].Len += changeChunk
		} else {
			rs = append(rs, Range{i * changeChunk, changeChunk})
		}
	}
	return rs
}

// flushPoint rebuilds the source at the last Quiesce: orig with the writes
// logged until then applied in order.
func (e *export) flushPoint(orig []byte) []byte {
	e.mu.Lock()
	log := slices.Clone(e.log[:e.atFlush])
	e.mu.Unlock()
	img := slices.Clone(orig)
	for _, w := range log {
		if w.seq == 0 {
			clear(img[w.off : w.off+w.n])
		} else {
			fillWrite(img[w.off:w.off+w.n], w.seq)
		}
	}
	return img
}

// latencies summarises the latencies of requests.
type latencies struct {
	n        int
	p99, max time.Duration
}

func summarise(ds []time.Duration) latencies {
	if len(ds) == 0 {
		return latencies{}
	}
	slices.Sort(ds)
	return latencies{n: len(ds), p99: ds[(len(ds)*99)/100], max: ds[len(ds)-1]}
}

func (l latencies) String() string {
	return fmt.Sprintf("%d requests, p99 %v, max %v", l.n, l.p99.Round(time.Microsecond), l.max.Round(time.Microsecond))
}

// underWrites is one snapshot taken while a writer runs.
type underWrites struct {
	dir      string
	size     int64
	data     []span
	want     Method
	tracked  bool // WithChanges
	quiesces int  // Quiesce calls expected
	opts     []Option
	// short: a tracked copy holds writes for a small part of the Clone
	// (checked where the copy is long enough for the comparison to hold
	// on a busy machine).
	short bool
}

// underWritesReport is what one such snapshot measured.
type underWritesReport struct {
	res            Result
	before, during latencies
	flowed         int // changes acknowledged from the Clone's start to its last hold
}

// TestCloneUnderWrites takes snapshots while a writer changes the source;
// each must be the source at its flush point, byte for byte. A copy with
// change tracking must let writes flow while it copies, and on a big
// source hold them for a small part of the Clone; the copy held from
// start to end and the reflink are there to compare with. The latencies of
// the writer's requests before and during each snapshot are logged side
// by side, not checked.
func TestCloneUnderWrites(t *testing.T) {
	const big = 256 * mib
	bigData := []span{{0, 96 * mib}, {128 * mib, 64 * mib}, {224 * mib, 16 * mib}}
	var rows []string
	for _, tc := range []struct {
		name  string
		fs    string // a loop-mounted filesystem, or the test's temporary directory
		fsize int64
		uw    underWrites
	}{
		{"copy", "ext4", 1 << 30, underWrites{size: big, data: bigData, want: Copy, tracked: true, quiesces: 1, short: true}},
		{"copy-held", "ext4", 1 << 30, underWrites{size: big, data: bigData, want: Copy, quiesces: 1}},
		{"copy-tempdir", "", 0, underWrites{size: 32 * mib, data: []span{{0, 8 * mib}, {16 * mib, 4 * mib}}, want: Copy, tracked: true, quiesces: 1,
			opts: []Option{WithoutReflink(), WithChunkSize(512 * kib)}}},
		// WithChanges changes nothing to a reflink.
		{"reflink", "xfs", 512 * mib, underWrites{size: 32 * mib, data: []span{{0, 8 * mib}, {16 * mib, 4 * mib}}, want: Reflink, tracked: true, quiesces: 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.fs == "" {
				tc.uw.dir = t.TempDir()
			} else {
				tc.uw.dir = loopfs.Mount(t, tc.fs, tc.fsize)
			}
			r := testUnderWrites(t, tc.uw)
			rows = append(rows, fmt.Sprintf("%-12s %-7s %4d MiB copied (%3d MiB again)  held %-10v of %-10v  before: %-38s during: %s",
				tc.name, r.res.Method, r.res.Copied/mib, r.res.Recopied/mib, r.res.Held.Round(time.Microsecond), r.res.Duration.Round(time.Millisecond), r.before, r.during))
		})
	}
	t.Logf("snapshots under writes (latency of the writes and trims before the snapshot and during it):\n%s", strings.Join(rows, "\n"))
}

func testUnderWrites(t *testing.T, uw underWrites) underWritesReport {
	src, dst := filepath.Join(uw.dir, "vol.img"), filepath.Join(uw.dir, "snap.img")
	makeFile(t, src, uw.size, uw.data, 4)
	orig, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	dropCache(t, src)
	f, err := os.OpenFile(src, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	e := &export{f: f}

	// The writer: 4 to 64 KiB at random places, a write or now and then
	// a trim, with a pause of 100µs (at least) after each; the latency of
	// each is recorded with its start.
	type timed struct {
		start time.Time
		d     time.Duration
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	var times []timed
	go func() {
		rng := rand.New(rand.NewPCG(5, 6))
		buf := make([]byte, 64*kib)
		for seq := uint64(1); ctx.Err() == nil; seq++ {
			n := (1 + rng.Int64N(16)) * 4 * kib
			off := rng.Int64N((uw.size-n)/(4*kib)) * 4 * kib
			trim := rng.IntN(8) == 0
			if !trim {
				fillWrite(buf[:n], seq)
			}
			start := time.Now()
			var err error
			if trim {
				err = e.trim(off, n)
			} else {
				err = e.write(buf[:n], off, seq)
			}
			if err != nil {
				done <- err
				return
			}
			times = append(times, timed{start, time.Since(start)})
			time.Sleep(100 * time.Microsecond)
		}
		done <- nil
	}()
	stopped := false
	stopWriter := func() {
		if !stopped {
			stopped = true
			cancel()
			if err := <-done; err != nil {
				t.Errorf("writer: %v", err)
			}
		}
	}
	defer stopWriter()
	time.Sleep(300 * time.Millisecond)
	waitWrites(t, e, 50)

	opts := append(slices.Clone(uw.opts), WithQuiesce(e.quiesce(t)))
	if uw.tracked {
		opts = append(opts, WithChanges(e.track))
	}
	atStart := int(e.writes.Load())
	start := time.Now()
	res, err := Clone(context.Background(), src, dst, opts...)
	end := time.Now()
	if err != nil {
		t.Fatal(err)
	}
	// Writes flow again after the snapshot.
	waitWrites(t, e, e.writes.Load()+50)
	stopWriter()

	var before, during []time.Duration
	for _, w := range times {
		switch {
		case w.start.Before(start):
			before = append(before, w.d)
		case w.start.Before(end):
			during = append(during, w.d)
		}
	}
	e.mu.Lock()
	q, r, atFlush, total := e.quiesced, e.resumed, e.atFlush, len(e.log)
	e.mu.Unlock()
	rep := underWritesReport{res: res, before: summarise(before), during: summarise(during), flowed: atFlush - atStart}
	t.Logf("%+v", res)
	t.Logf("%d changes acknowledged during the Clone before its last hold; latency before: %v; during: %v", rep.flowed, rep.before, rep.during)

	if res.Method != uw.want {
		t.Fatalf("method %s, want %s", res.Method, uw.want)
	}
	if q != uw.quiesces || r != q {
		t.Errorf("quiesced %d times, resumed %d times, want %d each", q, r, uw.quiesces)
	}
	got, err := os.ReadFile(dst)
	if err != nil {
		t.Fatal(err)
	}
	if want := e.flushPoint(orig); !bytes.Equal(got, want) {
		i := 0
		for i < min(len(got), len(want)) && got[i] == want[i] {
			i++
		}
		t.Fatalf("the snapshot is not the source at the flush point: %d bytes, want %d, first difference at byte %d", len(got), len(want), i)
	}
	if total <= atFlush {
		t.Error("no write after the flush point: the writer was not running")
	}
	if uw.tracked && res.Method == Copy {
		// The copy ran while writes flowed and what they changed was
		// copied again.
		if rep.flowed < 5 {
			t.Errorf("only %d changes acknowledged from the start of the copy to its last hold", rep.flowed)
		}
		if res.Recopied == 0 {
			t.Error("nothing copied again though the source changed during the copy")
		}
	}
	// The hold was a small part of the Clone: the copy of the data was
	// not in it. (Held for the whole copy, it is most of the Clone, the
	// destination's sync the rest.)
	if uw.short && res.Held*4 > res.Duration {
		t.Errorf("writes held for %v of a %v Clone", res.Held, res.Duration)
	}
	return rep
}

func waitWrites(t *testing.T, e *export, n int64) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for e.writes.Load() < n {
		if time.Now().After(deadline) {
			t.Fatalf("only %d writes of %d after 30s", e.writes.Load(), n)
		}
		time.Sleep(time.Millisecond)
	}
}

// cancelAfter is a context whose Err turns to context.Canceled on its
// n-th call: a cancellation at a chosen check, mid-copy.
type cancelAfter struct {
	context.Context
	calls, n atomic.Int64
}

func (c *cancelAfter) Err() error {
	if c.calls.Add(1) >= c.n.Load() {
		return context.Canceled
	}
	return nil
}

func TestCloneErrors(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "vol.img")
	makeFile(t, src, 16*mib, []span{{0, 8 * mib}, {12 * mib, 4 * mib}}, 7)
	bg := context.Background()

	noLeftovers := func(t *testing.T) {
		t.Helper()
		if names := dirNames(t, dir); !slices.Equal(names, []string{"vol.img"}) {
			t.Errorf("directory holds %v, want only vol.img", names)
		}
	}

	t.Run("missing source", func(t *testing.T) {
		_, err := Clone(bg, filepath.Join(dir, "nope.img"), filepath.Join(dir, "snap.img"))
		if !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("error %v, want one for a missing file", err)
		}
		noLeftovers(t)
	})
	t.Run("missing destination directory", func(t *testing.T) {
		_, err := Clone(bg, src, filepath.Join(dir, "nodir", "snap.img"))
		if !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("error %v, want one for a missing directory", err)
		}
		noLeftovers(t)
	})
	t.Run("source is a directory", func(t *testing.T) {
		if _, err := Clone(bg, dir, filepath.Join(dir, "snap.img")); err == nil {
			t.Error("cloned a directory")
		}
		noLeftovers(t)
	})
	t.Run("existing destination", func(t *testing.T) {
		dst := filepath.Join(dir, "snap.img")
		if err := os.WriteFile(dst, []byte("keep"), 0o600); err != nil {
			t.Fatal(err)
		}
		defer os.Remove(dst)
		_, err := Clone(bg, src, dst)
		if !errors.Is(err, fs.ErrExist) {
			t.Errorf("error %v, want one for an existing file", err)
		}
		if b, err := os.ReadFile(dst); err != nil || string(b) != "keep" {
			t.Errorf("existing destination now %q (%v)", b, err)
		}
	})
	t.Run("source larger than the maximum", func(t *testing.T) {
		_, err := Clone(bg, src, filepath.Join(dir, "snap.img"), WithMaxSize(16*mib-1))
		var tl *TooLargeError
		if !errors.As(err, &tl) || tl.Size != 16*mib || tl.Max != 16*mib-1 {
			t.Errorf("error %v, want a TooLargeError of 16 MiB over 16 MiB - 1", err)
		}
		noLeftovers(t)
	})
	t.Run("source grown past the maximum before the flush point", func(t *testing.T) {
		// The source grows while writes are held for the point the copy
		// claims: the size taken there is the one checked, and nothing
		// appears at the destination.
		grown := filepath.Join(t.TempDir(), "grown.img")
		makeFile(t, grown, 4*mib, []span{{0, 4 * mib}}, 3)
		_, err := Clone(bg, grown, filepath.Join(dir, "snap.img"), WithoutReflink(), WithMaxSize(4*mib),
			WithQuiesce(func(context.Context) (func(), error) {
				return nil, os.Truncate(grown, 8*mib)
			}))
		var tl *TooLargeError
		if !errors.As(err, &tl) || tl.Size != 8*mib {
			t.Errorf("error %v, want a TooLargeError of 8 MiB", err)
		}
		noLeftovers(t)
	})
	t.Run("source at the maximum", func(t *testing.T) {
		dst := filepath.Join(dir, "snap.img")
		if res, err := Clone(bg, src, dst, WithMaxSize(16*mib)); err != nil || res.Size != 16*mib {
			t.Errorf("Clone at the maximum: %+v, %v", res, err)
		}
		os.Remove(dst)
	})
	t.Run("cancelled before", func(t *testing.T) {
		ctx, cancel := context.WithCancel(bg)
		cancel()
		if _, err := Clone(ctx, src, filepath.Join(dir, "snap.img")); !errors.Is(err, context.Canceled) {
			t.Errorf("error %v, want context.Canceled", err)
		}
		noLeftovers(t)
	})
	t.Run("cancelled mid-copy", func(t *testing.T) {
		// 12 MiB of data in 1 MiB chunks: a dozen checks; cancel at the
		// sixth, well into the copy.
		ctx := &cancelAfter{Context: bg}
		ctx.n.Store(6)
		var quiesced, resumed int
		_, err := Clone(ctx, src, filepath.Join(dir, "snap.img"), WithoutReflink(), WithChunkSize(mib),
			WithQuiesce(func(context.Context) (func(), error) {
				quiesced++
				return func() { resumed++ }, nil
			}))
		if !errors.Is(err, context.Canceled) {
			t.Errorf("error %v, want context.Canceled", err)
		}
		if ctx.calls.Load() != 6 {
			t.Errorf("context checked %d times, want 6", ctx.calls.Load())
		}
		if quiesced != 1 || resumed != 1 {
			t.Errorf("quiesced %d times, resumed %d times, want once each", quiesced, resumed)
		}
		noLeftovers(t)
	})
	t.Run("cancelled mid-copy with change tracking", func(t *testing.T) {
		// Cancelled while the data is copied with writes flowing: no hold
		// is taken, the tracking stops.
		ctx := &cancelAfter{Context: bg}
		ctx.n.Store(6)
		var quiesced, resumed, started, stopped int
		_, err := Clone(ctx, src, filepath.Join(dir, "snap.img"), WithoutReflink(), WithChunkSize(mib),
			WithQuiesce(func(context.Context) (func(), error) {
				quiesced++
				return func() { resumed++ }, nil
			}),
			WithChanges(func() (func() []Range, func()) {
				started++
				return func() []Range { return nil }, func() { stopped++ }
			}))
		if !errors.Is(err, context.Canceled) {
			t.Errorf("error %v, want context.Canceled", err)
		}
		if quiesced != 0 || resumed != 0 {
			t.Errorf("quiesced %d times, resumed %d times, want none", quiesced, resumed)
		}
		if started != 1 || stopped != 1 {
			t.Errorf("tracking started %d times, stopped %d times, want once each", started, stopped)
		}
		noLeftovers(t)
	})
}

// TestCloneTimes measures a snapshot of a 1 GiB volume with 512 MiB of
// data (1 MiB data, 1 MiB hole), by reflink on XFS and by copy on ext4,
// the source's pages dropped from the cache first. Nothing is asserted
// about the times.
func TestCloneTimes(t *testing.T) {
	if testing.Short() {
		t.Skip("skipping: writes 1.5 GiB")
	}
	const size = 1 << 30
	var data []span
	for off := int64(0); off < size; off += 2 * mib {
		data = append(data, span{off, mib})
	}
	for _, tc := range []struct {
		fs   string
		want Method
	}{
		{"xfs", Reflink},
		{"ext4", Copy},
	} {
		t.Run(tc.fs, func(t *testing.T) {
			mnt := loopfs.Mount(t, tc.fs, 3<<30)
			src, dst := filepath.Join(mnt, "vol.img"), filepath.Join(mnt, "snap.img")
			makeFile(t, src, size, data, 8)
			dropCache(t, src)
			var e export
			res, err := Clone(context.Background(), src, dst, WithQuiesce(func(context.Context) (func(), error) {
				e.mu.Lock()
				return e.mu.Unlock, nil
			}))
			if err != nil {
				t.Fatal(err)
			}
			if res.Method != tc.want {
				t.Fatalf("method %s, want %s", res.Method, tc.want)
			}
			t.Logf("%s on %s: 1 GiB, 512 MiB data: writes held %v, clone %v in all, %d bytes copied, %d bytes allocated",
				res.Method, tc.fs, res.Held, res.Duration, res.Copied, res.Allocated)
		})
	}
}
