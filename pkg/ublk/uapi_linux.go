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

import "unsafe"

// The ublk UAPI (include/uapi/linux/ublk_cmd.h), the parts we use.

// Control and I/O command numbers; sent in the ioctl encoding (the
// kernel takes it from 6.3 on and, with UBLK_F_CMD_IOCTL_ENCODE, requires
// it for I/O commands).
const (
	cmdGetDevInfo        = 0x02
	cmdAddDev            = 0x04
	cmdDelDev            = 0x05
	cmdStartDev          = 0x06
	cmdStopDev           = 0x07
	cmdSetParams         = 0x08
	cmdGetParams         = 0x09
	cmdStartUserRecovery = 0x10
	cmdEndUserRecovery   = 0x11
	cmdGetDevInfo2       = 0x12
	cmdGetFeatures       = 0x13
	cmdUpdateSize        = 0x15

	ioFetchReq         = 0x20
	ioCommitAndFetchRq = 0x21
)

const (
	iocWrite = 1
	iocRead  = 2
)

// ioc builds an ioctl number as _IOC(dir, 'u', nr, size) does.
func ioc(dir, nr, size uint32) uint32 { return dir<<30 | size<<16 | uint32('u')<<8 | nr }

func ctrlOp(nr uint32) uint32 {
	dir := uint32(iocRead | iocWrite)
	switch nr {
	case cmdGetDevInfo, cmdGetParams, cmdGetDevInfo2, cmdGetFeatures:
		dir = iocRead
	}
	return ioc(dir, nr, uint32(unsafe.Sizeof(ctrlCmd{})))
}

func ioOp(nr uint32) uint32 { return ioc(iocRead|iocWrite, nr, uint32(unsafe.Sizeof(ioCmd{}))) }

// Feature flags.
const (
	FlagUserRecovery        uint64 = 1 << 3
	FlagUserRecoveryReissue uint64 = 1 << 4
	FlagCmdIoctlEncode      uint64 = 1 << 6
	FlagUpdateSize          uint64 = 1 << 10
)

// Device states (devInfo.state).
const (
	StateDead     = 0
	StateLive     = 1
	StateQuiesced = 2
)

// I/O results.
const (
	ioResOK    = 0
	ioResAbort = -19 // -ENODEV: the queue is going away; no refetch
)

// Operations in ioDesc.opFlags (low 8 bits) and their flags.
const (
	opRead        = 0
	opWrite       = 1
	opFlush       = 2
	opDiscard     = 3
	opWriteZeroes = 5

	ioFlagFUA     = 1 << 13
	ioFlagNoUnmap = 1 << 15
)

// ctrlCmd is struct ublksrv_ctrl_cmd, carried in a 128-byte entry's
// command area.
type ctrlCmd struct {
	devID      uint32
	queueID    uint16
	len        uint16
	addr       uint64
	data       uint64
	devPathLen uint16
	pad        uint16
	reserved   uint32
}

// devInfo is struct ublksrv_ctrl_dev_info. The blank fields are the
// kernel's that we neither set nor read, named in their comments; they
// keep the layout (TestUAPILayout).
type devInfo struct {
	nrHWQueues    uint16
	queueDepth    uint16
	state         uint16
	_             uint16 // pad0
	maxIOBufBytes uint32
	devID         uint32
	ublksrvPID    int32
	_             uint32 // pad1
	flags         uint64
	_             uint64 // ublksrv_flags
	_             uint32 // owner_uid
	_             uint32 // owner_gid
	_             uint64 // reserved1
	_             uint64 // reserved2
}

// ioDesc is struct ublksrv_io_desc, one per tag in the queue's shared
// descriptor area.
type ioDesc struct {
	opFlags     uint32
	nrSectors   uint32
	startSector uint64
	addr        uint64
}

// ioCmd is struct ublksrv_io_cmd.
type ioCmd struct {
	qID    uint16
	tag    uint16
	result int32
	addr   uint64
}

// Parameter types.
const (
	paramTypeBasic   = 1 << 0
	paramTypeDiscard = 1 << 1
)

const (
	attrReadOnly      = 1 << 0
	attrVolatileCache = 1 << 2
	attrFUA           = 1 << 3
)

// paramBasic is struct ublk_param_basic; blank fields as in devInfo.
type paramBasic struct {
	attrs           uint32
	logicalBSShift  uint8
	physicalBSShift uint8
	ioOptShift      uint8
	ioMinShift      uint8
	maxSectors      uint32
	_               uint32 // chunk_sectors
	devSectors      uint64
	_               uint64 // virt_boundary_mask
}

// paramDiscard is struct ublk_param_discard; blank fields as in devInfo.
type paramDiscard struct {
	_                     uint32 // discard_alignment
	discardGranularity    uint32
	maxDiscardSectors     uint32
	maxWriteZeroesSectors uint32
	maxDiscardSegments    uint16
	_                     uint16 // reserved0
}

// params is the head of struct ublk_params: its basic and discard parts
// (len says how much of the kernel's struct we send).
type params struct {
	len     uint32
	types   uint32
	basic   paramBasic
	discard paramDiscard
}

// Where the descriptors of queue q are in the mmap of /dev/ublkcN: each
// queue has room for the largest depth.
const maxQueueDepth = 4096

func descAreaSize(depth int) int {
	n := depth * int(unsafe.Sizeof(ioDesc{}))
	return (n + pageSize - 1) &^ (pageSize - 1)
}

func descOffset(q int) int64 { return int64(q) * int64(descAreaSize(maxQueueDepth)) }

const pageSize = 4096
