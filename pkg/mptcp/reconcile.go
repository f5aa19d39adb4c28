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
	"time"
)

// Role says which kind of endpoints Reconcile manages.
type Role int

const (
	// RoleClient gives each managed address a "subflow" endpoint: the
	// kernel opens an additional subflow from it on each connection.
	RoleClient Role = iota + 1
	// RoleServer gives each managed address a "signal" endpoint: the
	// kernel announces it to clients (ADD_ADDR), which then join to it.
	RoleServer
)

func (r Role) String() string {
	switch r {
	case RoleClient:
		return "client"
	case RoleServer:
		return "server"
	}
	return fmt.Sprintf("Role(%d)", int(r))
}

// NICSpec selects local addresses: an interface name ("eth1"), matching the
// interface's addresses, or a CIDR prefix ("10.77.0.0/16",
// "fd00:77::/64"), matching the addresses inside it on any interface. A
// spec containing "/" is a CIDR. Only usable unicast addresses count:
// link-local, loopback, multicast and unspecified addresses never match.
type NICSpec string

// Interface is a network interface and its usable addresses, as an
// AddrSource reports it.
type Interface struct {
	Index int
	Name  string
	Addrs []netip.Addr
}

// AddrSource lists the interfaces of a network namespace with their
// addresses. SystemAddrs is the real one (Linux).
type AddrSource interface {
	Interfaces() ([]Interface, error)
}

// PMInterface is the subset of *PM that Reconcile and Watch use.
type PMInterface interface {
	Endpoints() ([]Endpoint, error)
	AddEndpoint(Endpoint) error
	DeleteEndpoint(id uint8) error
	SetEndpointFlags(Endpoint) error
	Limits() (Limits, error)
	SetLimits(Limits) error
}

var _ PMInterface = (*PM)(nil)

// Desired is the endpoint configuration Reconcile establishes.
type Desired struct {
	// NICs select the managed addresses; each gets one endpoint.
	NICs []NICSpec
	// Role chooses "subflow" (client) or "signal" (server) endpoints.
	Role Role
	// Backup selects the managed addresses whose endpoints get the backup
	// flag (addresses it selects outside NICs are ignored, with a warning).
	Backup []NICSpec
	// Port, for RoleServer only, is the port signal endpoints announce
	// and on which the kernel accepts MP_JOINs; 0 means the connection's
	// own port.
	Port uint16
	// Limits, if not nil, are set exactly. When nil they are derived from
	// the number n of managed endpoints: the subflows limit is raised to
	// n for a server (a join may arrive on every announced address) and
	// n-1 for a client, whose add_addr_accepted is raised to n-1 as well. Derived limits never lower the current ones,
	// so an administrator's larger limits stay.
	Limits *Limits
	// StaleLossCount, if not 0, is the least net.mptcp.stale_loss_cnt
	// Keep leaves in its namespace (see DefaultStaleLossCount); a larger
	// value stays.
	StaleLossCount int
	// BeforeAdd, if not nil, is called in every run with the addresses
	// the endpoints are wanted for (sorted), before any endpoint is
	// added. A server whose port listens on chosen addresses only opens
	// it on each new one here: a signal endpoint is announced to the
	// connections at once, and a join to an address where nothing
	// listens is reset and not tried again.
	BeforeAdd func(addrs []netip.Addr)
}

// Result reports what Reconcile did.
type Result struct {
	// Added are the endpoints added (with ID 0: the kernel picked it).
	Added []Endpoint
	// Removed are the endpoints deleted, including those replaced.
	Removed []Endpoint
	// Updated are endpoints changed in place: Backup/Fullmesh flags
	// through SET_FLAGS, or a kernel-created implicit endpoint turned into
	// a managed one.
	Updated []Endpoint
	// Limits are the limits in force afterwards.
	Limits Limits
	// LimitsChanged reports whether Reconcile set the limits.
	LimitsChanged bool
	// Warnings describe configuration that selects nothing.
	Warnings []string
	// Addrs are the addresses of the endpoints wanted, sorted.
	Addrs []netip.Addr
}

// Changed reports whether Reconcile changed anything.
func (r Result) Changed() bool {
	return len(r.Added)+len(r.Removed)+len(r.Updated) > 0 || r.LimitsChanged
}

// Reconcile makes the path-manager endpoints of a namespace match d,
// touching only the endpoints it manages.
//
// An endpoint is managed when its address is one that d.NICs select now,
// lies inside one of d.NICs' CIDR prefixes, or (for an address that has
// left its interface) when it is bound to an interface d.NICs name. Every
// other endpoint, such as one an administrator added for another address,
// is left alone, though it counts towards MaxEndpoints.
//
// Each selected address gets exactly one endpoint with the role's flag,
// the backup flag if d.Backup selects it, d.Port (server) and the
// interface's index. A managed endpoint with other Backup or Fullmesh flags
// is fixed with SET_FLAGS; one with another role flag, port, interface or
// the Laminar flag is deleted and added again (the kernel cannot change
// those in place); surplus and stale managed endpoints are deleted.
//
// Reconcile first computes the whole plan and checks it: when the
// namespace would end up with more than MaxEndpoints endpoints it returns
// an error wrapping ErrTooManyEndpoints and changes nothing. It then sets
// the limits (see Desired.Limits), deletes, adds and updates, and returns
// what it did; if the kernel refuses a step, the Result lists the steps
// done before it. A second run with unchanged addresses changes nothing.
func Reconcile(p PMInterface, addrs AddrSource, d Desired) (Result, error) {
	res, _, err := reconcile(p, addrs, d, nil)
	return res, err
}

// wanted is an address Desired selects and the endpoint it should have.
type wanted struct {
	ep     Endpoint
	ifname string
}

type specMatcher struct {
	spec   NICSpec
	name   string       // interface name, or ""
	prefix netip.Prefix // valid for a CIDR spec
	hits   int
}

func parseSpecs(specs []NICSpec, what string) ([]*specMatcher, error) {
	ms := make([]*specMatcher, 0, len(specs))
	for _, s := range specs {
		str := strings.TrimSpace(string(s))
		if str == "" {
			return nil, fmt.Errorf("mptcp: %s: empty NIC spec", what)
		}
		m := &specMatcher{spec: s}
		if strings.Contains(str, "/") {
			pfx, err := netip.ParsePrefix(str)
			if err != nil {
				return nil, fmt.Errorf("mptcp: %s: NIC spec %q is neither an interface name nor a CIDR: %w", what, s, err)
			}
			m.prefix = pfx.Masked()
		} else {
			m.name = str
		}
		ms = append(ms, m)
	}
	return ms, nil
}

func (m *specMatcher) match(ifc Interface, a netip.Addr) bool {
	if m.name != "" {
		return ifc.Name == m.name
	}
	return m.prefix.Contains(a)
}

// usable reports whether a may be an endpoint address.
func usable(a netip.Addr) bool {
	return a.IsValid() && !a.IsUnspecified() && !a.IsLoopback() && !a.IsMulticast() &&
		!a.IsLinkLocalUnicast() && !a.IsLinkLocalMulticast()
}

func (d Desired) validate() error {
	if d.Role != RoleClient && d.Role != RoleServer {
		return fmt.Errorf("mptcp: reconcile: invalid role %v", d.Role)
	}
	if d.Role == RoleClient && d.Port != 0 {
		return errors.New("mptcp: reconcile: a port is only for server (signal) endpoints")
	}
	if d.Limits != nil && (d.Limits.Subflows > MaxLimit || d.Limits.AddAddrAccepted > MaxLimit) {
		return fmt.Errorf("mptcp: reconcile: limits subflows %d add_addr_accepted %d: the kernel's maximum is %d",
			d.Limits.Subflows, d.Limits.AddAddrAccepted, MaxLimit)
	}
	return nil
}

// resolve returns the endpoints d wants, in address order, the managed
// ownership test for existing endpoints and warnings.
func (d Desired) resolve(ifs []Interface) ([]wanted, func(Endpoint) bool, []string, error) {
	nics, err := parseSpecs(d.NICs, "NICs")
	if err != nil {
		return nil, nil, nil, err
	}
	backups, err := parseSpecs(d.Backup, "Backup")
	if err != nil {
		return nil, nil, nil, err
	}
	var warns []string
	flag := Subflow
	port := uint16(0)
	if d.Role == RoleServer {
		flag, port = Signal, d.Port
	}

	ifs = slices.Clone(ifs)
	slices.SortFunc(ifs, func(a, b Interface) int { return cmp.Compare(a.Index, b.Index) })
	byAddr := map[netip.Addr]*wanted{}
	var order []netip.Addr
	boundIdx := map[int32]bool{} // interfaces a named spec selects
	for _, ifc := range ifs {
		for _, m := range nics {
			if m.name != "" && m.name == ifc.Name {
				boundIdx[int32(ifc.Index)] = true
			}
		}
		for _, a := range ifc.Addrs {
			a = a.Unmap()
			if !usable(a) {
				continue
			}
			sel := false
			for _, m := range nics {
				if m.match(ifc, a) {
					m.hits++
					sel = true
				}
			}
			if !sel {
				continue
			}
			if w, dup := byAddr[a]; dup {
				warns = append(warns, fmt.Sprintf("address %s is on both %s and %s; using %s", a, w.ifname, ifc.Name, w.ifname))
				continue
			}
			w := &wanted{ifname: ifc.Name, ep: Endpoint{Addr: a, Port: port, Flags: flag, IfIndex: int32(ifc.Index)}}
			for _, m := range backups {
				if m.match(ifc, a) {
					m.hits++
					w.ep.Flags |= Backup
				}
			}
			byAddr[a] = w
			order = append(order, a)
		}
	}
	for _, m := range nics {
		if m.hits > 0 {
			continue
		}
		if m.name != "" && !slices.ContainsFunc(ifs, func(i Interface) bool { return i.Name == m.name }) {
			warns = append(warns, fmt.Sprintf("NIC %q: no such interface", m.spec))
		} else {
			warns = append(warns, fmt.Sprintf("NIC %q: no usable address", m.spec))
		}
	}
	for _, m := range backups {
		if m.hits == 0 {
			warns = append(warns, fmt.Sprintf("backup NIC %q selects none of the NICs' addresses", m.spec))
		}
	}

	slices.SortFunc(order, netip.Addr.Compare)
	want := make([]wanted, 0, len(order))
	for _, a := range order {
		want = append(want, *byAddr[a])
	}
	managed := func(e Endpoint) bool {
		a := e.Addr.Unmap()
		if _, ok := byAddr[a]; ok {
			return true
		}
		for _, m := range nics {
			if m.name == "" && m.prefix.Contains(a) {
				return true
			}
		}
		return e.IfIndex != 0 && boundIdx[e.IfIndex]
	}
	return want, managed, warns, nil
}

// plan is the list of changes Reconcile applies, in this order.
type plan struct {
	limits    *Limits    // to set, or nil
	removes   []Endpoint // DEL_ADDR by ID
	inPlace   []Endpoint // ADD_ADDR replacing an implicit endpoint, keeping its ID
	adds      []Endpoint // ADD_ADDR
	updates   []Endpoint // SET_FLAGS by ID
	endpoints int        // endpoints in the namespace afterwards
}

// replaceMask are the flags SET_FLAGS cannot change but Reconcile sets.
const replaceMask = Signal | Subflow | Laminar

func makePlan(existing []Endpoint, want []wanted, managed func(Endpoint) bool) plan {
	var pl plan
	wantBy := map[netip.Addr]Endpoint{}
	for _, w := range want {
		wantBy[w.ep.Addr] = w.ep
	}
	// Group the managed endpoints by address, keeping kernel (ID) order.
	have := map[netip.Addr][]Endpoint{}
	for _, e := range existing {
		if managed(e) {
			a := e.Addr.Unmap()
			have[a] = append(have[a], e)
		}
	}
	for _, e := range existing {
		if _, ok := wantBy[e.Addr.Unmap()]; managed(e) && !ok {
			pl.removes = append(pl.removes, e)
		}
	}
	for _, w := range want {
		eps := have[w.ep.Addr]
		if len(eps) == 0 {
			pl.adds = append(pl.adds, w.ep)
			continue
		}
		// Keep the endpoint closest to the wanted one; delete the rest.
		keep := slices.MinFunc(eps, func(a, b Endpoint) int {
			return cmp.Compare(distance(a, w.ep), distance(b, w.ep))
		})
		for _, e := range eps {
			if e.ID != keep.ID {
				pl.removes = append(pl.removes, e)
			}
		}
		switch {
		case keep.Flags&Implicit != 0 && w.ep.Port == 0:
			// ADD_ADDR without an ID replaces an implicit endpoint for
			// the same address in place, keeping its subflows.
			pl.inPlace = append(pl.inPlace, w.ep)
		case keep.Flags&(replaceMask|Implicit) != w.ep.Flags&replaceMask ||
			keep.Port != w.ep.Port || keep.IfIndex != w.ep.IfIndex:
			pl.removes = append(pl.removes, keep)
			pl.adds = append(pl.adds, w.ep)
		case keep.Flags&settableFlags != w.ep.Flags&settableFlags:
			u := keep
			u.Flags = keep.Flags&^settableFlags | w.ep.Flags&settableFlags
			pl.updates = append(pl.updates, u)
		}
	}
	// The kernel checks the number of endpoints before it looks for an
	// implicit one to replace, so a full namespace needs delete and add.
	if len(pl.inPlace) > 0 && len(existing)-len(pl.removes) >= MaxEndpoints {
		for _, w := range pl.inPlace {
			for _, e := range have[w.Addr] {
				if e.Flags&Implicit != 0 && !slices.Contains(pl.removes, e) {
					pl.removes = append(pl.removes, e)
					break
				}
			}
			pl.adds = append(pl.adds, w)
		}
		pl.inPlace = nil
	}
	slices.SortFunc(pl.removes, func(a, b Endpoint) int { return cmp.Compare(a.ID, b.ID) })
	pl.endpoints = len(existing) - len(pl.removes) + len(pl.adds)
	return pl
}

// distance ranks how much must change to turn e into w.
func distance(e, w Endpoint) int {
	switch {
	case e.Flags&(replaceMask|Implicit) != w.Flags&replaceMask || e.Port != w.Port || e.IfIndex != w.IfIndex:
		return 2
	case e.Flags&settableFlags != w.Flags&settableFlags:
		return 1
	}
	return 0
}

// deriveLimits returns the limits for n managed endpoints, never below cur.
func (d Desired) deriveLimits(cur Limits, n int) Limits {
	if d.Limits != nil {
		return *d.Limits
	}
	// A client's first subflow uses none of its endpoints' budget; a
	// server may receive a join on every address it announces (the NICs
	// need not include the address clients dial).
	need := n - 1
	if d.Role == RoleServer {
		need = n
	}
	need = max(0, min(need, MaxLimit))
	l := cur
	l.Subflows = max(cur.Subflows, uint32(need))
	if d.Role == RoleClient {
		l.AddAddrAccepted = max(cur.AddAddrAccepted, uint32(need))
	}
	return l
}

// reconcile is Reconcile with the addresses earlier runs managed (for
// Watch); it also returns the addresses this run leaves managed.
func reconcile(p PMInterface, addrs AddrSource, d Desired, prev map[netip.Addr]bool) (Result, map[netip.Addr]bool, error) {
	var res Result
	if err := d.validate(); err != nil {
		return res, prev, err
	}
	ifs, err := addrs.Interfaces()
	if err != nil {
		return res, prev, fmt.Errorf("mptcp: reconcile: listing addresses: %w", err)
	}
	want, owns, warns, err := d.resolve(ifs)
	if err != nil {
		return res, prev, err
	}
	res.Warnings = warns
	for _, w := range want {
		res.Addrs = append(res.Addrs, w.ep.Addr)
	}
	if d.BeforeAdd != nil {
		d.BeforeAdd(slices.Clone(res.Addrs))
	}
	managed := func(e Endpoint) bool {
		return e.Addr.IsValid() && (owns(e) || prev[e.Addr.Unmap()])
	}
	existing, err := p.Endpoints()
	if err != nil {
		return res, prev, fmt.Errorf("mptcp: reconcile: %w", err)
	}
	cur, err := p.Limits()
	if err != nil {
		return res, prev, fmt.Errorf("mptcp: reconcile: %w", err)
	}

	pl := makePlan(existing, want, managed)
	if pl.endpoints > MaxEndpoints {
		others := 0
		for _, e := range existing {
			if !managed(e) {
				others++
			}
		}
		return res, prev, fmt.Errorf("mptcp: reconcile: %d endpoints needed (%d managed + %d others), more than the kernel's limit of %d per namespace; nothing changed: %w",
			pl.endpoints, len(want), others, MaxEndpoints, ErrTooManyEndpoints)
	}
	res.Limits = cur
	if l := d.deriveLimits(cur, len(want)); l != cur {
		pl.limits = &l
	}

	next := map[netip.Addr]bool{}
	for _, w := range want {
		next[w.ep.Addr] = true
	}
	fail := func(err error) (Result, map[netip.Addr]bool, error) {
		// Keep what is left to remove managed for the next run.
		for a := range prev {
			next[a] = true
		}
		for _, e := range pl.removes {
			next[e.Addr.Unmap()] = true
		}
		return res, next, fmt.Errorf("mptcp: reconcile: %w", err)
	}

	if pl.limits != nil {
		if err := p.SetLimits(*pl.limits); err != nil {
			return fail(err)
		}
		res.Limits, res.LimitsChanged = *pl.limits, true
	}
	for _, e := range pl.removes {
		if err := p.DeleteEndpoint(e.ID); err != nil {
			return fail(err)
		}
		res.Removed = append(res.Removed, e)
	}
	// Replacements of implicit endpoints before additions: the kernel
	// checks the number of endpoints first even for them.
	for _, e := range pl.inPlace {
		if err := p.AddEndpoint(e); err != nil {
			return fail(err)
		}
		res.Updated = append(res.Updated, e)
	}
	for _, e := range pl.adds {
		if err := p.AddEndpoint(e); err != nil {
			return fail(err)
		}
		res.Added = append(res.Added, e)
	}
	for _, e := range pl.updates {
		if err := p.SetEndpointFlags(e); err != nil {
			return fail(err)
		}
		res.Updated = append(res.Updated, e)
	}
	return res, next, nil
}

// WatchOptions tune Watch.
type WatchOptions struct {
	// Interval between periodic runs; 0 means 10 seconds.
	Interval time.Duration
	// Changes, if not nil, triggers a run soon after each receive
	// (AddrChanges provides one on Linux). A closed channel is ignored.
	Changes <-chan struct{}
	// Settle is how long Watch waits after a change for more changes
	// before running; 0 means 200 milliseconds.
	Settle time.Duration
	// OnResult, if not nil, is called after every run, from Watch's
	// goroutine.
	OnResult func(Result, error)
	// Backup, if not nil, is called before every run for more addresses
	// to flag backup beside those d.Backup selects (the slow paths).
	Backup func() []netip.Addr
	// Kick, if not nil, triggers a run at once after each receive (a
	// change of what Backup returns). A closed channel is ignored.
	Kick <-chan struct{}
}

// Watch keeps the endpoints matching d: it runs Reconcile at once, then
// every opt.Interval and shortly after each notification on opt.Changes,
// until ctx is done, when it returns ctx's error. It returns earlier only
// when d itself is invalid. Errors of single runs (the kernel refusing a
// change, too many endpoints) go to opt.OnResult and the next run tries
// again.
//
// Unlike a single Reconcile, Watch remembers the addresses it manages, so
// it also removes the endpoints of an interface that disappeared
// altogether.
//
// p and addrs must stay bound to the namespace to manage (DialPM and
// DialAddrs bind to the namespace of the thread that calls them), because
// Watch's goroutine may run on any thread.
func Watch(ctx context.Context, p PMInterface, addrs AddrSource, d Desired, opt WatchOptions) error {
	if err := d.validate(); err != nil {
		return err
	}
	if _, err := parseSpecs(d.NICs, "NICs"); err != nil {
		return err
	}
	if _, err := parseSpecs(d.Backup, "Backup"); err != nil {
		return err
	}
	interval := cmp.Or(opt.Interval, 10*time.Second)
	settle := cmp.Or(opt.Settle, 200*time.Millisecond)

	var prev map[netip.Addr]bool
	run := func() {
		var (
			res Result
			err error
		)
		dd := d
		if opt.Backup != nil {
			dd.Backup = slices.Clone(d.Backup)
			for _, a := range opt.Backup() {
				dd.Backup = append(dd.Backup, NICSpec(netip.PrefixFrom(a, a.BitLen()).String()))
			}
		}
		res, prev, err = reconcile(p, addrs, dd, prev)
		if opt.OnResult != nil {
			opt.OnResult(res, err)
		}
	}

	ticker := time.NewTicker(interval)
	defer ticker.Stop()
	changes, kick := opt.Changes, opt.Kick
	run()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-ticker.C:
			run()
		case _, ok := <-kick:
			if !ok {
				kick = nil
				continue
			}
			run()
		case _, ok := <-changes:
			if !ok {
				changes = nil
				continue
			}
			// Let a burst of changes (an address and its routes, both
			// families) settle, then run once.
			t := time.NewTimer(settle)
		settling:
			for {
				select {
				case <-ctx.Done():
					t.Stop()
					return ctx.Err()
				case _, ok := <-changes:
					if !ok {
						changes = nil
					}
				case <-t.C:
					break settling
				}
			}
			run()
			ticker.Reset(interval)
		}
	}
}
