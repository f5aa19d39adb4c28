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
	"testing"
)

func TestInetChecksum(t *testing.T) {
	// RFC 1071's example: the one's complement sum is ddf2.
	if got := inetChecksum([]byte{0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7}); got != ^uint16(0xddf2) {
		t.Fatalf("checksum %#04x, want %#04x", got, ^uint16(0xddf2))
	}
	if got := inetChecksum([]byte{0x01}); got != ^uint16(0x0100) {
		t.Fatalf("odd length: %#04x", got)
	}
}

func TestEchoRequest(t *testing.T) {
	reqs := newEchoRequests(false, 0x1234, 101)
	for _, seq := range []uint16{0, 7, 0xffff, 0x8001} {
		b := reqs.at(seq)
		if len(b) != 109 || b[0] != icmpEchoRequest || binary.BigEndian.Uint16(b[6:]) != seq || inetChecksum(b) != 0 {
			t.Fatalf("IPv4 echo request %d % x: length %d, checksum over it %#04x (want 0)", seq, b[:8], len(b), inetChecksum(b))
		}
	}
	if b6 := newEchoRequests(true, 0x1234, 100).at(7); b6[0] != icmp6EchoRequest || b6[2] != 0 || b6[3] != 0 {
		t.Fatalf("IPv6 echo request % x: want type 128 and the checksum left to the kernel", b6[:8])
	}
	b := reqs.at(7)
	// The request's reply, as the peer turns it round.
	b[0] = icmpEchoReply
	if id, ok := parseEchoReply(false, b); !ok || id != 0x1234 {
		t.Fatalf("reply id %#x, %v", id, ok)
	}
	if _, ok := parseEchoReply(true, b); ok {
		t.Fatal("an ICMPv4 reply parsed as ICMPv6")
	}
	if _, ok := parseEchoReply(false, b[:7]); ok {
		t.Fatal("a truncated reply parsed")
	}
}

func TestAnsweredRate(t *testing.T) {
	answered := make([]bool, 91) // 90 requests: the first 30 do not count
	for i := 1; i <= 30; i++ {
		answered[i] = true
	}
	for i := 31; i <= 90; i += 4 {
		answered[i] = true // 15 of the 60 that count
	}
	if got := answeredRate(answered, 100); got != 25 {
		t.Fatalf("rate %v, want 25 (a quarter of 100)", got)
	}
	if got := answeredRate(make([]bool, 2), 100); got != 0 {
		t.Fatalf("rate of a probe of one request: %v", got)
	}
}
