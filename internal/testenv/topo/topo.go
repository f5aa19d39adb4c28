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

// Package topo builds the multi-path test topology used by the end-to-end
// tests and by the shell scripts (through e2e/cmd/topo): two "hosts",
// i.e. two network namespaces (client side and server side), joined by N
// veth pairs, one per path.
//
// Path i (1-based) has client address <Subnet>.i.1/24 and server address
// <Subnet>.i.2/24 (Subnet defaults to "10.77"). Both ends of every veth
// pair get a tbf qdisc limiting egress, so each direction of a path is
// shaped to that path's rate.
//
// MPTCP is configured so that ONE MPTCP connection from the client to the
// server address of path 1 ends up with exactly one subflow per path: the
// server namespace announces (ADD_ADDR, "signal" endpoints) its addresses
// on paths 2..N and the client, which has no endpoints of its own, opens
// one subflow towards each announced address; routing picks the matching
// client address of that path as source.
//
// MP_JOIN SYNs are matched against ordinary listening sockets. A server
// that listens on a specific address (ServerAddr(1):port) therefore
// refuses joins sent to its other addresses (the client sees ECONNREFUSED
// and keeps a single subflow). To make such servers work, the signal
// endpoints carry a dedicated join port (Config.JoinPort, default
// DefaultJoinPort): the kernel then opens its own listener on
// <address>:<join port> for each endpoint and announces address+port.
// With JoinPort < 0 the addresses are announced without a port and the
// server must listen on the wildcard address for subflows to join.
//
// Everything lives inside the two namespaces, so deleting them (Down)
// removes the veth devices, addresses, qdiscs and MPTCP endpoints too.
// Creating and deleting namespaces needs root (CAP_SYS_ADMIN + CAP_NET_ADMIN)
// and the iproute2 tools ip and tc.
package topo

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/netip"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
)

// callerSubnets numbers the subnets Plan picks for ClientInCaller
// topologies.
var callerSubnets atomic.Int32

// DefaultSubnet is the first two octets of all path addresses.
const DefaultSubnet = "10.77"

// DefaultJoinPort is the default Config.JoinPort. It lies outside the
// default ephemeral port range and away from well-known ports.
const DefaultJoinPort = 10900

// DefaultRateMbit is the default per-path rate.
const DefaultRateMbit = 1000

// maxIfName is IFNAMSIZ-1: the longest Linux interface name.
const maxIfName = 15

// Config describes a topology to build.
type Config struct {
	// Name prefixes the namespace and interface names. It must be unique
	// among topologies that exist at the same time (see UniqueName) and
	// short: the derived names (Name+"-cli", Name+"-c"+path) must fit in
	// 15 characters. Allowed characters: letters, digits, '_' and '-'.
	Name string
	// Paths configures each path; len(Paths) is the number of paths.
	Paths []PathConfig
	// Subnet is the first two octets of the path addresses, "10.77" if
	// empty.
	Subnet string
	// JoinPort is the port announced with the server's extra addresses,
	// on which the kernel accepts MP_JOINs (see the package comment).
	// 0 means DefaultJoinPort; a negative value announces the addresses
	// without a port.
	JoinPort int
	// ClientInCaller makes the caller's own network namespace the client
	// host: the client ends of the veths, the client's sysctls and MPTCP
	// limits live there, and ClientNS names it (a bind mount of
	// /proc/self/ns/net), so `ip -n`, nsenter and InNetns reach it as
	// usual. The caller's processes and sockets then act as the client
	// host without entering a namespace, as a node plugin on its host
	// does. Only for a machine the tests own (the test VM): Down removes
	// the veths and the name, not the namespace. Topologies that exist at
	// the same time need distinct Subnets; Plan picks one for each when
	// Subnet is empty.
	ClientInCaller bool
	// PlainTCP says no MPTCP subflow will join from the client (its
	// connections are plain TCP): a ClientInCaller topology then
	// reserves none of the caller's MPTCP endpoints (see caller.go).
	PlainTCP bool
}

// PathConfig configures one path.
type PathConfig struct {
	// RateMbit is the tbf rate of each direction, in Mbit/s (10^6 bit/s).
	// Zero means DefaultRateMbit.
	RateMbit int
	// Backup marks the server's MPTCP endpoint on this path as "backup"
	// (ip mptcp endpoint ... signal backup). It has no effect on path 1,
	// whose address is the one the client connects to and therefore has
	// no endpoint.
	Backup bool
}

// Path is one built path.
type Path struct {
	ClientIf, ServerIf     string // veth names (inside ClientNS / ServerNS)
	ClientAddr, ServerAddr netip.Addr
	RateMbit               int
	Backup                 bool
}

// Topology is a built topology. Create it with Up (or NewForTest) and
// remove it with Down.
type Topology struct {
	Name     string
	ClientNS string // network namespace of the client host
	ServerNS string // network namespace of the server host
	Paths    []Path
	// ClientInCaller: ClientNS names the caller's namespace (see Config).
	ClientInCaller bool
	// endpoints is what it holds of the caller's MPTCP endpoints.
	endpoints int
	// JoinPort is the port of the server's MP_JOIN listeners on paths
	// 2..N, 0 if the addresses are announced without a port.
	JoinPort int
}

// Default4 returns the default topology: 4 paths of 1000 Mbit/s.
func Default4(name string) Config {
	return Uniform(name, 4, DefaultRateMbit)
}

// Asymmetric returns 3 paths of 1000 Mbit/s and a 4th one of 100 Mbit/s.
func Asymmetric(name string) Config {
	return Config{
		Name: name,
		Paths: []PathConfig{
			{RateMbit: 1000}, {RateMbit: 1000}, {RateMbit: 1000}, {RateMbit: 100},
		},
	}
}

// Uniform returns n paths of rateMbit each.
func Uniform(name string, n, rateMbit int) Config {
	cfg := Config{Name: name, Paths: make([]PathConfig, n)}
	for i := range cfg.Paths {
		cfg.Paths[i].RateMbit = rateMbit
	}
	return cfg
}

// UniqueName returns prefix followed by 4 random hex digits, e.g. for
// tests that may run concurrently with other processes using topo.
func UniqueName(prefix string) string {
	var b [2]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// ClientNSName and ServerNSName return the namespace names for name.
func ClientNSName(name string) string { return name + "-cli" }

// ServerNSName returns the server namespace name for a topology name.
func ServerNSName(name string) string { return name + "-srv" }

// ClientIfName returns the client-side veth name of path (1-based).
func ClientIfName(name string, path int) string { return name + "-c" + strconv.Itoa(path) }

// ServerIfName returns the server-side veth name of path (1-based).
func ServerIfName(name string, path int) string { return name + "-s" + strconv.Itoa(path) }

var nameRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_-]*$`)

// Plan validates cfg and computes the topology it describes without
// creating anything (used by Up and by "topo env").
func Plan(cfg Config) (*Topology, error) {
	if !nameRE.MatchString(cfg.Name) {
		return nil, fmt.Errorf("topo: invalid name %q (letters, digits, '_' and '-' only)", cfg.Name)
	}
	n := len(cfg.Paths)
	if n < 1 || n > 254 {
		return nil, fmt.Errorf("topo: need 1..254 paths, got %d", n)
	}
	for _, s := range []string{ClientNSName(cfg.Name), ServerNSName(cfg.Name), ClientIfName(cfg.Name, n), ServerIfName(cfg.Name, n)} {
		if len(s) > maxIfName {
			return nil, fmt.Errorf("topo: name %q too long: derived name %q exceeds %d characters", cfg.Name, s, maxIfName)
		}
	}
	subnet := cfg.Subnet
	if subnet == "" {
		subnet = DefaultSubnet
		if cfg.ClientInCaller {
			// Client addresses share the caller's namespace with those of
			// every other such topology: give each its own subnet.
			subnet = fmt.Sprintf("10.%d", 100+callerSubnets.Add(1)%150)
		}
	}
	if a, err := netip.ParseAddr(subnet + ".0.0"); err != nil || !a.Is4() {
		return nil, fmt.Errorf("topo: invalid subnet %q: want two IPv4 octets such as %q", subnet, DefaultSubnet)
	}
	joinPort := cfg.JoinPort
	switch {
	case joinPort == 0:
		joinPort = DefaultJoinPort
	case joinPort < 0:
		joinPort = 0
	case joinPort > 65535:
		return nil, fmt.Errorf("topo: invalid join port %d", cfg.JoinPort)
	}
	t := &Topology{
		ClientInCaller: cfg.ClientInCaller,
		JoinPort:       joinPort,
		Name:           cfg.Name,
		ClientNS:       ClientNSName(cfg.Name),
		ServerNS:       ServerNSName(cfg.Name),
		Paths:          make([]Path, n),
	}
	for i, pc := range cfg.Paths {
		rate := pc.RateMbit
		if rate == 0 {
			rate = DefaultRateMbit
		}
		if rate < 0 || rate > 1_000_000 {
			return nil, fmt.Errorf("topo: path %d: invalid rate %d Mbit/s", i+1, rate)
		}
		t.Paths[i] = Path{
			ClientIf:   ClientIfName(cfg.Name, i+1),
			ServerIf:   ServerIfName(cfg.Name, i+1),
			ClientAddr: netip.MustParseAddr(fmt.Sprintf("%s.%d.1", subnet, i+1)),
			ServerAddr: netip.MustParseAddr(fmt.Sprintf("%s.%d.2", subnet, i+1)),
			RateMbit:   rate,
			Backup:     pc.Backup,
		}
	}
	return t, nil
}

// path returns the 1-based path p or panics with a clear message.
func (t *Topology) path(p int) Path {
	if p < 1 || p > len(t.Paths) {
		panic(fmt.Sprintf("topo: path %d out of range 1..%d", p, len(t.Paths)))
	}
	return t.Paths[p-1]
}

// ServerAddr returns the server address of path p (1-based).
func (t *Topology) ServerAddr(p int) netip.Addr { return t.path(p).ServerAddr }

// ClientAddr returns the client address of path p (1-based).
func (t *Topology) ClientAddr(p int) netip.Addr { return t.path(p).ClientAddr }

// PathOf returns the 1-based path whose /24 contains a, or 0.
func (t *Topology) PathOf(a netip.Addr) int {
	a = a.Unmap()
	for i, p := range t.Paths {
		pfx := netip.PrefixFrom(p.ServerAddr, 24).Masked()
		if pfx.Contains(a) {
			return i + 1
		}
	}
	return 0
}

// LineRateMBps returns the sum of all path rates in MB/s (10^6 bytes/s).
func (t *Topology) LineRateMBps() float64 {
	var sum float64
	for _, p := range t.Paths {
		sum += float64(p.RateMbit) / 8
	}
	return sum
}

// Env returns shell variable assignments describing t, in a stable
// order: TOPO_NAME, CLIENT_NS, SERVER_NS, PATHS, JOIN_PORT (0: none), then for each path i
// CLIENT_IFi, SERVER_IFi, CLIENT_ADDRi, SERVER_ADDRi, RATE_MBITi, BACKUPi.
func (t *Topology) Env() []string {
	env := []string{
		"TOPO_NAME=" + t.Name,
		"CLIENT_NS=" + t.ClientNS,
		"SERVER_NS=" + t.ServerNS,
		"PATHS=" + strconv.Itoa(len(t.Paths)),
		"JOIN_PORT=" + strconv.Itoa(t.JoinPort),
	}
	for i, p := range t.Paths {
		n := strconv.Itoa(i + 1)
		backup := "0"
		if p.Backup {
			backup = "1"
		}
		env = append(env,
			"CLIENT_IF"+n+"="+p.ClientIf,
			"SERVER_IF"+n+"="+p.ServerIf,
			"CLIENT_ADDR"+n+"="+p.ClientAddr.String(),
			"SERVER_ADDR"+n+"="+p.ServerAddr.String(),
			"RATE_MBIT"+n+"="+strconv.Itoa(p.RateMbit),
			"BACKUP"+n+"="+backup,
		)
	}
	return env
}

// Up creates the topology described by cfg. Leftovers of an earlier
// topology with the same Name are removed first. On any error everything
// Up created is removed again.
func Up(cfg Config) (_ *Topology, err error) {
	t, err := Plan(cfg)
	if err != nil {
		return nil, err
	}
	if err := Down(t.Name); err != nil {
		return nil, fmt.Errorf("topo: removing leftovers of %q: %w", t.Name, err)
	}
	if t.ClientInCaller && !cfg.PlainTCP {
		if err := takeCallerEndpoints(len(t.Paths) - 1); err != nil {
			return nil, err
		}
		t.endpoints = len(t.Paths) - 1
	}
	defer func() {
		if err != nil {
			if derr := t.Down(); derr != nil {
				err = errors.Join(err, fmt.Errorf("topo: cleanup after failed Up: %w", derr))
			}
		}
	}()
	if err := t.create(); err != nil {
		return nil, err
	}
	return t, nil
}

// create performs the steps of Up; the caller cleans up on error.
func (t *Topology) create() error {
	for _, ns := range []string{t.ClientNS, t.ServerNS} {
		if ns == t.ClientNS && t.ClientInCaller {
			continue
		}
		if err := run("ip", "netns", "add", ns); err != nil {
			return err
		}
		if err := run("ip", "-n", ns, "link", "set", "lo", "up"); err != nil {
			return err
		}
	}
	// After `ip netns add`, which makes the namespace directory a mount
	// point of its own.
	if t.ClientInCaller {
		if err := nameCallerNetns(t.ClientNS); err != nil {
			return err
		}
	}
	if err := failpoint("netns"); err != nil {
		return err
	}
	for _, p := range t.Paths {
		// Create both ends directly inside their namespaces, so nothing
		// ever appears in (or can leak into) the caller's namespace.
		if err := run("ip", "link", "add", p.ClientIf, "netns", t.ClientNS,
			"type", "veth", "peer", "name", p.ServerIf, "netns", t.ServerNS); err != nil {
			return err
		}
		for _, e := range []struct {
			ns, dev string
			addr    netip.Addr
		}{{t.ClientNS, p.ClientIf, p.ClientAddr}, {t.ServerNS, p.ServerIf, p.ServerAddr}} {
			if err := run("ip", "-n", e.ns, "addr", "add", netip.PrefixFrom(e.addr, 24).String(), "dev", e.dev); err != nil {
				return err
			}
			if err := run("tc", append([]string{"-n", e.ns, "qdisc", "replace", "dev", e.dev, "root"}, TBFArgs(p.RateMbit)...)...); err != nil {
				return err
			}
			if err := run("ip", "-n", e.ns, "link", "set", e.dev, "up"); err != nil {
				return err
			}
		}
	}
	if err := failpoint("links"); err != nil {
		return err
	}
	if err := configureMPTCP(t); err != nil {
		return err
	}
	return failpoint("mptcp")
}

// SetRate shapes both directions of path p (1-based) to rateMbit Mbit/s
// from now on: a path slowing down or recovering while connections run.
func (t *Topology) SetRate(p, rateMbit int) error {
	if p < 1 || p > len(t.Paths) {
		return fmt.Errorf("topo: no path %d of %d", p, len(t.Paths))
	}
	path := &t.Paths[p-1]
	for _, e := range []struct{ ns, dev string }{{t.ClientNS, path.ClientIf}, {t.ServerNS, path.ServerIf}} {
		if err := run("tc", append([]string{"-n", e.ns, "qdisc", "replace", "dev", e.dev, "root"}, TBFArgs(rateMbit)...)...); err != nil {
			return err
		}
	}
	path.RateMbit = rateMbit
	return nil
}

// Down removes the topology. It is idempotent and safe on a nil or
// partially built topology.
func (t *Topology) Down() error {
	if t == nil {
		return nil
	}
	var errs []error
	if t.ClientInCaller {
		if ok, _ := netnsExists(t.ClientNS); ok {
			errs = append(errs, t.dropCallerEndpoints())
		}
	}
	errs = append(errs, Down(t.Name))
	if t.endpoints > 0 {
		releaseCallerEndpoints(t.endpoints)
		t.endpoints = 0
	}
	return errors.Join(errs...)
}

// Down removes every namespace and stray interface created for a
// topology called name. Removing something that does not exist is not an
// error.
//
// Deleting a namespace only unlinks its name; the kernel destroys it
// (and its veth devices) once the last socket or process inside it is
// gone, so close connections made inside it first. The name of a
// ClientInCaller client is unlinked the same way; its veths, which live
// in the caller's namespace, go with the stray interfaces below.
func Down(name string) error {
	if !nameRE.MatchString(name) {
		return fmt.Errorf("topo: invalid name %q", name)
	}
	var errs []error
	for _, ns := range []string{ClientNSName(name), ServerNSName(name)} {
		exists, err := netnsExists(ns)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if exists {
			if err := run("ip", "netns", "del", ns); err != nil {
				errs = append(errs, err)
			}
		}
	}
	// Interfaces are created inside the namespaces, but remove any that
	// ended up in the current namespace anyway (deleting one end of a
	// veth pair removes the other).
	links, err := output("ip", "-o", "link", "show")
	if err != nil {
		errs = append(errs, err)
	} else {
		for _, dev := range strayLinks(links, name) {
			if err := run("ip", "link", "del", dev); err != nil && !strings.Contains(err.Error(), "Cannot find device") {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// strayLinks returns the interfaces in `ip -o link show` output whose
// names are client/server veth names of topology name.
func strayLinks(out, name string) []string {
	var devs []string
	for line := range strings.SplitSeq(out, "\n") {
		// "7: foo-c1@if6: <BROADCAST,...> ..."
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		dev, _, _ := strings.Cut(strings.TrimSuffix(f[1], ":"), "@")
		for _, side := range []string{name + "-c", name + "-s"} {
			if rest, ok := strings.CutPrefix(dev, side); ok {
				if _, err := strconv.Atoi(rest); err == nil {
					devs = append(devs, dev)
				}
			}
		}
	}
	return devs
}

// failpoint lets tests inject a failure after a step of Up.
var failpoint = func(step string) error { return nil }
