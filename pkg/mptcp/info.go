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

package mptcp

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Socket option constants: SOL_MPTCP (include/linux/socket.h) and
// MPTCP_INFO (include/uapi/linux/mptcp.h).
const (
	SolMPTCP     = 284
	OptMPTCPInfo = 1
)

// Flag bits of Info.Flags (MPTCP_INFO_FLAG_*).
const (
	InfoFlagFallback          = 1 << 0
	InfoFlagRemoteKeyReceived = 1 << 1
)

// Sizes of struct mptcp_info as returned by successive kernel versions
// (sizeof, including trailing padding, of each revision of the struct).
const (
	// InfoSizeMin is the size of the first revision (Linux 5.9). Shorter
	// replies are rejected.
	InfoSizeMin = 40
	// InfoSizeLocalAddr adds local_addr_used, local_addr_max (5.12) and
	// csum_enabled (5.14).
	InfoSizeLocalAddr = 48
	// InfoSizeCounters adds retransmits and the byte counters (6.5).
	InfoSizeCounters = 80
	// InfoSizeSubflowsTotal adds subflows_total (6.8).
	InfoSizeSubflowsTotal = 88
	// InfoSize is the size of the newest revision known to this package:
	// last_data_sent/recv and last_ack_recv (6.10), endpoint maxima in
	// the former reserved bytes (6.18).
	InfoSize = 96
)

// ErrShortInfo is returned by DecodeInfo when the buffer is shorter than
// the oldest revision of struct mptcp_info.
var ErrShortInfo = errors.New("mptcp: MPTCP_INFO reply too short")

// Info is a decoded struct mptcp_info (include/uapi/linux/mptcp.h).
//
// Kernels fill only the prefix of the struct they know about; fields past
// Size are left zero. Use the Has* methods before trusting newer fields.
//
// Note on subflow counting: Subflows (mptcpi_subflows, a.k.a.
// mptcpi_extra_subflows) counts only the *additional* subflows created
// with MP_JOIN, not the initial MP_CAPABLE subflow; SubflowsTotal (Linux
// 6.8+) counts all of them including the initial one while it is alive.
type Info struct {
	// Size is the number of bytes of the struct the kernel returned (and
	// that were decoded), at most InfoSize.
	Size int

	Subflows           uint8 // additional (MP_JOIN) subflows currently established
	AddAddrSignal      uint8 // ADD_ADDRs sent by the in-kernel path manager
	AddAddrAccepted    uint8 // ADD_ADDRs received and accepted
	SubflowsMax        uint8 // limit: additional subflows
	AddAddrSignalMax   uint8 // number of "signal" endpoints
	AddAddrAcceptedMax uint8 // limit: accepted ADD_ADDRs
	Flags              uint32
	Token              uint32
	WriteSeq           uint64
	SndUna             uint64
	RcvNxt             uint64

	// Linux 5.12+.
	LocalAddrUsed uint8
	LocalAddrMax  uint8 // number of "subflow" endpoints
	// Linux 5.14+.
	CsumEnabled bool

	// Linux 6.5+.
	Retransmits   uint32
	BytesRetrans  uint64
	BytesSent     uint64
	BytesReceived uint64
	BytesAcked    uint64

	// Linux 6.8+.
	SubflowsTotal uint8
	// Linux 6.18+ (zero, i.e. reserved, on older kernels).
	EndpLaminarMax  uint8
	EndpFullmeshMax uint8

	// Linux 6.10+: milliseconds since the last data sent, data received
	// and ack received at the MPTCP level.
	LastDataSent uint32
	LastDataRecv uint32
	LastAckRecv  uint32
}

// Fallback reports whether the kernel flagged the connection as having
// fallen back to plain TCP.
func (i Info) Fallback() bool { return i.Flags&InfoFlagFallback != 0 }

// RemoteKeyReceived reports whether the peer's MPTCP key was received.
func (i Info) RemoteKeyReceived() bool { return i.Flags&InfoFlagRemoteKeyReceived != 0 }

// HasCounters reports whether Retransmits and the Bytes* counters were
// provided by the kernel.
func (i Info) HasCounters() bool { return i.Size >= InfoSizeCounters }

// HasSubflowsTotal reports whether SubflowsTotal was provided.
func (i Info) HasSubflowsTotal() bool { return i.Size >= offSubflowsTotal+1 }

// HasLastTimes reports whether LastDataSent/LastDataRecv/LastAckRecv were
// provided.
func (i Info) HasLastTimes() bool { return i.Size >= InfoSize }

// TotalSubflows returns the number of established subflows including the
// initial one: SubflowsTotal when the kernel reports it, else Subflows+1
// (which assumes the initial subflow is still alive).
func (i Info) TotalSubflows() int {
	if i.HasSubflowsTotal() {
		return int(i.SubflowsTotal)
	}
	return int(i.Subflows) + 1
}

// Field offsets in struct mptcp_info (natural C alignment).
const (
	offSubflows           = 0
	offAddAddrSignal      = 1
	offAddAddrAccepted    = 2
	offSubflowsMax        = 3
	offAddAddrSignalMax   = 4
	offAddAddrAcceptedMax = 5
	offFlags              = 8 // 2 bytes of padding before
	offToken              = 12
	offWriteSeq           = 16
	offSndUna             = 24
	offRcvNxt             = 32
	offLocalAddrUsed      = 40
	offLocalAddrMax       = 41
	offCsumEnabled        = 42
	offRetransmits        = 44 // 1 byte of padding before
	offBytesRetrans       = 48
	offBytesSent          = 56
	offBytesReceived      = 64
	offBytesAcked         = 72
	offSubflowsTotal      = 80
	offEndpLaminarMax     = 81
	offEndpFullmeshMax    = 82
	offLastDataSent       = 84 // 1 reserved byte before
	offLastDataRecv       = 88
	offLastAckRecv        = 92
)

// DecodeInfo decodes a struct mptcp_info as returned by
// getsockopt(SOL_MPTCP, MPTCP_INFO), in host byte order. b may be shorter
// than InfoSize (older kernels); fields not entirely covered by b stay
// zero. Bytes beyond InfoSize (newer kernels) are ignored. A buffer
// shorter than InfoSizeMin yields an error wrapping ErrShortInfo.
func DecodeInfo(b []byte) (Info, error) {
	if len(b) < InfoSizeMin {
		return Info{}, fmt.Errorf("%w: %d bytes, need at least %d", ErrShortInfo, len(b), InfoSizeMin)
	}
	if len(b) > InfoSize {
		b = b[:InfoSize]
	}
	d := decoder{b: b}
	ne := binary.NativeEndian
	var i Info
	i.Size = len(b)

	i.Subflows = d.u8(offSubflows)
	i.AddAddrSignal = d.u8(offAddAddrSignal)
	i.AddAddrAccepted = d.u8(offAddAddrAccepted)
	i.SubflowsMax = d.u8(offSubflowsMax)
	i.AddAddrSignalMax = d.u8(offAddAddrSignalMax)
	i.AddAddrAcceptedMax = d.u8(offAddAddrAcceptedMax)
	i.Flags = d.u32(ne, offFlags)
	i.Token = d.u32(ne, offToken)
	i.WriteSeq = d.u64(ne, offWriteSeq)
	i.SndUna = d.u64(ne, offSndUna)
	i.RcvNxt = d.u64(ne, offRcvNxt)

	i.LocalAddrUsed = d.u8(offLocalAddrUsed)
	i.LocalAddrMax = d.u8(offLocalAddrMax)
	i.CsumEnabled = d.u8(offCsumEnabled) != 0

	i.Retransmits = d.u32(ne, offRetransmits)
	i.BytesRetrans = d.u64(ne, offBytesRetrans)
	i.BytesSent = d.u64(ne, offBytesSent)
	i.BytesReceived = d.u64(ne, offBytesReceived)
	i.BytesAcked = d.u64(ne, offBytesAcked)

	i.SubflowsTotal = d.u8(offSubflowsTotal)
	i.EndpLaminarMax = d.u8(offEndpLaminarMax)
	i.EndpFullmeshMax = d.u8(offEndpFullmeshMax)
	i.LastDataSent = d.u32(ne, offLastDataSent)
	i.LastDataRecv = d.u32(ne, offLastDataRecv)
	i.LastAckRecv = d.u32(ne, offLastAckRecv)
	return i, nil
}

// decoder reads fixed-offset fields, yielding zero for fields that are
// not entirely inside b.
type decoder struct{ b []byte }

func (d decoder) u8(off int) uint8 {
	if off+1 > len(d.b) {
		return 0
	}
	return d.b[off]
}

func (d decoder) u32(bo binary.ByteOrder, off int) uint32 {
	if off+4 > len(d.b) {
		return 0
	}
	return bo.Uint32(d.b[off:])
}

func (d decoder) u64(bo binary.ByteOrder, off int) uint64 {
	if off+8 > len(d.b) {
		return 0
	}
	return bo.Uint64(d.b[off:])
}
