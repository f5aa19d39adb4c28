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
	"errors"
	"fmt"
	"net/netip"
	"os"
	"strings"
	"syscall"

	"github.com/mdlayher/genetlink"
	"github.com/mdlayher/netlink"
)

var (
	// ErrPMNotFound is returned by DialPM when the kernel has no
	// "mptcp_pm" generic netlink family (built without MPTCP).
	ErrPMNotFound = errors.New("mptcp: path manager (generic netlink family mptcp_pm) not found")

	// ErrTooManyEndpoints is returned when a network namespace would hold
	// more than MaxEndpoints endpoints: by AddEndpoint when the kernel
	// refuses one more (ERANGE), and by Reconcile when its plan would
	// exceed the limit.
	ErrTooManyEndpoints = errors.New("mptcp: too many endpoints")

	// ErrEndpointNotFound is returned by DeleteEndpointAddr when no
	// endpoint has the address.
	ErrEndpointNotFound = errors.New("mptcp: endpoint not found")
)

// EndpointFlags are the flags of a path-manager endpoint.
type EndpointFlags uint32

var flagNames = []struct {
	f    EndpointFlags
	name string
}{
	{Signal, "signal"},
	{Subflow, "subflow"},
	{Backup, "backup"},
	{Fullmesh, "fullmesh"},
	{Implicit, "implicit"},
	{Laminar, "laminar"},
}

// String returns the flag names joined by "|" (as `ip mptcp` names them),
// unknown bits in hexadecimal, or "0" when no flag is set.
func (f EndpointFlags) String() string {
	if f == 0 {
		return "0"
	}
	var parts []string
	for _, fn := range flagNames {
		if f&fn.f != 0 {
			parts = append(parts, fn.name)
			f &^= fn.f
		}
	}
	if f != 0 {
		parts = append(parts, fmt.Sprintf("%#x", uint32(f)))
	}
	return strings.Join(parts, "|")
}

// Endpoint is a local address the path manager uses: to announce it to
// peers (Signal) or to open subflows from it (Subflow).
type Endpoint struct {
	// ID identifies the endpoint in its namespace (1-255). In AddEndpoint,
	// 0 lets the kernel pick the lowest free ID.
	ID uint8
	// Addr is the local IPv4 or IPv6 address.
	Addr netip.Addr
	// Port, if not 0, is the port on which a Signal endpoint (without
	// Subflow) accepts MP_JOINs; the kernel then listens on Addr:Port.
	Port uint16
	// Flags are Signal, Subflow, Backup, Fullmesh, Laminar (and Implicit,
	// which only the kernel sets).
	Flags EndpointFlags
	// IfIndex, if not 0, is the interface subflows from Addr are bound to.
	IfIndex int32
}

// String formats e like `ip mptcp endpoint show`.
func (e Endpoint) String() string {
	var b strings.Builder
	b.WriteString(e.Addr.String())
	if e.Port != 0 {
		fmt.Fprintf(&b, " port %d", e.Port)
	}
	fmt.Fprintf(&b, " id %d", e.ID)
	if e.Flags != 0 {
		b.WriteString(" " + strings.ReplaceAll(e.Flags.String(), "|", " "))
	}
	if e.IfIndex != 0 {
		fmt.Fprintf(&b, " ifindex %d", e.IfIndex)
	}
	return b.String()
}

// Limits are the per-namespace limits of the in-kernel path manager.
type Limits struct {
	// Subflows is the maximum number of additional subflows per MPTCP
	// connection (`ip mptcp limits` "subflows"; kernel default 2).
	Subflows uint32
	// AddAddrAccepted is the maximum number of ADD_ADDR announcements
	// accepted (and acted on) per connection ("add_addr_accepted").
	AddAddrAccepted uint32
}

// PMError is the error of a path-manager operation that the kernel
// refused. errors.Is works with the errno (e.g. syscall.EEXIST, or
// fs.ErrExist) and with the package's sentinels where one applies.
type PMError struct {
	// Op names the operation, e.g. "add endpoint".
	Op string
	// Err is the underlying error, normally a syscall.Errno.
	Err error
	// Message is the kernel's extended-ack text, if it sent one.
	Message string

	kind error // a sentinel such as ErrTooManyEndpoints, or nil
}

func (e *PMError) Error() string {
	s := "mptcp: " + e.Op + ": " + e.Err.Error()
	if e.Message != "" {
		s += " (" + e.Message + ")"
	}
	return s
}

// Unwrap returns the underlying error and the sentinel, if any.
func (e *PMError) Unwrap() []error {
	if e.kind != nil {
		return []error{e.kind, e.Err}
	}
	return []error{e.Err}
}

// newPMError wraps err from operation op, unwrapping netlink's OpError to
// its errno and extended-ack message.
func newPMError(op string, err error, kind error) error {
	pe := &PMError{Op: op, Err: err, kind: kind}
	var oe *netlink.OpError
	if errors.As(err, &oe) {
		pe.Err, pe.Message = oe.Err, oe.Message
		var se *os.SyscallError
		if errors.As(oe.Err, &se) {
			pe.Err = se.Err
		}
	}
	return pe
}

// PM is a client of the in-kernel MPTCP path manager of one network
// namespace: the generic netlink family "mptcp_pm", which `ip mptcp
// endpoint` and `ip mptcp limits` also use. Endpoints and limits are per
// namespace; a PM manages the namespace its socket was created in. It is
// safe for concurrent use.
type PM struct {
	c      *genetlink.Conn
	family uint16
}

// DialPM connects to the path manager of the calling thread's network
// namespace. To manage another namespace, switch a locked OS thread into
// it first (for instance with internal/testenv/topo.InNetns); the PM stays bound to
// that namespace and may be used from any goroutine afterwards.
func DialPM() (*PM, error) {
	return dialPM()
}

// newPM returns a PM using c, looking up the "mptcp_pm" family.
func newPM(c *genetlink.Conn) (*PM, error) {
	f, err := c.GetFamily(pmFamilyName)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("%w: %w", ErrPMNotFound, err)
		}
		return nil, fmt.Errorf("mptcp: looking up generic netlink family %q: %w", pmFamilyName, err)
	}
	return &PM{c: c, family: f.ID}, nil
}

// Close releases the PM's netlink socket.
func (p *PM) Close() error { return p.c.Close() }

// execute sends a request for cmd with attributes data and returns the
// replies' attribute payloads.
func (p *PM) execute(cmd uint8, flags netlink.HeaderFlags, data []byte) ([]genetlink.Message, error) {
	return p.c.Execute(genetlink.Message{
		Header: genetlink.Header{Command: cmd, Version: pmFamilyVersion},
		Data:   data,
	}, p.family, netlink.Request|flags)
}

// Endpoints lists the namespace's endpoints in ID order (GET_ADDR dump).
func (p *PM) Endpoints() ([]Endpoint, error) {
	msgs, err := p.execute(pmCmdGetAddr, netlink.Dump, nil)
	if err != nil {
		return nil, newPMError("list endpoints", err, nil)
	}
	eps := make([]Endpoint, 0, len(msgs))
	for _, m := range msgs {
		e, err := decodeEndpoint(m.Data)
		if err != nil {
			return nil, fmt.Errorf("mptcp: list endpoints: %w", err)
		}
		eps = append(eps, e)
	}
	return eps, nil
}

// Endpoint returns the endpoint with the given ID (GET_ADDR). The kernel
// answers EINVAL when there is none.
func (p *PM) Endpoint(id uint8) (Endpoint, error) {
	b, err := encodeEndpointID(id)
	if err != nil {
		return Endpoint{}, err
	}
	msgs, err := p.execute(pmCmdGetAddr, 0, b)
	if err != nil {
		return Endpoint{}, newPMError(fmt.Sprintf("get endpoint id %d", id), err, nil)
	}
	if len(msgs) != 1 {
		return Endpoint{}, fmt.Errorf("mptcp: get endpoint id %d: %d replies, want 1", id, len(msgs))
	}
	e, err := decodeEndpoint(msgs[0].Data)
	if err != nil {
		return Endpoint{}, fmt.Errorf("mptcp: get endpoint id %d: %w", id, err)
	}
	return e, nil
}

// AddEndpoint adds e (ADD_ADDR). With e.ID 0 the kernel picks the ID; list
// the endpoints to learn it. The kernel refuses (EINVAL) a Port without
// Signal or with Subflow, Signal together with Fullmesh, and Implicit; it
// refuses a duplicate address with EEXIST and an ID in use with EBUSY.
// Past MaxEndpoints the error wraps ErrTooManyEndpoints (and ERANGE).
func (p *PM) AddEndpoint(e Endpoint) error {
	b, err := encodeEndpoint(e)
	if err != nil {
		return err
	}
	if _, err := p.execute(pmCmdAddAddr, netlink.Acknowledge, b); err != nil {
		var kind error
		if errors.Is(err, syscall.ERANGE) {
			kind = ErrTooManyEndpoints
		}
		return newPMError("add endpoint "+e.String(), err, kind)
	}
	return nil
}

// DeleteEndpoint deletes the endpoint with the given ID (DEL_ADDR), closing
// the subflows that use it. The kernel identifies endpoints by ID only and
// answers EINVAL for an unknown one. ID 0 never names a configured endpoint
// (it stands for each connection's initial address), so DeleteEndpoint(0)
// fails with EINVAL without asking the kernel; use DeleteEndpointAddr to
// delete by address.
func (p *PM) DeleteEndpoint(id uint8) error {
	op := fmt.Sprintf("delete endpoint id %d", id)
	if id == 0 {
		return &PMError{Op: op, Err: syscall.EINVAL,
			Message: "endpoints have IDs 1-255; delete by address with DeleteEndpointAddr"}
	}
	b, err := encodeEndpointID(id)
	if err != nil {
		return err
	}
	if _, err := p.execute(pmCmdDelAddr, netlink.Acknowledge, b); err != nil {
		return newPMError(op, err, nil)
	}
	return nil
}

// DeleteEndpointAddr deletes every endpoint whose address is addr (whatever
// its port), looking their IDs up first. It returns an error wrapping
// ErrEndpointNotFound when there is none.
func (p *PM) DeleteEndpointAddr(addr netip.Addr) error {
	eps, err := p.Endpoints()
	if err != nil {
		return err
	}
	found := false
	for _, e := range eps {
		if e.Addr == addr.Unmap() {
			found = true
			if err := p.DeleteEndpoint(e.ID); err != nil {
				return err
			}
		}
	}
	if !found {
		return fmt.Errorf("mptcp: delete endpoint %s: %w", addr, ErrEndpointNotFound)
	}
	return nil
}

// SetEndpointFlags changes the Backup and Fullmesh flags of an endpoint
// (SET_FLAGS) to those in e.Flags; the kernel ignores the other flags and
// cannot change an endpoint's address, port, Signal or Subflow (delete and
// re-add it for that). The endpoint is looked up by e.ID when it is not 0,
// otherwise by e.Addr and e.Port. Fullmesh is refused (EINVAL) on Signal
// and Implicit endpoints. Changing Backup sends MP_PRIO on the existing
// subflows from the address.
func (p *PM) SetEndpointFlags(e Endpoint) error {
	var b []byte
	var err error
	if e.ID != 0 {
		b, err = encodeFlagsByID(e.ID, e.Flags)
	} else {
		b, err = encodeEndpoint(Endpoint{Addr: e.Addr, Port: e.Port, Flags: e.Flags})
	}
	if err != nil {
		return err
	}
	if _, err := p.execute(pmCmdSetFlags, netlink.Acknowledge, b); err != nil {
		return newPMError("set flags of endpoint "+e.String(), err, nil)
	}
	return nil
}

// Flush deletes all endpoints of the namespace (FLUSH_ADDRS).
func (p *PM) Flush() error {
	if _, err := p.execute(pmCmdFlushAddrs, netlink.Acknowledge, nil); err != nil {
		return newPMError("flush endpoints", err, nil)
	}
	return nil
}

// Limits returns the namespace's limits (GET_LIMITS).
func (p *PM) Limits() (Limits, error) {
	msgs, err := p.execute(pmCmdGetLimits, 0, nil)
	if err != nil {
		return Limits{}, newPMError("get limits", err, nil)
	}
	if len(msgs) != 1 {
		return Limits{}, fmt.Errorf("mptcp: get limits: %d replies, want 1", len(msgs))
	}
	l, err := decodeLimits(msgs[0].Data)
	if err != nil {
		return Limits{}, fmt.Errorf("mptcp: get limits: %w", err)
	}
	return l, nil
}

// SetLimits sets both limits (SET_LIMITS). The kernel refuses values above
// MaxLimit with EINVAL and then changes neither.
func (p *PM) SetLimits(l Limits) error {
	b, err := encodeLimits(l)
	if err != nil {
		return err
	}
	if _, err := p.execute(pmCmdSetLimits, netlink.Acknowledge, b); err != nil {
		return newPMError(fmt.Sprintf("set limits subflows %d add_addr_accepted %d", l.Subflows, l.AddAddrAccepted), err, nil)
	}
	return nil
}

// encodeEndpoint returns the attributes of an ADD_ADDR request for e (also
// used for lookups by address). ID, Port and IfIndex are omitted when 0:
// an ID attribute, even 0, stops the kernel from picking one.
func encodeEndpoint(e Endpoint) ([]byte, error) {
	if !e.Addr.IsValid() {
		return nil, fmt.Errorf("mptcp: endpoint %v: no address", e)
	}
	addr := e.Addr.Unmap()
	ae := netlink.NewAttributeEncoder()
	ae.Nested(pmAttrAddr, func(nae *netlink.AttributeEncoder) error {
		if addr.Is4() {
			nae.Uint16(pmAddrAttrFamily, afInet)
			a4 := addr.As4()
			nae.Bytes(pmAddrAttrAddr4, a4[:])
		} else {
			nae.Uint16(pmAddrAttrFamily, afInet6)
			a16 := addr.As16()
			nae.Bytes(pmAddrAttrAddr6, a16[:])
		}
		if e.ID != 0 {
			nae.Uint8(pmAddrAttrID, e.ID)
		}
		if e.Port != 0 {
			nae.Uint16(pmAddrAttrPort, e.Port)
		}
		nae.Uint32(pmAddrAttrFlags, uint32(e.Flags))
		if e.IfIndex != 0 {
			nae.Int32(pmAddrAttrIfIdx, e.IfIndex)
		}
		return nil
	})
	return ae.Encode()
}

// encodeEndpointID returns the attributes naming an endpoint by ID only.
func encodeEndpointID(id uint8) ([]byte, error) {
	ae := netlink.NewAttributeEncoder()
	ae.Nested(pmAttrAddr, func(nae *netlink.AttributeEncoder) error {
		nae.Uint8(pmAddrAttrID, id)
		return nil
	})
	return ae.Encode()
}

// encodeFlagsByID returns the attributes of a SET_FLAGS request naming
// the endpoint by ID (no family: the kernel then looks it up by ID).
func encodeFlagsByID(id uint8, f EndpointFlags) ([]byte, error) {
	ae := netlink.NewAttributeEncoder()
	ae.Nested(pmAttrAddr, func(nae *netlink.AttributeEncoder) error {
		nae.Uint8(pmAddrAttrID, id)
		nae.Uint32(pmAddrAttrFlags, uint32(f))
		return nil
	})
	return ae.Encode()
}

func encodeLimits(l Limits) ([]byte, error) {
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(pmAttrRcvAddAddrs, l.AddAddrAccepted)
	ae.Uint32(pmAttrSubflows, l.Subflows)
	return ae.Encode()
}

// decodeEndpoint decodes the attributes of a GET_ADDR reply.
func decodeEndpoint(b []byte) (Endpoint, error) {
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		return Endpoint{}, err
	}
	var (
		e     Endpoint
		found bool
	)
	for ad.Next() {
		if ad.Type() != pmAttrAddr {
			continue
		}
		if found {
			return Endpoint{}, errors.New("more than one address attribute")
		}
		found = true
		ad.Nested(func(nad *netlink.AttributeDecoder) error {
			var err error
			e, err = decodeAddr(nad)
			return err
		})
	}
	if err := ad.Err(); err != nil {
		return Endpoint{}, err
	}
	if !found {
		return Endpoint{}, errors.New("reply without an address attribute")
	}
	return e, nil
}

// decodeAddr decodes nested MPTCP_PM_ADDR_ATTR_* attributes.
func decodeAddr(ad *netlink.AttributeDecoder) (Endpoint, error) {
	var (
		e      Endpoint
		family uint16
		a4     []byte
		a6     []byte
	)
	for ad.Next() {
		switch ad.Type() {
		case pmAddrAttrFamily:
			family = ad.Uint16()
		case pmAddrAttrID:
			e.ID = ad.Uint8()
		case pmAddrAttrAddr4:
			a4 = ad.Bytes()
		case pmAddrAttrAddr6:
			a6 = ad.Bytes()
		case pmAddrAttrPort:
			e.Port = ad.Uint16()
		case pmAddrAttrFlags:
			e.Flags = EndpointFlags(ad.Uint32())
		case pmAddrAttrIfIdx:
			e.IfIndex = ad.Int32()
		}
	}
	if err := ad.Err(); err != nil {
		return Endpoint{}, err
	}
	switch family {
	case afInet:
		if len(a4) != 4 {
			return Endpoint{}, fmt.Errorf("IPv4 endpoint with %d address bytes", len(a4))
		}
		e.Addr = netip.AddrFrom4([4]byte(a4))
	case afInet6:
		if len(a6) != 16 {
			return Endpoint{}, fmt.Errorf("IPv6 endpoint with %d address bytes", len(a6))
		}
		e.Addr = netip.AddrFrom16([16]byte(a6))
	default:
		return Endpoint{}, fmt.Errorf("endpoint with address family %d", family)
	}
	return e, nil
}

// decodeLimits decodes the attributes of a GET_LIMITS reply.
func decodeLimits(b []byte) (Limits, error) {
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		return Limits{}, err
	}
	var (
		l              Limits
		gotSub, gotAdd bool
	)
	for ad.Next() {
		switch ad.Type() {
		case pmAttrRcvAddAddrs:
			l.AddAddrAccepted, gotAdd = ad.Uint32(), true
		case pmAttrSubflows:
			l.Subflows, gotSub = ad.Uint32(), true
		}
	}
	if err := ad.Err(); err != nil {
		return Limits{}, err
	}
	if !gotSub || !gotAdd {
		return Limits{}, errors.New("reply without both limits")
	}
	return l, nil
}
