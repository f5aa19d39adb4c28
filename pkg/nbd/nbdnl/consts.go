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

package nbdnl

// Wire numbers of the kernel's NBD generic netlink family.
//
// Family, commands and attributes are the enums of the Linux UAPI header
// include/uapi/linux/nbd-netlink.h; the flag bits are the NBD_CFLAG_* and
// NBD_FLAG_* defines of include/uapi/linux/nbd.h.
const (
	familyName    = "nbd"          // NBD_GENL_FAMILY_NAME
	familyVersion = 1              // NBD_GENL_VERSION
	mcastGroup    = "nbd_mc_group" // NBD_GENL_MCAST_GROUP_NAME
)

// Commands: enum NBD_CMD_*.
const (
	cmdConnect     = 1 // NBD_CMD_CONNECT
	cmdDisconnect  = 2 // NBD_CMD_DISCONNECT
	cmdReconfigure = 3 // NBD_CMD_RECONFIGURE
	cmdLinkDead    = 4 // NBD_CMD_LINK_DEAD, multicast only
	cmdStatus      = 5 // NBD_CMD_STATUS
)

// Top-level attributes: enum NBD_ATTR_*.
const (
	attrIndex             = 1  // NBD_ATTR_INDEX, u32
	attrSizeBytes         = 2  // NBD_ATTR_SIZE_BYTES, u64
	attrBlockSizeBytes    = 3  // NBD_ATTR_BLOCK_SIZE_BYTES, u64
	attrTimeout           = 4  // NBD_ATTR_TIMEOUT, u64 seconds
	attrServerFlags       = 5  // NBD_ATTR_SERVER_FLAGS, u64
	attrClientFlags       = 6  // NBD_ATTR_CLIENT_FLAGS, u64
	attrSockets           = 7  // NBD_ATTR_SOCKETS, nested
	attrDeadConnTimeout   = 8  // NBD_ATTR_DEAD_CONN_TIMEOUT, u64 seconds
	attrDeviceList        = 9  // NBD_ATTR_DEVICE_LIST, nested (STATUS reply)
	attrBackendIdentifier = 10 // NBD_ATTR_BACKEND_IDENTIFIER, string
)

// Inside NBD_ATTR_SOCKETS: [NBD_SOCK_ITEM [NBD_SOCK_FD]]...
const (
	attrSockItem = 1 // NBD_SOCK_ITEM, nested
	attrSockFD   = 1 // NBD_SOCK_FD, u32
)

// Inside NBD_ATTR_DEVICE_LIST: [NBD_DEVICE_ITEM [NBD_DEVICE_INDEX, NBD_DEVICE_CONNECTED]]...
const (
	attrDeviceItem      = 1 // NBD_DEVICE_ITEM, nested
	attrDeviceIndex     = 1 // NBD_DEVICE_INDEX, u32
	attrDeviceConnected = 2 // NBD_DEVICE_CONNECTED, u8
)

// ClientFlags are the NBD_CFLAG_* bits of NBD_ATTR_CLIENT_FLAGS.
type ClientFlags uint64

const (
	// DestroyOnDisconnect removes the device (/dev/nbdN disappears) once it
	// is disconnected. NBD_CFLAG_DESTROY_ON_DISCONNECT.
	DestroyOnDisconnect ClientFlags = 1 << 0
	// DisconnectOnClose disconnects the device when its last opener closes
	// it. NBD_CFLAG_DISCONNECT_ON_CLOSE.
	DisconnectOnClose ClientFlags = 1 << 1
)

// flagCanMultiConn is NBD_FLAG_CAN_MULTI_CONN in NBD_ATTR_SERVER_FLAGS. The
// kernel refuses more than one socket per device without it.
const flagCanMultiConn = 1 << 8

// ipprotoMPTCP is IPPROTO_MPTCP (include/uapi/linux/in.h), the SO_PROTOCOL of
// a multipath TCP socket.
const ipprotoMPTCP = 262
