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
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

const (
	loopControl = "/dev/loop-control"
	loopMajor   = 7
	// claimTries bounds the retries when another process binds the free
	// device LOOP_CTL_GET_FREE handed out before we could.
	claimTries = 32
)

// detachWait is how long DetachLoop waits for a transient opener (udev,
// blkid) to close the device before reporting ErrLoopBusy.
var detachWait = 2 * time.Second

// AttachLoop binds a free loop device to the file at path and returns the
// device path (/dev/loopN).
func AttachLoop(path string, o LoopOptions) (string, error) {
	f, err := AttachLoopFile(path, o)
	if err != nil {
		return "", err
	}
	dev := f.Name()
	f.Close()
	return dev, nil
}

// AttachLoopFile is AttachLoop returning the loop device opened (its Name
// is the device path), for callers that want to hold it, e.g. for an
// Autoclear device. Closing it does not detach a device without Autoclear.
func AttachLoopFile(path string, o LoopOptions) (*os.File, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, err
	}
	backing, err := openBacking(abs, o)
	if err != nil {
		return nil, err
	}
	// The kernel takes its own reference to the backing file.
	defer backing.Close()

	ctl, err := os.OpenFile(loopControl, os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("blockdev: %w", err)
	}
	defer ctl.Close()

	var lastErr error
	for try := 0; try < claimTries; try++ {
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return nil, fmt.Errorf("blockdev: LOOP_CTL_GET_FREE: %w", err)
		}
		dev := "/dev/loop" + strconv.Itoa(n)
		f, err := openLoopNode(dev, o.ReadOnly)
		if err != nil {
			return nil, err
		}
		err = bind(f, backing, abs, o)
		if err == nil {
			return f, nil
		}
		f.Close()
		if !errors.Is(err, unix.EBUSY) {
			return nil, fmt.Errorf("blockdev: attach %s to %s: %w", abs, dev, err)
		}
		// Someone bound this device between GET_FREE and our ioctl.
		lastErr = err
	}
	return nil, fmt.Errorf("%w after %d attempts: %v", ErrNoFreeLoop, claimTries, lastErr)
}

// openBacking opens the backing file, with O_DIRECT when direct I/O is
// wanted (the loop driver then enables it) and the file system allows it.
func openBacking(path string, o LoopOptions) (*os.File, error) {
	flags := os.O_RDWR
	if o.ReadOnly {
		flags = os.O_RDONLY
	}
	flags |= unix.O_CLOEXEC
	if o.DirectIO {
		f, err := os.OpenFile(path, flags|unix.O_DIRECT, 0)
		if err == nil {
			return f, nil
		}
		if !errors.Is(err, unix.EINVAL) {
			return nil, fmt.Errorf("blockdev: %w", err)
		}
		// No O_DIRECT on this file system: attach with buffered I/O.
	}
	f, err := os.OpenFile(path, flags, 0)
	if err != nil {
		return nil, fmt.Errorf("blockdev: %w", err)
	}
	return f, nil
}

// openLoopNode opens a loop device node, waiting briefly for devtmpfs to
// create the node of a device LOOP_CTL_GET_FREE has just added.
func openLoopNode(dev string, readOnly bool) (*os.File, error) {
	flags := os.O_RDWR
	if readOnly {
		flags = os.O_RDONLY
	}
	deadline := time.Now().Add(time.Second)
	for {
		f, err := os.OpenFile(dev, flags|unix.O_CLOEXEC, 0)
		if err == nil {
			return f, nil
		}
		if !errors.Is(err, os.ErrNotExist) || time.Now().After(deadline) {
			return nil, fmt.Errorf("blockdev: %w", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func loopFlags(o LoopOptions) uint32 {
	var fl uint32
	if o.ReadOnly {
		fl |= unix.LO_FLAGS_READ_ONLY
	}
	if o.Autoclear {
		fl |= unix.LO_FLAGS_AUTOCLEAR
	}
	if o.DirectIO {
		fl |= unix.LO_FLAGS_DIRECT_IO
	}
	return fl
}

// bind attaches backing to the loop device f, with LOOP_CONFIGURE where
// the kernel has it (5.8+) and LOOP_SET_FD + LOOP_SET_STATUS64 otherwise.
func bind(f, backing *os.File, path string, o LoopOptions) error {
	fd := int(f.Fd())
	cfg := unix.LoopConfig{Fd: uint32(backing.Fd()), Size: o.BlockSize}
	cfg.Info.Flags = loopFlags(o)
	copy(cfg.Info.File_name[:unix.LO_NAME_SIZE-1], path)
	err := unix.IoctlLoopConfigure(fd, &cfg)
	switch {
	case err == nil:
	case errors.Is(err, unix.ENOTTY), errors.Is(err, unix.EINVAL) && !hasConfigure():
		if err := bindLegacy(fd, backing, path, o); err != nil {
			return err
		}
	default:
		return fmt.Errorf("LOOP_CONFIGURE: %w", err)
	}
	if o.DirectIO {
		if st, err := unix.IoctlLoopGetStatus64(fd); err == nil && st.Flags&unix.LO_FLAGS_DIRECT_IO == 0 {
			// Best effort; the caller can check LoopStatus.
			_ = unix.IoctlSetInt(fd, unix.LOOP_SET_DIRECT_IO, 1)
		}
	}
	return nil
}

// hasConfigure reports whether the running kernel has LOOP_CONFIGURE
// (Linux 5.8). Older kernels answer an unknown loop ioctl with EINVAL,
// which LOOP_CONFIGURE also returns for a bad configuration, so the
// version tells the two apart.
func hasConfigure() bool {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return true
	}
	rel := string(bytes.TrimRight(u.Release[:], "\x00"))
	var major, minor int
	if _, err := fmt.Sscanf(rel, "%d.%d", &major, &minor); err != nil {
		return true
	}
	return major > 5 || major == 5 && minor >= 8
}

func bindLegacy(fd int, backing *os.File, path string, o LoopOptions) error {
	if err := unix.IoctlSetInt(fd, unix.LOOP_SET_FD, int(backing.Fd())); err != nil {
		return fmt.Errorf("LOOP_SET_FD: %w", err)
	}
	undo := func(err error) error {
		_ = unix.IoctlSetInt(fd, unix.LOOP_CLR_FD, 0)
		return err
	}
	var info unix.LoopInfo64
	// READ_ONLY follows the mode of the backing file; DIRECT_IO has its
	// own ioctl below.
	info.Flags = loopFlags(o) &^ (unix.LO_FLAGS_READ_ONLY | unix.LO_FLAGS_DIRECT_IO)
	copy(info.File_name[:unix.LO_NAME_SIZE-1], path)
	if err := unix.IoctlLoopSetStatus64(fd, &info); err != nil {
		return undo(fmt.Errorf("LOOP_SET_STATUS64: %w", err))
	}
	if o.BlockSize != 0 {
		if err := unix.IoctlSetInt(fd, unix.LOOP_SET_BLOCK_SIZE, int(o.BlockSize)); err != nil {
			return undo(fmt.Errorf("LOOP_SET_BLOCK_SIZE: %w", err))
		}
	}
	if o.DirectIO {
		_ = unix.IoctlSetInt(fd, unix.LOOP_SET_DIRECT_IO, 1)
	}
	return nil
}

// DetachLoop unbinds a loop device from its backing file. A device that is
// not bound is not an error.
//
// A device claimed exclusively (a mounted file system, a device-mapper
// table) is left alone and DetachLoop returns an error wrapping
// ErrLoopBusy. When another process merely has it open, the kernel marks
// it to detach on that opener's last close, and DetachLoop returns an
// error wrapping ErrLoopBusy too (after a short wait for transient openers
// such as udev).
func DetachLoop(dev string) error {
	sys, err := loopSysfs(dev)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return err
	}
	// O_EXCL on a block device fails with EBUSY while it is claimed.
	f, err := os.OpenFile(dev, os.O_RDONLY|unix.O_EXCL|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.EBUSY) {
		return fmt.Errorf("%w: %s is in use (mounted or held by another device)", ErrLoopBusy, dev)
	}
	if err != nil {
		return fmt.Errorf("blockdev: %w", err)
	}
	err = unix.IoctlSetInt(int(f.Fd()), unix.LOOP_CLR_FD, 0)
	// If we are the last opener, this close is what releases the backing
	// file.
	f.Close()
	if err != nil {
		if errors.Is(err, unix.ENXIO) {
			return nil // not bound
		}
		return fmt.Errorf("blockdev: LOOP_CLR_FD %s: %w", dev, err)
	}
	deadline := time.Now().Add(detachWait)
	for bound(sys) {
		if time.Now().After(deadline) {
			return fmt.Errorf("%w: %s", ErrLoopBusy, dev)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return nil
}

// loopSysfs returns /sys/dev/block/7:N for a loop device node.
func loopSysfs(dev string) (string, error) {
	sys, rdev, err := devSysfs(dev)
	if errors.Is(err, errNotBlock) || err == nil && unix.Major(rdev) != loopMajor {
		return "", fmt.Errorf("%w: %s", ErrNotLoop, dev)
	}
	return sys, err
}

// bound reports whether the loop device at sysfs dir sys has a backing
// file (the loop/ attribute group exists only while it does).
func bound(sys string) bool {
	_, err := os.Stat(filepath.Join(sys, "loop", "backing_file"))
	return err == nil
}

func readBackingFile(sys string) (string, error) {
	b, err := os.ReadFile(filepath.Join(sys, "loop", "backing_file"))
	if err != nil {
		return "", err
	}
	return strings.TrimSuffix(string(b), "\n"), nil
}

// findBoundLoops returns, sorted, the bound loop devices for which match
// holds; match gets the device's name and its backing file as the kernel
// reports it.
func findBoundLoops(match func(name, backing string) bool) ([]string, error) {
	ents, err := os.ReadDir("/sys/block")
	if err != nil {
		return nil, fmt.Errorf("blockdev: %w", err)
	}
	var out []string
	for _, e := range ents {
		name := e.Name()
		if !strings.HasPrefix(name, "loop") {
			continue
		}
		bf, err := readBackingFile(filepath.Join("/sys/block", name))
		if err != nil {
			continue // not bound, or gone meanwhile
		}
		if match(name, bf) {
			out = append(out, "/dev/"+name)
		}
	}
	sort.Slice(out, func(i, j int) bool { return loopNum(out[i]) < loopNum(out[j]) })
	return out, nil
}

// FindLoopByBackingFile returns the loop devices bound to the file at path
// (also when it was deleted since), sorted.
func FindLoopByBackingFile(path string) ([]string, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, err
	}
	abs = filepath.Clean(abs)
	return findBoundLoops(func(_, bf string) bool { return bf == abs || bf == abs+" (deleted)" })
}

// FindLoopByBackingInode returns the loop devices whose backing file is
// inode ino of the file system on device dev. It finds a loop device
// whose backing file lies on a mount this mount namespace cannot see
// (the kernel then reports its path relative to that mount alone).
func FindLoopByBackingInode(dev, ino uint64) ([]string, error) {
	return findBoundLoops(func(name, _ string) bool {
		f, err := os.OpenFile("/dev/"+name, os.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return false
		}
		defer f.Close()
		info, err := unix.IoctlLoopGetStatus64(int(f.Fd()))
		return err == nil && info.Device == dev && info.Inode == ino
	})
}

func loopNum(dev string) int {
	n, _ := strconv.Atoi(strings.TrimPrefix(dev, "/dev/loop"))
	return n
}

// StatLoop describes a bound loop device; an unbound one gives an error
// wrapping unix.ENXIO.
func StatLoop(dev string) (LoopStatus, error) {
	sys, err := loopSysfs(dev)
	if err != nil {
		return LoopStatus{}, err
	}
	f, err := os.OpenFile(dev, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return LoopStatus{}, fmt.Errorf("blockdev: %w", err)
	}
	defer f.Close()
	info, err := unix.IoctlLoopGetStatus64(int(f.Fd()))
	if err != nil {
		return LoopStatus{}, fmt.Errorf("blockdev: LOOP_GET_STATUS64 %s: %w", dev, err)
	}
	st := LoopStatus{
		Device:        dev,
		BackingDevice: info.Device,
		BackingInode:  info.Inode,
		Offset:        info.Offset,
		SizeLimit:     info.Sizelimit,
		ReadOnly:      info.Flags&unix.LO_FLAGS_READ_ONLY != 0,
		Autoclear:     info.Flags&unix.LO_FLAGS_AUTOCLEAR != 0,
		DirectIO:      info.Flags&unix.LO_FLAGS_DIRECT_IO != 0,
		PartScan:      info.Flags&unix.LO_FLAGS_PARTSCAN != 0,
	}
	if bf, err := readBackingFile(sys); err == nil {
		st.BackingFile = bf
	} else {
		st.BackingFile = string(bytes.TrimRight(info.File_name[:], "\x00"))
	}
	return st, nil
}

// LoopSetCapacity makes a loop device pick up the current size of its
// backing file (after the file grew or shrank).
func LoopSetCapacity(dev string) error {
	if _, err := loopSysfs(dev); err != nil {
		return err
	}
	f, err := os.OpenFile(dev, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("blockdev: %w", err)
	}
	defer f.Close()
	if err := unix.IoctlSetInt(int(f.Fd()), unix.LOOP_SET_CAPACITY, 0); err != nil {
		return fmt.Errorf("blockdev: LOOP_SET_CAPACITY %s: %w", dev, err)
	}
	return nil
}

// DeviceSize returns the size in bytes of a block device (BLKGETSIZE64).
func DeviceSize(dev string) (uint64, error) {
	f, err := os.OpenFile(dev, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, fmt.Errorf("blockdev: %w", err)
	}
	defer f.Close()
	n, err := unix.IoctlGetUint64(int(f.Fd()), unix.BLKGETSIZE64)
	if err != nil {
		return 0, fmt.Errorf("blockdev: BLKGETSIZE64 %s: %w", dev, err)
	}
	return n, nil
}

// LoopAvailable tells whether loop devices can be attached here: the
// process needs CAP_SYS_ADMIN (root) and /dev/loop-control must exist.
func LoopAvailable() error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("%w: loop devices need root", ErrUnsupported)
	}
	if _, err := os.Stat(loopControl); err != nil {
		return fmt.Errorf("%w: %v", ErrUnsupported, err)
	}
	return nil
}
