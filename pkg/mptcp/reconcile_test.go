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
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// fakeKernel is a PMInterface that behaves like the in-kernel path
// manager where Reconcile relies on it.
type fakeKernel struct {
	mu      sync.Mutex
	eps     []Endpoint
	limits  Limits
	calls   []string // mutating calls, in order
	failAdd error    // returned by AddEndpoint when set
}

func newFakeKernel(eps ...Endpoint) *fakeKernel {
	k := &fakeKernel{limits: Limits{Subflows: 2}} // the kernel's defaults
	k.eps = append(k.eps, eps...)
	k.sort()
	return k
}

func (k *fakeKernel) sort() {
	slices.SortFunc(k.eps, func(a, b Endpoint) int { return cmp.Compare(a.ID, b.ID) })
}

func (k *fakeKernel) Endpoints() ([]Endpoint, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return slices.Clone(k.eps), nil
}

func (k *fakeKernel) Limits() (Limits, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.limits, nil
}

func (k *fakeKernel) SetLimits(l Limits) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.calls = append(k.calls, fmt.Sprintf("limits %d %d", l.Subflows, l.AddAddrAccepted))
	if l.Subflows > MaxLimit || l.AddAddrAccepted > MaxLimit {
		return syscall.EINVAL
	}
	k.limits = l
	return nil
}

func signalOnly(f EndpointFlags) bool { return f&(Signal|Subflow) == Signal }

func (k *fakeKernel) AddEndpoint(e Endpoint) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.calls = append(k.calls, "add "+e.String())
	if k.failAdd != nil {
		return k.failAdd
	}
	switch {
	case e.Flags&Implicit != 0,
		e.Port != 0 && !signalOnly(e.Flags),
		e.Flags&Signal != 0 && e.Flags&Fullmesh != 0:
		return syscall.EINVAL
	case len(k.eps) >= MaxEndpoints:
		return syscall.ERANGE
	}
	for _, c := range k.eps {
		if e.ID != 0 && c.ID == e.ID {
			return syscall.EBUSY
		}
	}
	if !signalOnly(e.Flags) {
		e.Port = 0
	}
	for i, c := range k.eps {
		usePort := c.Port != 0 || e.Port != 0
		if c.Addr != e.Addr || (usePort && c.Port != e.Port) {
			continue
		}
		if c.Flags&Implicit == 0 {
			return syscall.EEXIST
		}
		if e.ID != 0 {
			return syscall.EINVAL
		}
		e.ID = c.ID
		k.eps[i] = e
		return nil
	}
	if e.ID == 0 {
		for id := 1; id <= 255; id++ {
			if !slices.ContainsFunc(k.eps, func(c Endpoint) bool { return int(c.ID) == id }) {
				e.ID = uint8(id)
				break
			}
		}
	}
	k.eps = append(k.eps, e)
	k.sort()
	return nil
}

func (k *fakeKernel) DeleteEndpoint(id uint8) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.calls = append(k.calls, fmt.Sprintf("delete %d", id))
	i := slices.IndexFunc(k.eps, func(c Endpoint) bool { return c.ID == id })
	if id == 0 || i < 0 {
		return syscall.EINVAL
	}
	k.eps = slices.Delete(k.eps, i, i+1)
	return nil
}

func (k *fakeKernel) SetEndpointFlags(e Endpoint) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.calls = append(k.calls, fmt.Sprintf("flags %d %v", e.ID, e.Flags))
	i := slices.IndexFunc(k.eps, func(c Endpoint) bool {
		if e.ID != 0 {
			return c.ID == e.ID
		}
		return c.Addr == e.Addr && (c.Port == 0 || c.Port == e.Port)
	})
	if i < 0 {
		return syscall.EINVAL
	}
	c := &k.eps[i]
	if e.Flags&Fullmesh != 0 && c.Flags&(Signal|Implicit) != 0 {
		return syscall.EINVAL
	}
	c.Flags = c.Flags&^settableFlags | e.Flags&settableFlags
	return nil
}

// state returns the endpoints as strings, for comparisons.
func (k *fakeKernel) state() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	var s []string
	for _, e := range k.eps {
		s = append(s, e.String())
	}
	return s
}

// fakeAddrs is an AddrSource with settable interfaces.
type fakeAddrs struct {
	mu  sync.Mutex
	ifs []Interface
	err error
}

func (f *fakeAddrs) Interfaces() ([]Interface, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.ifs), f.err
}

func (f *fakeAddrs) set(ifs ...Interface) {
	f.mu.Lock()
	f.ifs = ifs
	f.mu.Unlock()
}

func ifc(index int, name string, addrs ...string) Interface {
	i := Interface{Index: index, Name: name}
	for _, a := range addrs {
		i.Addrs = append(i.Addrs, netip.MustParseAddr(a))
	}
	return i
}

func ep(id uint8, addr string, flags EndpointFlags, port uint16, ifindex int32) Endpoint {
	return Endpoint{ID: id, Addr: netip.MustParseAddr(addr), Flags: flags, Port: port, IfIndex: ifindex}
}

// The test machine: eth1 and eth2 with a link-local IPv6 address each,
// eth1 also with a global IPv6 address; lo; eth3 with an address in
// another range.
var testIfs = []Interface{
	ifc(1, "lo", "127.0.0.1", "::1"),
	ifc(2, "eth1", "10.77.1.1", "fe80::1", "fd77::1"),
	ifc(3, "eth2", "10.77.2.1", "fe80::2"),
	ifc(4, "eth3", "192.168.9.1"),
}

func TestReconcile(t *testing.T) {
	admin := ep(42, "192.168.9.1", Signal, 0, 0) // on eth3, not managed
	lim := func(s, a uint32) *Limits { return &Limits{Subflows: s, AddAddrAccepted: a} }
	tests := []struct {
		name     string
		ifs      []Interface
		existing []Endpoint
		limits   *Limits // initial; nil = kernel defaults (2, 0)
		d        Desired
		want     []Endpoint // final state
		added    int
		removed  int
		updated  int
		limOut   Limits
		warn     []string // substrings of warnings, in order
		err      error    // errors.Is target
		errText  string
		calls    []string // exact mutating calls, when set
	}{
		{
			name: "fresh namespace, server",
			d:    Desired{NICs: []NICSpec{"eth1", "eth2"}, Role: RoleServer},
			want: []Endpoint{
				ep(1, "10.77.1.1", Signal, 0, 2),
				ep(2, "10.77.2.1", Signal, 0, 3),
				ep(3, "fd77::1", Signal, 0, 2),
			},
			added: 3, limOut: Limits{Subflows: 3},
		},
		{
			name: "fresh namespace, server with a join port",
			d:    Desired{NICs: []NICSpec{"eth1", "eth2"}, Role: RoleServer, Port: 10100},
			want: []Endpoint{
				ep(1, "10.77.1.1", Signal, 10100, 2),
				ep(2, "10.77.2.1", Signal, 10100, 3),
				ep(3, "fd77::1", Signal, 10100, 2),
			},
			added: 3, limOut: Limits{Subflows: 3},
		},
		{
			name: "fresh namespace, client",
			d:    Desired{NICs: []NICSpec{"eth1", "eth2"}, Role: RoleClient},
			want: []Endpoint{
				ep(1, "10.77.1.1", Subflow, 0, 2),
				ep(2, "10.77.2.1", Subflow, 0, 3),
				ep(3, "fd77::1", Subflow, 0, 2),
			},
			added: 3, limOut: Limits{Subflows: 2, AddAddrAccepted: 2},
			calls: []string{"limits 2 2", "add 10.77.1.1 id 0 subflow ifindex 2",
				"add 10.77.2.1 id 0 subflow ifindex 3", "add fd77::1 id 0 subflow ifindex 2"},
		},
		{
			name:     "admin endpoint untouched",
			existing: []Endpoint{admin},
			d:        Desired{NICs: []NICSpec{"eth2"}, Role: RoleClient},
			want:     []Endpoint{ep(1, "10.77.2.1", Subflow, 0, 3), admin},
			added:    1, limOut: Limits{Subflows: 2},
		},
		{
			name: "admin endpoint on an address outside the NICs, bound to another interface",
			existing: []Endpoint{
				ep(5, "10.99.0.1", Subflow, 0, 4), // eth3: not ours
			},
			d:     Desired{NICs: []NICSpec{"eth2"}, Role: RoleServer},
			want:  []Endpoint{ep(1, "10.77.2.1", Signal, 0, 3), ep(5, "10.99.0.1", Subflow, 0, 4)},
			added: 1, limOut: Limits{Subflows: 2},
		},
		{
			name: "backup flag changed in place",
			existing: []Endpoint{
				ep(3, "10.77.1.1", Subflow, 0, 2),
				ep(4, "10.77.2.1", Subflow|Backup, 0, 3),
			},
			d: Desired{NICs: []NICSpec{"eth1", "eth2"}, Role: RoleClient, Backup: []NICSpec{"eth1"}},
			want: []Endpoint{
				ep(1, "fd77::1", Subflow|Backup, 0, 2),
				ep(3, "10.77.1.1", Subflow|Backup, 0, 2),
				ep(4, "10.77.2.1", Subflow, 0, 3),
			},
			added: 1, updated: 2, limOut: Limits{Subflows: 2, AddAddrAccepted: 2},
		},
		{
			name:     "fullmesh cleared in place",
			existing: []Endpoint{ep(3, "10.77.2.1", Subflow|Fullmesh, 0, 3)},
			d:        Desired{NICs: []NICSpec{"eth2"}, Role: RoleClient},
			want:     []Endpoint{ep(3, "10.77.2.1", Subflow, 0, 3)},
			updated:  1, limOut: Limits{Subflows: 2},
			calls: []string{"flags 3 subflow"},
		},
		{
			name:     "role changed: deleted and added",
			existing: []Endpoint{ep(3, "10.77.2.1", Signal, 0, 3)},
			d:        Desired{NICs: []NICSpec{"eth2"}, Role: RoleClient},
			want:     []Endpoint{ep(1, "10.77.2.1", Subflow, 0, 3)},
			added:    1, removed: 1, limOut: Limits{Subflows: 2},
			calls: []string{"delete 3", "add 10.77.2.1 id 0 subflow ifindex 3"},
		},
		{
			name:     "port changed: deleted and added",
			existing: []Endpoint{ep(3, "10.77.2.1", Signal|Backup, 10100, 3)},
			d:        Desired{NICs: []NICSpec{"eth2"}, Role: RoleServer, Port: 10200, Backup: []NICSpec{"eth2"}},
			want:     []Endpoint{ep(1, "10.77.2.1", Signal|Backup, 10200, 3)},
			added:    1, removed: 1, limOut: Limits{Subflows: 2},
		},
		{
			name:     "interface changed: deleted and added",
			existing: []Endpoint{ep(3, "10.77.2.1", Signal, 0, 0)},
			d:        Desired{NICs: []NICSpec{"eth2"}, Role: RoleServer},
			want:     []Endpoint{ep(1, "10.77.2.1", Signal, 0, 3)},
			added:    1, removed: 1, limOut: Limits{Subflows: 2},
		},
		{
			name: "laminar cleared: deleted and added",
			existing: []Endpoint{
				ep(3, "10.77.2.1", Subflow|Laminar, 0, 3),
			},
			d:     Desired{NICs: []NICSpec{"eth2"}, Role: RoleClient},
			want:  []Endpoint{ep(1, "10.77.2.1", Subflow, 0, 3)},
			added: 1, removed: 1, limOut: Limits{Subflows: 2},
		},
		{
			name: "address removed from a named NIC",
			ifs: []Interface{
				ifc(2, "eth1", "10.77.1.1"),
				ifc(3, "eth2"), // 10.77.2.1 is gone
				ifc(4, "eth3", "192.168.9.1"),
			},
			existing: []Endpoint{
				ep(1, "10.77.1.1", Subflow, 0, 2),
				ep(2, "10.77.2.1", Subflow, 0, 3),
				admin,
			},
			d:       Desired{NICs: []NICSpec{"eth1", "eth2"}, Role: RoleClient},
			want:    []Endpoint{ep(1, "10.77.1.1", Subflow, 0, 2), admin},
			removed: 1, limOut: Limits{Subflows: 2},
			warn: []string{`NIC "eth2": no usable address`},
		},
		{
			name: "address removed from a CIDR",
			ifs:  []Interface{ifc(2, "eth1", "10.77.1.1"), ifc(4, "eth3", "192.168.9.1")},
			existing: []Endpoint{
				ep(1, "10.77.1.1", Subflow, 0, 2),
				ep(2, "10.77.2.1", Subflow, 0, 0), // no interface recorded
				admin,
			},
			d:       Desired{NICs: []NICSpec{"10.77.0.0/16"}, Role: RoleClient},
			want:    []Endpoint{ep(1, "10.77.1.1", Subflow, 0, 2), admin},
			removed: 1, limOut: Limits{Subflows: 2},
		},
		{
			name: "CIDR spans interfaces and families are separate",
			d:    Desired{NICs: []NICSpec{"10.77.0.0/16"}, Role: RoleServer},
			want: []Endpoint{
				ep(1, "10.77.1.1", Signal, 0, 2),
				ep(2, "10.77.2.1", Signal, 0, 3),
			},
			added: 2, limOut: Limits{Subflows: 2},
		},
		{
			name: "CIDR and name for the same addresses",
			d:    Desired{NICs: []NICSpec{"fd77::/64", "eth1"}, Role: RoleServer, Backup: []NICSpec{"fd77::/64"}},
			want: []Endpoint{
				ep(1, "10.77.1.1", Signal, 0, 2),
				ep(2, "fd77::1", Signal|Backup, 0, 2),
			},
			added: 2, limOut: Limits{Subflows: 2},
		},
		{
			name: "backup NIC by name",
			d:    Desired{NICs: []NICSpec{"eth1", "eth2"}, Role: RoleServer, Backup: []NICSpec{"eth2", "eth9"}},
			want: []Endpoint{
				ep(1, "10.77.1.1", Signal, 0, 2),
				ep(2, "10.77.2.1", Signal|Backup, 0, 3),
				ep(3, "fd77::1", Signal, 0, 2),
			},
			added: 3, limOut: Limits{Subflows: 3},
			warn: []string{`backup NIC "eth9" selects none`},
		},
		{
			name:  "unknown interface warns",
			d:     Desired{NICs: []NICSpec{"eth2", "wlan0"}, Role: RoleClient},
			want:  []Endpoint{ep(1, "10.77.2.1", Subflow, 0, 3)},
			added: 1, limOut: Limits{Subflows: 2},
			warn: []string{`NIC "wlan0": no such interface`},
		},
		{
			name:     "loopback and link-local never match",
			d:        Desired{NICs: []NICSpec{"lo", "fe80::/10"}, Role: RoleClient},
			existing: []Endpoint{admin},
			want:     []Endpoint{admin},
			limOut:   Limits{Subflows: 2},
			warn:     []string{`NIC "lo": no usable address`, `NIC "fe80::/10": no usable address`},
		},
		{
			name: "surplus endpoints for one address",
			existing: []Endpoint{
				ep(1, "10.77.2.1", Signal, 10100, 3),
				ep(2, "10.77.2.1", Signal, 0, 3),
				ep(3, "10.77.2.1", Signal, 10200, 3),
			},
			d:       Desired{NICs: []NICSpec{"eth2"}, Role: RoleServer},
			want:    []Endpoint{ep(2, "10.77.2.1", Signal, 0, 3)},
			removed: 2, limOut: Limits{Subflows: 2},
		},
		{
			name: "implicit endpoint taken over in place",
			existing: []Endpoint{
				ep(5, "10.77.2.1", Implicit, 0, 0),
			},
			d:       Desired{NICs: []NICSpec{"eth2"}, Role: RoleClient},
			want:    []Endpoint{ep(5, "10.77.2.1", Subflow, 0, 3)},
			updated: 1, limOut: Limits{Subflows: 2},
			calls: []string{"add 10.77.2.1 id 0 subflow ifindex 3"},
		},
		{
			name: "implicit endpoint replaced for a port",
			existing: []Endpoint{
				ep(5, "10.77.2.1", Implicit, 0, 0),
			},
			d:     Desired{NICs: []NICSpec{"eth2"}, Role: RoleServer, Port: 9000},
			want:  []Endpoint{ep(1, "10.77.2.1", Signal, 9000, 3)},
			added: 1, removed: 1, limOut: Limits{Subflows: 2},
		},
		{
			name: "exactly eight endpoints",
			existing: []Endpoint{
				ep(10, "192.168.9.10", Signal, 0, 0), ep(11, "192.168.9.11", Signal, 0, 0),
				ep(12, "192.168.9.12", Signal, 0, 0), ep(13, "192.168.9.13", Signal, 0, 0),
				ep(14, "192.168.9.14", Signal, 0, 0),
				ep(15, "10.77.2.1", Implicit, 0, 0), // taken over in place: no extra
			},
			d: Desired{NICs: []NICSpec{"eth1", "eth2"}, Role: RoleClient},
			want: []Endpoint{
				ep(1, "10.77.1.1", Subflow, 0, 2), ep(2, "fd77::1", Subflow, 0, 2),
				ep(10, "192.168.9.10", Signal, 0, 0), ep(11, "192.168.9.11", Signal, 0, 0),
				ep(12, "192.168.9.12", Signal, 0, 0), ep(13, "192.168.9.13", Signal, 0, 0),
				ep(14, "192.168.9.14", Signal, 0, 0), ep(15, "10.77.2.1", Subflow, 0, 3),
			},
			added: 2, updated: 1, limOut: Limits{Subflows: 2, AddAddrAccepted: 2},
		},
		{
			name: "implicit endpoint in a full namespace: deleted and added",
			existing: []Endpoint{
				ep(10, "192.168.9.10", Signal, 0, 0), ep(11, "192.168.9.11", Signal, 0, 0),
				ep(12, "192.168.9.12", Signal, 0, 0), ep(13, "192.168.9.13", Signal, 0, 0),
				ep(14, "192.168.9.14", Signal, 0, 0), ep(15, "192.168.9.15", Signal, 0, 0),
				ep(16, "192.168.9.16", Signal, 0, 0),
				ep(17, "10.77.2.1", Implicit, 0, 0),
			},
			d: Desired{NICs: []NICSpec{"eth2"}, Role: RoleClient},
			want: []Endpoint{
				ep(1, "10.77.2.1", Subflow, 0, 3),
				ep(10, "192.168.9.10", Signal, 0, 0), ep(11, "192.168.9.11", Signal, 0, 0),
				ep(12, "192.168.9.12", Signal, 0, 0), ep(13, "192.168.9.13", Signal, 0, 0),
				ep(14, "192.168.9.14", Signal, 0, 0), ep(15, "192.168.9.15", Signal, 0, 0),
				ep(16, "192.168.9.16", Signal, 0, 0),
			},
			added: 1, removed: 1, limOut: Limits{Subflows: 2},
			calls: []string{"delete 17", "add 10.77.2.1 id 0 subflow ifindex 3"},
		},
		{
			name: "over the limit: refused, nothing applied",
			existing: []Endpoint{
				ep(10, "192.168.9.10", Signal, 0, 0), ep(11, "192.168.9.11", Signal, 0, 0),
				ep(12, "192.168.9.12", Signal, 0, 0), ep(13, "192.168.9.13", Signal, 0, 0),
				ep(14, "192.168.9.14", Signal, 0, 0), ep(15, "192.168.9.15", Signal, 0, 0),
				ep(20, "10.77.9.9", Subflow, 0, 2), // stale, would be removed
			},
			limits:  lim(0, 0),
			d:       Desired{NICs: []NICSpec{"eth1", "eth2"}, Role: RoleClient},
			err:     ErrTooManyEndpoints,
			errText: "9 endpoints needed (3 managed + 6 others), more than the kernel's limit of 8",
			calls:   []string{},
		},
		{
			name:     "derived limits never lower an administrator's",
			limits:   lim(7, 5),
			existing: []Endpoint{admin},
			d:        Desired{NICs: []NICSpec{"eth1", "eth2"}, Role: RoleClient},
			want: []Endpoint{
				ep(1, "10.77.1.1", Subflow, 0, 2), ep(2, "10.77.2.1", Subflow, 0, 3),
				ep(3, "fd77::1", Subflow, 0, 2), admin,
			},
			added: 3, limOut: Limits{Subflows: 7, AddAddrAccepted: 5},
		},
		{
			name:   "explicit limits are set exactly",
			limits: lim(7, 5),
			d:      Desired{NICs: []NICSpec{"eth2"}, Role: RoleServer, Limits: lim(1, 0)},
			want:   []Endpoint{ep(1, "10.77.2.1", Signal, 0, 3)},
			added:  1, limOut: Limits{Subflows: 1},
		},
		{
			name:    "invalid role",
			d:       Desired{NICs: []NICSpec{"eth2"}},
			errText: "invalid role",
		},
		{
			name:    "port on a client",
			d:       Desired{NICs: []NICSpec{"eth2"}, Role: RoleClient, Port: 80},
			errText: "only for server",
		},
		{
			name:    "bad CIDR",
			d:       Desired{NICs: []NICSpec{"10.77.0.0/33"}, Role: RoleClient},
			errText: "neither an interface name nor a CIDR",
		},
		{
			name:    "empty spec",
			d:       Desired{NICs: []NICSpec{"eth1"}, Backup: []NICSpec{" "}, Role: RoleClient},
			errText: "empty NIC spec",
		},
		{
			name:    "limits above the maximum",
			d:       Desired{NICs: []NICSpec{"eth1"}, Role: RoleClient, Limits: lim(9, 0)},
			errText: "maximum is 8",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			k := newFakeKernel(tt.existing...)
			if tt.limits != nil {
				k.limits = *tt.limits
			}
			addrs := &fakeAddrs{ifs: testIfs}
			if tt.ifs != nil {
				addrs.ifs = tt.ifs
			}
			before := k.state()
			res, err := Reconcile(k, addrs, tt.d)
			if tt.err != nil || tt.errText != "" {
				if err == nil {
					t.Fatalf("no error, result %+v", res)
				}
				if tt.err != nil && !errors.Is(err, tt.err) {
					t.Errorf("error %v, want %v", err, tt.err)
				}
				if !strings.Contains(err.Error(), tt.errText) {
					t.Errorf("error %q lacks %q", err, tt.errText)
				}
				if got := k.state(); !slices.Equal(got, before) || len(k.calls) != 0 {
					t.Errorf("refused reconcile changed the kernel: calls %q, endpoints %q", k.calls, got)
				}
				if res.Changed() {
					t.Errorf("refused reconcile reports changes: %+v", res)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			var want []string
			for _, e := range tt.want {
				want = append(want, e.String())
			}
			if got := k.state(); !slices.Equal(got, want) {
				t.Errorf("endpoints\n got %q\nwant %q", got, want)
			}
			if len(res.Added) != tt.added || len(res.Removed) != tt.removed || len(res.Updated) != tt.updated {
				t.Errorf("result added %v removed %v updated %v; want %d, %d, %d",
					res.Added, res.Removed, res.Updated, tt.added, tt.removed, tt.updated)
			}
			if res.Limits != tt.limOut || k.limits != tt.limOut {
				t.Errorf("limits: result %+v, kernel %+v, want %+v", res.Limits, k.limits, tt.limOut)
			}
			if len(res.Warnings) != len(tt.warn) {
				t.Errorf("warnings %q, want %q", res.Warnings, tt.warn)
			} else {
				for i, w := range tt.warn {
					if !strings.Contains(res.Warnings[i], w) {
						t.Errorf("warning %q lacks %q", res.Warnings[i], w)
					}
				}
			}
			if tt.calls != nil && !slices.Equal(k.calls, tt.calls) {
				t.Errorf("calls\n got %q\nwant %q", k.calls, tt.calls)
			}

			// Idempotent: a second run changes nothing.
			k.calls = nil
			again, err := Reconcile(k, addrs, tt.d)
			if err != nil {
				t.Fatalf("second run: %v", err)
			}
			if again.Changed() || len(k.calls) != 0 {
				t.Errorf("second run changed things: %+v, calls %q", again, k.calls)
			}
		})
	}
}

func TestReconcileApplyFailure(t *testing.T) {
	k := newFakeKernel(ep(3, "10.77.2.1", Signal, 0, 3))
	k.failAdd = syscall.ENOMEM
	res, err := Reconcile(k, &fakeAddrs{ifs: testIfs}, Desired{NICs: []NICSpec{"eth2"}, Role: RoleClient})
	if !errors.Is(err, syscall.ENOMEM) {
		t.Fatalf("error %v, want ENOMEM", err)
	}
	if len(res.Removed) != 1 || len(res.Added) != 0 {
		t.Errorf("result %+v, want the deletion done before the failed add", res)
	}
}

func TestReconcileSourceError(t *testing.T) {
	k := newFakeKernel()
	_, err := Reconcile(k, &fakeAddrs{err: syscall.EACCES}, Desired{NICs: []NICSpec{"eth2"}, Role: RoleClient})
	if !errors.Is(err, syscall.EACCES) || len(k.calls) != 0 {
		t.Fatalf("error %v, calls %q", err, k.calls)
	}
}

func TestWatch(t *testing.T) {
	k := newFakeKernel()
	addrs := &fakeAddrs{ifs: []Interface{ifc(2, "eth1", "10.77.1.1"), ifc(3, "eth2", "10.77.2.1")}}
	changes := make(chan struct{}, 1)
	results := make(chan Result, 16)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Watch(ctx, k, addrs, Desired{NICs: []NICSpec{"eth1", "eth2"}, Role: RoleClient}, WatchOptions{
			Interval: time.Hour,
			Changes:  changes,
			Settle:   time.Millisecond,
			OnResult: func(r Result, err error) {
				if err != nil {
					t.Errorf("run: %v", err)
				}
				results <- r
			},
		})
	}()
	next := func() Result {
		t.Helper()
		select {
		case r := <-results:
			return r
		case <-time.After(10 * time.Second):
			t.Fatal("no run")
		}
		return Result{}
	}
	if r := next(); len(r.Added) != 2 {
		t.Fatalf("first run %+v, want 2 added", r)
	}

	// A new address: added after the change notification.
	addrs.set(ifc(2, "eth1", "10.77.1.1", "10.77.1.2"), ifc(3, "eth2", "10.77.2.1"))
	changes <- struct{}{}
	if r := next(); len(r.Added) != 1 || r.Added[0].Addr != netip.MustParseAddr("10.77.1.2") {
		t.Fatalf("after a new address: %+v", r)
	}

	// eth2 disappears altogether: Watch remembers its address.
	addrs.set(ifc(2, "eth1", "10.77.1.1", "10.77.1.2"))
	changes <- struct{}{}
	if r := next(); len(r.Removed) != 1 || r.Removed[0].Addr != netip.MustParseAddr("10.77.2.1") {
		t.Fatalf("after eth2 vanished: %+v", r)
	}
	changes <- struct{}{}
	if r := next(); r.Changed() {
		t.Fatalf("idle run changed things: %+v", r)
	}

	close(changes) // a closed channel only stops notifications
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("Watch returned %v, want context.Canceled", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Watch did not return after cancel")
	}
}

func TestWatchInvalid(t *testing.T) {
	err := Watch(context.Background(), newFakeKernel(), &fakeAddrs{}, Desired{NICs: []NICSpec{"a/b"}, Role: RoleClient}, WatchOptions{})
	if err == nil {
		t.Fatal("Watch accepted an invalid spec")
	}
}

func TestReconcileInterfaceVanishedSingleRun(t *testing.T) {
	// Without Watch's memory, an endpoint bound to an interface that no
	// longer exists, on an address no spec selects, is not recognised.
	k := newFakeKernel(ep(1, "10.77.2.1", Subflow, 0, 3))
	res, err := Reconcile(k, &fakeAddrs{ifs: []Interface{ifc(2, "eth1")}}, Desired{NICs: []NICSpec{"eth1", "eth2"}, Role: RoleClient})
	if err != nil || res.Changed() {
		t.Fatalf("%+v, %v", res, err)
	}
}
