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
	"fmt"
	"io/fs"
	"net/netip"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// testNS is a network namespace made for one test, with two veth
// interfaces a0 and b0 (peers a1, b1), up, and addresses:
//
//	a0: 10.201.1.1/24, fd00:201:1::1/64
//	b0: 10.201.2.1/24
type testNS struct {
	t    *testing.T
	name string
	pm   *mptcp.PM
	addr *mptcp.SystemAddrs
}

func newTestNS(t *testing.T) *testNS {
	t.Helper()
	topo.RequireRoot(t)
	ns := &testNS{t: t, name: topo.UniqueName("mptcppm")}
	if out, err := exec.Command("ip", "netns", "add", ns.name).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add %s: %v: %s", ns.name, err, out)
	}
	t.Cleanup(func() {
		if out, err := exec.Command("ip", "netns", "del", ns.name).CombinedOutput(); err != nil {
			t.Errorf("ip netns del %s: %v: %s", ns.name, err, out)
		}
	})
	ns.ip("link", "add", "a0", "type", "veth", "peer", "name", "a1")
	ns.ip("link", "add", "b0", "type", "veth", "peer", "name", "b1")
	for _, dev := range []string{"a0", "a1", "b0", "b1"} {
		ns.ip("link", "set", dev, "up")
	}
	ns.ip("addr", "add", "10.201.1.1/24", "dev", "a0")
	ns.ip("addr", "add", "fd00:201:1::1/64", "dev", "a0", "nodad")
	ns.ip("addr", "add", "10.201.2.1/24", "dev", "b0")

	err := topo.InNetns(ns.name, func() error {
		var err error
		if ns.pm, err = mptcp.DialPM(); err != nil {
			return err
		}
		ns.addr, err = mptcp.DialAddrs()
		return err
	})
	if errors.Is(err, mptcp.ErrPMNotFound) {
		t.Skipf("skipping: kernel without the MPTCP path manager: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ns.pm.Close()
		ns.addr.Close()
	})
	return ns
}

// ip runs `ip -n NS args...` and returns its output, failing the test on
// error.
func (ns *testNS) ip(args ...string) string {
	ns.t.Helper()
	out, err := ns.tryIP(args...)
	if err != nil {
		ns.t.Fatal(err)
	}
	return out
}

func (ns *testNS) tryIP(args ...string) (string, error) {
	cmd := exec.Command("ip", append([]string{"-n", ns.name}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("ip -n %s %s: %v: %s", ns.name, strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

func (ns *testNS) ifindex(name string) int32 {
	ns.t.Helper()
	ifs, err := ns.addr.Interfaces()
	if err != nil {
		ns.t.Fatal(err)
	}
	for _, i := range ifs {
		if i.Name == name {
			return int32(i.Index)
		}
	}
	ns.t.Fatalf("no interface %s", name)
	return 0
}

// ipEndpoints parses `ip mptcp endpoint show`, e.g.
// "10.0.0.1 port 1000 id 3 signal backup dev eth0".
func (ns *testNS) ipEndpoints() []mptcp.Endpoint {
	ns.t.Helper()
	idx := map[string]int32{}
	ifs, err := ns.addr.Interfaces()
	if err != nil {
		ns.t.Fatal(err)
	}
	for _, i := range ifs {
		idx[i.Name] = int32(i.Index)
	}
	var eps []mptcp.Endpoint
	for line := range strings.Lines(ns.ip("mptcp", "endpoint", "show")) {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		var e mptcp.Endpoint
		var err error
		if e.Addr, err = netip.ParseAddr(f[0]); err != nil {
			ns.t.Fatalf("parsing %q: %v", line, err)
		}
		for i := 1; i < len(f); i++ {
			switch f[i] {
			case "port", "id", "dev":
				if i+1 >= len(f) {
					ns.t.Fatalf("parsing %q", line)
				}
				i++
				switch f[i-1] {
				case "port":
					n, _ := strconv.Atoi(f[i])
					e.Port = uint16(n)
				case "id":
					n, _ := strconv.Atoi(f[i])
					e.ID = uint8(n)
				case "dev":
					e.IfIndex = idx[f[i]]
				}
			case "signal":
				e.Flags |= mptcp.Signal
			case "subflow":
				e.Flags |= mptcp.Subflow
			case "backup":
				e.Flags |= mptcp.Backup
			case "fullmesh":
				e.Flags |= mptcp.Fullmesh
			case "implicit":
				e.Flags |= mptcp.Implicit
			case "laminar":
				e.Flags |= mptcp.Laminar
			default:
				ns.t.Fatalf("parsing %q: unknown word %q", line, f[i])
			}
		}
		eps = append(eps, e)
	}
	return eps
}

// ipLimits parses `ip mptcp limits show`.
func (ns *testNS) ipLimits() mptcp.Limits {
	ns.t.Helper()
	var l mptcp.Limits
	f := strings.Fields(ns.ip("mptcp", "limits", "show"))
	for i := 0; i+1 < len(f); i += 2 {
		n, err := strconv.ParseUint(f[i+1], 10, 32)
		if err != nil {
			ns.t.Fatalf("parsing limits %q: %v", f, err)
		}
		switch f[i] {
		case "subflows":
			l.Subflows = uint32(n)
		case "add_addr_accepted":
			l.AddAddrAccepted = uint32(n)
		}
	}
	return l
}

func sortEndpoints(eps []mptcp.Endpoint) []mptcp.Endpoint {
	eps = slices.Clone(eps)
	slices.SortFunc(eps, func(a, b mptcp.Endpoint) int { return int(a.ID) - int(b.ID) })
	return eps
}

// checkEndpoints compares PM.Endpoints with `ip mptcp endpoint show` and
// with want (IDs of want entries that are 0 are not compared).
func (ns *testNS) checkEndpoints(want []mptcp.Endpoint) []mptcp.Endpoint {
	ns.t.Helper()
	got, err := ns.pm.Endpoints()
	if err != nil {
		ns.t.Fatal(err)
	}
	if ip := ns.ipEndpoints(); !slices.Equal(sortEndpoints(got), sortEndpoints(ip)) {
		ns.t.Fatalf("PM.Endpoints and ip disagree:\n PM: %v\n ip: %v", got, ip)
	}
	if want == nil {
		return got
	}
	// Compare with IDs only where want has one.
	var g, w []string
	for _, e := range got {
		for _, we := range want {
			if we.Addr == e.Addr && we.ID == 0 {
				e.ID = 0
			}
		}
		g = append(g, e.String())
	}
	for _, e := range want {
		w = append(w, e.String())
	}
	slices.Sort(g)
	slices.Sort(w)
	if !slices.Equal(g, w) {
		ns.t.Fatalf("endpoints:\n got: %q\nwant: %q", g, w)
	}
	return got
}

func TestPMNetns(t *testing.T) {
	ns := newTestNS(t)
	pm := ns.pm
	a0, b0 := ns.ifindex("a0"), ns.ifindex("b0")

	// Limits: the kernel's defaults, then set and read back.
	l, err := pm.Limits()
	if err != nil {
		t.Fatal(err)
	}
	if want := ns.ipLimits(); l != want || l.Subflows != 2 || l.AddAddrAccepted != 0 {
		t.Fatalf("fresh namespace limits %+v, ip says %+v, want subflows 2 add_addr_accepted 0", l, want)
	}
	if err := pm.SetLimits(mptcp.Limits{Subflows: 4, AddAddrAccepted: 3}); err != nil {
		t.Fatal(err)
	}
	if l, _ := pm.Limits(); l != (mptcp.Limits{Subflows: 4, AddAddrAccepted: 3}) || ns.ipLimits() != l {
		t.Fatalf("limits after set: %+v, ip says %+v", l, ns.ipLimits())
	}
	if err := pm.SetLimits(mptcp.Limits{Subflows: mptcp.MaxLimit, AddAddrAccepted: mptcp.MaxLimit}); err != nil {
		t.Fatalf("limits at the maximum: %v", err)
	}
	err = pm.SetLimits(mptcp.Limits{Subflows: mptcp.MaxLimit + 1, AddAddrAccepted: 1})
	var pe *mptcp.PMError
	if !errors.Is(err, syscall.EINVAL) || !errors.As(err, &pe) {
		t.Fatalf("limit above the maximum: %v, want EINVAL", err)
	}
	t.Logf("limit %d: %v", mptcp.MaxLimit+1, err)
	if l := ns.ipLimits(); l != (mptcp.Limits{Subflows: mptcp.MaxLimit, AddAddrAccepted: mptcp.MaxLimit}) {
		t.Fatalf("a refused SET_LIMITS changed the limits to %+v", l)
	}

	// Add: signal with port and backup, subflow with an ID, IPv6 fullmesh.
	sig := mptcp.Endpoint{Addr: netip.MustParseAddr("10.201.1.1"), Port: 10100, Flags: mptcp.Signal | mptcp.Backup, IfIndex: a0}
	sub := mptcp.Endpoint{ID: 7, Addr: netip.MustParseAddr("10.201.2.1"), Flags: mptcp.Subflow, IfIndex: b0}
	v6 := mptcp.Endpoint{Addr: netip.MustParseAddr("fd00:201:1::1"), Flags: mptcp.Subflow | mptcp.Fullmesh}
	for _, e := range []mptcp.Endpoint{sig, sub, v6} {
		if err := pm.AddEndpoint(e); err != nil {
			t.Fatal(err)
		}
	}
	got := ns.checkEndpoints([]mptcp.Endpoint{sig, sub, v6})
	t.Logf("endpoints: %v", got)
	if got[0].ID != 1 || got[0].Addr != sig.Addr {
		t.Errorf("first endpoint %v, want ID 1 picked by the kernel for %s", got[0], sig.Addr)
	}

	e, err := pm.Endpoint(7)
	if err != nil || e != sub {
		t.Fatalf("Endpoint(7) = %v, %v; want %v", e, err, sub)
	}
	if _, err := pm.Endpoint(99); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("Endpoint(99) error %v, want EINVAL", err)
	}

	// Refusals.
	if err := pm.AddEndpoint(mptcp.Endpoint{Addr: sub.Addr, Flags: mptcp.Subflow}); !errors.Is(err, fs.ErrExist) || !errors.Is(err, syscall.EEXIST) {
		t.Errorf("duplicate address: %v, want EEXIST", err)
	}
	if err := pm.AddEndpoint(mptcp.Endpoint{ID: 7, Addr: netip.MustParseAddr("10.201.3.1"), Flags: mptcp.Subflow}); !errors.Is(err, syscall.EBUSY) {
		t.Errorf("ID in use: %v, want EBUSY", err)
	}
	if err := pm.AddEndpoint(mptcp.Endpoint{Addr: netip.MustParseAddr("10.201.3.1"), Port: 10101, Flags: mptcp.Subflow}); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("port on a subflow endpoint: %v, want EINVAL", err)
	}
	if err := pm.AddEndpoint(mptcp.Endpoint{Addr: netip.MustParseAddr("10.201.3.1"), Flags: mptcp.Signal | mptcp.Fullmesh}); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("signal+fullmesh: %v, want EINVAL", err)
	}
	if err := pm.AddEndpoint(mptcp.Endpoint{Addr: netip.MustParseAddr("10.201.3.1"), Flags: mptcp.Implicit}); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("implicit: %v, want EINVAL", err)
	}

	// SET_FLAGS by ID: backup on.
	if err := pm.SetEndpointFlags(mptcp.Endpoint{ID: 7, Flags: mptcp.Subflow | mptcp.Backup}); err != nil {
		t.Fatal(err)
	}
	sub.Flags |= mptcp.Backup
	// SET_FLAGS by address and port, asking for subflow instead of signal
	// and no backup: only backup changes.
	if err := pm.SetEndpointFlags(mptcp.Endpoint{Addr: sig.Addr, Port: sig.Port, Flags: mptcp.Subflow}); err != nil {
		t.Fatal(err)
	}
	sig.Flags = mptcp.Signal
	// Fullmesh off by ID on the IPv6 endpoint.
	v6.ID = got[2].ID
	if err := pm.SetEndpointFlags(mptcp.Endpoint{ID: v6.ID, Flags: mptcp.Subflow}); err != nil {
		t.Fatal(err)
	}
	v6.Flags = mptcp.Subflow
	ns.checkEndpoints([]mptcp.Endpoint{sig, sub, v6})
	// The port identifies a port endpoint when looking up by address.
	if err := pm.SetEndpointFlags(mptcp.Endpoint{Addr: sig.Addr, Flags: mptcp.Signal | mptcp.Backup}); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("set flags by address without its port: %v, want EINVAL", err)
	}
	if err := pm.SetEndpointFlags(mptcp.Endpoint{Addr: sig.Addr, Port: sig.Port, Flags: mptcp.Signal | mptcp.Fullmesh}); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("fullmesh on a signal endpoint: %v, want EINVAL", err)
	}

	// Delete.
	if err := pm.DeleteEndpoint(7); err != nil {
		t.Fatal(err)
	}
	if err := pm.DeleteEndpoint(7); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("deleting a deleted endpoint: %v, want EINVAL", err)
	}
	if err := pm.DeleteEndpoint(0); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("DeleteEndpoint(0): %v, want EINVAL", err)
	}
	if err := pm.DeleteEndpointAddr(v6.Addr); err != nil {
		t.Fatal(err)
	}
	if err := pm.DeleteEndpointAddr(v6.Addr); !errors.Is(err, mptcp.ErrEndpointNotFound) {
		t.Errorf("DeleteEndpointAddr of a deleted address: %v, want ErrEndpointNotFound", err)
	}
	ns.checkEndpoints([]mptcp.Endpoint{sig})

	// Eight endpoints at most; the ninth is ERANGE.
	for i := 2; i <= mptcp.MaxEndpoints; i++ {
		e := mptcp.Endpoint{Addr: netip.AddrFrom4([4]byte{10, 201, 3, byte(i)}), Flags: mptcp.Subflow}
		if err := pm.AddEndpoint(e); err != nil {
			t.Fatalf("endpoint %d: %v", i, err)
		}
	}
	err = pm.AddEndpoint(mptcp.Endpoint{Addr: netip.MustParseAddr("10.201.3.99"), Flags: mptcp.Subflow})
	if !errors.Is(err, mptcp.ErrTooManyEndpoints) || !errors.Is(err, syscall.ERANGE) {
		t.Fatalf("endpoint %d: %v, want ErrTooManyEndpoints and ERANGE", mptcp.MaxEndpoints+1, err)
	}
	t.Logf("endpoint %d: %v", mptcp.MaxEndpoints+1, err)
	if n := len(ns.checkEndpoints(nil)); n != mptcp.MaxEndpoints {
		t.Fatalf("%d endpoints, want %d", n, mptcp.MaxEndpoints)
	}

	if err := pm.Flush(); err != nil {
		t.Fatal(err)
	}
	ns.checkEndpoints([]mptcp.Endpoint{})
	t.Logf("limits after flush: %+v", ns.ipLimits())
}
