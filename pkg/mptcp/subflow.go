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
	"net/netip"
	"time"
)

// Socket options of level SolMPTCP that list an MPTCP connection's
// subflows (include/uapi/linux/mptcp.h).
const (
	// OptTCPInfo (MPTCP_TCPINFO, Linux 5.16) returns a struct tcp_info
	// per subflow after a struct mptcp_subflow_data header.
	OptTCPInfo = 2
	// OptSubflowAddrs (MPTCP_SUBFLOW_ADDRS, Linux 5.16) returns a struct
	// mptcp_subflow_addrs per subflow after the same header.
	OptSubflowAddrs = 3
	// OptFullInfo (MPTCP_FULL_INFO, Linux 6.5) returns the connection's
	// struct mptcp_info and, into arrays the caller points it at, a struct
	// mptcp_subflow_info and a struct tcp_info per subflow, all taken
	// under one lock.
	OptFullInfo = 4
)

// Sizes of the structures the subflow options exchange.
const (
	// FullInfoHeaderSize is the part of struct mptcp_full_info before
	// its embedded struct mptcp_info: six u32 sizes and counts, then the
	// two u64 user pointers to the arrays.
	FullInfoHeaderSize = 40
	// FullInfoSize is struct mptcp_full_info with the newest struct
	// mptcp_info this package knows.
	FullInfoSize = FullInfoHeaderSize + InfoSize
	// SubflowDataSize is struct mptcp_subflow_data, the header of the
	// MPTCP_TCPINFO and MPTCP_SUBFLOW_ADDRS replies.
	SubflowDataSize = 16
	// sockaddrStorageSize is struct __kernel_sockaddr_storage (8-byte
	// aligned).
	sockaddrStorageSize = 128
	// SubflowAddrsSize is struct mptcp_subflow_addrs: a local and a
	// remote sockaddr_storage.
	SubflowAddrsSize = 2 * sockaddrStorageSize
	// SubflowInfoSize is struct mptcp_subflow_info: a u32 id, 4 bytes of
	// padding, then struct mptcp_subflow_addrs.
	SubflowInfoSize = 8 + SubflowAddrsSize
	// TCPInfoSize is how much of struct tcp_info this package asks for:
	// up to and including tcpi_bytes_retrans (Linux 4.19). Older kernels
	// return less; the counters they lack stay zero.
	TCPInfoSize = offTCPBytesRetrans + 8
)

// Field offsets in struct mptcp_full_info.
const (
	offFullSizeTCPInfoKernel = 0
	offFullSizeTCPInfoUser   = 4
	offFullSizeSfInfoKernel  = 8
	offFullSizeSfInfoUser    = 12
	offFullNumSubflows       = 16
	offFullSizeArraysUser    = 20
	offFullSubflowInfo       = 24 // __aligned_u64 user pointer
	offFullTCPInfo           = 32 // __aligned_u64 user pointer
)

// Field offsets in struct mptcp_subflow_data.
const (
	offSfdSizeSubflowData = 0
	offSfdNumSubflows     = 4
	offSfdSizeKernel      = 8
	offSfdSizeUser        = 12
)

// Field offsets in struct mptcp_subflow_info.
const (
	offSfInfoID    = 0
	offSfInfoAddrs = 8
)

// Field offsets in struct tcp_info (include/uapi/linux/tcp.h).
const (
	offTCPState         = 0
	offTCPLastAckRecv   = 56  // tcpi_last_ack_recv, milliseconds
	offTCPBytesAcked    = 120 // tcpi_bytes_acked (4.1)
	offTCPBytesReceived = 128 // tcpi_bytes_received (4.1)
	offTCPBytesSent     = 200 // tcpi_bytes_sent (4.19)
	offTCPBytesRetrans  = 208 // tcpi_bytes_retrans (4.19)
)

// ErrShortSubflows is returned by the subflow decoders when a reply is
// shorter than its header says.
var ErrShortSubflows = errors.New("mptcp: subflow reply too short")

// SubflowInfo is one TCP subflow of an MPTCP connection: the path it
// takes and the bytes it carried. The counters are the subflow's own (struct
// tcp_info) and start at zero when the subflow is created.
type SubflowInfo struct {
	// ID is the kernel's subflow id (MPTCP_FULL_INFO only; zero when
	// read with the older options).
	ID uint32
	// Local and Remote are the subflow's addresses; invalid (the zero
	// AddrPort) when the kernel did not report them.
	Local, Remote netip.AddrPort
	// State is the TCP state (tcpi_state: 1 established, ...).
	State uint8
	// BytesSent counts the bytes sent, retransmissions included
	// (tcpi_bytes_sent); BytesRetrans the retransmitted ones.
	BytesSent, BytesRetrans uint64
	// BytesAcked counts the bytes the peer acknowledged
	// (tcpi_bytes_acked).
	BytesAcked uint64
	// BytesReceived counts the bytes received in order
	// (tcpi_bytes_received).
	BytesReceived uint64
	// LastAckRecv is how long ago the subflow last received an
	// acknowledgement it accepted (tcpi_last_ack_recv): a peer whose
	// kernel answers keepalive probes keeps it short however slow its
	// server process is.
	LastAckRecv time.Duration
	// RTT is the smoothed round-trip time (tcpi_rtt); DeliveryRate the
	// kernel's latest estimate of the rate at which the subflow's data
	// reached the peer, in bytes per second (tcpi_delivery_rate, Linux
	// 4.18; zero before).
	RTT          time.Duration
	DeliveryRate uint64
}

// FullInfo is a decoded MPTCP_FULL_INFO reply.
type FullInfo struct {
	// Info is the connection's MPTCP_INFO, taken with the subflows.
	Info Info
	// Subflows are the subflows the kernel filled in, at most the
	// number of array slots the caller provided.
	Subflows []SubflowInfo
	// Total is the number of subflows the connection has; more than
	// len(Subflows) when the arrays were too small.
	Total int
}

// DecodeFullInfo decodes an MPTCP_FULL_INFO reply: full is struct
// mptcp_full_info as the kernel rewrote it (n bytes of it, the length it
// reported), sfinfo and tcpinfo the arrays the struct pointed at. The
// kernel sets the element sizes it used in the header; the arrays must
// hold that many bytes for each subflow it filled.
func DecodeFullInfo(full, sfinfo, tcpinfo []byte) (FullInfo, error) {
	if len(full) < FullInfoHeaderSize {
		return FullInfo{}, fmt.Errorf("%w: MPTCP_FULL_INFO header of %d bytes, need %d", ErrShortSubflows, len(full), FullInfoHeaderSize)
	}
	ne := binary.NativeEndian
	d := decoder{b: full}
	var fi FullInfo
	if len(full) > FullInfoHeaderSize {
		info, err := DecodeInfo(full[FullInfoHeaderSize:])
		if err != nil {
			return FullInfo{}, err
		}
		fi.Info = info
	}
	sfSize := int(d.u32(ne, offFullSizeSfInfoUser))
	tcpSize := int(d.u32(ne, offFullSizeTCPInfoUser))
	total := int(d.u32(ne, offFullNumSubflows))
	slots := int(d.u32(ne, offFullSizeArraysUser))
	fi.Total = total
	n := min(total, slots)
	if n == 0 {
		return fi, nil
	}
	// Zero-sized elements would make any count fit (the kernel never
	// reports them when it fills the arrays), and counts and sizes are
	// compared by division: their product may overflow.
	if sfSize <= 0 || tcpSize <= 0 || n > len(sfinfo)/sfSize || n > len(tcpinfo)/tcpSize {
		return FullInfo{}, fmt.Errorf("%w: %d subflows of %d+%d bytes, arrays of %d and %d bytes",
			ErrShortSubflows, n, sfSize, tcpSize, len(sfinfo), len(tcpinfo))
	}
	fi.Subflows = make([]SubflowInfo, n)
	for i := range n {
		s := &fi.Subflows[i]
		sf := sfinfo[i*sfSize : (i+1)*sfSize]
		s.ID = decoder{b: sf}.u32(ne, offSfInfoID)
		if len(sf) > offSfInfoAddrs {
			s.Local, s.Remote = decodeSubflowAddrs(sf[offSfInfoAddrs:])
		}
		decodeTCPInfo(s, tcpinfo[i*tcpSize:(i+1)*tcpSize])
	}
	return fi, nil
}

// DecodeSubflowData splits an MPTCP_TCPINFO or MPTCP_SUBFLOW_ADDRS reply
// (n bytes: the length the kernel reported) into its elements, and
// returns the number of subflows the connection has, which may be more
// than the elements that fitted.
func DecodeSubflowData(b []byte) (elems [][]byte, total int, err error) {
	if len(b) < SubflowDataSize {
		return nil, 0, fmt.Errorf("%w: header of %d bytes, need %d", ErrShortSubflows, len(b), SubflowDataSize)
	}
	ne := binary.NativeEndian
	hdr := int(ne.Uint32(b[offSfdSizeSubflowData:]))
	total = int(ne.Uint32(b[offSfdNumSubflows:]))
	size := int(ne.Uint32(b[offSfdSizeUser:]))
	if hdr < SubflowDataSize || hdr > len(b) {
		return nil, 0, fmt.Errorf("%w: header size %d in a reply of %d bytes", ErrShortSubflows, hdr, len(b))
	}
	data := b[hdr:]
	if size <= 0 {
		return nil, total, nil
	}
	n := min(total, len(data)/size)
	elems = make([][]byte, n)
	for i := range n {
		elems[i] = data[i*size : (i+1)*size]
	}
	return elems, total, nil
}

// decodeSubflowAddrs decodes a struct mptcp_subflow_addrs, or the prefix
// of it the kernel returned.
func decodeSubflowAddrs(b []byte) (local, remote netip.AddrPort) {
	local = decodeSockaddr(b[:min(len(b), sockaddrStorageSize)])
	if len(b) > sockaddrStorageSize {
		remote = decodeSockaddr(b[sockaddrStorageSize:min(len(b), SubflowAddrsSize)])
	}
	return local, remote
}

// decodeTCPInfo decodes into s the fields of a struct tcp_info (or of the
// prefix of it the kernel returned) that SubflowInfo carries.
func decodeTCPInfo(s *SubflowInfo, b []byte) {
	ne := binary.NativeEndian
	d := decoder{b: b}
	s.State = d.u8(offTCPState)
	s.LastAckRecv = time.Duration(d.u32(ne, offTCPLastAckRecv)) * time.Millisecond
	s.BytesAcked = d.u64(ne, offTCPBytesAcked)
	s.BytesReceived = d.u64(ne, offTCPBytesReceived)
	s.BytesSent = d.u64(ne, offTCPBytesSent)
	s.BytesRetrans = d.u64(ne, offTCPBytesRetrans)
	s.RTT = time.Duration(d.u32(ne, offTCPRTT)) * time.Microsecond
	s.DeliveryRate = d.u64(ne, offTCPDeliveryRate)
}

// decodeSockaddr decodes a sockaddr_in or sockaddr_in6 (family in host
// byte order, port and address in network byte order); anything else, or
// a truncated one, is the zero AddrPort. IPv4-mapped IPv6 addresses are
// unmapped.
func decodeSockaddr(b []byte) netip.AddrPort {
	if len(b) < 2 {
		return netip.AddrPort{}
	}
	switch binary.NativeEndian.Uint16(b) {
	case afInet:
		if len(b) < 8 {
			return netip.AddrPort{}
		}
		return netip.AddrPortFrom(netip.AddrFrom4([4]byte(b[4:8])), binary.BigEndian.Uint16(b[2:]))
	case afInet6:
		if len(b) < 24 {
			return netip.AddrPort{}
		}
		return netip.AddrPortFrom(netip.AddrFrom16([16]byte(b[8:24])).Unmap(), binary.BigEndian.Uint16(b[2:]))
	}
	return netip.AddrPort{}
}
