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
