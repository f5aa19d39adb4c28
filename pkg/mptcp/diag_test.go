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
	"encoding/binary"
	"net/netip"
	"testing"
	"time"

	"github.com/mdlayher/netlink"
)

func TestDecodeDiagMsg(t *testing.T) {
	ne := binary.NativeEndian
	msg := make([]byte, diagMsgSize)
	msg[0] = afInet
	binary.BigEndian.PutUint16(msg[4:], 40001)
	binary.BigEndian.PutUint16(msg[6:], 10809)
	copy(msg[8:], []byte{10, 0, 4, 1})
	copy(msg[24:], []byte{10, 0, 4, 2})
	ne.PutUint32(msg[44:], 7)
	ne.PutUint32(msg[48:], 1)
	info := make([]byte, offTCPDeliveryRate+8)
	info[offTCPAppLimited] = 1
	ne.PutUint32(info[offTCPRTT:], 2500)
	ne.PutUint64(info[offTCPBytesAcked:], 123456)
	ne.PutUint64(info[offTCPDeliveryRate:], 12_500_000)

	ae := netlink.NewAttributeEncoder()
	ae.Bytes(diagAttrInfo, info)
	ae.Nested(diagAttrULPInfo, func(nae *netlink.AttributeEncoder) error {
		nae.String(ulpInfoName, "mptcp")
		nae.Nested(ulpInfoMPTCP, func(m *netlink.AttributeEncoder) error {
			m.Uint32(subflowAttrFlags, subflowFlagBkupLc|1<<3)
			return nil
		})
		return nil
	})
	attrs, err := ae.Encode()
	if err != nil {
		t.Fatal(err)
	}
	s, err := decodeDiagMsg(append(msg, attrs...))
	if err != nil {
		t.Fatal(err)
	}
	want := TCPSocket{
		Cookie: 1<<32 | 7, Local: netip.MustParseAddrPort("10.0.4.1:40001"), Remote: netip.MustParseAddrPort("10.0.4.2:10809"),
		Subflow: true, BackupLocal: true, BytesAcked: 123456, DeliveryRate: 12_500_000, AppLimited: true, RTT: 2500 * time.Microsecond,
	}
	if s != want {
		t.Fatalf("decoded %+v\nwant    %+v", s, want)
	}

	// A plain TCP socket: no ULP attribute; an IPv6 one with a mapped
	// address unmaps.
	msg6 := make([]byte, diagMsgSize)
	msg6[0] = afInet6
	copy(msg6[8:], netip.MustParseAddr("::ffff:10.0.0.1").AsSlice())
	copy(msg6[24:], netip.MustParseAddr("fd00::2").AsSlice())
	s, err = decodeDiagMsg(msg6)
	if err != nil {
		t.Fatal(err)
	}
	if s.Subflow || s.Local.Addr() != netip.MustParseAddr("10.0.0.1") || s.Remote.Addr() != netip.MustParseAddr("fd00::2") {
		t.Fatalf("IPv6 plain socket decoded as %+v", s)
	}

	for _, bad := range [][]byte{msg[:diagMsgSize-1], append([]byte{99}, msg[1:]...), append(msg[:diagMsgSize:diagMsgSize], 5, 0, 2)} {
		if _, err := decodeDiagMsg(bad); err == nil {
			t.Errorf("decoded a malformed message of %d bytes", len(bad))
		}
	}
}
