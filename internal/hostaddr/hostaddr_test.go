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

package hostaddr_test

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/mpnbd/mpnbd/internal/hostaddr"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// fakeSource is an AddrSource with fixed interfaces; calls counts its
// calls.
type fakeSource struct {
	ifs   []mptcp.Interface
	err   error
	calls int
}

func (f *fakeSource) Interfaces() ([]mptcp.Interface, error) {
	f.calls++
	return f.ifs, f.err
}

func addrs(ss ...string) []netip.Addr {
	out := make([]netip.Addr, len(ss))
	for i, s := range ss {
		out[i] = netip.MustParseAddr(s)
	}
	return out
}

// storageHost has storage NICs on two subnets with two addresses on
// each of eth1 and eth2, given out of index order, besides addresses
// that never count.
func storageHost() *fakeSource {
	return &fakeSource{ifs: []mptcp.Interface{
		{Index: 4, Name: "eth2", Addrs: addrs("10.77.2.9", "10.77.1.9", "fe80::2")},
		{Index: 1, Name: "lo", Addrs: addrs("127.0.0.1", "::1")},
		{Index: 2, Name: "eth0", Addrs: addrs("192.168.0.10", "fd00:77::10", "fe80::1")},
		{Index: 3, Name: "eth1", Addrs: addrs("10.77.1.5", "::ffff:10.77.3.5", "fd00:77:1::5")},
	}}
}

func TestResolve(t *testing.T) {
	for _, tc := range []struct {
		name    string
		entries []string
		want    []string
		asked   bool // whether the source is read
	}{
		{"an address", []string{"10.0.0.1"}, []string{"10.0.0.1"}, false},
		{"an address the host lacks, IPv6 and mapped", []string{"fd00::1", "::ffff:10.0.0.2"}, []string{"fd00::1", "10.0.0.2"}, false},
		{"a prefix with one address", []string{"10.77.2.0/24"}, []string{"10.77.2.9"}, true},
		{"a prefix with addresses on two interfaces, by index", []string{"10.77.1.0/24"}, []string{"10.77.1.5", "10.77.1.9"}, true},
		{"a prefix with host bits", []string{"10.77.1.77/24"}, []string{"10.77.1.5", "10.77.1.9"}, true},
		{"an IPv4-mapped address in a prefix", []string{"10.77.3.0/24"}, []string{"10.77.3.5"}, true},
		{"an IPv6 prefix", []string{"fd00:77:1::/64"}, []string{"fd00:77:1::5"}, true},
		{"an IPv6 prefix over two interfaces", []string{"fd00:77::/32"}, []string{"fd00:77::10", "fd00:77:1::5"}, true},
		{"entries in order", []string{"10.77.2.0/24", "10.0.0.1", "10.77.1.0/24"},
			[]string{"10.77.2.9", "10.0.0.1", "10.77.1.5", "10.77.1.9"}, true},
		{"a literal inside a later prefix, kept once", []string{"10.77.1.9", "10.77.1.0/24"}, []string{"10.77.1.9", "10.77.1.5"}, true},
		{"a literal inside an earlier prefix, kept once", []string{"10.77.1.0/24", "10.77.1.5"}, []string{"10.77.1.5", "10.77.1.9"}, true},
		{"overlapping prefixes", []string{"10.77.1.0/24", "10.77.0.0/16"}, []string{"10.77.1.5", "10.77.1.9", "10.77.3.5", "10.77.2.9"}, true},
		{"every address", []string{"0.0.0.0/0", "::/0"},
			[]string{"192.168.0.10", "10.77.1.5", "10.77.3.5", "10.77.2.9", "10.77.1.9", "fd00:77::10", "fd00:77:1::5"}, true},
		{"blank entries skipped", []string{" ", "10.0.0.1 "}, []string{"10.0.0.1"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, err := hostaddr.Parse("--storage-address", tc.entries)
			if err != nil {
				t.Fatal(err)
			}
			src := storageHost()
			got, err := l.Resolve(src)
			if err != nil {
				t.Fatal(err)
			}
			if s := hostaddr.Strings(got); !slices.Equal(s, tc.want) {
				t.Errorf("Resolve(%q) = %q, want %q", tc.entries, s, tc.want)
			}
			if asked := src.calls > 0; asked != tc.asked || src.calls > 1 || l.HasPrefix() != tc.asked {
				t.Errorf("Resolve(%q) read the source %d times (HasPrefix %v)", tc.entries, src.calls, l.HasPrefix())
			}
		})
	}
}

func TestResolveErrors(t *testing.T) {
	for _, tc := range []struct {
		name    string
		entries []string
		want    string
	}{
		{"a prefix without an address of the host", []string{"10.77.1.0/24", "10.77.4.0/24"},
			"--storage-address 10.77.4.0/24: no address of this host is in it"},
		{"a prefix holding only loopback addresses", []string{"127.0.0.0/8"}, "--storage-address 127.0.0.0/8: no address"},
		{"a prefix holding only link-local addresses", []string{"fe80::/10"}, "--storage-address fe80::/10: no address"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, err := hostaddr.Parse("--storage-address", tc.entries)
			if err != nil {
				t.Fatal(err)
			}
			got, err := l.Resolve(storageHost())
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Resolve(%q) = %v, %v; want an error containing %q", tc.entries, got, err, tc.want)
			}
		})
	}

	l, err := hostaddr.Parse("--storage-address", []string{"10.0.0.1", "10.77.1.0/24"})
	if err != nil {
		t.Fatal(err)
	}
	failing := errors.New("netlink says no")
	if _, err := l.Resolve(&fakeSource{err: failing}); !errors.Is(err, failing) || !strings.Contains(err.Error(), "--storage-address") {
		t.Errorf("Resolve with a failing source: %v, want it wrapped and naming the flag", err)
	}
}

func TestParseErrors(t *testing.T) {
	for _, tc := range []struct {
		entries []string
		want    string
	}{
		{[]string{"eth0"}, `invalid --storage-address "eth0": want an IP address without a port, or a CIDR`},
		{[]string{"10.0.0.2:10809"}, `invalid --storage-address "10.0.0.2:10809"`},
		{[]string{"[fd00::1]:10809"}, `invalid --storage-address "[fd00::1]:10809"`},
		{[]string{"fe80::1%eth0"}, `invalid --storage-address "fe80::1%eth0"`},
		{[]string{"10.0.0.0/33"}, `invalid --storage-address "10.0.0.0/33"`},
		{[]string{"10.77.1.0/"}, `invalid --storage-address "10.77.1.0/"`},
		{[]string{"eth1/24"}, `invalid --storage-address "eth1/24"`},
		{[]string{"10.0.0.1", "10.0.0.2", "10.0.0.1"}, "--storage-address 10.0.0.1 is given twice"},
		{[]string{"10.0.0.1", "::ffff:10.0.0.1"}, "--storage-address 10.0.0.1 is given twice"},
		{[]string{"10.77.1.0/24", "10.77.1.0/24"}, "--storage-address 10.77.1.0/24 is given twice"},
	} {
		l, err := hostaddr.Parse("--storage-address", tc.entries)
		if err == nil || !strings.HasPrefix(err.Error(), tc.want) {
			t.Errorf("Parse(%q) = %+v, %v; want an error %q", tc.entries, l, err, tc.want)
		}
	}
}

// TestGlobal: the addresses of the node plugin's default, every global
// unicast address of the host once.
func TestGlobal(t *testing.T) {
	src := storageHost()
	src.ifs = append(src.ifs, mptcp.Interface{Index: 5, Name: "eth3", Addrs: addrs("10.77.1.5", "224.0.0.1", "0.0.0.0", "255.255.255.255")})
	got, err := hostaddr.Global(src)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"192.168.0.10", "fd00:77::10", "10.77.1.5", "10.77.3.5", "fd00:77:1::5", "10.77.2.9", "10.77.1.9"}
	if s := hostaddr.Strings(got); !slices.Equal(s, want) {
		t.Errorf("Global = %q, want %q", s, want)
	}
}
