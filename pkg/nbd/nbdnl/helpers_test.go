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
	"fmt"
	"strings"
	"testing"

	"github.com/mdlayher/netlink"
	"github.com/mdlayher/netlink/nlenc"
)

// tattr is a decoded attribute tree, for comparing what the client sent.
type tattr struct {
	Type uint16
	Data []byte  // leaf payload
	Kids []tattr // nested attributes
}

func leaf(typ uint16, data []byte) tattr { return tattr{Type: typ, Data: data} }
func nest(typ uint16, kids ...tattr) tattr {
	if kids == nil {
		kids = []tattr{}
	}
	return tattr{Type: typ, Kids: kids}
}
func u8(v uint8) []byte   { return []byte{v} }
func u32(v uint32) []byte { return nlenc.Uint32Bytes(v) }
func u64(v uint64) []byte { return nlenc.Uint64Bytes(v) }
func str(s string) []byte { return nlenc.Bytes(s) } // NUL-terminated

// parseTree decodes b, descending into attributes flagged as nested.
func parseTree(t *testing.T, b []byte) []tattr {
	t.Helper()
	attrs, err := netlink.UnmarshalAttributes(b)
	if err != nil {
		t.Fatalf("unmarshal attributes: %v", err)
	}
	out := []tattr{}
	for _, a := range attrs {
		typ := a.Type &^ (netlink.Nested | netlink.NetByteOrder)
		if a.Type&netlink.Nested != 0 {
			out = append(out, nest(typ, parseTree(t, a.Data)...))
			continue
		}
		out = append(out, leaf(typ, a.Data))
	}
	return out
}

func formatTree(attrs []tattr) string {
	var sb strings.Builder
	var walk func([]tattr, string)
	walk = func(as []tattr, indent string) {
		for _, a := range as {
			if a.Kids != nil {
				fmt.Fprintf(&sb, "%s%d {\n", indent, a.Type)
				walk(a.Kids, indent+"  ")
				fmt.Fprintf(&sb, "%s}\n", indent)
				continue
			}
			fmt.Fprintf(&sb, "%s%d = % x\n", indent, a.Type, a.Data)
		}
	}
	walk(attrs, "")
	return sb.String()
}

func checkTree(t *testing.T, b []byte, want ...tattr) {
	t.Helper()
	if want == nil {
		want = []tattr{}
	}
	got := formatTree(parseTree(t, b))
	if w := formatTree(want); got != w {
		t.Errorf("attributes sent:\n%s\nwant:\n%s", got, w)
	}
}

// encodeStatusReply builds the attributes of a STATUS reply the way the
// kernel does (nests without NLA_F_NESTED).
func encodeStatusReply(devs []DeviceStatus) []byte {
	var items []netlink.Attribute
	for _, d := range devs {
		c := uint8(0)
		if d.Connected {
			c = 1
		}
		item, err := netlink.MarshalAttributes([]netlink.Attribute{
			{Type: attrDeviceIndex, Data: u32(d.Index)},
			{Type: attrDeviceConnected, Data: u8(c)},
		})
		if err != nil {
			panic(err)
		}
		items = append(items, netlink.Attribute{Type: attrDeviceItem, Data: item})
	}
	list, err := netlink.MarshalAttributes(items)
	if err != nil {
		panic(err)
	}
	b, err := netlink.MarshalAttributes([]netlink.Attribute{{Type: attrDeviceList, Data: list}})
	if err != nil {
		panic(err)
	}
	return b
}

func encodeIndex(index uint32) []byte {
	b, err := netlink.MarshalAttributes([]netlink.Attribute{{Type: attrIndex, Data: u32(index)}})
	if err != nil {
		panic(err)
	}
	return b
}
