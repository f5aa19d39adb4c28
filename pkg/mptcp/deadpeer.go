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
	"errors"
	"net"
	"time"
)

// A storage host that loses power sends no reset: its connections look
// open to the other side, and Linux retransmits into the silence for
// tcp_retries2 (about 15 minutes) before it reports the connection dead.
// ArmDeadPeer and LastHeard let a data connection notice such a peer
// within seconds without mistaking a slow one for a dead one: what they
// watch is the peer's kernel, which acknowledges data and keepalive
// probes however busy the server process is.

// ErrPeerUnknown is returned by LastHeard when the connection gives no
// kernel view of its peer (not a TCP socket, or no subflow to ask).
var ErrPeerUnknown = errors.New("mptcp: no kernel view of the peer")

// KeepaliveFor returns the keepalive ArmDeadPeer sets for a bound of d:
// a probe after a quarter of d without a segment from the peer and every
// quarter of d after that (whole seconds, the kernel's unit, at least
// one), so that a live peer is heard from well within d. The count
// makes the probes outlast d about three times (on a plain TCP socket
// TCP_USER_TIMEOUT ends it at d anyway).
func KeepaliveFor(d time.Duration) net.KeepAliveConfig {
	iv := max((d/4+time.Second-1)/time.Second*time.Second, time.Second)
	return net.KeepAliveConfig{Enable: true, Idle: iv, Interval: iv, Count: int(max(3*d/iv, 3))}
}

// ArmDeadPeer makes the kernel watch c's peer with a bound of d: the
// keepalive of KeepaliveFor on every socket, and on a plain TCP socket
// TCP_USER_TIMEOUT d, so that data (or a keepalive probe) unacknowledged
// for d ends the connection with ETIMEDOUT; the kernel then also drops
// what was still queued to send, which can never arrive late. An MPTCP
// socket refuses TCP_USER_TIMEOUT (ENOPROTOOPT, up to Linux 6.18 at
// least), and should: one subflow's silent path must not end a
// connection that its other subflows carry on. For MPTCP only the
// keepalive is set (the kernel passes it to every subflow); the owner
// decides with LastHeard. d <= 0 does nothing. c may be a wrapper (a TLS
// connection).
func ArmDeadPeer(c net.Conn, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	tc := TCPConn(c)
	if tc == nil {
		return ErrPeerUnknown
	}
	ka := KeepaliveFor(d)
	multipath := IsMPTCP(tc)
	if multipath {
		// Probes as often, but a subflow is reset only after about a
		// minute of silence: a path's short outage keeps its subflow,
		// which carries on when the path is back.
		ka.Count = max(ka.Count, int(time.Minute/ka.Interval))
	}
	if err := tc.SetKeepAliveConfig(ka); err != nil {
		return err
	}
	if multipath {
		return nil
	}
	return setUserTimeout(tc, d)
}

// LastHeard returns how long ago c's peer last acknowledged anything:
// for a plain TCP connection its tcp_info, for MPTCP the freshest of its
// established subflows. A peer whose host is up answers keepalive probes
// (ArmDeadPeer), so this stays short while its server process is merely
// slow, and grows without bound when the host is silent. The error wraps
// ErrPeerUnknown when c says nothing of its peer.
func LastHeard(c net.Conn) (time.Duration, error) {
	tc := TCPConn(c)
	if tc == nil {
		return 0, ErrPeerUnknown
	}
	if IsMPTCP(tc) {
		subs, err := GetSubflows(tc)
		if err != nil {
			return 0, err
		}
		best := time.Duration(-1)
		for _, s := range subs {
			if s.State != tcpEstablished {
				continue
			}
			if best < 0 || s.LastAckRecv < best {
				best = s.LastAckRecv
			}
		}
		if best < 0 {
			return 0, ErrPeerUnknown
		}
		return best, nil
	}
	return lastAckRecv(tc)
}
