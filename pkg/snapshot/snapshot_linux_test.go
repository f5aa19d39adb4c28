package snapshot

import (
	"context"
	"crypto/sha256"
	"errors"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
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
	mnt := mountFS(t, "xfs", 512*mib)
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
	before := checksum(t, dst)
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
	if after := checksum(t, dst); after != before {
		t.Fatal("the snapshot changed when the source was written")
	}
	if d := dataSpans(t, dst); !slices.Equal(d, pattern) {
		t.Errorf("snapshot data ranges after source writes %v, want %v", d, pattern)
	}
}

func TestCloneCopyExt4(t *testing.T) {
	mnt := mountFS(t, "ext4", 512*mib)
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

// export stands in for an NBD export: writes go through it, and its
// quiesce holds them while the snapshot is made.
type export struct {
	mu     sync.Mutex
	f      *os.File
	writes atomic.Int64

	sum      [sha256.Size]byte // the source's checksum at the flush point
	quiesced int               // Quiesce calls
	resumed  int               // resume calls
}

func (e *export) write(p []byte, off int64) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if _, err := e.f.WriteAt(p, off); err != nil {
		return err
	}
	e.writes.Add(1)
	return nil
}

// quiesce holds new writes (the mutex also waits for the one in flight),
// syncs the source and records what it holds.
func (e *export) quiesce(t *testing.T) func(context.Context) (func(), error) {
	return func(context.Context) (func(), error) {
		e.mu.Lock()
		e.quiesced++
		if err := e.f.Sync(); err != nil {
			t.Errorf("sync: %v", err)
		}
		e.sum = checksum(t, e.f.Name())
		return func() {
			e.resumed++
			e.mu.Unlock()
		}, nil
	}
}

func TestCloneUnderWrites(t *testing.T) {
	t.Run("copy", func(t *testing.T) {
		testUnderWrites(t, t.TempDir(), Copy, WithoutReflink(), WithChunkSize(512*kib))
	})
	t.Run("reflink", func(t *testing.T) {
		testUnderWrites(t, mountFS(t, "xfs", 512*mib), Reflink)
	})
}

func testUnderWrites(t *testing.T, dir string, want Method, opts ...Option) {
	const size = 32 * mib
	src, dst := filepath.Join(dir, "vol.img"), filepath.Join(dir, "snap.img")
	makeFile(t, src, size, []span{{0, 8 * mib}, {16 * mib, 4 * mib}}, 4)
	f, err := os.OpenFile(src, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	e := &export{f: f}

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		rng := rand.New(rand.NewPCG(5, 6))
		buf := make([]byte, 64*kib)
		for ctx.Err() == nil {
			n := (1 + rng.Int64N(16)) * 4 * kib
			off := rng.Int64N((size-n)/(4*kib)) * 4 * kib
			for i := range buf[:n] {
				buf[i] = byte(rng.Uint32())
			}
			if err := e.write(buf[:n], off); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("writer: %v", err)
		}
	}()
	waitWrites(t, e, 50)

	res, err := Clone(context.Background(), src, dst, append(opts, WithQuiesce(e.quiesce(t)))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%+v after %d writes", res, e.writes.Load())
	if res.Method != want {
		t.Fatalf("method %s, want %s", res.Method, want)
	}
	// Writes flow again after the snapshot.
	waitWrites(t, e, e.writes.Load()+50)
	e.mu.Lock()
	q, r, sum := e.quiesced, e.resumed, e.sum
	e.mu.Unlock()
	if q != 1 || r != 1 {
		t.Errorf("quiesced %d times, resumed %d times, want once each", q, r)
	}
	if got := checksum(t, dst); got != sum {
		t.Fatal("the snapshot is not the source at the flush point")
	}
	if checksum(t, src) == sum {
		t.Error("the source did not change after the snapshot: the writer was not running")
	}
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
			mnt := mountFS(t, tc.fs, 3<<30)
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
