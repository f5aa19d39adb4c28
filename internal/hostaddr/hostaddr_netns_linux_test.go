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
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/mpnbd/mpnbd/internal/hostaddr"
	"github.com/mpnbd/mpnbd/internal/testenv/topo"
)

// TestResolveNetns resolves prefixes on the addresses of a network
// namespace of its own (hostaddr.System), where a0 has 10.77.1.5/24 and
// fd00:77:1::5/64 and b0 10.77.2.5/24.
func TestResolveNetns(t *testing.T) {
	topo.RequireRoot(t)
	ns := topo.UniqueName("hostaddr")
	ip := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	ip("netns", "add", ns)
	t.Cleanup(func() {
		if out, err := exec.Command("ip", "netns", "del", ns).CombinedOutput(); err != nil {
			t.Errorf("ip netns del %s: %v: %s", ns, err, out)
		}
	})
	ip("-n", ns, "link", "add", "a0", "type", "veth", "peer", "name", "a1")
	ip("-n", ns, "link", "add", "b0", "type", "veth", "peer", "name", "b1")
	for _, dev := range []string{"lo", "a0", "a1", "b0", "b1"} {
		ip("-n", ns, "link", "set", dev, "up")
	}
	ip("-n", ns, "addr", "add", "10.77.1.5/24", "dev", "a0")
	ip("-n", ns, "addr", "add", "fd00:77:1::5/64", "dev", "a0", "nodad")
	ip("-n", ns, "addr", "add", "10.77.2.5/24", "dev", "b0")

	l, err := hostaddr.Parse("--storage-address", []string{"10.77.1.0/24", "fd00:77:1::/64", "10.77.9.9", "10.77.2.0/24"})
	if err != nil {
		t.Fatal(err)
	}
	var got, global []netip.Addr
	var missing error
	err = topo.InNetns(ns, func() error {
		var err error
		if got, err = l.Resolve(hostaddr.System); err != nil {
			return err
		}
		if global, err = hostaddr.Global(hostaddr.System); err != nil {
			return err
		}
		none, _ := hostaddr.Parse("--storage-address", []string{"10.77.3.0/24"})
		_, missing = none.Resolve(hostaddr.System)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if s, want := hostaddr.Strings(got), []string{"10.77.1.5", "fd00:77:1::5", "10.77.9.9", "10.77.2.5"}; !slices.Equal(s, want) {
		t.Errorf("resolved %q in the namespace, want %q", s, want)
	}
	if s, want := hostaddr.Strings(global), []string{"10.77.1.5", "fd00:77:1::5", "10.77.2.5"}; !slices.Equal(s, want) {
		t.Errorf("global addresses of the namespace %q, want %q", s, want)
	}
	if missing == nil || !strings.Contains(missing.Error(), "10.77.3.0/24: no address of this host is in it") {
		t.Errorf("resolving a prefix without an address of the namespace: %v", missing)
	}
}
