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

package nbdnl

import (
	"reflect"
	"testing"

	"github.com/mdlayher/netlink"
)

func TestDecodeStatus(t *testing.T) {
	devs := []DeviceStatus{{Index: 0, Connected: true}, {Index: 1}, {Index: 15, Connected: true}}
	got, err := decodeStatus(encodeStatusReply(devs))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, devs) {
		t.Fatalf("got %+v, want %+v", got, devs)
	}

	empty, err := decodeStatus(encodeStatusReply(nil))
	if err != nil || len(empty) != 0 {
		t.Fatalf("empty list: got %+v, %v", empty, err)
	}
}

func TestDecodeStatusNestedFlagAndUnknown(t *testing.T) {
	// Nests flagged NLA_F_NESTED and unknown attributes decode as well.
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(99, 1)
	ae.Nested(attrDeviceList, func(ae *netlink.AttributeEncoder) error {
		ae.Uint32(7, 0) // not a device item
		ae.Nested(attrDeviceItem, func(ae *netlink.AttributeEncoder) error {
			ae.Uint8(attrDeviceConnected, 1)
			ae.Uint32(attrDeviceIndex, 4)
			ae.Uint64(42, 0)
			return nil
		})
		return nil
	})
	b, err := ae.Encode()
	if err != nil {
		t.Fatal(err)
	}
	got, err := decodeStatus(b)
	if err != nil {
		t.Fatal(err)
	}
	if want := []DeviceStatus{{Index: 4, Connected: true}}; !reflect.DeepEqual(got, want) {
		t.Fatalf("got %+v, want %+v", got, want)
	}
}

func TestDecodeStatusMalformed(t *testing.T) {
	mustMarshal := func(as ...netlink.Attribute) []byte {
		b, err := netlink.MarshalAttributes(as)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	item := func(as ...netlink.Attribute) []byte {
		return mustMarshal(netlink.Attribute{Type: attrDeviceList,
			Data: mustMarshal(netlink.Attribute{Type: attrDeviceItem, Data: mustMarshal(as...)})})
	}
	for name, b := range map[string][]byte{
		"no device list":   encodeIndex(3),
		"truncated":        encodeStatusReply([]DeviceStatus{{Index: 1}})[:10],
		"item without idx": item(netlink.Attribute{Type: attrDeviceConnected, Data: u8(1)}),
		"short index":      item(netlink.Attribute{Type: attrDeviceIndex, Data: []byte{1, 2}}),
		"long connected":   item(netlink.Attribute{Type: attrDeviceIndex, Data: u32(1)}, netlink.Attribute{Type: attrDeviceConnected, Data: u32(1)}),
	} {
		if devs, err := decodeStatus(b); err == nil {
			t.Errorf("%s: decoded %+v, want an error", name, devs)
		}
	}
}

func TestDecodeLinkDead(t *testing.T) {
	ev, err := decodeLinkDead(encodeIndex(12))
	if err != nil {
		t.Fatal(err)
	}
	if ev != (LinkDead{Index: 12}) {
		t.Fatalf("got %+v", ev)
	}
	for name, b := range map[string][]byte{
		"empty": nil,
		"other attr": func() []byte {
			b, _ := netlink.MarshalAttributes([]netlink.Attribute{{Type: attrSizeBytes, Data: u64(1)}})
			return b
		}(),
		"short index": func() []byte {
			b, _ := netlink.MarshalAttributes([]netlink.Attribute{{Type: attrIndex, Data: []byte{1}}})
			return b
		}(),
		"truncated": encodeIndex(1)[:6],
	} {
		if ev, err := decodeLinkDead(b); err == nil {
			t.Errorf("%s: decoded %+v, want an error", name, ev)
		}
	}
}
