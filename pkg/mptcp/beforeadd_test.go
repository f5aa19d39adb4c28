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
	"net/netip"
	"slices"
	"testing"
)

// TestReconcileBeforeAdd: BeforeAdd learns the wanted addresses before
// the first endpoint is added, so a server can listen on an address
// before it is announced.
func TestReconcileBeforeAdd(t *testing.T) {
	k := newFakeKernel()
	var got []netip.Addr
	callsBefore := -1
	d := Desired{NICs: []NICSpec{"eth2", "eth1"}, Role: RoleServer, BeforeAdd: func(a []netip.Addr) {
		got, callsBefore = a, len(k.calls)
	}}
	addrs := &fakeAddrs{ifs: []Interface{ifc(2, "eth1", "10.77.1.1"), ifc(3, "eth2", "10.77.2.1")}}
	res, err := Reconcile(k, addrs, d)
	if err != nil {
		t.Fatal(err)
	}
	want := []netip.Addr{netip.MustParseAddr("10.77.1.1"), netip.MustParseAddr("10.77.2.1")}
	if !slices.Equal(got, want) {
		t.Fatalf("BeforeAdd got %v, want %v", got, want)
	}
	if len(res.Added) != 2 {
		t.Fatalf("result %+v, want 2 endpoints added", res)
	}
	for _, c := range k.calls[:callsBefore] {
		if len(c) > 4 && c[:4] == "add " {
			t.Fatalf("endpoint added before BeforeAdd ran: calls %q", k.calls)
		}
	}
}
