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

// Package ublk serves a Linux ublk block device (/dev/ublkbN) from
// userspace: control commands to /dev/ublk-control and, per hardware
// queue, FETCH_REQ / COMMIT_AND_FETCH_REQ on /dev/ublkcN, both as
// io_uring URING_CMD entries (pkg/iouring). A Handler does the I/O (the
// NBD session, for the ublk transport). Devices are created with user
// recovery: when the serving process dies the kernel keeps the device and
// holds its I/O, and a new process takes it over with Recover. Only Linux
// has ublk (mainline since 6.0; the kernel module is ublk_drv).
package ublk
