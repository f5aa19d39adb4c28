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
	"net/netip"
	"time"
)

// Measuring a flagged path beside the connection.
//
// A path flagged backup carries none of the connection's data, so the
// connection no longer measures it. Clearing the flag to measure it puts
// data on it again, and while it is still slow that data holds up what
// the fast paths carry behind it. ProbePath measures the path beside the
// connection instead: it sends ICMP echo requests of many fragments from
// the path's local address to its peer, paced at a given rate for a
// fraction of a second, and counts how many come back. A path that
// carries the rate answers them all; a slower one drops what it cannot
// carry in its queues, and a fragment lost loses its request or reply
// whole. The requests of the first third, which a shaper's bucket and an
// empty queue let through, do not count; the rate returned is the asked
// rate times the share of the others answered. Requests and replies cross
// the path in both directions, so the verdict is the slower direction's.
// The connection's data meanwhile stays on the other paths.
//
// A sender that is not scheduled in time sends late, never in a burst
// (which a fast path's queue would drop): the probe takes longer and a
// slow path answers more of it, so a probe that took over twice its time
// has no verdict (ErrProbeStarved) and is repeated later.
//
// The probe needs a raw ICMP socket (CAP_NET_RAW, which the node plugin
// and the storage agent have) and a peer that answers echo requests; when
// either is missing, it fails and SlowPaths falls back to clearing the
// flag.

// Probe parameters.
const (
	// probePacket is the size of one echo request and reply, IP header
	// included. The IP layer sends it in fragments; one datagram of many
	// fragments costs the probe one system call each way, where packets
	// of one fragment each cost so many calls that a busy host could not
	// send them at a fast path's rate. A fragment dropped loses its
	// datagram: asked more than it carries, a path returns far less than
	// its speed, so the caller asks a little over the rate it needs.
	probePacket = 32000
	// probeLength is how long the requests are sent, probeGrace the
	// wait for the last replies, probeBurst how far behind its pace a
	// late sender may catch up at once (about what a sleep takes on a
	// busy host).
	probeLength = 150 * time.Millisecond
	probeGrace  = 50 * time.Millisecond
	probeBurst  = 3 * time.Millisecond
	// probeMaxRate bounds the rate of a probe (about 10,000 requests a
	// second): faster paths cannot be measured this way.
	probeMaxRate = ProbeMaxRate
	// probeReachWait bounds the wait for the reply to the first request,
	// which tells an unreachable peer from a slow path.
	probeReachWait = time.Second
)

// ProbeMaxRate is the highest rate, in bytes per second, ProbePath sends.
const ProbeMaxRate = 320e6

// ErrProbeRate: the rate asked of ProbePath is beyond what it can send.
var ErrProbeRate = errors.New("mptcp: path probe rate too high to measure by ICMP")

// ErrProbeStarved: ProbePath could not send its requests in time (a busy
// host); the probe has no verdict.
var ErrProbeStarved = errors.New("mptcp: path probe sender starved of CPU")

// ProbePath sends ICMP echo requests from local to remote at rate bytes
// per second for a fraction of a second and returns the rate, in bytes per
// second, that the path carried of it (rate times the share answered). It
// fails when remote answers no echo request (within a second), the socket
// cannot be made or the sender was starved (ErrProbeStarved).
// It runs in the calling thread's network namespace.
func ProbePath(local, remote netip.Addr, rate float64) (float64, error) {
	if rate <= 0 || rate > probeMaxRate {
		return 0, ErrProbeRate
	}
	return probePath(local.Unmap(), remote.Unmap(), rate)
}

// answeredRate is rate times the share of the requests after the first
// third whose replies came back; answered[seq] tells, for seq from 1.
func answeredRate(answered []bool, rate float64) float64 {
	n := len(answered) - 1
	if n < 3 {
		return 0
	}
	from := 1 + n/3
	got := 0
	for _, ok := range answered[from:] {
		if ok {
			got++
		}
	}
	return rate * float64(got) / float64(n+1-from)
}

// ICMP message types.
const (
	icmpEchoReply     = 0
	icmpEchoRequest   = 8
	icmp6EchoRequest  = 128
	icmp6EchoReply    = 129
	ipv4HeaderLen     = 20
	ipv6HeaderLen     = 40
	icmpEchoHeaderLen = 8
)

// echoRequests makes echo requests with id, each payload bytes long
// after its ICMP header; at(seq) returns the one with sequence number
// seq, in a buffer that the next call overwrites.
type echoRequests struct {
	v6  bool
	b   []byte
	sum uint32 // one's complement sum of the request with seq and checksum 0
}

func newEchoRequests(v6 bool, id uint16, payload int) *echoRequests {
	b := make([]byte, icmpEchoHeaderLen+payload)
	b[0] = icmpEchoRequest
	if v6 {
		b[0] = icmp6EchoRequest // the kernel fills the ICMPv6 checksum
	}
	binary.BigEndian.PutUint16(b[4:], id)
	return &echoRequests{v6: v6, b: b, sum: onesSum(b)}
}

func (r *echoRequests) at(seq uint16) []byte {
	binary.BigEndian.PutUint16(r.b[6:], seq)
	if !r.v6 {
		binary.BigEndian.PutUint16(r.b[2:], ^fold(r.sum+uint32(seq)))
	}
	return r.b
}

// parseEchoReply reads an ICMP message (after any IP header) and returns
// its id and whether it is an echo reply.
func parseEchoReply(v6 bool, b []byte) (id uint16, ok bool) {
	want := byte(icmpEchoReply)
	if v6 {
		want = icmp6EchoReply
	}
	if len(b) < icmpEchoHeaderLen || b[0] != want || b[1] != 0 {
		return 0, false
	}
	return binary.BigEndian.Uint16(b[4:]), true
}

// inetChecksum is the Internet checksum (RFC 1071) of b.
func inetChecksum(b []byte) uint16 { return ^fold(onesSum(b)) }

// onesSum adds b up as big-endian 16-bit words, unfolded.
func onesSum(b []byte) uint32 {
	var sum uint32
	for len(b) >= 2 {
		sum += uint32(b[0])<<8 | uint32(b[1])
		b = b[2:]
	}
	if len(b) == 1 {
		sum += uint32(b[0]) << 8
	}
	return sum
}

// fold folds a sum's carries into 16 bits.
func fold(sum uint32) uint16 {
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	return uint16(sum)
}
