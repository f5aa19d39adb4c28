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
	"encoding/binary"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"slices"
	"testing"

	"golang.org/x/sys/unix"
)

const (
	kib = int64(1) << 10
	mib = int64(1) << 20
)

// span is a byte range [off, off+len).
type span struct{ off, len int64 }

// makeFile creates path with the given size, random data in the given
// spans and holes elsewhere, synced. It returns the bytes of data.
func makeFile(t *testing.T, path string, size int64, data []span, seed uint64) int64 {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	rng := rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8)})
	buf := make([]byte, mib)
	var total int64
	for _, s := range data {
		for pos := s.off; pos < s.off+s.len; {
			n := min(int64(len(buf)), s.off+s.len-pos)
			rng.Read(buf[:n])
			// Stamp the offset, so that a block in the wrong place shows.
			if n >= 8 {
				binary.LittleEndian.PutUint64(buf, uint64(pos))
			}
			if _, err := f.WriteAt(buf[:n], pos); err != nil {
				t.Fatal(err)
			}
			pos += n
			total += n
		}
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	return total
}

// dataSpans lists path's data ranges as SEEK_DATA/SEEK_HOLE see them.
func dataSpans(t *testing.T, path string) []span {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	var spans []span
	for off := int64(0); off < fi.Size(); {
		start, err := unix.Seek(int(f.Fd()), off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break
		}
		if err != nil {
			t.Fatalf("SEEK_DATA %s at %d: %v", path, off, err)
		}
		end, err := unix.Seek(int(f.Fd()), start, unix.SEEK_HOLE)
		if err != nil {
			t.Fatalf("SEEK_HOLE %s at %d: %v", path, start, err)
		}
		spans = append(spans, span{start, end - start})
		off = end
	}
	return spans
}

// sameContent fails the test at the first byte where a and b differ.
func sameContent(t *testing.T, a, b string) {
	t.Helper()
	fa, err := os.Open(a)
	if err != nil {
		t.Fatal(err)
	}
	defer fa.Close()
	fb, err := os.Open(b)
	if err != nil {
		t.Fatal(err)
	}
	defer fb.Close()
	ba, bb := make([]byte, mib), make([]byte, mib)
	for off := int64(0); ; {
		na, erra := io.ReadFull(fa, ba)
		nb, errb := io.ReadFull(fb, bb)
		if !bytes.Equal(ba[:na], bb[:nb]) {
			i := 0
			for i < min(na, nb) && ba[i] == bb[i] {
				i++
			}
			t.Fatalf("%s and %s differ at byte %d", a, b, off+int64(i))
		}
		if erra != nil || errb != nil {
			if (erra == nil) != (errb == nil) {
				t.Fatalf("%s: %v, %s: %v", a, erra, b, errb)
			}
			return
		}
		off += int64(na)
	}
}

// dirNames lists a directory, sorted.
func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	es, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range es {
		names = append(names, e.Name())
	}
	slices.Sort(names)
	return names
}

// dropCache asks the kernel to forget path's cached pages (it is synced),
// so that a measurement reads from the disk.
func dropCache(t *testing.T, path string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		t.Logf("fadvise DONTNEED %s: %v", path, err)
	}
}
