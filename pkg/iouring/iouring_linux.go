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

package iouring

import (
	"errors"
	"fmt"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Opcodes this package's users send (include/uapi/linux/io_uring.h).
const (
	OpNop      uint8 = 0
	OpRead     uint8 = 22
	OpWrite    uint8 = 23
	OpURingCmd uint8 = 46
)

// Setup flags.
const (
	SetupSQE128       uint32 = 1 << 10
	SetupCQE32        uint32 = 1 << 11
	SetupSingleIssuer uint32 = 1 << 12
)

const (
	featSingleMmap = 1 << 0

	enterGetEvents = 1 << 0

	offSQRing = 0
	offCQRing = 0x8000000
	offSQEs   = 0x10000000
)

// params is struct io_uring_params.
type params struct {
	sqEntries, cqEntries, flags, sqThreadCPU, sqThreadIdle, features, wqFD uint32
	resv                                                                   [3]uint32
	sqOff                                                                  sqringOffsets
	cqOff                                                                  cqringOffsets
}

type sqringOffsets struct {
	head, tail, ringMask, ringEntries, flags, dropped, array, resv1 uint32
	userAddr                                                        uint64
}

type cqringOffsets struct {
	head, tail, ringMask, ringEntries, overflow, cqes, flags, resv1 uint32
	userAddr                                                        uint64
}

// SQE is a submission entry: the 64 bytes every opcode shares. With
// SetupSQE128 the driver command area (Cmd) follows in the same slot.
type SQE struct {
	Opcode   uint8
	Flags    uint8
	IOPrio   uint16
	FD       int32
	Off      uint64 // for OpURingCmd: the low 32 bits are the command op
	Addr     uint64
	Len      uint32
	OpFlags  uint32
	UserData uint64
	BufIndex uint16
	Personal uint16
	FileIdx  int32
	Addr3    uint64
	pad      uint64
}

// CmdSize is the size of a 128-byte entry's command area: it starts at
// byte 48 of the entry (where Addr3 is in a 64-byte one) and runs to the
// end.
const CmdSize = 80

// CQE is a completion entry.
type CQE struct {
	UserData uint64
	Res      int32
	Flags    uint32
}

// Ring is one io_uring instance.
type Ring struct {
	fd      int
	sqeSize int
	cqeSize int

	sqRing, cqRing, sqeMem []byte

	sqHead, sqTail, sqMask, sqEntries *uint32
	sqArray                           []uint32
	cqHead, cqTail, cqMask            *uint32
	cqes                              unsafe.Pointer

	// pending counts entries filled since the last Submit.
	pending uint32
}

// ErrFull: every submission entry is taken until Submit.
var ErrFull = errors.New("iouring: submission queue full")

// New sets up a ring with room for entries submissions (rounded up to a
// power of two by the kernel) and the given setup flags.
func New(entries uint32, flags uint32) (*Ring, error) {
	var p params
	p.flags = flags
	fd, _, errno := unix.Syscall(unix.SYS_IO_URING_SETUP, uintptr(entries), uintptr(unsafe.Pointer(&p)), 0)
	if errno != 0 {
		return nil, syscallErr("io_uring_setup", errno)
	}
	r := &Ring{fd: int(fd), sqeSize: 64, cqeSize: 16}
	if flags&SetupSQE128 != 0 {
		r.sqeSize = 128
	}
	if flags&SetupCQE32 != 0 {
		r.cqeSize = 32
	}
	if err := r.mapRings(&p); err != nil {
		r.Close()
		return nil, err
	}
	return r, nil
}

func (r *Ring) mapRings(p *params) error {
	sqSize := int(p.sqOff.array) + int(p.sqEntries)*4
	cqSize := int(p.cqOff.cqes) + int(p.cqEntries)*r.cqeSize
	single := p.features&featSingleMmap != 0
	if single {
		sqSize = max(sqSize, cqSize)
	}
	var err error
	r.sqRing, err = unix.Mmap(r.fd, offSQRing, sqSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return fmt.Errorf("iouring: mmap submission ring: %w", err)
	}
	if single {
		r.cqRing = r.sqRing
	} else if r.cqRing, err = unix.Mmap(r.fd, offCQRing, cqSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE); err != nil {
		return fmt.Errorf("iouring: mmap completion ring: %w", err)
	}
	r.sqeMem, err = unix.Mmap(r.fd, offSQEs, int(p.sqEntries)*r.sqeSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return fmt.Errorf("iouring: mmap submission entries: %w", err)
	}
	at := func(b []byte, off uint32) *uint32 { return (*uint32)(unsafe.Pointer(&b[off])) }
	r.sqHead, r.sqTail = at(r.sqRing, p.sqOff.head), at(r.sqRing, p.sqOff.tail)
	r.sqMask, r.sqEntries = at(r.sqRing, p.sqOff.ringMask), at(r.sqRing, p.sqOff.ringEntries)
	r.sqArray = unsafe.Slice(at(r.sqRing, p.sqOff.array), p.sqEntries)
	r.cqHead, r.cqTail = at(r.cqRing, p.cqOff.head), at(r.cqRing, p.cqOff.tail)
	r.cqMask = at(r.cqRing, p.cqOff.ringMask)
	r.cqes = unsafe.Pointer(&r.cqRing[p.cqOff.cqes])
	return nil
}

// Close unmaps the rings and closes the ring's descriptor; what was
// submitted and not completed is cancelled by the kernel.
func (r *Ring) Close() error {
	var errs []error
	if r.sqeMem != nil {
		errs = append(errs, unix.Munmap(r.sqeMem))
	}
	if r.cqRing != nil && unsafe.SliceData(r.cqRing) != unsafe.SliceData(r.sqRing) {
		errs = append(errs, unix.Munmap(r.cqRing))
	}
	if r.sqRing != nil {
		errs = append(errs, unix.Munmap(r.sqRing))
	}
	r.sqeMem, r.cqRing, r.sqRing = nil, nil, nil
	if r.fd >= 0 {
		errs = append(errs, unix.Close(r.fd))
		r.fd = -1
	}
	return errors.Join(errs...)
}

// FD is the ring's file descriptor.
func (r *Ring) FD() int { return r.fd }

// Next returns the next free submission entry, zeroed, and, for a ring
// with 128-byte entries, its command area. The entry goes to the kernel at
// the next Submit.
func (r *Ring) Next() (*SQE, []byte, error) {
	head := atomic.LoadUint32(r.sqHead)
	tail := *r.sqTail + r.pending
	if tail-head >= *r.sqEntries {
		return nil, nil, ErrFull
	}
	idx := tail & *r.sqMask
	slot := r.sqeMem[int(idx)*r.sqeSize : int(idx+1)*r.sqeSize]
	clear(slot)
	r.sqArray[idx] = idx
	r.pending++
	var cmd []byte
	if r.sqeSize == 128 {
		cmd = slot[48:128]
	}
	return (*SQE)(unsafe.Pointer(&slot[0])), cmd, nil
}

// SetCmdOp puts a driver command op in an OpURingCmd entry.
func (s *SQE) SetCmdOp(op uint32) { s.Off = uint64(op) }

// Submit hands the filled entries to the kernel and, with wait > 0, waits
// until at least wait completions are ready. It returns how many entries
// the kernel took.
func (r *Ring) Submit(wait uint32) (int, error) {
	n := r.pending
	if n > 0 {
		atomic.StoreUint32(r.sqTail, *r.sqTail+n)
		r.pending = 0
	}
	var flags uintptr
	if wait > 0 {
		flags = enterGetEvents
	}
	if n == 0 && wait == 0 {
		return 0, nil
	}
	for {
		got, _, errno := unix.Syscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), uintptr(n), uintptr(wait), flags, 0, 0)
		if errno == syscall.EINTR {
			// The kernel submits only what is still between head and
			// tail: asking again is safe.
			continue
		}
		if errno != 0 {
			return int(got), syscallErr("io_uring_enter", errno)
		}
		return int(got), nil
	}
}

// Peek returns the next completion, if one is ready, without consuming
// it; Seen consumes it.
func (r *Ring) Peek() (CQE, bool) {
	head := *r.cqHead
	if head == atomic.LoadUint32(r.cqTail) {
		return CQE{}, false
	}
	c := *(*CQE)(unsafe.Add(r.cqes, uintptr(head&*r.cqMask)*uintptr(r.cqeSize)))
	return c, true
}

// Seen consumes the completion Peek returned.
func (r *Ring) Seen() { atomic.StoreUint32(r.cqHead, *r.cqHead+1) }

// Wait returns the next completion, waiting for one (and submitting what
// is pending) when none is ready.
func (r *Ring) Wait() (CQE, error) {
	for {
		if c, ok := r.Peek(); ok {
			r.Seen()
			return c, nil
		}
		if _, err := r.Submit(1); err != nil {
			return CQE{}, err
		}
	}
}

func syscallErr(name string, errno syscall.Errno) error {
	return fmt.Errorf("iouring: %s: %w", name, errno)
}
