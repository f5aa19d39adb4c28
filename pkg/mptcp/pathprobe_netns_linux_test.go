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
	"errors"
	"net/netip"
	"testing"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// TestProbePath measures the paths of 3 x 1 Gbit/s + 100 Mbit/s with
// ICMP echo from either side, asking 90 MB/s of each (what the slow-path
// watch asks on 1 Gbit/s paths): a 1 Gbit/s path carries it (its replies
// come back at 80 % of it or more; the watch's verdict needs that), the
// 100 Mbit/s path returns under 30 % of it. A peer that answers nothing
// is an error, not a slow path.
func TestProbePath(t *testing.T) {
	tp := topo.NewForTest(t, topo.Asymmetric(topo.UniqueName("pp")))
	const ask = 90e6
	for _, c := range []struct {
		side  string
		in    func(func() error) error
		local func(int) netip.Addr
		peer  func(int) netip.Addr
	}{
		{"node", tp.InClient, tp.ClientAddr, tp.ServerAddr},
		{"storage", tp.InServer, tp.ServerAddr, tp.ClientAddr},
	} {
		// A probe whose sender was not scheduled in time measures a
		// fast path short (a recovery found at the next probe), never
		// a slow path fast: the fast path gets five tries, and every
		// try of the slow path must find it slow.
		for _, p := range []int{1, 4} {
			best := 0.0
			for range 5 {
				var got float64
				err := c.in(func() (err error) {
					// A starved probe has no verdict; the watch
					// repeats it later, and so does the test.
					for range 5 {
						if got, err = mptcp.ProbePath(c.local(p), c.peer(p), ask); !errors.Is(err, mptcp.ErrProbeStarved) {
							break
						}
						t.Log(err)
					}
					return err
				})
				if err != nil {
					t.Fatalf("%s side, path %d: %v", c.side, p, err)
				}
				t.Logf("%s side, path %d (%d Mbit/s): %.1f MB/s of %.0f asked", c.side, p, tp.Paths[p-1].RateMbit, got/1e6, ask/1e6)
				if p == 4 && got > 0.3*ask {
					t.Errorf("%s side: the 100 Mbit/s path measured %.1f MB/s, over 30 %% of the %.0f MB/s asked", c.side, got/1e6, ask/1e6)
				}
				best = max(best, got)
			}
			if p == 1 && best < 0.8*ask {
				t.Errorf("%s side: the 1 Gbit/s path measured at best %.1f MB/s in five tries, under 80 %% of the %.0f MB/s asked", c.side, best/1e6, ask/1e6)
			}
		}
	}

	// An address on path 1's subnet that nobody holds answers nothing.
	nobody := tp.ServerAddr(1).Next().Next()
	err := tp.InClient(func() error {
		_, err := mptcp.ProbePath(tp.ClientAddr(1), nobody, ask)
		return err
	})
	if err == nil {
		t.Fatalf("a probe of %s, which nobody holds, succeeded", nobody)
	}
	t.Logf("probe of an absent peer: %v", err)
	if _, err := mptcp.ProbePath(tp.ClientAddr(1), tp.ServerAddr(1), 1e12); !errors.Is(err, mptcp.ErrProbeRate) {
		t.Fatalf("a probe at 1 TB/s: %v, want ErrProbeRate", err)
	}
}

// TestProbePathIPv6: the probe over ICMPv6 (the kernel fills its
// checksum, the socket hands over no IP header), on a 1 Gbit/s path given
// IPv6 addresses.
func TestProbePathIPv6(t *testing.T) {
	tp := topo.NewForTest(t, topo.Uniform(topo.UniqueName("p6"), 1, 1000))
	local, peer := netip.MustParseAddr("fd00:77::1"), netip.MustParseAddr("fd00:77::2")
	for _, c := range []struct {
		ns, dev string
		addr    netip.Addr
	}{{tp.ClientNS, tp.Paths[0].ClientIf, local}, {tp.ServerNS, tp.Paths[0].ServerIf, peer}} {
		if out, err := topo.Exec(c.ns, "ip", "-6", "addr", "add", c.addr.String()+"/64", "dev", c.dev, "nodad").CombinedOutput(); err != nil {
			t.Fatalf("ip -6 addr add %s: %v: %s", c.addr, err, out)
		}
	}
	const ask = 60e6
	best := 0.0
	for range 3 {
		var got float64
		err := tp.InClient(func() (err error) {
			for range 5 {
				if got, err = mptcp.ProbePath(local, peer, ask); !errors.Is(err, mptcp.ErrProbeStarved) {
					break
				}
			}
			return err
		})
		if err != nil {
			t.Fatalf("IPv6 probe: %v", err)
		}
		t.Logf("IPv6, 1 Gbit/s: %.1f MB/s of %.0f asked", got/1e6, ask/1e6)
		best = max(best, got)
	}
	if best < 0.8*ask {
		t.Fatalf("the 1 Gbit/s path measured at best %.1f MB/s over IPv6, under 80 %% of the %.0f MB/s asked", best/1e6, ask/1e6)
	}
}
