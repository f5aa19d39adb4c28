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

package nbddev

import (
	"net"

	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// armSockets gives every socket handed to the kernel the dead-peer bound
// before the kernel takes it (the options stay with the socket): a
// keepalive, and on plain TCP sockets (tcp, multiconn) TCP_USER_TIMEOUT.
// A storage host that falls silent then makes the socket fail with
// ETIMEDOUT within the bound, whether requests wait on it or not; the
// kernel marks it dead and multicasts LINK_DEAD, and the watcher redials
// and hands the kernel a new socket (RECONFIGURE) while the path or host
// is still away for multiconn, once it is back for tcp. The requests in
// flight on the dead socket are requeued only when their request
// timeout passes (the kernel does not requeue on a socket's death; seen
// in the VM: a 30 s stall with the default, 10 s with requestTimeout
// 10s), so the request timeout bounds the stall: a class that wants
// shorter stalls sets requestTimeout, and the dead-peer bound follows at
// half. The kernel purges a timed-out socket's send queue, so nothing
// queued on it reaches the server late, after the requests were requeued
// elsewhere; the request timeout, at least twice the bound, never
// requeues a request of a socket that could still deliver it. MPTCP
// sockets (the kernel transport) refuse TCP_USER_TIMEOUT and get only
// the keepalive; there the request timeout is what ends a silent
// connection.
func (a *Attacher) armSockets(v *volume, conns []net.Conn) {
	for _, c := range conns {
		if err := mptcp.ArmDeadPeer(c, v.opts.DeadPeerTimeout); err != nil {
			a.log.Warn("cannot bound the wait on a silent storage host on this socket", "volume_id", v.target.VolumeID, "error", err)
		}
	}
}
