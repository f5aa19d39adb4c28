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

package topo

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// A Fabric is a switched storage network of several hosts, as a cluster
// with several storage nodes has: a hub namespace holds one bridge per
// path (a switch per storage NIC), and every host (a namespace of its
// own) is joined to each bridge by a veth pair, both ends shaped to the
// path's rate. Host h (0-based, in FabricConfig.Hosts order) has address
// <Subnet>.<path>.<10+h>/24 on path p, so every host reaches every other
// on every path, directly.
//
// MPTCP: every host announces its addresses on paths 2..N (signal
// endpoints) and accepts as many subflows and announcements as there are
// paths, so that a connection to a host's path-1 address, whichever host
// opens it, gets one subflow per path. A host that only dials (a client)
// announces too; peers' joins towards its ephemeral ports are refused,
// which costs nothing.
type Fabric struct {
	cfg   FabricConfig
	HubNS string
	hosts []string
}

// FabricConfig describes a Fabric.
type FabricConfig struct {
	// Name prefixes the namespaces and interfaces: at most 6 characters
	// (UniqueName makes one).
	Name string
	// Hosts are the hosts' short names (letters and digits, at most 3
	// characters).
	Hosts []string
	// Paths is the number of paths (bridges), 1 to 8.
	Paths int
	// RateMbit shapes each direction of each host's link on each path.
	RateMbit int
	// Subnet is the first two octets of the addresses (default "10.78").
	Subnet string
	// RootHost, if set, is the host (one of Hosts) that is the caller's
	// own network namespace rather than one of the fabric's: where the
	// kernel's nbd generic-netlink family resolves (only the initial
	// namespace), in a VM guest given to the test. Its links go with the
	// hub; Down also removes its MPTCP endpoints of the fabric (its MPTCP
	// limits stay as the fabric set them).
	RootHost string
}

// NewFabricForTest builds the fabric, skipping the test (with the
// reason printed) without root or the tools, and deletes it when the test
// ends.
func NewFabricForTest(t testing.TB, cfg FabricConfig) *Fabric {
	t.Helper()
	RequireRoot(t)
	f, err := NewFabric(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := f.Down(); err != nil {
			t.Errorf("fabric down: %v", err)
		}
	})
	return f
}

// NewFabric builds the fabric; Down deletes it.
func NewFabric(cfg FabricConfig) (f *Fabric, err error) {
	switch {
	case cfg.Name == "" || len(cfg.Name) > 6:
		return nil, fmt.Errorf("topo: fabric name %q: want 1 to 6 characters", cfg.Name)
	case cfg.Paths < 1 || cfg.Paths > 8:
		return nil, fmt.Errorf("topo: fabric of %d paths: want 1 to 8", cfg.Paths)
	case len(cfg.Hosts) == 0 || len(cfg.Hosts) > 200:
		return nil, fmt.Errorf("topo: fabric of %d hosts", len(cfg.Hosts))
	case cfg.RateMbit <= 0:
		return nil, fmt.Errorf("topo: fabric rate %d Mbit/s", cfg.RateMbit)
	}
	if cfg.Subnet == "" {
		cfg.Subnet = "10.78"
	}
	for _, h := range cfg.Hosts {
		if h == "" || len(h) > 3 || strings.ContainsAny(h, "-/ .") {
			return nil, fmt.Errorf("topo: fabric host name %q: want 1 to 3 letters or digits", h)
		}
	}
	f = &Fabric{cfg: cfg, HubNS: cfg.Name + "-hub", hosts: cfg.Hosts}
	defer func() {
		if err != nil {
			err = errors.Join(err, f.Down())
		}
	}()
	if err := run("ip", "netns", "add", f.HubNS); err != nil {
		return f, err
	}
	if err := run("ip", "-n", f.HubNS, "link", "set", "lo", "up"); err != nil {
		return f, err
	}
	for p := 1; p <= cfg.Paths; p++ {
		br := "br" + strconv.Itoa(p)
		if err := run("ip", "-n", f.HubNS, "link", "add", br, "type", "bridge"); err != nil {
			return f, err
		}
		if err := run("ip", "-n", f.HubNS, "link", "set", br, "up"); err != nil {
			return f, err
		}
	}
	if cfg.RootHost != "" && !slices.Contains(cfg.Hosts, cfg.RootHost) {
		return f, fmt.Errorf("topo: fabric root host %q is not one of its hosts", cfg.RootHost)
	}
	for _, h := range cfg.Hosts {
		ns := f.NS(h)
		// in is a command of ip or tc run in h's namespace.
		in := func(tool string, args ...string) []string {
			if ns == "" {
				return append([]string{tool}, args...)
			}
			return append([]string{tool, "-n", ns}, args...)
		}
		hostEnd := []string{}
		if ns != "" {
			if err := run("ip", "netns", "add", ns); err != nil {
				return f, err
			}
			if err := run("ip", "-n", ns, "link", "set", "lo", "up"); err != nil {
				return f, err
			}
			hostEnd = []string{"netns", ns}
		}
		for p := 1; p <= cfg.Paths; p++ {
			hostIf, hubIf := f.IfName(h, p), cfg.Name+"-"+h+"b"+strconv.Itoa(p)
			steps := [][]string{
				append(append([]string{"ip", "link", "add", hostIf}, hostEnd...), "type", "veth", "peer", "name", hubIf, "netns", f.HubNS),
				{"ip", "-n", f.HubNS, "link", "set", hubIf, "master", "br" + strconv.Itoa(p)},
				{"ip", "-n", f.HubNS, "link", "set", hubIf, "up"},
				in("ip", "addr", "add", f.Addr(h, p).String()+"/24", "dev", hostIf),
				in("ip", "link", "set", hostIf, "up"),
				in("tc", append([]string{"qdisc", "add", "dev", hostIf, "root"}, TBFArgs(cfg.RateMbit)...)...),
				append([]string{"tc", "-n", f.HubNS, "qdisc", "add", "dev", hubIf, "root"}, TBFArgs(cfg.RateMbit)...),
			}
			if p > 1 {
				steps = append(steps, in("ip", "mptcp", "endpoint", "add", f.Addr(h, p).String(), "dev", hostIf, "signal"))
			}
			for _, s := range steps {
				if err := run(s[0], s[1:]...); err != nil {
					return f, err
				}
			}
		}
		n := strconv.Itoa(max(cfg.Paths, 2))
		limits := in("ip", "mptcp", "limits", "set", "subflows", n, "add_addr_accepted", n)
		if err := run(limits[0], limits[1:]...); err != nil {
			return f, err
		}
	}
	return f, nil
}

// NS is the namespace of host h ("" for the root host: the caller's).
func (f *Fabric) NS(h string) string {
	if h == f.cfg.RootHost {
		return ""
	}
	return f.cfg.Name + "-" + h
}

// IfName is host h's interface on path p.
func (f *Fabric) IfName(h string, p int) string { return f.cfg.Name + "-" + h + "p" + strconv.Itoa(p) }

// Addr is host h's address on path p (1-based).
func (f *Fabric) Addr(h string, p int) netip.Addr {
	i := -1
	for k, n := range f.hosts {
		if n == h {
			i = k
		}
	}
	if i < 0 {
		panic("topo: no fabric host " + h)
	}
	return netip.MustParseAddr(fmt.Sprintf("%s.%d.%d", f.cfg.Subnet, p, 10+i))
}

// Addrs are host h's addresses, path 1 first.
func (f *Fabric) Addrs(h string) []netip.Addr {
	out := make([]netip.Addr, f.cfg.Paths)
	for p := range out {
		out[p] = f.Addr(h, p+1)
	}
	return out
}

// Down deletes the hosts' namespaces and the hub (and with them every
// interface, address and qdisc of the fabric).
func (f *Fabric) Down() error {
	var errs []error
	if h := f.cfg.RootHost; h != "" {
		// Its endpoints on the fabric's addresses: "ADDR id N signal dev IF".
		out, err := output("ip", "mptcp", "endpoint", "show")
		if err != nil {
			errs = append(errs, err)
		}
		for _, line := range strings.Split(out, "\n") {
			fs := strings.Fields(line)
			if len(fs) < 3 || fs[1] != "id" || !slices.ContainsFunc(f.Addrs(h), func(a netip.Addr) bool { return a.String() == fs[0] }) {
				continue
			}
			if err := run("ip", "mptcp", "endpoint", "delete", "id", fs[2]); err != nil {
				errs = append(errs, err)
			}
		}
	}
	for _, ns := range append(f.namespaces(), f.HubNS) {
		if ns == "" {
			continue
		}
		ok, err := netnsExists(ns)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if ok {
			if err := run("ip", "netns", "del", ns); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

func (f *Fabric) namespaces() []string {
	out := make([]string, len(f.hosts))
	for i, h := range f.hosts {
		out[i] = f.NS(h)
	}
	return out
}

// DropPeers makes namespace ns drop, silently, every packet to or from
// addrs, until Undrop with the same table: a partition between ns and
// those hosts, with no reset or ICMP sent.
func DropPeers(ns, table string, addrs []netip.Addr) error {
	set := make([]string, len(addrs))
	for i, a := range addrs {
		set[i] = a.String()
	}
	list := "{ " + strings.Join(set, ", ") + " }"
	script := fmt.Sprintf(`table inet %s {
	chain in { type filter hook input priority -300; policy accept; ip saddr %s drop; }
	chain out { type filter hook output priority -300; policy accept; ip daddr %s drop; }
}
`, table, list, list)
	return applyNft(ns, script)
}

// DropPort makes namespace ns drop, silently, every TCP packet to or from
// port (on any interface, loopback included), until Undrop with the same
// table: a process of ns cut off from the service it reaches there.
func DropPort(ns, table string, port int) error {
	script := fmt.Sprintf(`table inet %s {
	chain in { type filter hook input priority -300; policy accept; tcp dport %d drop; tcp sport %d drop; }
	chain out { type filter hook output priority -300; policy accept; tcp dport %d drop; tcp sport %d drop; }
}
`, table, port, port, port, port)
	return applyNft(ns, script)
}
