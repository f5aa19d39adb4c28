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

// Numbers of the in-kernel path manager's generic netlink interface.
//
// Source: the Linux UAPI headers include/uapi/linux/mptcp_pm.h (generated
// from Documentation/netlink/specs/mptcp_pm.yaml) and
// include/uapi/linux/mptcp.h, checked against Linux 6.18. The limits come
// from net/mptcp/pm_kernel.c (MPTCP_PM_ADDR_MAX), which applies the same
// maximum to the number of endpoints per network namespace and to each of
// the two limits.

const (
	// MPTCP_PM_NAME, MPTCP_PM_VER
	pmFamilyName    = "mptcp_pm"
	pmFamilyVersion = 1

	// enum mptcp_pm_cmd (MPTCP_PM_CMD_*); 0 is UNSPEC.
	pmCmdAddAddr    = 1 // MPTCP_PM_CMD_ADD_ADDR
	pmCmdDelAddr    = 2 // MPTCP_PM_CMD_DEL_ADDR
	pmCmdGetAddr    = 3 // MPTCP_PM_CMD_GET_ADDR (do and dump)
	pmCmdFlushAddrs = 4 // MPTCP_PM_CMD_FLUSH_ADDRS
	pmCmdSetLimits  = 5 // MPTCP_PM_CMD_SET_LIMITS
	pmCmdGetLimits  = 6 // MPTCP_PM_CMD_GET_LIMITS
	pmCmdSetFlags   = 7 // MPTCP_PM_CMD_SET_FLAGS

	// Top-level attributes (MPTCP_PM_ATTR_*; MPTCP_PM_ENDPOINT_ADDR is
	// the same number as MPTCP_PM_ATTR_ADDR).
	pmAttrAddr        = 1 // nested address attributes
	pmAttrRcvAddAddrs = 2 // u32: limit add_addr_accepted
	pmAttrSubflows    = 3 // u32: limit subflows

	// Nested address attributes (MPTCP_PM_ADDR_ATTR_*).
	pmAddrAttrFamily = 1 // u16: AF_INET or AF_INET6
	pmAddrAttrID     = 2 // u8
	pmAddrAttrAddr4  = 3 // be32 (struct in_addr)
	pmAddrAttrAddr6  = 4 // 16 bytes (struct in6_addr)
	pmAddrAttrPort   = 5 // u16, host byte order (the kernel does htons/ntohs)
	pmAddrAttrFlags  = 6 // u32: MPTCP_PM_ADDR_FLAG_*
	pmAddrAttrIfIdx  = 7 // s32

	// Address families as sent in pmAddrAttrFamily (Linux values).
	afInet  = 2
	afInet6 = 10
)

// Endpoint flags (MPTCP_PM_ADDR_FLAG_*).
const (
	// Signal: announce the address to peers with ADD_ADDR.
	Signal EndpointFlags = 1 << 0
	// Subflow: create an additional subflow from the address.
	Subflow EndpointFlags = 1 << 1
	// Backup: subflows on the address are backup subflows.
	Backup EndpointFlags = 1 << 2
	// Fullmesh: create subflows from the address to every known peer
	// address (only with Subflow).
	Fullmesh EndpointFlags = 1 << 3
	// Implicit: set by the kernel on endpoints it created for an address
	// used by a subflow without an endpoint; cannot be requested.
	Implicit EndpointFlags = 1 << 4
	// Laminar: use the address for subflows towards addresses the peer
	// announced (Linux 6.18).
	Laminar EndpointFlags = 1 << 5
)

const (
	// MaxEndpoints is the kernel's limit of endpoints per network
	// namespace (MPTCP_PM_ADDR_MAX). ADD_ADDR past it fails with ERANGE,
	// reported as ErrTooManyEndpoints.
	MaxEndpoints = 8

	// MaxLimit is the largest value SET_LIMITS accepts for either limit
	// (also MPTCP_PM_ADDR_MAX); larger values fail with EINVAL.
	MaxLimit = 8

	// settableFlags are the flags SET_FLAGS changes; the kernel ignores
	// the others.
	settableFlags = Backup | Fullmesh
)
