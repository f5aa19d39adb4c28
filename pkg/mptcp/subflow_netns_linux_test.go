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

package mptcp_test

import (
	"io"
	"net"
	"net/netip"
	"testing"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// TestSubflowsPerPath moves data over an MPTCP connection with a subflow
// on each of 2 paths, both ways, and reads the bytes per subflow on both
// ends: every path carried some, and together at least what was moved.
func TestSubflowsPerPath(t *testing.T) {
	tp := topo.NewForTest(t, topo.Uniform(topo.UniqueName("sf"), 2, 1000))
	if err := mptcp.Available(); err != nil {
		t.Skipf("skipping: MPTCP unavailable: %v", err)
	}
	// Both paths carry some: the data moves once the second subflow is
	// there.
	client, server := connectAllPaths(t, tp)

	const up, down = 16 << 20, 8 << 20
	done := make(chan error, 1)
	go func() {
		if _, err := io.CopyN(io.Discard, server, up); err != nil {
			done <- err
			return
		}
		_, err := server.Write(make([]byte, down))
		done <- err
	}()
	if _, err := client.Write(make([]byte, up)); err != nil {
		t.Fatal(err)
	}
	if _, err := io.CopyN(io.Discard, client, down); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}

	for _, read := range []struct {
		name string
		fn   func(net.Conn) ([]mptcp.SubflowInfo, error)
	}{{"full-info", mptcp.GetSubflows}, {"legacy", mptcp.GetSubflowsLegacy}} {
		for _, side := range []struct {
			name       string
			c          net.Conn
			sent, recv uint64
			local      func(int) netip.Addr
			remote     func(int) netip.Addr
		}{
			{"client", client, up, down, tp.ClientAddr, tp.ServerAddr},
			{"server", server, down, up, tp.ServerAddr, tp.ClientAddr},
		} {
			subs, err := read.fn(side.c)
			if err != nil {
				t.Fatalf("%s %s: %v", read.name, side.name, err)
			}
			if len(subs) != 2 {
				t.Fatalf("%s %s: %d subflows, want 2: %+v", read.name, side.name, len(subs), subs)
			}
			var sent, acked, recv uint64
			seen := map[int]bool{}
			for _, s := range subs {
				t.Logf("%s %s: %s -> %s sent %d acked %d received %d retransmitted %d",
					read.name, side.name, s.Local, s.Remote, s.BytesSent, s.BytesAcked, s.BytesReceived, s.BytesRetrans)
				p := tp.PathOf(s.Remote.Addr())
				if p == 0 || s.Local.Addr() != side.local(p) || s.Remote.Addr() != side.remote(p) {
					t.Errorf("%s %s: subflow %s -> %s is not on one path", read.name, side.name, s.Local, s.Remote)
				}
				seen[p] = true
				if s.BytesSent == 0 || s.BytesAcked == 0 || s.BytesReceived == 0 {
					t.Errorf("%s %s: path %d carried nothing one way: %+v", read.name, side.name, p, s)
				}
				sent += s.BytesSent
				acked += s.BytesAcked
				recv += s.BytesReceived
			}
			if len(seen) != 2 {
				t.Errorf("%s %s: subflows on paths %v, want 1 and 2", read.name, side.name, seen)
			}
			if sent < side.sent || acked < side.sent || recv < side.recv {
				t.Errorf("%s %s: subflows sent %d (acked %d), received %d; moved %d and %d",
					read.name, side.name, sent, acked, recv, side.sent, side.recv)
			}
		}
	}
}
