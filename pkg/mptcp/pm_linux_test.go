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
	"bytes"
	"errors"
	"io"
	"io/fs"
	"net/netip"
	"strings"
	"syscall"
	"testing"

	"github.com/mdlayher/genetlink"
	"github.com/mdlayher/genetlink/genltest"
	"github.com/mdlayher/netlink"
)

const fakeFamilyID = 0x2a

// fakePM returns a PM talking to a fake kernel: fn sees every request to
// the mptcp_pm family and returns the replies.
func fakePM(t *testing.T, fn genltest.Func) *PM {
	t.Helper()
	c := genltest.Dial(genltest.ServeFamily(genetlink.Family{
		ID:      fakeFamilyID,
		Version: pmFamilyVersion,
		Name:    pmFamilyName,
	}, fn))
	p, err := newPM(c)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// request is what the fake kernel saw.
type request struct {
	cmd     uint8
	version uint8
	flags   netlink.HeaderFlags
	family  uint16
	data    []byte
}

// recorder returns a genltest.Func that records the request and answers
// with replies, or err, or (neither given) an acknowledgement.
func recorder(got *request, replies []genetlink.Message, err error) genltest.Func {
	if replies == nil && err == nil {
		err = io.EOF // genltest: no messages and no error
	}
	return func(greq genetlink.Message, nreq netlink.Message) ([]genetlink.Message, error) {
		*got = request{
			cmd:     greq.Header.Command,
			version: greq.Header.Version,
			flags:   nreq.Header.Flags,
			family:  uint16(nreq.Header.Type),
			data:    bytes.Clone(greq.Data),
		}
		return replies, err
	}
}

func TestPMRequests(t *testing.T) {
	v4 := netip.MustParseAddr("10.77.1.2")
	v6 := netip.MustParseAddr("fd00:77::1")
	ack := netlink.Request | netlink.Acknowledge
	tests := []struct {
		name  string
		call  func(p *PM) error
		cmd   uint8
		flags netlink.HeaderFlags
		data  []byte
	}{
		{
			name: "add IPv4 signal with port, backup, interface",
			call: func(p *PM) error {
				return p.AddEndpoint(Endpoint{Addr: v4, Port: 10100, Flags: Signal | Backup, IfIndex: 3})
			},
			cmd: 1, flags: ack,
			data: rawNested(1,
				rawAttr(1, nlU16(2)...), // family AF_INET
				rawAttr(3, 10, 77, 1, 2),
				rawAttr(5, nlU16(10100)...),
				rawAttr(6, nlU32(1|4)...),
				rawAttr(7, nlU32(3)...),
			),
		},
		{
			name: "add IPv6 subflow fullmesh with ID",
			call: func(p *PM) error {
				return p.AddEndpoint(Endpoint{ID: 9, Addr: v6, Flags: Subflow | Fullmesh})
			},
			cmd: 1, flags: ack,
			data: rawNested(1,
				rawAttr(1, nlU16(10)...), // family AF_INET6
				rawAttr(4, 0xfd, 0, 0, 0x77, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1),
				rawAttr(2, 9),
				rawAttr(6, nlU32(2|8)...),
			),
		},
		{
			name: "add IPv4-mapped IPv6 is sent as IPv4",
			call: func(p *PM) error {
				return p.AddEndpoint(Endpoint{Addr: netip.AddrFrom16(v4.As16()), Flags: Subflow})
			},
			cmd: 1, flags: ack,
			data: rawNested(1, rawAttr(1, nlU16(2)...), rawAttr(3, 10, 77, 1, 2), rawAttr(6, nlU32(2)...)),
		},
		{
			name: "delete by ID",
			call: func(p *PM) error { return p.DeleteEndpoint(5) },
			cmd:  2, flags: ack,
			data: rawNested(1, rawAttr(2, 5)),
		},
		{
			name: "set flags by ID",
			call: func(p *PM) error {
				return p.SetEndpointFlags(Endpoint{ID: 4, Addr: v4, Flags: Subflow | Backup})
			},
			cmd: 7, flags: ack,
			data: rawNested(1, rawAttr(2, 4), rawAttr(6, nlU32(2|4)...)),
		},
		{
			name: "set flags by address and port",
			call: func(p *PM) error {
				return p.SetEndpointFlags(Endpoint{Addr: v4, Port: 443, Flags: Signal})
			},
			cmd: 7, flags: ack,
			data: rawNested(1, rawAttr(1, nlU16(2)...), rawAttr(3, 10, 77, 1, 2), rawAttr(5, nlU16(443)...), rawAttr(6, nlU32(1)...)),
		},
		{
			name: "flush",
			call: func(p *PM) error { return p.Flush() },
			cmd:  4, flags: ack,
		},
		{
			name: "set limits",
			call: func(p *PM) error { return p.SetLimits(Limits{Subflows: 3, AddAddrAccepted: 2}) },
			cmd:  5, flags: ack,
			data: append(rawAttr(2, nlU32(2)...), rawAttr(3, nlU32(3)...)...),
		},
		{
			name: "list",
			call: func(p *PM) error { _, err := p.Endpoints(); return err },
			cmd:  3, flags: netlink.Request | netlink.Dump,
		},
		{
			name: "get by ID",
			call: func(p *PM) error { _, err := p.Endpoint(6); return err },
			cmd:  3, flags: netlink.Request,
			data: rawNested(1, rawAttr(2, 6)),
		},
		{
			name: "get limits",
			call: func(p *PM) error { _, err := p.Limits(); return err },
			cmd:  6, flags: netlink.Request,
		},
	}
	// Valid replies for the commands that expect one.
	replies := map[uint8][]genetlink.Message{
		3: {{Data: rawNested(1, rawAttr(1, nlU16(2)...), rawAttr(2, 6), rawAttr(3, 10, 0, 0, 1))}},
		6: {{Data: append(rawAttr(2, nlU32(0)...), rawAttr(3, nlU32(2)...)...)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var got request
			p := fakePM(t, recorder(&got, replies[tt.cmd], nil))
			if err := tt.call(p); err != nil {
				t.Fatal(err)
			}
			if got.cmd != tt.cmd || got.version != 1 || got.family != fakeFamilyID || got.flags != tt.flags {
				t.Errorf("request cmd %d version %d family %#x flags %v; want cmd %d version 1 family %#x flags %v",
					got.cmd, got.version, got.family, got.flags, tt.cmd, fakeFamilyID, tt.flags)
			}
			if !bytes.Equal(got.data, tt.data) {
				t.Errorf("attributes\n got % x\nwant % x", got.data, tt.data)
			}
		})
	}
}

func TestPMEndpointsDecode(t *testing.T) {
	dump := []genetlink.Message{
		// As the kernel fills them: family, port, id, flags, if-idx
		// (only when set), then the address.
		{Data: rawNested(1,
			rawAttr(1, nlU16(2)...), rawAttr(5, nlU16(0)...), rawAttr(2, 1), rawAttr(6, nlU32(1)...),
			rawAttr(3, 192, 0, 2, 10))},
		{Data: rawNested(1,
			rawAttr(1, nlU16(2)...), rawAttr(5, nlU16(10100)...), rawAttr(2, 2), rawAttr(6, nlU32(1|4)...),
			rawAttr(7, nlU32(4)...), rawAttr(3, 192, 0, 2, 11))},
		{Data: rawNested(1,
			rawAttr(1, nlU16(10)...), rawAttr(5, nlU16(0)...), rawAttr(2, 3), rawAttr(6, nlU32(2|8|32)...),
			rawAttr(7, nlU32(5)...), rawAttr(4, 0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x42),
			rawAttr(99, 1, 2, 3))}, // unknown attributes are skipped
		// The nested flag is optional, and unknown top-level attributes
		// are skipped too.
		{Data: append(rawAttr(42, 7), rawAttr(1,
			append(append(rawAttr(1, nlU16(2)...), rawAttr(2, 200)...), rawAttr(3, 198, 51, 100, 1)...)...)...)},
	}
	var got request
	p := fakePM(t, recorder(&got, dump, nil))
	eps, err := p.Endpoints()
	if err != nil {
		t.Fatal(err)
	}
	want := []Endpoint{
		{ID: 1, Addr: netip.MustParseAddr("192.0.2.10"), Flags: Signal},
		{ID: 2, Addr: netip.MustParseAddr("192.0.2.11"), Port: 10100, Flags: Signal | Backup, IfIndex: 4},
		{ID: 3, Addr: netip.MustParseAddr("2001:db8::42"), Flags: Subflow | Fullmesh | Laminar, IfIndex: 5},
		{ID: 200, Addr: netip.MustParseAddr("198.51.100.1")},
	}
	if len(eps) != len(want) {
		t.Fatalf("got %d endpoints %v, want %v", len(eps), eps, want)
	}
	for i := range want {
		if eps[i] != want[i] {
			t.Errorf("endpoint %d = %+v, want %+v", i, eps[i], want[i])
		}
	}

	// An empty dump is no endpoints.
	p = fakePM(t, recorder(&got, nil, nil))
	if eps, err := p.Endpoints(); err != nil || len(eps) != 0 {
		t.Errorf("empty dump: %v, %v", eps, err)
	}
}

func TestPMLimitsDecode(t *testing.T) {
	var got request
	p := fakePM(t, recorder(&got, []genetlink.Message{
		{Data: append(rawAttr(3, nlU32(5)...), rawAttr(2, nlU32(7)...)...)},
	}, nil))
	l, err := p.Limits()
	if err != nil || l != (Limits{Subflows: 5, AddAddrAccepted: 7}) {
		t.Fatalf("Limits() = %+v, %v", l, err)
	}
}

func TestPMErrnoMapping(t *testing.T) {
	e := Endpoint{Addr: netip.MustParseAddr("10.0.0.1"), Flags: Subflow}
	tests := []struct {
		name  string
		errno syscall.Errno
		call  func(p *PM) error
		is    []error
		isnt  []error
	}{
		{"add past the limit", syscall.ERANGE, func(p *PM) error { return p.AddEndpoint(e) },
			[]error{ErrTooManyEndpoints, syscall.ERANGE}, nil},
		{"add duplicate", syscall.EEXIST, func(p *PM) error { return p.AddEndpoint(e) },
			[]error{fs.ErrExist, syscall.EEXIST}, []error{ErrTooManyEndpoints}},
		{"add without permission", syscall.EPERM, func(p *PM) error { return p.AddEndpoint(e) },
			[]error{fs.ErrPermission}, []error{ErrTooManyEndpoints}},
		{"delete unknown", syscall.EINVAL, func(p *PM) error { return p.DeleteEndpoint(3) },
			[]error{syscall.EINVAL}, nil},
		{"set flags", syscall.EINVAL, func(p *PM) error { return p.SetEndpointFlags(Endpoint{ID: 3}) },
			[]error{syscall.EINVAL}, nil},
		{"set limits", syscall.EINVAL, func(p *PM) error { return p.SetLimits(Limits{Subflows: 9}) },
			[]error{syscall.EINVAL}, nil},
		// (A dump's error cannot be faked: nltest copies the request's
		// dump flags into the error, where they mean extended-ack TLVs.)
		{"get without permission", syscall.EPERM, func(p *PM) error { _, err := p.Endpoint(1); return err },
			[]error{fs.ErrPermission}, nil},
		{"get limits", syscall.ENOMEM, func(p *PM) error { _, err := p.Limits(); return err },
			[]error{syscall.ENOMEM}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var got request
			p := fakePM(t, recorder(&got, nil, genltest.Error(int(tt.errno))))
			err := tt.call(p)
			var pe *PMError
			if !errors.As(err, &pe) || pe.Err != tt.errno {
				t.Fatalf("error %#v, want a *PMError with errno %v", err, tt.errno)
			}
			if !strings.HasPrefix(err.Error(), "mptcp: ") {
				t.Errorf("error %q lacks the package prefix", err)
			}
			for _, target := range tt.is {
				if !errors.Is(err, target) {
					t.Errorf("errors.Is(%v, %v) = false", err, target)
				}
			}
			for _, target := range tt.isnt {
				if errors.Is(err, target) {
					t.Errorf("errors.Is(%v, %v) = true", err, target)
				}
			}
		})
	}

	// ID 0 is refused without asking the kernel.
	called := false
	p := fakePM(t, func(genetlink.Message, netlink.Message) ([]genetlink.Message, error) {
		called = true
		return nil, io.EOF
	})
	if err := p.DeleteEndpoint(0); !errors.Is(err, syscall.EINVAL) || called {
		t.Errorf("DeleteEndpoint(0) = %v (kernel asked: %v), want EINVAL without a request", err, called)
	}
	if err := p.AddEndpoint(Endpoint{Flags: Signal}); err == nil || called {
		t.Errorf("AddEndpoint without an address = %v (kernel asked: %v), want an error without a request", err, called)
	}
}

func TestPMDeleteEndpointAddr(t *testing.T) {
	var deleted []uint8
	p := fakePM(t, func(greq genetlink.Message, _ netlink.Message) ([]genetlink.Message, error) {
		switch greq.Header.Command {
		case pmCmdGetAddr:
			return []genetlink.Message{
				{Data: rawNested(1, rawAttr(1, nlU16(2)...), rawAttr(2, 1), rawAttr(3, 10, 0, 0, 1))},
				{Data: rawNested(1, rawAttr(1, nlU16(2)...), rawAttr(2, 2), rawAttr(5, nlU16(80)...), rawAttr(6, nlU32(1)...), rawAttr(3, 10, 0, 0, 2))},
				{Data: rawNested(1, rawAttr(1, nlU16(2)...), rawAttr(2, 3), rawAttr(6, nlU32(2)...), rawAttr(3, 10, 0, 0, 2))},
			}, nil
		case pmCmdDelAddr:
			id, err := decodeEndpointRequestID(greq.Data)
			if err != nil {
				return nil, err
			}
			deleted = append(deleted, id)
			return nil, io.EOF
		}
		return nil, genltest.Error(int(syscall.EOPNOTSUPP))
	})
	if err := p.DeleteEndpointAddr(netip.MustParseAddr("10.0.0.2")); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(deleted, []uint8{2, 3}) {
		t.Errorf("deleted IDs %v, want [2 3]", deleted)
	}
	if err := p.DeleteEndpointAddr(netip.MustParseAddr("10.0.0.9")); !errors.Is(err, ErrEndpointNotFound) {
		t.Errorf("unknown address: %v, want ErrEndpointNotFound", err)
	}
}

// decodeEndpointRequestID returns the ID of a DEL_ADDR request, which
// carries nothing else.
func decodeEndpointRequestID(b []byte) (uint8, error) {
	want := func(id uint8) []byte { return rawNested(1, rawAttr(2, id)) }
	for id := 1; id < 256; id++ {
		if bytes.Equal(b, want(uint8(id))) {
			return uint8(id), nil
		}
	}
	return 0, errors.New("not a delete-by-ID request")
}

func TestNewPMFamilyMissing(t *testing.T) {
	c := genltest.Dial(func(genetlink.Message, netlink.Message) ([]genetlink.Message, error) {
		return nil, genltest.Error(int(syscall.ENOENT))
	})
	defer c.Close()
	_, err := newPM(c)
	if !errors.Is(err, ErrPMNotFound) || !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("newPM without the family: %v, want ErrPMNotFound", err)
	}
}
