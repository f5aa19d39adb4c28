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
	"context"
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/internal/testenv/loopfs"
)

// TestFiemapLayout: the structs passed to FS_IOC_FIEMAP have the kernel's
// layout (struct fiemap is 32 bytes, struct fiemap_extent 56).
func TestFiemapLayout(t *testing.T) {
	var m fiemap
	var e fiemapExtent
	if off := unsafe.Offsetof(m.extents); off != 32 {
		t.Errorf("the extents start at byte %d of fiemap, want 32", off)
	}
	if n := unsafe.Sizeof(e); n != 56 {
		t.Errorf("fiemapExtent is %d bytes, want 56", n)
	}
	if off := unsafe.Offsetof(e.length); off != 16 {
		t.Errorf("fe_length at byte %d of fiemap_extent, want 16", off)
	}
	if off := unsafe.Offsetof(e.flags); off != 40 {
		t.Errorf("fe_flags at byte %d of fiemap_extent, want 40", off)
	}
}

// usage is Usage that fails the test on error.
func usage(t *testing.T, path string) Space {
	t.Helper()
	s, err := Usage(path)
	if err != nil {
		t.Fatalf("Usage(%s): %v", path, err)
	}
	return s
}

// overwrite writes n bytes of a fixed pattern at off in path and syncs.
func overwrite(t *testing.T, path string, off, n int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, n)
	for i := range buf {
		buf[i] = byte(i*13 + 7)
	}
	if _, err := f.WriteAt(buf, off); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
}

// TestUsageReflinkXFS: a file and its reflink share all their data; an
// overwrite of 1 MiB of the source takes 1 MiB out of what both share and
// leaves the source's allocation as it was.
func TestUsageReflinkXFS(t *testing.T) {
	mnt := loopfs.Mount(t, "xfs", 512*mib)
	src, dst := filepath.Join(mnt, "vol.img"), filepath.Join(mnt, "snap.img")
	data := makeFile(t, src, patternSize, pattern, 3)

	alone := usage(t, src)
	t.Logf("source alone: %+v (%d bytes of data)", alone, data)
	if alone.Allocated < data || alone.Allocated > data+256*kib {
		t.Errorf("source allocates %d bytes for %d bytes of data", alone.Allocated, data)
	}
	if alone.Shared != 0 {
		t.Errorf("source shares %d bytes before any clone", alone.Shared)
	}

	res, err := Clone(context.Background(), src, dst)
	if err != nil {
		t.Fatal(err)
	}
	if res.Method != Reflink {
		t.Fatalf("method %s, want %s", res.Method, Reflink)
	}
	s, d := usage(t, src), usage(t, dst)
	t.Logf("after the reflink: source %+v, snapshot %+v", s, d)
	if s.Shared <= 0 || s.Shared != alone.Allocated || s.Allocated != alone.Allocated {
		t.Errorf("source after the reflink: %+v, want all its %d allocated bytes shared", s, alone.Allocated)
	}
	if d.Shared <= 0 || d.Shared != alone.Allocated || d.Allocated != alone.Allocated {
		t.Errorf("snapshot: %+v, want the source's %d allocated bytes, all shared", d, alone.Allocated)
	}

	// Inside the data at 4 MiB: 1 MiB that the source now holds alone.
	overwrite(t, src, 4*mib, mib)
	s2, d2 := usage(t, src), usage(t, dst)
	t.Logf("after overwriting 1 MiB of the source: source %+v, snapshot %+v", s2, d2)
	if drop := s.Shared - s2.Shared; drop < mib-64*kib || drop > mib+64*kib {
		t.Errorf("source shares %d bytes, then %d after a 1 MiB overwrite (drop %d, want ~%d)", s.Shared, s2.Shared, drop, mib)
	}
	if diff := s2.Allocated - s.Allocated; diff < -64*kib || diff > 64*kib {
		t.Errorf("source allocates %d bytes, then %d after overwriting allocated data", s.Allocated, s2.Allocated)
	}
	if d2.Shared != s2.Shared || d2.Allocated != d.Allocated {
		t.Errorf("snapshot after the source's overwrite: %+v, want %d shared and %d allocated", d2, s2.Shared, d.Allocated)
	}
}

// TestUsageSparseXFS: holes count for nothing, allocated or shared, and a
// file of more extents than one FIEMAP call maps is counted to its end.
func TestUsageSparseXFS(t *testing.T) {
	mnt := loopfs.Mount(t, "xfs", 512*mib)
	ctx := context.Background()

	// All hole: 1 GiB of size, nothing on disk.
	empty := filepath.Join(mnt, "empty.img")
	makeFile(t, empty, 1<<30, nil, 4)
	if _, err := Clone(ctx, empty, empty+".snap"); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{empty, empty + ".snap"} {
		if u := usage(t, p); u.Allocated != 0 || u.Shared != 0 {
			t.Errorf("%s, all hole: %+v, want nothing", filepath.Base(p), u)
		}
	}

	// 1 MiB of data in a 256 MiB file.
	thin := filepath.Join(mnt, "thin.img")
	data := makeFile(t, thin, 256*mib, []span{{100 * mib, mib}}, 5)
	if _, err := Clone(ctx, thin, thin+".snap"); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{thin, thin + ".snap"} {
		if u := usage(t, p); u.Shared != data || u.Allocated != data {
			t.Errorf("%s, %d bytes of data in %d: %+v, want %d allocated and shared", filepath.Base(p), data, 256*mib, u, data)
		}
	}

	// 600 extents of 4 KiB, a hole after each: three FIEMAP batches.
	var spans []span
	for i := range int64(600) {
		spans = append(spans, span{i * 8 * kib, 4 * kib})
	}
	many := filepath.Join(mnt, "many.img")
	data = makeFile(t, many, 600*8*kib, spans, 6)
	if n := len(dataSpans(t, many)); n != len(spans) {
		t.Fatalf("%d data ranges, want %d", n, len(spans))
	}
	if _, err := Clone(ctx, many, many+".snap"); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{many, many + ".snap"} {
		u := usage(t, p)
		t.Logf("%s: %+v (%d bytes of data)", filepath.Base(p), u, data)
		// Allocated also counts the extent tree's own blocks, not shared.
		if u.Shared != data || u.Allocated < data || u.Allocated > data+256*kib {
			t.Errorf("%s, %d extents of 4 KiB: %+v, want %d shared", filepath.Base(p), len(spans), u, data)
		}
	}
}

// TestUsageCopyExt4: a copy shares nothing with its source.
func TestUsageCopyExt4(t *testing.T) {
	mnt := loopfs.Mount(t, "ext4", 512*mib)
	src, dst := filepath.Join(mnt, "vol.img"), filepath.Join(mnt, "snap.img")
	data := makeFile(t, src, patternSize, pattern, 7)
	res, err := Clone(context.Background(), src, dst)
	if err != nil {
		t.Fatal(err)
	}
	if res.Method != Copy {
		t.Fatalf("method %s, want %s", res.Method, Copy)
	}
	for _, p := range []string{src, dst} {
		u := usage(t, p)
		t.Logf("%s: %+v (%d bytes of data)", filepath.Base(p), u, data)
		if u.Shared != 0 || u.Allocated < data || u.Allocated > data+256*kib {
			t.Errorf("%s: %+v, want %d bytes allocated and none shared", filepath.Base(p), u, data)
		}
	}
}

// TestUsageNoFiemap: on a filesystem that cannot map extents (tmpfs), a
// file's usage is its allocation and no sharing, not an error.
func TestUsageNoFiemap(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skipf("skipping: mounting a tmpfs needs root (euid %d)", os.Geteuid())
	}
	if _, err := exec.LookPath("mount"); err != nil {
		t.Skipf("skipping: mount not found: %v", err)
	}
	mnt := t.TempDir()
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", mnt).CombinedOutput(); err != nil {
		t.Skipf("skipping: mount -t tmpfs: %v: %s", err, out)
	}
	t.Cleanup(func() {
		if out, err := exec.Command("umount", mnt).CombinedOutput(); err != nil {
			t.Errorf("cleanup: umount %s: %v: %s", mnt, err, out)
		}
	})
	p := filepath.Join(mnt, "vol.img")
	data := makeFile(t, p, 16*mib, []span{{mib, 2 * mib}}, 8)

	// The case under test: the ioctl itself is refused here.
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	m := fiemap{length: ^uint64(0), extentCount: fiemapBatch}
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), fsIocFiemap, uintptr(unsafe.Pointer(&m)))
	f.Close()
	if errno == 0 {
		t.Skip("skipping: this kernel's tmpfs maps extents")
	}
	t.Logf("FS_IOC_FIEMAP on tmpfs: %v", errno)

	u := usage(t, p)
	if u.Shared != 0 || u.Allocated < data || u.Allocated > data+64*kib {
		t.Errorf("tmpfs file with %d bytes of data: %+v, want them allocated and none shared", data, u)
	}
}

// TestUsageMissing: a file that is not there is an error that says so.
func TestUsageMissing(t *testing.T) {
	_, err := Usage(filepath.Join(t.TempDir(), "nothing.img"))
	if !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("Usage of a missing file: %v, want fs.ErrNotExist", err)
	}
}
