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

// Package blockdev manages loop devices (a block device backed by a
// regular file) through the kernel's ioctl interface, without the losetup
// tool, and reads block device sizes.
//
// Everything here needs Linux and, for attaching and detaching, root
// (CAP_SYS_ADMIN); on other systems the functions return an error wrapping
// ErrUnsupported.
package blockdev

import "errors"

// LoopOptions configures AttachLoop.
type LoopOptions struct {
	// ReadOnly makes the loop device read-only (and opens the backing file
	// read-only).
	ReadOnly bool
	// DirectIO asks the loop driver to access the backing file with
	// O_DIRECT, bypassing the page cache of the backing file system. It is
	// best effort: the backing file system must support O_DIRECT at the
	// device's logical block size. LoopStatus tells whether it took effect.
	DirectIO bool
	// Autoclear makes the kernel detach the device when its last opener
	// closes it. AttachLoop closes its own descriptor before returning, so
	// an autoclear device nobody else holds open is detached at once: use
	// AttachLoopFile to keep it open.
	Autoclear bool
	// BlockSize is the device's logical block size (512, 1024, 2048 or
	// 4096); zero keeps the kernel's default (512, or the backing block
	// device's).
	BlockSize uint32
}

// LoopStatus describes a bound loop device.
type LoopStatus struct {
	// Device is the device path, e.g. /dev/loop3.
	Device string
	// BackingFile is the path of the backing file as the kernel reports it.
	BackingFile string
	// BackingDevice and BackingInode identify the backing file: the
	// st_dev of its file system and its inode number.
	BackingDevice uint64
	BackingInode  uint64
	Offset        uint64
	SizeLimit     uint64
	ReadOnly      bool
	Autoclear     bool
	DirectIO      bool
	PartScan      bool
}

// QueueLimits are settings of a block device's request queue, in KiB:
// MaxSectorsKB bounds the size of one request the device is sent,
// ReadAheadKB is the readahead of the page cache on it (and of the file
// systems on it).
type QueueLimits struct {
	MaxSectorsKB uint32
	ReadAheadKB  uint32
}

var (
	// ErrUnsupported is returned on systems without loop devices.
	ErrUnsupported = errors.New("blockdev: not supported on this system")
	// ErrNotLoop is returned for a device that is not a loop device.
	ErrNotLoop = errors.New("blockdev: not a loop device")
	// ErrLoopBusy is returned by DetachLoop for a device in use.
	ErrLoopBusy = errors.New("blockdev: loop device busy")
	// ErrNoFreeLoop is returned when no free loop device could be claimed.
	ErrNoFreeLoop = errors.New("blockdev: no free loop device")
)
