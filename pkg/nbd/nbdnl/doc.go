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

// Package nbdnl drives the Linux kernel NBD client through its generic
// netlink family ("nbd", version 1, multicast group "nbd_mc_group").
//
// A Client hands connected sockets to the kernel (Connect), replaces dead
// ones (Reconfigure), tears devices down (Disconnect), lists them (Status,
// StatusAll) and reports dead links (WatchLinkDead). The sysfs helpers
// (WaitReady, Backend, FindByBackend) read /sys/block/nbdN.
//
// # Kernel behaviour the client relies on
//
// Read from drivers/block/nbd.c; it holds from 6.1 on unless a version is
// named:
//
//   - CONNECT, DISCONNECT and RECONFIGURE need CAP_SYS_ADMIN (EPERM
//     otherwise); STATUS has no capability check.
//   - CONNECT without NBD_ATTR_INDEX takes the first existing device that
//     has no configuration (newer kernels also skip devices marked
//     destroy-on-disconnect) and creates a new one if there is none. With an
//     index, a missing device is created; a configured one gives EBUSY.
//     SIZE_BYTES and SOCKETS are required (EINVAL). More than one socket
//     without NBD_FLAG_CAN_MULTI_CONN in the server flags gives EINVAL, as
//     does a socket that is not TCP or a UNIX stream socket on kernels that
//     carry "nbd: restrict sockets to TCP and UDP" (upstream commit
//     9f7c02e03157, September 2025, backported to stable series including
//     6.1); an MPTCP socket is refused there. The reply carries NBD_ATTR_INDEX.
//   - DISCONNECT and RECONFIGURE of an index with no device give EINVAL (not
//     ENOENT). DISCONNECT of a device that exists but is not configured
//     succeeds and does nothing.
//   - RECONFIGURE of a device that has a backend identifier needs the same
//     identifier again (EINVAL on mismatch or when missing). Each socket it
//     carries replaces one dead connection slot; once no slot is dead the
//     remaining sockets are ignored and the command still succeeds. Sent
//     client flags replace the current ones (a clear bit clears).
//   - STATUS with an index that names no device succeeds with an empty
//     device list.
//   - The family is visible outside the initial network namespace only from
//     6.4 on ("nbd: allow genl access outside init_net"); before that the
//     family lookup fails with ENOENT there, just as when the driver is not
//     loaded. NBD_CMD_LINK_DEAD is multicast to the initial network
//     namespace only, on every version.
package nbdnl
