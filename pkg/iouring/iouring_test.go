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

//go:build linux

package iouring

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"unsafe"
)

func newRing(t *testing.T, entries, flags uint32) *Ring {
	t.Helper()
	r, err := New(entries, flags)
	if errors.Is(err, syscall.ENOSYS) || errors.Is(err, syscall.EPERM) {
		t.Skipf("skipping: io_uring is not available here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

func TestLayout(t *testing.T) {
	if n := unsafe.Sizeof(SQE{}); n != 64 {
		t.Fatalf("SQE is %d bytes, want 64", n)
	}
	if n := unsafe.Sizeof(CQE{}); n != 16 {
		t.Fatalf("CQE is %d bytes, want 16", n)
	}
	if n := unsafe.Sizeof(params{}); n != 120 {
		t.Fatalf("io_uring_params is %d bytes, want 120", n)
	}
	if off := unsafe.Offsetof(SQE{}.Addr3); off+CmdSize != 128 {
		t.Fatalf("the command area starts at %d, want 48", off)
	}
}

// TestNopsWrapAround submits more NOPs than the ring has entries, in
// batches, so head and tail wrap; every completion comes back once with
// its user data.
func TestNopsWrapAround(t *testing.T) {
	for _, flags := range []uint32{0, SetupSQE128} {
		r := newRing(t, 8, flags)
		seen := map[uint64]bool{}
		next := uint64(1)
		for batch := 0; batch < 10; batch++ {
			for i := 0; i < 5; i++ {
				sqe, cmd, err := r.Next()
				if err != nil {
					t.Fatal(err)
				}
				if (flags&SetupSQE128 != 0) != (len(cmd) == CmdSize) {
					t.Fatalf("command area of %d bytes with flags %#x", len(cmd), flags)
				}
				sqe.Opcode, sqe.UserData = OpNop, next
				next++
			}
			if n, err := r.Submit(5); err != nil || n != 5 {
				t.Fatalf("submit: %d, %v", n, err)
			}
			for i := 0; i < 5; i++ {
				c, err := r.Wait()
				if err != nil {
					t.Fatal(err)
				}
				if c.Res != 0 || seen[c.UserData] || c.UserData == 0 || c.UserData >= next {
					t.Fatalf("completion %+v (seen before: %v)", c, seen[c.UserData])
				}
				seen[c.UserData] = true
			}
			if _, ok := r.Peek(); ok {
				t.Fatal("a completion left over")
			}
		}
		if len(seen) != 50 {
			t.Fatalf("%d completions, want 50", len(seen))
		}
	}
}

func TestFull(t *testing.T) {
	r := newRing(t, 4, 0)
	for i := 0; i < 4; i++ {
		if _, _, err := r.Next(); err != nil {
			t.Fatal(err)
		}
	}
	if _, _, err := r.Next(); !errors.Is(err, ErrFull) {
		t.Fatalf("fifth entry of four: %v, want ErrFull", err)
	}
}

// buffer is memory the kernel reads or writes after the submission
// returns, outside the Go heap (a stack could move meanwhile).
func buffer(t *testing.T, n int) []byte {
	t.Helper()
	b, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := syscall.Munmap(b); err != nil {
			t.Error(err)
		}
	})
	return b
}

// TestReadWrite writes and reads a file through the ring.
func TestReadWrite(t *testing.T) {
	r := newRing(t, 4, SetupSQE128)
	f, err := os.Create(filepath.Join(t.TempDir(), "f"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	want := buffer(t, 4096)
	copy(want, bytes.Repeat([]byte("ring"), 1024))
	sqe, _, _ := r.Next()
	sqe.Opcode, sqe.FD, sqe.Off = OpWrite, int32(f.Fd()), 4096
	sqe.Addr, sqe.Len, sqe.UserData = uint64(uintptr(unsafe.Pointer(&want[0]))), uint32(len(want)), 1
	c, err := r.Wait()
	if err != nil || c.Res != int32(len(want)) || c.UserData != 1 {
		t.Fatalf("write: %+v, %v", c, err)
	}
	got := buffer(t, len(want))
	sqe, _, _ = r.Next()
	sqe.Opcode, sqe.FD, sqe.Off = OpRead, int32(f.Fd()), 4096
	sqe.Addr, sqe.Len, sqe.UserData = uint64(uintptr(unsafe.Pointer(&got[0]))), uint32(len(got)), 2
	c, err = r.Wait()
	if err != nil || c.Res != int32(len(got)) || c.UserData != 2 {
		t.Fatalf("read: %+v, %v", c, err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("read back differs")
	}
	// A bad descriptor is the completion's error, not the submission's.
	sqe, _, _ = r.Next()
	sqe.Opcode, sqe.FD, sqe.Addr, sqe.Len, sqe.UserData = OpRead, 1<<20, uint64(uintptr(unsafe.Pointer(&got[0]))), 1, 3
	c, err = r.Wait()
	if err != nil || c.Res != -int32(syscall.EBADF) {
		t.Fatalf("read of a bad descriptor: %+v, %v", c, err)
	}
}
