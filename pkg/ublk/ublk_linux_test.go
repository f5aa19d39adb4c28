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

package ublk

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The tests below need the ublk driver: TestUblkInVM (vm_test.go) boots a
// kernel that has it and runs them there.

func requireUblk(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("skipping: needs root")
	}
	if err := Available(); err != nil {
		t.Skipf("skipping: %v (TestUblkInVM runs this in a VM whose kernel has ublk)", err)
	}
}

// memHandler is a device in memory that counts what it is asked.
type memHandler struct {
	mu                       sync.Mutex
	data                     []byte
	flushes, trims, zeroes   atomic.Int64
	fuaWrites, noUnmapZeroes atomic.Int64
}

func (m *memHandler) ReadAt(p []byte, off int64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if off < 0 || off+int64(len(p)) > int64(len(m.data)) {
		return io.ErrUnexpectedEOF
	}
	copy(p, m.data[off:])
	return nil
}

func (m *memHandler) WriteAt(p []byte, off int64, fua bool) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if off < 0 || off+int64(len(p)) > int64(len(m.data)) {
		return io.ErrShortWrite
	}
	copy(m.data[off:], p)
	if fua {
		m.fuaWrites.Add(1)
	}
	return nil
}

func (m *memHandler) Flush() error { m.flushes.Add(1); return nil }

func (m *memHandler) Trim(off, n int64) error {
	m.trims.Add(1)
	return m.zero(off, n)
}

func (m *memHandler) WriteZeroes(off, n int64, noUnmap bool) error {
	m.zeroes.Add(1)
	if noUnmap {
		m.noUnmapZeroes.Add(1)
	}
	return m.zero(off, n)
}

func (m *memHandler) zero(off, n int64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if off < 0 || off+n > int64(len(m.data)) {
		return io.ErrShortWrite
	}
	clear(m.data[off : off+n])
	return nil
}

func openControl(t *testing.T) *Control {
	t.Helper()
	c, err := OpenControl()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// alignedBuf is page-aligned memory for O_DIRECT.
func alignedBuf(t *testing.T, n int) []byte {
	t.Helper()
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := unix.Munmap(b); err != nil {
			t.Error(err)
		}
	})
	return b
}

func ioctlRange(f *os.File, req uint, off, n uint64) error {
	r := [2]uint64{off, n}
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), uintptr(req), uintptr(unsafe.Pointer(&r[0])))
	if errno != 0 {
		return errno
	}
	return nil
}

// TestDeviceIO: reads and writes through /dev/ublkbN reach the handler
// byte for byte; fsync is a flush, BLKDISCARD a trim, BLKZEROOUT a
// write-zeroes; Delete removes the block device.
func TestDeviceIO(t *testing.T) {
	requireUblk(t)
	ctrl := openControl(t)
	if f, err := ctrl.Features(); err == nil {
		t.Logf("driver features %#x", f)
	}
	const size = 64 << 20
	h := &memHandler{data: make([]byte, size)}
	d, err := Create(context.Background(), ctrl, Config{Size: size, Queues: 2, Depth: 32, MaxIO: 256 << 10, Discard: true, WriteZeroes: true}, h)
	if err != nil {
		t.Fatal(err)
	}
	deleted := false
	t.Cleanup(func() {
		if !deleted {
			if err := d.Delete(); err != nil {
				t.Logf("cleanup: delete device %d: %v", d.ID, err)
			}
		}
	})
	if st, err := ctrl.State(d.ID); err != nil || st != StateLive {
		t.Fatalf("state after create: %d, %v", st, err)
	}
	f, err := os.OpenFile(d.BlockPath(), os.O_RDWR|unix.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	var bsize uint64
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.BLKGETSIZE64, uintptr(unsafe.Pointer(&bsize))); errno != 0 || bsize != size {
		t.Fatalf("device size %d (%v), want %d", bsize, errno, size)
	}
	want := alignedBuf(t, 8<<20)
	rand.Read(want)
	if _, err := f.WriteAt(want, 1<<20); err != nil {
		t.Fatalf("write: %v", err)
	}
	if !bytes.Equal(h.data[1<<20:1<<20+len(want)], want) {
		t.Fatal("the handler holds other bytes than were written")
	}
	got := alignedBuf(t, len(want))
	if _, err := f.ReadAt(got, 1<<20); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("read back: %v (equal: %v)", err, bytes.Equal(got, want))
	}
	if err := f.Sync(); err != nil || h.flushes.Load() == 0 {
		t.Fatalf("fsync: %v, %d flushes", err, h.flushes.Load())
	}
	if err := ioctlRange(f, unix.BLKDISCARD, 1<<20, 1<<20); err != nil || h.trims.Load() == 0 {
		t.Fatalf("BLKDISCARD: %v, %d trims", err, h.trims.Load())
	}
	if err := ioctlRange(f, unix.BLKZEROOUT, 4<<20, 1<<20); err != nil || h.zeroes.Load() == 0 {
		t.Fatalf("BLKZEROOUT: %v, %d write-zeroes", err, h.zeroes.Load())
	}
	if _, err := f.ReadAt(got[:6<<20], 1<<20); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got[:1<<20], make([]byte, 1<<20)) || !bytes.Equal(got[3<<20:4<<20], make([]byte, 1<<20)) ||
		!bytes.Equal(got[1<<20:3<<20], want[1<<20:3<<20]) {
		t.Fatal("discarded or zeroed ranges do not read as zeroes, or their neighbours changed")
	}
	f.Close()
	deleted = true
	if err := d.Delete(); err != nil {
		t.Fatalf("delete: %v", err)
	}
	if _, err := os.Stat(d.BlockPath()); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("%s after delete: %v", d.BlockPath(), err)
	}
	select {
	case <-d.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("queues still serving after delete")
	}
}

// keeper is a memHandler that keeps the buffers of large writes, as a
// session does, remembering what each held when it took it.
type keeper struct {
	*memHandler
	mu      sync.Mutex
	kept    []*[]byte
	at      [][]byte // what each kept buffer held when it was taken
	buffers atomic.Int64
}

func (k *keeper) Buffer(n int) *[]byte {
	k.buffers.Add(1)
	b := make([]byte, n)
	return &b
}

func (k *keeper) KeepWrite(buf *[]byte, n int, off int64, fua bool) error {
	k.mu.Lock()
	k.kept = append(k.kept, buf)
	k.at = append(k.at, bytes.Clone(*buf))
	k.mu.Unlock()
	return k.WriteAt((*buf)[:n], off, fua)
}

// openDevice creates a device served by h, deleted when the test ends,
// and opens its block device for direct I/O.
func openDevice(t *testing.T, ctrl *Control, cfg Config, h Handler) *os.File {
	t.Helper()
	d, err := Create(context.Background(), ctrl, cfg, h)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := d.Delete(); err != nil {
			t.Logf("cleanup: delete device %d: %v", d.ID, err)
		}
	})
	f, err := os.OpenFile(d.BlockPath(), os.O_RDWR|unix.O_DIRECT, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// TestKeeperBuffers: with a Keeper, every write that fills half of the
// request buffer hands that buffer over, smaller ones are copied; the
// queue never touches a buffer it handed over (the next requests of its
// tag land in a new one), and every byte reads back.
func TestKeeperBuffers(t *testing.T) {
	requireUblk(t)
	ctrl := openControl(t)
	const size, maxIO = 32 << 20, 256 << 10
	k := &keeper{memHandler: &memHandler{data: make([]byte, size)}}
	f := openDevice(t, ctrl, Config{Size: size, Queues: 1, Depth: 8, MaxIO: maxIO}, k)
	want := alignedBuf(t, 16<<20)
	rand.Read(want)
	// Large writes (kept), then small ones over part of them (copied),
	// then large ones again: those land in the tags' new buffers.
	if _, err := f.WriteAt(want[:8<<20], 0); err != nil {
		t.Fatal(err)
	}
	for off := 0; off < 1<<20; off += 16 << 10 {
		rand.Read(want[off : off+16<<10])
		if _, err := f.WriteAt(want[off:off+16<<10], int64(off)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := f.WriteAt(want[8<<20:], 8<<20); err != nil {
		t.Fatal(err)
	}
	got := alignedBuf(t, len(want))
	if _, err := f.ReadAt(got, 0); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("read back: %v (equal: %v)", err, bytes.Equal(got, want))
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if len(k.kept) < (16<<20)/maxIO {
		t.Fatalf("%d buffers kept for %d large writes", len(k.kept), (16<<20)/maxIO)
	}
	if b := k.buffers.Load(); b != int64(8+len(k.kept)) {
		t.Fatalf("%d buffers asked for: want one per tag (8) and one per kept write (%d)", b, len(k.kept))
	}
	for i, b := range k.kept {
		if !bytes.Equal(*b, k.at[i]) {
			t.Fatalf("kept buffer %d changed after the queue handed it over", i)
		}
	}
}

// starter is a keeper that also starts requests, completing them later
// from goroutines of its own, and declines every third one (by offset), which
// the queue then serves through the Handler.
type starter struct {
	*keeper
	started, declined, pushes atomic.Int64
	mu                        sync.Mutex
	pending                   []func()
}

func (s *starter) StartIO(write bool, p []byte, kept *[]byte, off int64, fua bool, done func(error)) bool {
	if (off/4096)%3 == 0 {
		s.declined.Add(1)
		return false
	}
	s.started.Add(1)
	s.mu.Lock()
	s.pending = append(s.pending, func() {
		var err error
		switch {
		case !write:
			err = s.ReadAt(p, off)
		case kept != nil:
			err = s.KeepWrite(kept, len(p), off, fua)
		default:
			err = s.WriteAt(p, off, fua)
		}
		done(err)
	})
	s.mu.Unlock()
	return true
}

// Push runs what was started, each in a goroutine of its own.
func (s *starter) Push() {
	s.pushes.Add(1)
	s.mu.Lock()
	run := s.pending
	s.pending = nil
	s.mu.Unlock()
	for _, f := range run {
		go f()
	}
}

// TestStarterRequests: with a Starter, the queue's thread starts reads
// and writes itself and pushes them out; what the Starter declines goes
// through the Handler; every byte reads back, and nothing started is left
// unpushed (the test would hang, bounded by the read's deadline).
func TestStarterRequests(t *testing.T) {
	requireUblk(t)
	ctrl := openControl(t)
	const size, maxIO = 32 << 20, 256 << 10
	s := &starter{keeper: &keeper{memHandler: &memHandler{data: make([]byte, size)}}}
	f := openDevice(t, ctrl, Config{Size: size, Queues: 2, Depth: 16, MaxIO: maxIO}, s)
	want := alignedBuf(t, 16<<20)
	rand.Read(want)
	if _, err := f.WriteAt(want, 0); err != nil {
		t.Fatal(err)
	}
	// Small requests at many offsets, some declined.
	for off := 0; off < 2<<20; off += 4096 {
		if _, err := f.WriteAt(want[off:off+4096], int64(off)); err != nil {
			t.Fatal(err)
		}
	}
	got := alignedBuf(t, len(want))
	done := make(chan error, 1)
	go func() { _, err := f.ReadAt(got, 0); done <- err }()
	select {
	case err := <-done:
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("read back: %v (equal: %v)", err, bytes.Equal(got, want))
		}
	case <-time.After(time.Minute):
		t.Fatal("the read did not complete in a minute: started requests left unpushed?")
	}
	if s.started.Load() == 0 || s.declined.Load() == 0 || s.pushes.Load() == 0 {
		t.Fatalf("started %d, declined %d, pushes %d: want all of them", s.started.Load(), s.declined.Load(), s.pushes.Load())
	}
	t.Logf("started %d requests in %d pushes, %d declined", s.started.Load(), s.pushes.Load(), s.declined.Load())
	s.keeper.mu.Lock()
	defer s.keeper.mu.Unlock()
	for i, b := range s.kept {
		if !bytes.Equal(*b, s.at[i]) {
			t.Fatalf("kept buffer %d changed after the queue handed it over", i)
		}
	}
}

// fileHandler serves a file.
type fileHandler struct{ f *os.File }

func (h fileHandler) ReadAt(p []byte, off int64) error { _, err := h.f.ReadAt(p, off); return err }
func (h fileHandler) WriteAt(p []byte, off int64, fua bool) error {
	_, err := h.f.WriteAt(p, off)
	if err == nil && fua {
		err = h.f.Sync()
	}
	return err
}
func (h fileHandler) Flush() error { return h.f.Sync() }
func (h fileHandler) Trim(off, n int64) error {
	return unix.Fallocate(int(h.f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n)
}
func (h fileHandler) WriteZeroes(off, n int64, noUnmap bool) error {
	return unix.Fallocate(int(h.f.Fd()), unix.FALLOC_FL_ZERO_RANGE|unix.FALLOC_FL_KEEP_SIZE, off, n)
}

// helperSpec is what the serving helper process does.
type helperSpec struct {
	File    string
	Size    int64
	Recover int64 // a device id to take over, or -1 to create one
}

const helperEnv = "MPNBD_UBLK_TEST_SERVER"

// TestHelperServer is not a test: it is the serving process that
// TestRecoverAfterKill starts and kills.
func TestHelperServer(t *testing.T) {
	spec := os.Getenv(helperEnv)
	if spec == "" {
		t.Skip("helper process for TestRecoverAfterKill")
	}
	var hs helperSpec
	if err := json.Unmarshal([]byte(spec), &hs); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(hs.File, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	ctrl, err := OpenControl()
	if err != nil {
		t.Fatal(err)
	}
	var d *Device
	if hs.Recover >= 0 {
		d, err = Recover(context.Background(), ctrl, uint32(hs.Recover), fileHandler{f}, nil)
	} else {
		d, err = Create(context.Background(), ctrl, Config{Size: uint64(hs.Size), Depth: 16}, fileHandler{f})
	}
	if err != nil {
		t.Fatal(err)
	}
	fmt.Printf("DEVICE %d\n", d.ID)
	<-d.Done()
}

func startHelper(t *testing.T, hs helperSpec) (*exec.Cmd, uint32) {
	t.Helper()
	spec, _ := json.Marshal(hs)
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperServer$", "-test.v")
	cmd.Env = append(os.Environ(), helperEnv+"="+string(spec))
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	idc := make(chan uint32, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if s, ok := strings.CutPrefix(sc.Text(), "DEVICE "); ok {
				if id, err := strconv.Atoi(s); err == nil {
					idc <- uint32(id)
				}
			}
		}
		close(idc)
	}()
	select {
	case id, ok := <-idc:
		if !ok {
			t.Fatal("the serving process exited without a device")
		}
		return cmd, id
	case <-time.After(30 * time.Second):
		t.Fatal("the serving process made no device in 30s")
	}
	return nil, 0
}

// TestRecoverAfterKill: the process serving a device is SIGKILLed in the
// middle of a write; the kernel keeps the device and holds its I/O; a new
// process takes the device over, the write completes with no error and
// the data reads back.
func TestRecoverAfterKill(t *testing.T) {
	requireUblk(t)
	const size = 64 << 20
	file := t.TempDir() + "/disk"
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(file, size); err != nil {
		t.Fatal(err)
	}
	first, id := startHelper(t, helperSpec{File: file, Size: size, Recover: -1})
	ctrl := openControl(t)
	t.Cleanup(func() {
		if err := ctrl.Remove(id); err != nil {
			t.Logf("cleanup: remove device %d: %v", id, err)
		}
	})
	dev := BlockPath(id)
	data := make([]byte, 32<<20)
	rand.Read(data)
	// The same data is written several times over, so that the write is
	// still going when the server dies however fast the guest runs.
	const passes = 8
	errc := make(chan error, 1)
	started := make(chan struct{})
	go func() {
		f, err := os.OpenFile(dev, os.O_WRONLY|unix.O_DIRECT, 0)
		if err != nil {
			errc <- err
			return
		}
		defer f.Close()
		buf, err := unix.Mmap(-1, 0, 1<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
		if err != nil {
			errc <- err
			return
		}
		defer func() { _ = unix.Munmap(buf) }() // ours: it cannot fail
		for pass := range passes {
			for off := 0; off < len(data); off += len(buf) {
				copy(buf, data[off:])
				if _, err := f.WriteAt(buf, int64(off)); err != nil {
					errc <- fmt.Errorf("pass %d: write at %d: %w", pass, off, err)
					return
				}
				if pass == 0 && off == 0 {
					close(started)
				}
			}
		}
		errc <- f.Sync()
	}()
	select {
	case <-started:
	case err := <-errc:
		t.Fatalf("the write failed before it began: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("no write went through in 30s")
	}
	time.Sleep(100 * time.Millisecond)
	select {
	case err := <-errc:
		t.Fatalf("the whole write (%d MiB) ended before the server could be killed (%v): the test proves nothing", passes*len(data)>>20, err)
	default:
	}
	first.Process.Kill()
	first.Wait()
	deadline := time.Now().Add(20 * time.Second)
	for {
		st, err := ctrl.State(id)
		if err == nil && st == StateQuiesced {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("device state %d (%v) 20s after its server died, want quiesced", st, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	select {
	case err := <-errc:
		t.Fatalf("the write ended while no process served the device: %v", err)
	default:
	}
	startHelper(t, helperSpec{File: file, Size: size, Recover: int64(id)})
	select {
	case err := <-errc:
		if err != nil {
			t.Fatalf("the write across the server's death: %v", err)
		}
	case <-time.After(2 * time.Minute):
		t.Fatal("the write did not finish after the new server took over")
	}
	if st, err := ctrl.State(id); err != nil || st != StateLive {
		t.Fatalf("state after recovery: %d, %v", st, err)
	}
	got, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got[:len(data)], data) {
		t.Fatal("the file differs from what was written across the server's death")
	}
}
