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

package blockdev

import (
	"bytes"
	"crypto/rand"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func requireLoop(t *testing.T) {
	t.Helper()
	if err := LoopAvailable(); err != nil {
		t.Skipf("skipping: %v", err)
	}
}

// backingFile makes a sparse file of size bytes.
func backingFile(t *testing.T, size int64) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "backing.img")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	f.Close()
	return p
}

// attach attaches and registers a cleanup that detaches whatever is left.
func attach(t *testing.T, path string, o LoopOptions) string {
	t.Helper()
	dev, err := AttachLoop(path, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		devs, _ := FindLoopByBackingFile(path)
		for _, d := range devs {
			if err := DetachLoop(d); err != nil {
				t.Errorf("cleanup: detach %s: %v", d, err)
			}
		}
	})
	return dev
}

func sysAttr(t *testing.T, dev, attr string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), attr))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// losetupJ lists what losetup sees on a backing file (empty when nothing).
func losetupJ(t *testing.T, path string) string {
	t.Helper()
	if _, err := exec.LookPath("losetup"); err != nil {
		return ""
	}
	out, err := exec.Command("losetup", "-j", path).CombinedOutput()
	if err != nil {
		t.Fatalf("losetup -j: %v: %s", err, out)
	}
	return strings.TrimSpace(string(out))
}

func TestAttachDetachLoop(t *testing.T) {
	requireLoop(t)
	const size = 64 << 20
	path := backingFile(t, size)
	dev := attach(t, path, LoopOptions{DirectIO: true, BlockSize: 4096})

	if !strings.HasPrefix(dev, "/dev/loop") {
		t.Fatalf("device %q", dev)
	}
	n, err := DeviceSize(dev)
	if err != nil {
		t.Fatal(err)
	}
	if n != size {
		t.Fatalf("device size %d, want %d", n, size)
	}
	if got := sysAttr(t, dev, "loop/dio"); got != "1" {
		t.Errorf("loop/dio = %q, want 1 (direct I/O not enabled)", got)
	}
	if got := sysAttr(t, dev, "queue/logical_block_size"); got != "4096" {
		t.Errorf("logical block size %s, want 4096", got)
	}
	st, err := StatLoop(dev)
	if err != nil {
		t.Fatal(err)
	}
	if st.BackingFile != path || !st.DirectIO || st.ReadOnly || st.Autoclear {
		t.Errorf("status %+v", st)
	}
	devs, err := FindLoopByBackingFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(devs) != 1 || devs[0] != dev {
		t.Fatalf("FindLoopByBackingFile = %v, want [%s]", devs, dev)
	}
	if out := losetupJ(t, path); out != "" && !strings.HasPrefix(out, dev+":") {
		t.Errorf("losetup -j: %q, want %s", out, dev)
	}

	// Data written through the device lands in the file.
	want := make([]byte, 1<<20)
	rand.Read(want)
	f, err := os.OpenFile(dev, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(want, 8<<20); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	f.Close()
	got := make([]byte, len(want))
	bf, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bf.ReadAt(got, 8<<20); err != nil {
		t.Fatal(err)
	}
	bf.Close()
	if !bytes.Equal(got, want) {
		t.Fatal("data written to the loop device is not in the backing file")
	}

	if err := DetachLoop(dev); err != nil {
		t.Fatal(err)
	}
	if devs, _ := FindLoopByBackingFile(path); len(devs) != 0 {
		t.Fatalf("still attached after detach: %v", devs)
	}
	if out := losetupJ(t, path); out != "" {
		t.Fatalf("losetup still lists the file: %q", out)
	}
	if _, err := StatLoop(dev); !errors.Is(err, unix.ENXIO) {
		t.Errorf("StatLoop after detach: %v, want ENXIO", err)
	}
	// Detaching again, or a device that is not a loop device.
	if err := DetachLoop(dev); err != nil {
		t.Errorf("second detach: %v", err)
	}
	if err := DetachLoop("/dev/null"); !errors.Is(err, ErrNotLoop) {
		t.Errorf("DetachLoop(/dev/null) = %v, want ErrNotLoop", err)
	}
}

func TestLoopReadOnly(t *testing.T) {
	requireLoop(t)
	path := backingFile(t, 16<<20)
	dev := attach(t, path, LoopOptions{ReadOnly: true})
	if got := sysAttr(t, dev, "ro"); got != "1" {
		t.Errorf("ro = %q, want 1", got)
	}
	// Opening for writing may succeed; writing must not.
	if f, err := os.OpenFile(dev, os.O_WRONLY, 0); err == nil {
		_, werr := f.WriteAt(make([]byte, 4096), 0)
		if werr == nil {
			werr = f.Sync()
		}
		f.Close()
		if werr == nil {
			t.Fatal("wrote to a read-only loop device")
		}
	}
	if err := DetachLoop(dev); err != nil {
		t.Fatal(err)
	}
}

func TestLoopAutoclear(t *testing.T) {
	requireLoop(t)
	path := backingFile(t, 16<<20)
	f, err := AttachLoopFile(path, LoopOptions{Autoclear: true})
	if err != nil {
		t.Fatal(err)
	}
	dev := f.Name()
	if st, err := StatLoop(dev); err != nil || !st.Autoclear {
		t.Fatalf("status %+v, %v", st, err)
	}
	f.Close()
	deadline := time.Now().Add(2 * time.Second)
	for {
		devs, _ := FindLoopByBackingFile(path)
		if len(devs) == 0 {
			break
		}
		if time.Now().After(deadline) {
			_ = DetachLoop(dev) // the failure below is what counts
			t.Fatalf("autoclear device %s still attached after the last close", dev)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestDetachBusyLoop(t *testing.T) {
	requireLoop(t)
	old := detachWait
	detachWait = 100 * time.Millisecond
	t.Cleanup(func() { detachWait = old })

	path := backingFile(t, 16<<20)
	dev := attach(t, path, LoopOptions{})
	holder, err := os.Open(dev)
	if err != nil {
		t.Fatal(err)
	}
	if err := DetachLoop(dev); !errors.Is(err, ErrLoopBusy) {
		holder.Close()
		t.Fatalf("DetachLoop with the device held open = %v, want ErrLoopBusy", err)
	}
	holder.Close()
	// The kernel detaches it on that last close.
	deadline := time.Now().Add(2 * time.Second)
	for {
		devs, _ := FindLoopByBackingFile(path)
		if len(devs) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("device %s still attached after the holder closed it", dev)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestLoopSetCapacity(t *testing.T) {
	requireLoop(t)
	path := backingFile(t, 16<<20)
	dev := attach(t, path, LoopOptions{DirectIO: true})
	if err := os.Truncate(path, 48<<20); err != nil {
		t.Fatal(err)
	}
	if err := LoopSetCapacity(dev); err != nil {
		t.Fatal(err)
	}
	n, err := DeviceSize(dev)
	if err != nil {
		t.Fatal(err)
	}
	if n != 48<<20 {
		t.Fatalf("size after LoopSetCapacity %d, want %d", n, 48<<20)
	}
	if err := DetachLoop(dev); err != nil {
		t.Fatal(err)
	}
}

func TestFindLoopByBackingFileNone(t *testing.T) {
	requireLoop(t)
	devs, err := FindLoopByBackingFile(filepath.Join(t.TempDir(), "nothing"))
	if err != nil || len(devs) != 0 {
		t.Fatalf("FindLoopByBackingFile = %v, %v", devs, err)
	}
}

func TestDetachClaimedLoop(t *testing.T) {
	requireLoop(t)
	path := backingFile(t, 16<<20)
	dev := attach(t, path, LoopOptions{})
	claim, err := os.OpenFile(dev, os.O_RDONLY|unix.O_EXCL, 0)
	if err != nil {
		t.Fatal(err)
	}
	err = DetachLoop(dev)
	if !errors.Is(err, ErrLoopBusy) {
		claim.Close()
		t.Fatalf("DetachLoop of a claimed device = %v, want ErrLoopBusy", err)
	}
	st, serr := StatLoop(dev)
	claim.Close()
	if serr != nil || st.Autoclear {
		t.Fatalf("a refused detach changed the device: %+v, %v", st, serr)
	}
	if err := DetachLoop(dev); err != nil {
		t.Fatal(err)
	}
	if devs, _ := FindLoopByBackingFile(path); len(devs) != 0 {
		t.Fatalf("still attached: %v", devs)
	}
}

func TestSetQueueLimits(t *testing.T) {
	requireLoop(t)
	path := backingFile(t, 16<<20)
	dev := attach(t, path, LoopOptions{DirectIO: true})
	before, err := StatQueue(dev)
	if err != nil {
		t.Fatal(err)
	}
	want := QueueLimits{MaxSectorsKB: 512, ReadAheadKB: 384}
	if before == want {
		want = QueueLimits{MaxSectorsKB: 256, ReadAheadKB: 192}
	}
	if err := SetQueueLimits(dev, want); err != nil {
		t.Fatal(err)
	}
	got, err := StatQueue(dev)
	if err != nil {
		t.Fatal(err)
	}
	if got != want {
		t.Fatalf("queue after SetQueueLimits(%+v): %+v (before: %+v)", want, got, before)
	}

	// A zero field leaves the setting alone.
	if err := SetQueueLimits(dev, QueueLimits{ReadAheadKB: 2 * want.ReadAheadKB}); err != nil {
		t.Fatal(err)
	}
	if got, err = StatQueue(dev); err != nil {
		t.Fatal(err)
	}
	if want.ReadAheadKB *= 2; got != want {
		t.Fatalf("queue after setting read_ahead_kb alone: %+v, want %+v", got, want)
	}

	// A request size above what the device takes is lowered to its limit.
	if err := SetQueueLimits(dev, QueueLimits{MaxSectorsKB: 1 << 30, ReadAheadKB: want.ReadAheadKB}); err != nil {
		t.Fatal(err)
	}
	dir, err := queueDir(dev)
	if err != nil {
		t.Fatal(err)
	}
	hw, err := readQueueKB(dir, "max_hw_sectors_kb")
	if err != nil {
		t.Fatal(err)
	}
	if got, err = StatQueue(dev); err != nil {
		t.Fatal(err)
	}
	if want.MaxSectorsKB = hw; got != want {
		t.Fatalf("queue after asking for max_sectors_kb past %d: %+v, want %+v", hw, got, want)
	}

	if err := SetQueueLimits(path, want); err == nil {
		t.Fatalf("SetQueueLimits on the regular file %s: no error", path)
	}
}
