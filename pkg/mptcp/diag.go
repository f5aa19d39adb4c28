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
	"fmt"
	"net/netip"
	"time"

	"github.com/mdlayher/netlink"
)

// The kernel's socket diagnostics (NETLINK_SOCK_DIAG, include/uapi/linux/
// inet_diag.h and sock_diag.h) list every TCP socket of a network namespace
// with its struct tcp_info, MPTCP subflows included: they are TCP sockets
// whose upper layer protocol (ULP) is "mptcp". Reading them needs no handle
// on the connections, so one process sees the subflows of every process on
// the host: the data-path processes of a node, or any NBD server.
const (
	netlinkSockDiag   = 4  // NETLINK_SOCK_DIAG
	sockDiagByFamily  = 20 // SOCK_DIAG_BY_FAMILY
	diagReqSize       = 56 // struct inet_diag_req_v2
	diagMsgSize       = 72 // struct inet_diag_msg
	diagAttrInfo      = 2  // INET_DIAG_INFO: struct tcp_info
	diagAttrULPInfo   = 19 // INET_DIAG_ULP_INFO (nested)
	ulpInfoName       = 1  // INET_ULP_INFO_NAME
	ulpInfoMPTCP      = 3  // INET_ULP_INFO_MPTCP (nested MPTCP_SUBFLOW_ATTR_*)
	subflowAttrFlags  = 8  // MPTCP_SUBFLOW_ATTR_FLAGS
	subflowFlagBkupRm = 1 << 4
	subflowFlagBkupLc = 1 << 5
	tcpEstablished    = 1

	offTCPAppLimited   = 7   // tcpi_delivery_rate_app_limited: bit 0
	offTCPRTT          = 68  // tcpi_rtt, microseconds
	offTCPDeliveryRate = 160 // tcpi_delivery_rate, bytes per second (4.18)
)

// TCPSocket is one established TCP socket as the socket diagnostics report
// it.
type TCPSocket struct {
	// Cookie identifies the socket for as long as it exists.
	Cookie uint64
	// Local and Remote are its addresses (IPv4-mapped ones unmapped).
	Local, Remote netip.AddrPort
	// Subflow says the socket is an MPTCP subflow; BackupLocal and
	// BackupRemote say this host or the peer marked it backup (MP_PRIO or
	// the backup flag of the endpoint it was made from).
	Subflow                   bool
	BackupLocal, BackupRemote bool
	// BytesAcked counts the bytes the peer acknowledged (tcpi_bytes_acked).
	BytesAcked uint64
	// DeliveryRate is the kernel's latest estimate of the rate at which the
	// socket's data reached the peer, in bytes per second
	// (tcpi_delivery_rate). AppLimited says the sender did not have
	// enough data to fill the path while it was measured, so the path
	// may carry more.
	DeliveryRate uint64
	AppLimited   bool
	// RTT is the smoothed round-trip time.
	RTT time.Duration
}

// diagRequest builds a struct inet_diag_req_v2 asking for the established
// TCP sockets of family with their struct tcp_info.
func diagRequest(family uint8) []byte {
	b := make([]byte, diagReqSize)
	b[0] = family
	b[1] = 6                       // IPPROTO_TCP
	b[2] = 1 << (diagAttrInfo - 1) // idiag_ext
	binary.NativeEndian.PutUint32(b[4:], 1<<tcpEstablished)
	return b
}

// decodeDiagMsg decodes a struct inet_diag_msg and its attributes.
func decodeDiagMsg(b []byte) (TCPSocket, error) {
	if len(b) < diagMsgSize {
		return TCPSocket{}, fmt.Errorf("mptcp: socket diagnostics message of %d bytes, need %d", len(b), diagMsgSize)
	}
	var s TCPSocket
	family := b[0]
	sport, dport := binary.BigEndian.Uint16(b[4:]), binary.BigEndian.Uint16(b[6:])
	var src, dst netip.Addr
	switch family {
	case afInet:
		src, dst = netip.AddrFrom4([4]byte(b[8:12])), netip.AddrFrom4([4]byte(b[24:28]))
	case afInet6:
		src, dst = netip.AddrFrom16([16]byte(b[8:24])).Unmap(), netip.AddrFrom16([16]byte(b[24:40])).Unmap()
	default:
		return TCPSocket{}, fmt.Errorf("mptcp: socket diagnostics message of address family %d", family)
	}
	s.Local, s.Remote = netip.AddrPortFrom(src, sport), netip.AddrPortFrom(dst, dport)
	ne := binary.NativeEndian
	s.Cookie = uint64(ne.Uint32(b[44:])) | uint64(ne.Uint32(b[48:]))<<32

	ad, err := netlink.NewAttributeDecoder(b[diagMsgSize:])
	if err != nil {
		return TCPSocket{}, fmt.Errorf("mptcp: socket diagnostics attributes: %w", err)
	}
	for ad.Next() {
		switch ad.Type() {
		case diagAttrInfo:
			d := decoder{b: ad.Bytes()}
			s.AppLimited = d.u8(offTCPAppLimited)&1 != 0
			s.RTT = time.Duration(d.u32(ne, offTCPRTT)) * time.Microsecond
			s.BytesAcked = d.u64(ne, offTCPBytesAcked)
			s.DeliveryRate = d.u64(ne, offTCPDeliveryRate)
		case diagAttrULPInfo:
			ad.Nested(func(nd *netlink.AttributeDecoder) error {
				for nd.Next() {
					switch nd.Type() {
					case ulpInfoName:
						s.Subflow = nd.String() == "mptcp"
					case ulpInfoMPTCP:
						nd.Nested(func(md *netlink.AttributeDecoder) error {
							for md.Next() {
								if md.Type() == subflowAttrFlags {
									f := md.Uint32()
									s.BackupLocal = f&subflowFlagBkupLc != 0
									s.BackupRemote = f&subflowFlagBkupRm != 0
								}
							}
							return nil
						})
					}
				}
				return nil
			})
		}
	}
	if err := ad.Err(); err != nil {
		return TCPSocket{}, fmt.Errorf("mptcp: socket diagnostics attributes: %w", err)
	}
	return s, nil
}
