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
	"encoding/binary"
	"net/netip"
	"testing"
)

var nlNE = binary.NativeEndian

// Raw attribute builders, written out independently of the encoder under
// test: struct nlattr is a native-endian u16 length (header included) and
// u16 type, then the data padded to 4 bytes.
func rawAttr(typ uint16, data ...byte) []byte {
	b := make([]byte, 4, 4+len(data)+3)
	nlNE.PutUint16(b[0:2], uint16(4+len(data)))
	nlNE.PutUint16(b[2:4], typ)
	b = append(b, data...)
	for len(b)%4 != 0 {
		b = append(b, 0)
	}
	return b
}

func rawNested(typ uint16, attrs ...[]byte) []byte {
	return rawAttr(typ|0x8000, bytes.Join(attrs, nil)...) // NLA_F_NESTED
}

func nlU16(v uint16) []byte { b := make([]byte, 2); nlNE.PutUint16(b, v); return b }
func nlU32(v uint32) []byte { b := make([]byte, 4); nlNE.PutUint32(b, v); return b }

func TestPMDecodeErrors(t *testing.T) {
	for _, tt := range []struct {
		name string
		data []byte
	}{
		{"no address attribute", rawAttr(3, nlU32(1)...)},
		{"two address attributes", append(
			rawNested(1, rawAttr(1, nlU16(2)...), rawAttr(3, 1, 2, 3, 4)),
			rawNested(1, rawAttr(1, nlU16(2)...), rawAttr(3, 1, 2, 3, 4))...)},
		{"no family", rawNested(1, rawAttr(3, 1, 2, 3, 4))},
		{"unknown family", rawNested(1, rawAttr(1, nlU16(7)...), rawAttr(3, 1, 2, 3, 4))},
		{"IPv4 family without address", rawNested(1, rawAttr(1, nlU16(2)...))},
		{"IPv4 family with IPv6 address", rawNested(1, rawAttr(1, nlU16(2)...), rawAttr(4, make([]byte, 16)...))},
		{"short IPv6 address", rawNested(1, rawAttr(1, nlU16(10)...), rawAttr(4, 1, 2, 3, 4))},
		{"short flags", rawNested(1, rawAttr(1, nlU16(2)...), rawAttr(3, 1, 2, 3, 4), rawAttr(6, 1, 2))},
		{"truncated", rawNested(1, rawAttr(1, nlU16(2)...))[:6]},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if e, err := decodeEndpoint(tt.data); err == nil {
				t.Errorf("decoded %v, want an error", e)
			}
		})
	}
	for _, tt := range []struct {
		name string
		data []byte
	}{
		{"empty", nil},
		{"subflows only", rawAttr(3, nlU32(1)...)},
		{"short value", append(rawAttr(2, 1, 0), rawAttr(3, nlU32(1)...)...)},
	} {
		t.Run("limits "+tt.name, func(t *testing.T) {
			if l, err := decodeLimits(tt.data); err == nil {
				t.Errorf("decoded %+v, want an error", l)
			}
		})
	}
}

func TestEndpointFlagsString(t *testing.T) {
	for f, want := range map[EndpointFlags]string{
		0:                         "0",
		Signal:                    "signal",
		Subflow | Backup:          "subflow|backup",
		Signal | Backup | Laminar: "signal|backup|laminar",
		Fullmesh | Implicit:       "fullmesh|implicit",
		Subflow | 0x100:           "subflow|0x100",
	} {
		if got := f.String(); got != want {
			t.Errorf("%#x.String() = %q, want %q", uint32(f), got, want)
		}
	}
}

func TestEndpointString(t *testing.T) {
	e := Endpoint{ID: 3, Addr: netip.MustParseAddr("10.0.0.1"), Port: 1000, Flags: Signal | Backup, IfIndex: 4}
	if got, want := e.String(), "10.0.0.1 port 1000 id 3 signal backup ifindex 4"; got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
}

// replyOf encodes e as the kernel fills a GET_ADDR reply.
func replyOf(e Endpoint) []byte {
	attrs := [][]byte{rawAttr(1, nlU16(2)...), rawAttr(5, nlU16(e.Port)...), rawAttr(2, e.ID), rawAttr(6, nlU32(uint32(e.Flags))...)}
	if e.IfIndex != 0 {
		attrs = append(attrs, rawAttr(7, nlU32(uint32(e.IfIndex))...))
	}
	if e.Addr.Is4() {
		a := e.Addr.As4()
		attrs = append(attrs, rawAttr(3, a[:]...))
	} else {
		attrs[0] = rawAttr(1, nlU16(10)...)
		a := e.Addr.As16()
		attrs = append(attrs, rawAttr(4, a[:]...))
	}
	return rawNested(1, attrs...)
}

func TestEndpointRoundTrip(t *testing.T) {
	for _, e := range []Endpoint{
		{ID: 1, Addr: netip.MustParseAddr("10.1.2.3"), Flags: Subflow},
		{ID: 255, Addr: netip.MustParseAddr("10.1.2.3"), Port: 65535, Flags: Signal | Backup, IfIndex: 1 << 30},
		{ID: 17, Addr: netip.MustParseAddr("2001:db8::1"), Flags: Subflow | Fullmesh | Laminar, IfIndex: 2},
	} {
		got, err := decodeEndpoint(replyOf(e))
		if err != nil || got != e {
			t.Errorf("decode(kernel reply of %v) = %v, %v", e, got, err)
		}
		b, err := encodeEndpoint(e)
		if err != nil {
			t.Fatal(err)
		}
		if got, err := decodeEndpoint(b); err != nil || got != e {
			t.Errorf("decode(encode(%v)) = %v, %v", e, got, err)
		}
	}
}

// FuzzDecodeEndpoint checks that the GET_ADDR reply decoder never panics
// and that what it accepts survives encoding and decoding again.
func FuzzDecodeEndpoint(f *testing.F) {
	f.Add(replyOf(Endpoint{ID: 1, Addr: netip.MustParseAddr("10.0.0.1"), Flags: Signal}))
	f.Add(replyOf(Endpoint{ID: 2, Addr: netip.MustParseAddr("10.0.0.2"), Port: 8080, Flags: Signal | Backup, IfIndex: 3}))
	f.Add(replyOf(Endpoint{ID: 3, Addr: netip.MustParseAddr("fd00::3"), Flags: Subflow | Fullmesh, IfIndex: 4}))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		e, err := decodeEndpoint(b)
		if err != nil {
			return
		}
		if !e.Addr.IsValid() || (!e.Addr.Is4() && !e.Addr.Is6()) {
			t.Fatalf("decoded an invalid address: %v", e)
		}
		enc, err := encodeEndpoint(e)
		if err != nil {
			t.Fatalf("encode(%v): %v", e, err)
		}
		again, err := decodeEndpoint(enc)
		if err != nil {
			t.Fatalf("decode(encode(%v)): %v", e, err)
		}
		// Requests send IPv4-mapped IPv6 addresses as IPv4.
		want := e
		want.Addr = e.Addr.Unmap()
		if again != want {
			t.Fatalf("round trip: %v became %v", e, again)
		}
	})
}

// FuzzDecodeLimits checks the GET_LIMITS reply decoder likewise.
func FuzzDecodeLimits(f *testing.F) {
	f.Add(append(rawAttr(2, nlU32(0)...), rawAttr(3, nlU32(2)...)...))
	f.Add(append(rawAttr(3, nlU32(8)...), rawAttr(2, nlU32(8)...)...))
	f.Add(rawAttr(3, nlU32(1)...))
	f.Fuzz(func(t *testing.T, b []byte) {
		l, err := decodeLimits(b)
		if err != nil {
			return
		}
		enc, err := encodeLimits(l)
		if err != nil {
			t.Fatal(err)
		}
		if again, err := decodeLimits(enc); err != nil || again != l {
			t.Fatalf("round trip: %+v became %+v, %v", l, again, err)
		}
	})
}
