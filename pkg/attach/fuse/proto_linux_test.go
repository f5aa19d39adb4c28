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

package fuse

import (
	"bytes"
	"encoding/binary"
	"errors"
	"log/slog"
	"os"
	"sync"
	"testing"

	"golang.org/x/sys/unix"
)

// req builds a request as the kernel sends it.
func req(op uint32, unique, node uint64, arg ...[]byte) []byte {
	b := make([]byte, inHeaderSize)
	for _, a := range arg {
		b = append(b, a...)
	}
	le.PutUint32(b[0:], uint32(len(b)))
	le.PutUint32(b[4:], op)
	le.PutUint64(b[8:], unique)
	le.PutUint64(b[16:], node)
	return b
}

func le32(v ...uint32) []byte {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		le.PutUint32(b[4*i:], x)
	}
	return b
}

func le64(v ...uint64) []byte {
	b := make([]byte, 8*len(v))
	for i, x := range v {
		le.PutUint64(b[8*i:], x)
	}
	return b
}

func readArg(fh, off uint64, size uint32) []byte {
	return append(append(le64(fh, off), le32(size, 0)...), make([]byte, 16)...)
}

func writeArg(off uint64, data []byte) []byte {
	a := append(append(le64(0, off), le32(uint32(len(data)), 0)...), make([]byte, 16)...)
	return append(a, data...)
}

func TestParseRequest(t *testing.T) {
	good := req(fuseGetattr, 7, rootNode, make([]byte, 16))
	r, err := parseRequest(good)
	if err != nil || r.hdr.Opcode != fuseGetattr || r.hdr.Unique != 7 || r.hdr.NodeID != rootNode || len(r.arg) != 16 {
		t.Fatalf("parse: %+v, %v", r, err)
	}
	withExt := req(fuseGetattr, 8, rootNode, make([]byte, 24))
	le.PutUint16(withExt[36:], 1) // 8 bytes of extensions
	if r, err := parseRequest(withExt); err != nil || len(r.arg) != 16 {
		t.Fatalf("extensions: %d bytes of arguments, %v", len(r.arg), err)
	}
	for name, b := range map[string][]byte{
		"short":       good[:inHeaderSize-1],
		"len too big": append(bytes.Clone(good[:4]), good[4:len(good)-1]...),
		"len small": func() []byte {
			b := bytes.Clone(good)
			le.PutUint32(b, inHeaderSize)
			return b
		}(),
		"ext too big": func() []byte {
			b := bytes.Clone(good)
			le.PutUint16(b[36:], 3)
			return b
		}(),
	} {
		if _, err := parseRequest(b); !errors.Is(err, errMalformed) {
			t.Errorf("%s: %v, want errMalformed", name, err)
		}
	}
}

func TestDecoders(t *testing.T) {
	w, err := decodeWrite(writeArg(4096, []byte("abc")))
	if err != nil || w.Offset != 4096 || string(w.Data) != "abc" {
		t.Fatalf("write: %+v, %v", w, err)
	}
	bad := writeArg(0, []byte("abc"))
	le.PutUint32(bad[16:], 4) // more than it carries
	if _, err := decodeWrite(bad); !errors.Is(err, errMalformed) {
		t.Errorf("write beyond its data: %v", err)
	}
	r, err := decodeRead(readArg(0, 1<<40, 1<<20))
	if err != nil || r.Offset != 1<<40 || r.Size != 1<<20 {
		t.Fatalf("read: %+v, %v", r, err)
	}
	sa := make([]byte, setattrInSize)
	le.PutUint32(sa, fattrSize)
	le.PutUint64(sa[16:], 123)
	if s, err := decodeSetattr(sa); err != nil || s.Valid != fattrSize || s.Size != 123 {
		t.Fatalf("setattr: %+v, %v", s, err)
	}
	fa := append(le64(0, 10, 20), le32(unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 0)...)
	if f, err := decodeFallocate(fa); err != nil || f.Offset != 10 || f.Length != 20 || f.Mode != unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE {
		t.Fatalf("fallocate: %+v, %v", f, err)
	}
	if n, err := decodeName([]byte("vol\x00junk")); err != nil || n != "vol" {
		t.Fatalf("name: %q, %v", n, err)
	}
	if _, err := decodeName([]byte("vol")); !errors.Is(err, errMalformed) {
		t.Errorf("name without NUL: %v", err)
	}
	if in, err := decodeInit(le32(7, 41, 1<<17, initAsyncRead|initMaxPages)); err != nil || in.Minor != 41 || in.Flags != initAsyncRead|initMaxPages || in.MaxReadahead != 1<<17 {
		t.Fatalf("init: %+v, %v", in, err)
	}
	for name, f := range map[string]func() error{
		"read":      func() error { _, err := decodeRead(make([]byte, readInSize-1)); return err },
		"write":     func() error { _, err := decodeWrite(make([]byte, writeInSize-1)); return err },
		"setattr":   func() error { _, err := decodeSetattr(make([]byte, setattrInSize-1)); return err },
		"open":      func() error { _, err := decodeOpen(make([]byte, openInSize-1)); return err },
		"fallocate": func() error { _, err := decodeFallocate(make([]byte, fallocateInSize-1)); return err },
		"init":      func() error { _, err := decodeInit(make([]byte, 7)); return err },
	} {
		if err := f(); !errors.Is(err, errMalformed) {
			t.Errorf("short %s: %v", name, err)
		}
	}
}

func TestEncoders(t *testing.T) {
	b := encodeInitOut(initParams{Minor: 36, Flags: initMaxPages, MaxReadahead: 4096, MaxWrite: 1 << 20, MaxBackground: 32})
	if len(b) != initOutSize || le.Uint32(b) != 7 || le.Uint32(b[4:]) != 36 || le.Uint32(b[12:]) != initMaxPages ||
		le.Uint16(b[16:]) != 32 || le.Uint16(b[18:]) != 24 || le.Uint32(b[20:]) != 1<<20 || le.Uint16(b[28:]) != 256 {
		t.Fatalf("init out % x", b)
	}
	a := attr{Ino: fileNode, Size: 1 << 30, Blocks: 1 << 21, Time: 5, Mode: unix.S_IFREG | 0o600, Nlink: 1, Blksize: 4096}
	e := encodeEntryOut(a, attrTTL)
	if len(e) != entryOutSize || le.Uint64(e) != fileNode || le.Uint64(e[16:]) != attrTTL || le.Uint64(e[40+8:]) != 1<<30 ||
		le.Uint32(e[40+60:]) != unix.S_IFREG|0o600 || le.Uint64(e[40+32:]) != 5 || le.Uint32(e[40+80:]) != 4096 {
		t.Fatalf("entry out % x", e)
	}
	if o := encodeAttrOut(a, 9); len(o) != attrOutSize || le.Uint64(o) != 9 || le.Uint64(o[16:]) != fileNode {
		t.Fatalf("attr out % x", o)
	}
	if o := encodeOpenOut(fopenDirectIO); len(o) != openOutSize || le.Uint32(o[8:]) != fopenDirectIO {
		t.Fatalf("open out % x", o)
	}
	s := encodeStatfsOut(100, 4096)
	if len(s) != statfsOutSize || le.Uint64(s) != 100 || le.Uint32(s[40:]) != 4096 || le.Uint32(s[44:]) != 255 {
		t.Fatalf("statfs out % x", s)
	}
	var h [outHeaderSize]byte
	putOutHeader(h[:], 16, int32(unix.ENOENT), 42)
	if le.Uint32(h[:]) != 16 || int32(le.Uint32(h[4:])) != -int32(unix.ENOENT) || le.Uint64(h[8:]) != 42 {
		t.Fatalf("out header % x", h)
	}
	n := encodeNotifyInvalInode(fileNode, -1, 0)
	if len(n) != 40 || le.Uint32(n[4:]) != notifyInvalInode || le.Uint64(n[8:]) != 0 || int64(le.Uint64(n[24:])) != -1 {
		t.Fatalf("notify % x", n)
	}

	ents := []dirent{{1, direntTypeDir, "."}, {1, direntTypeDir, ".."}, {2, direntTypeReg, "volume"}}
	all := encodeDirents(ents, 0, 4096)
	if len(all) != 3*32 {
		t.Fatalf("dirents: %d bytes", len(all))
	}
	if le.Uint64(all[64+8:]) != 3 || le.Uint32(all[64+16:]) != 6 || string(all[64+24:64+30]) != "volume" {
		t.Fatalf("third dirent % x", all[64:])
	}
	if got := encodeDirents(ents, 1, 40); len(got) != 32 || le.Uint64(got[8:]) != 2 {
		t.Fatalf("from 1 in 40 bytes: % x", got)
	}
	if got := encodeDirents(ents, 3, 4096); len(got) != 0 {
		t.Fatalf("past the end: % x", got)
	}
}

// boundedIO is a blockIO that fails the test on any access outside the
// export.
type boundedIO struct {
	t    testing.TB
	size int64
	mu   sync.Mutex
	data []byte
}

func (b *boundedIO) check(op string, off int64, n int) {
	if off < 0 || int64(n) > b.size || off > b.size-int64(n) {
		b.t.Fatalf("%s of %d bytes at %d: outside the export of %d bytes", op, n, off, b.size)
	}
}

func (b *boundedIO) ReadAt(p []byte, off int64) (int, error) {
	b.check("read", off, len(p))
	b.mu.Lock()
	defer b.mu.Unlock()
	return copy(p, b.data[off:]), nil
}

func (b *boundedIO) WriteAt(p []byte, off int64) (int, error) {
	b.check("write", off, len(p))
	b.mu.Lock()
	defer b.mu.Unlock()
	return copy(b.data[off:], p), nil
}

func (b *boundedIO) Flush() error { return nil }

func (b *boundedIO) WriteZeroes(off, length int64, noHole bool) error {
	b.check("write-zeroes", off, int(length))
	return nil
}

// fuzzServer is a server whose replies go to /dev/null, over an export
// of 1 MiB + 3 bytes.
func fuzzServer(t testing.TB) (*fuseServer, []byte) {
	null, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { null.Close() })
	const size = 1<<20 + 3
	bio := &boundedIO{t: t, size: size, data: make([]byte, size)}
	f := &exportFile{bio: bio, canZero: true, log: slog.Default()}
	f.size.Store(size)
	const maxWrite = 128 << 10
	s := &fuseServer{fd: int(null.Fd()), params: initParams{MaxWrite: maxWrite}, file: f, name: "vol",
		log: slog.New(slog.DiscardHandler), gone: make(chan struct{})}
	s.ents = []dirent{{rootNode, direntTypeDir, "."}, {rootNode, direntTypeDir, ".."}, {fileNode, direntTypeReg, "vol"}}
	return s, make([]byte, inHeaderSize+writeInSize+maxWrite)
}

// FuzzServe feeds the server arbitrary requests: none may crash it or
// reach the export outside its bounds.
func FuzzServe(f *testing.F) {
	f.Add(req(fuseLookup, 1, rootNode, []byte("vol\x00")))
	f.Add(req(fuseGetattr, 2, fileNode, make([]byte, 16)))
	f.Add(req(fuseRead, 3, fileNode, readArg(0, 1<<20-5, 4096)))
	f.Add(req(fuseRead, 4, fileNode, readArg(0, 0, 128<<10)))
	f.Add(req(fuseWrite, 5, fileNode, writeArg(1<<20, []byte("abcdef"))))
	f.Add(req(fuseWrite, 6, fileNode, writeArg(1<<63+5, []byte("x"))))
	f.Add(req(fuseFallocate, 7, fileNode, append(le64(0, 1<<20, 1<<62), le32(unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 0)...)))
	f.Add(req(fuseFallocate, 8, fileNode, append(le64(0, ^uint64(0)-1, 10), le32(unix.FALLOC_FL_ZERO_RANGE, 0)...)))
	f.Add(req(fuseReaddir, 9, rootNode, readArg(0, 1, 4096)))
	f.Add(req(fuseSetattr, 10, fileNode, make([]byte, setattrInSize)))
	f.Add(req(fuseOpen, 11, fileNode, le32(unix.O_RDWR, 0)))
	f.Add(req(fuseStatfs, 12, rootNode))
	f.Add(req(fuseBatchForget, 13, 0, le32(1, 0), le64(fileNode, 1)))
	f.Add(req(99, 14, fileNode))
	f.Fuzz(func(t *testing.T, b []byte) {
		s, buf := fuzzServer(t)
		n := copy(buf, b)
		if len(b) >= 4 && n >= 4 {
			// Mostly consistent lengths, so that the fuzzer gets past
			// the header check.
			if b[0]&1 == 0 {
				binary.LittleEndian.PutUint32(buf, uint32(n))
			}
		}
		s.serve(buf, n)
	})
}
