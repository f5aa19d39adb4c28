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
	"errors"
	"net/netip"
	"testing"
	"time"
)

// putSockaddr writes a in a sockaddr_storage at b the way the kernel
// does: family in host byte order, port and address in network order.
func putSockaddr(b []byte, a netip.AddrPort) {
	ne := binary.NativeEndian
	if a.Addr().Is4() {
		ne.PutUint16(b, afInet)
		binary.BigEndian.PutUint16(b[2:], a.Port())
		ip := a.Addr().As4()
		copy(b[4:], ip[:])
		return
	}
	ne.PutUint16(b, afInet6)
	binary.BigEndian.PutUint16(b[2:], a.Port())
	binary.BigEndian.PutUint32(b[4:], 0x12345) // flowinfo, ignored
	ip := a.Addr().As16()
	copy(b[8:], ip[:])
	ne.PutUint32(b[24:], 3) // scope id, ignored
}

// putTCPInfo writes s's counters in a struct tcp_info at b.
func putTCPInfo(b []byte, s SubflowInfo) {
	ne := binary.NativeEndian
	b[offTCPState] = s.State
	ne.PutUint64(b[offTCPBytesAcked:], s.BytesAcked)
	ne.PutUint64(b[offTCPBytesReceived:], s.BytesReceived)
	ne.PutUint64(b[offTCPBytesSent:], s.BytesSent)
	ne.PutUint64(b[offTCPBytesRetrans:], s.BytesRetrans)
	ne.PutUint32(b[offTCPRTT:], uint32(s.RTT/time.Microsecond))
	ne.PutUint64(b[offTCPDeliveryRate:], s.DeliveryRate)
	// Fields in between that must not leak into the counters.
	for _, off := range []int{8, 104, 112, 136, 192} {
		ne.PutUint32(b[off:], 0xffffffff)
	}
}

func sampleSubflows() []SubflowInfo {
	return []SubflowInfo{
		{
			ID: 1, State: 1,
			Local:     netip.MustParseAddrPort("10.77.1.1:40000"),
			Remote:    netip.MustParseAddrPort("10.77.1.2:10809"),
			BytesSent: 3 << 20, BytesRetrans: 1500, BytesAcked: 3<<20 - 1500, BytesReceived: 1 << 10,
			RTT: 1250 * time.Microsecond, DeliveryRate: 117 << 20,
		},
		{
			ID: 2, State: 1,
			Local:     netip.MustParseAddrPort("[fd00::1]:40001"),
			Remote:    netip.MustParseAddrPort("[fd00::2]:10900"),
			BytesSent: 1 << 40, BytesAcked: 1 << 40, BytesReceived: 1<<33 + 7,
		},
	}
}

// encodeFullInfo builds a kernel-shaped MPTCP_FULL_INFO reply: the
// header the kernel rewrote, the mptcp_info and the two arrays, with
// element sizes sfSize and tcpSize (what the kernel settled on), room for
// slots subflows of which total exist.
func encodeFullInfo(info Info, subs []SubflowInfo, total, slots, sfSize, tcpSize int) (full, sfinfo, tcpinfo []byte) {
	ne := binary.NativeEndian
	full = make([]byte, FullInfoSize)
	ne.PutUint32(full[offFullSizeTCPInfoKernel:], 280)
	ne.PutUint32(full[offFullSizeTCPInfoUser:], uint32(tcpSize))
	ne.PutUint32(full[offFullSizeSfInfoKernel:], SubflowInfoSize)
	ne.PutUint32(full[offFullSizeSfInfoUser:], uint32(sfSize))
	ne.PutUint32(full[offFullNumSubflows:], uint32(total))
	ne.PutUint32(full[offFullSizeArraysUser:], uint32(slots))
	ne.PutUint64(full[offFullSubflowInfo:], 0xc000010000) // user pointers: ignored
	ne.PutUint64(full[offFullTCPInfo:], 0xc000020000)
	copy(full[FullInfoHeaderSize:], encodeInfo(info))
	sfinfo = make([]byte, slots*sfSize)
	tcpinfo = make([]byte, slots*tcpSize)
	for i, s := range subs {
		sf := make([]byte, SubflowInfoSize)
		ne.PutUint32(sf[offSfInfoID:], s.ID)
		putSockaddr(sf[offSfInfoAddrs:], s.Local)
		putSockaddr(sf[offSfInfoAddrs+sockaddrStorageSize:], s.Remote)
		copy(sfinfo[i*sfSize:(i+1)*sfSize], sf)
		ti := make([]byte, TCPInfoSize)
		putTCPInfo(ti, s)
		copy(tcpinfo[i*tcpSize:(i+1)*tcpSize], ti)
	}
	return full, sfinfo, tcpinfo
}

func TestDecodeFullInfo(t *testing.T) {
	want := sampleSubflows()
	full, sfinfo, tcpinfo := encodeFullInfo(sampleInfo(), want, 2, 8, SubflowInfoSize, TCPInfoSize)
	got, err := DecodeFullInfo(full, sfinfo, tcpinfo)
	if err != nil {
		t.Fatal(err)
	}
	if got.Info != sampleInfo() {
		t.Errorf("Info = %+v\nwant %+v", got.Info, sampleInfo())
	}
	if got.Total != 2 || len(got.Subflows) != 2 {
		t.Fatalf("Total %d, %d subflows; want 2, 2", got.Total, len(got.Subflows))
	}
	for i := range want {
		if got.Subflows[i] != want[i] {
			t.Errorf("subflow %d:\n got  %+v\n want %+v", i, got.Subflows[i], want[i])
		}
	}
}

// TestDecodeFullInfoKnownBytes writes the fields at literal offsets, so
// the offset constants cannot be wrong the same way in both directions.
func TestDecodeFullInfoKnownBytes(t *testing.T) {
	ne := binary.NativeEndian
	full := make([]byte, FullInfoHeaderSize)
	ne.PutUint32(full[4:], 216)  // size_tcpinfo_user
	ne.PutUint32(full[12:], 264) // size_sfinfo_user
	ne.PutUint32(full[16:], 1)   // num_subflows
	ne.PutUint32(full[20:], 1)   // size_arrays_user
	sf := make([]byte, 264)
	ne.PutUint32(sf[0:], 9)                       // id
	ne.PutUint16(sf[8:], 2)                       // local: AF_INET
	sf[10], sf[11] = 0x2a, 0x49                   // port 10825
	sf[12], sf[13], sf[14], sf[15] = 192, 0, 2, 1 // 192.0.2.1
	ne.PutUint16(sf[136:], 2)                     // remote: AF_INET
	sf[138], sf[139] = 0x2a, 0x39                 // port 10809
	sf[140], sf[141], sf[142], sf[143] = 192, 0, 2, 2
	ti := make([]byte, 216)
	ti[0] = 1                   // TCP_ESTABLISHED
	ne.PutUint64(ti[120:], 100) // bytes_acked
	ne.PutUint64(ti[128:], 200) // bytes_received
	ne.PutUint64(ti[200:], 300) // bytes_sent
	ne.PutUint64(ti[208:], 4)   // bytes_retrans
	got, err := DecodeFullInfo(full, sf, ti)
	if err != nil {
		t.Fatal(err)
	}
	want := SubflowInfo{
		ID: 9, State: 1,
		Local:      netip.MustParseAddrPort("192.0.2.1:10825"),
		Remote:     netip.MustParseAddrPort("192.0.2.2:10809"),
		BytesAcked: 100, BytesReceived: 200, BytesSent: 300, BytesRetrans: 4,
	}
	if len(got.Subflows) != 1 || got.Subflows[0] != want {
		t.Fatalf("got %+v\nwant %+v", got.Subflows, want)
	}
	if got.Info != (Info{}) {
		t.Errorf("Info decoded from a header-only reply: %+v", got.Info)
	}
}

// TestDecodeFullInfoSmallerElements: a kernel whose struct tcp_info ends
// before tcpi_bytes_sent, and arrays with too few slots.
func TestDecodeFullInfoSmallerElements(t *testing.T) {
	subs := sampleSubflows()
	full, sfinfo, tcpinfo := encodeFullInfo(sampleInfo(), subs[:1], 2, 1, SubflowInfoSize, offTCPBytesSent)
	got, err := DecodeFullInfo(full[:FullInfoHeaderSize+InfoSizeCounters], sfinfo, tcpinfo)
	if err != nil {
		t.Fatal(err)
	}
	if got.Total != 2 || len(got.Subflows) != 1 {
		t.Fatalf("Total %d, %d subflows; want 2 and 1 that fitted", got.Total, len(got.Subflows))
	}
	want := subs[0]
	want.BytesSent, want.BytesRetrans = 0, 0
	if got.Subflows[0] != want {
		t.Errorf("got  %+v\nwant %+v", got.Subflows[0], want)
	}
	if got.Info.Size != InfoSizeCounters || got.Info.HasSubflowsTotal() {
		t.Errorf("Info size %d", got.Info.Size)
	}

	// Only the id: addresses unknown.
	full, sfinfo, tcpinfo = encodeFullInfo(Info{}, subs[:1], 1, 1, 4, TCPInfoSize)
	got, err = DecodeFullInfo(full[:FullInfoHeaderSize], sfinfo, tcpinfo)
	if err != nil {
		t.Fatal(err)
	}
	if s := got.Subflows[0]; s.ID != 1 || s.Local.IsValid() || s.Remote.IsValid() || s.BytesSent != subs[0].BytesSent {
		t.Errorf("id-only subflow decoded as %+v", s)
	}
}

func TestDecodeFullInfoShort(t *testing.T) {
	if _, err := DecodeFullInfo(make([]byte, FullInfoHeaderSize-1), nil, nil); !errors.Is(err, ErrShortSubflows) {
		t.Errorf("short header: %v", err)
	}
	full, sfinfo, tcpinfo := encodeFullInfo(Info{}, sampleSubflows(), 2, 2, SubflowInfoSize, TCPInfoSize)
	if _, err := DecodeFullInfo(full, sfinfo[:len(sfinfo)-1], tcpinfo); !errors.Is(err, ErrShortSubflows) {
		t.Errorf("short subflow array: %v", err)
	}
	if _, err := DecodeFullInfo(full, sfinfo, tcpinfo[:TCPInfoSize]); !errors.Is(err, ErrShortSubflows) {
		t.Errorf("short tcp_info array: %v", err)
	}
	if _, err := DecodeFullInfo(full[:FullInfoHeaderSize+InfoSizeMin-1], sfinfo, tcpinfo); !errors.Is(err, ErrShortInfo) {
		t.Errorf("short mptcp_info: %v", err)
	}
}

// encodeSubflowData builds an MPTCP_TCPINFO / MPTCP_SUBFLOW_ADDRS reply.
func encodeSubflowData(total, size int, elems ...[]byte) []byte {
	ne := binary.NativeEndian
	b := make([]byte, SubflowDataSize)
	ne.PutUint32(b[offSfdSizeSubflowData:], SubflowDataSize)
	ne.PutUint32(b[offSfdNumSubflows:], uint32(total))
	ne.PutUint32(b[offSfdSizeKernel:], uint32(size+8))
	ne.PutUint32(b[offSfdSizeUser:], uint32(size))
	for _, e := range elems {
		b = append(b, e[:size]...)
	}
	return b
}

func TestDecodeSubflowData(t *testing.T) {
	subs := sampleSubflows()
	var addrs, infos [][]byte
	for _, s := range subs {
		a := make([]byte, SubflowAddrsSize)
		putSockaddr(a, s.Local)
		putSockaddr(a[sockaddrStorageSize:], s.Remote)
		addrs = append(addrs, a)
		ti := make([]byte, TCPInfoSize)
		putTCPInfo(ti, s)
		infos = append(infos, ti)
	}
	ae, na, err := DecodeSubflowData(encodeSubflowData(2, SubflowAddrsSize, addrs...))
	if err != nil || na != 2 || len(ae) != 2 {
		t.Fatalf("addrs: %d of %d, %v", len(ae), na, err)
	}
	te, nt, err := DecodeSubflowData(encodeSubflowData(2, TCPInfoSize, infos...))
	if err != nil || nt != 2 || len(te) != 2 {
		t.Fatalf("tcp_info: %d of %d, %v", len(te), nt, err)
	}
	for i, s := range subs {
		var got SubflowInfo
		got.Local, got.Remote = decodeSubflowAddrs(ae[i])
		decodeTCPInfo(&got, te[i])
		s.ID = 0
		if got != s {
			t.Errorf("subflow %d:\n got  %+v\n want %+v", i, got, s)
		}
	}

	// Three subflows, room for one; the rest is truncated.
	e, n, err := DecodeSubflowData(encodeSubflowData(3, 100, infos[0]))
	if err != nil || n != 3 || len(e) != 1 || len(e[0]) != 100 {
		t.Errorf("truncated: %d elements of %d, %v", len(e), n, err)
	}
	if _, _, err := DecodeSubflowData(make([]byte, SubflowDataSize-1)); !errors.Is(err, ErrShortSubflows) {
		t.Errorf("short: %v", err)
	}
	bad := encodeSubflowData(0, 8)
	binary.NativeEndian.PutUint32(bad, 64)
	if _, _, err := DecodeSubflowData(bad); !errors.Is(err, ErrShortSubflows) {
		t.Errorf("header larger than the reply: %v", err)
	}
}

func TestDecodeSockaddr(t *testing.T) {
	for _, s := range []string{"10.0.0.1:1", "[2001:db8::1]:65535", "0.0.0.0:0"} {
		want := netip.MustParseAddrPort(s)
		b := make([]byte, sockaddrStorageSize)
		putSockaddr(b, want)
		if got := decodeSockaddr(b); got != want {
			t.Errorf("%s decoded as %s", s, got)
		}
		if got := decodeSockaddr(b[:7]); got.IsValid() {
			t.Errorf("truncated %s decoded as %s", s, got)
		}
	}
	// IPv4-mapped IPv6 (a dual-stack socket) reads as IPv4.
	b := make([]byte, sockaddrStorageSize)
	putSockaddr(b, netip.MustParseAddrPort("[::ffff:10.1.2.3]:80"))
	if got := decodeSockaddr(b); got != netip.MustParseAddrPort("10.1.2.3:80") {
		t.Errorf("mapped address decoded as %s", got)
	}
	if got := decodeSockaddr(make([]byte, sockaddrStorageSize)); got.IsValid() {
		t.Errorf("AF_UNSPEC decoded as %s", got)
	}
}

func FuzzDecodeFullInfo(f *testing.F) {
	full, sfinfo, tcpinfo := encodeFullInfo(sampleInfo(), sampleSubflows(), 2, 2, SubflowInfoSize, TCPInfoSize)
	f.Add(full, sfinfo, tcpinfo)
	f.Add(full[:FullInfoHeaderSize], sfinfo[:10], tcpinfo)
	f.Fuzz(func(t *testing.T, full, sfinfo, tcpinfo []byte) {
		fi, err := DecodeFullInfo(full, sfinfo, tcpinfo)
		if err == nil && len(fi.Subflows) > fi.Total {
			t.Fatalf("%d subflows decoded of %d", len(fi.Subflows), fi.Total)
		}
	})
}
