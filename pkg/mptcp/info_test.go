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
	"testing"
)

// encodeInfo is the inverse of DecodeInfo for the full current layout; it
// lets tests build kernel-shaped replies and truncate them.
func encodeInfo(i Info) []byte {
	b := make([]byte, InfoSize)
	ne := binary.NativeEndian
	b[offSubflows] = i.Subflows
	b[offAddAddrSignal] = i.AddAddrSignal
	b[offAddAddrAccepted] = i.AddAddrAccepted
	b[offSubflowsMax] = i.SubflowsMax
	b[offAddAddrSignalMax] = i.AddAddrSignalMax
	b[offAddAddrAcceptedMax] = i.AddAddrAcceptedMax
	ne.PutUint32(b[offFlags:], i.Flags)
	ne.PutUint32(b[offToken:], i.Token)
	ne.PutUint64(b[offWriteSeq:], i.WriteSeq)
	ne.PutUint64(b[offSndUna:], i.SndUna)
	ne.PutUint64(b[offRcvNxt:], i.RcvNxt)
	b[offLocalAddrUsed] = i.LocalAddrUsed
	b[offLocalAddrMax] = i.LocalAddrMax
	if i.CsumEnabled {
		b[offCsumEnabled] = 1
	}
	ne.PutUint32(b[offRetransmits:], i.Retransmits)
	ne.PutUint64(b[offBytesRetrans:], i.BytesRetrans)
	ne.PutUint64(b[offBytesSent:], i.BytesSent)
	ne.PutUint64(b[offBytesReceived:], i.BytesReceived)
	ne.PutUint64(b[offBytesAcked:], i.BytesAcked)
	b[offSubflowsTotal] = i.SubflowsTotal
	b[offEndpLaminarMax] = i.EndpLaminarMax
	b[offEndpFullmeshMax] = i.EndpFullmeshMax
	ne.PutUint32(b[offLastDataSent:], i.LastDataSent)
	ne.PutUint32(b[offLastDataRecv:], i.LastDataRecv)
	ne.PutUint32(b[offLastAckRecv:], i.LastAckRecv)
	return b
}

func sampleInfo() Info {
	return Info{
		Size:               InfoSize,
		Subflows:           3,
		AddAddrSignal:      1,
		AddAddrAccepted:    3,
		SubflowsMax:        3,
		AddAddrSignalMax:   2,
		AddAddrAcceptedMax: 3,
		Flags:              InfoFlagRemoteKeyReceived,
		Token:              0xdeadbeef,
		WriteSeq:           0x0102030405060708,
		SndUna:             0x1112131415161718,
		RcvNxt:             0x2122232425262728,
		LocalAddrUsed:      1,
		LocalAddrMax:       4,
		CsumEnabled:        true,
		Retransmits:        7,
		BytesRetrans:       1 << 20,
		BytesSent:          64 << 20,
		BytesReceived:      1 << 30,
		BytesAcked:         (64 << 20) - 1,
		SubflowsTotal:      4,
		EndpLaminarMax:     5,
		EndpFullmeshMax:    6,
		LastDataSent:       10,
		LastDataRecv:       20,
		LastAckRecv:        30,
	}
}

func TestDecodeInfoFull(t *testing.T) {
	want := sampleInfo()
	got, err := DecodeInfo(encodeInfo(want))
	if err != nil {
		t.Fatal(err)
	}
	if got != want {
		t.Fatalf("round trip mismatch:\n got %+v\nwant %+v", got, want)
	}
	if got.Fallback() || !got.RemoteKeyReceived() {
		t.Errorf("flags: fallback=%v remoteKey=%v", got.Fallback(), got.RemoteKeyReceived())
	}
	if !got.HasCounters() || !got.HasSubflowsTotal() || !got.HasLastTimes() {
		t.Errorf("Has*: %v %v %v", got.HasCounters(), got.HasSubflowsTotal(), got.HasLastTimes())
	}
	if n := got.TotalSubflows(); n != 4 {
		t.Errorf("TotalSubflows = %d, want 4", n)
	}
}

// TestDecodeInfoKnownBytes pins the layout with a hand-written reply, so
// that encodeInfo and DecodeInfo cannot drift together.
func TestDecodeInfoKnownBytes(t *testing.T) {
	b := make([]byte, InfoSize)
	b[0], b[1], b[2], b[3], b[4], b[5] = 3, 0, 3, 3, 0, 3
	binary.NativeEndian.PutUint32(b[8:], 2)           // flags
	binary.NativeEndian.PutUint32(b[12:], 0x11223344) // token
	binary.NativeEndian.PutUint64(b[16:], 100)        // write_seq
	binary.NativeEndian.PutUint64(b[24:], 90)         // snd_una
	binary.NativeEndian.PutUint64(b[32:], 80)         // rcv_nxt
	b[40], b[41], b[42] = 1, 2, 1
	binary.NativeEndian.PutUint32(b[44:], 5)  // retransmits
	binary.NativeEndian.PutUint64(b[48:], 6)  // bytes_retrans
	binary.NativeEndian.PutUint64(b[56:], 7)  // bytes_sent
	binary.NativeEndian.PutUint64(b[64:], 8)  // bytes_received
	binary.NativeEndian.PutUint64(b[72:], 9)  // bytes_acked
	b[80], b[81], b[82] = 4, 1, 2             // subflows_total, laminar, fullmesh
	binary.NativeEndian.PutUint32(b[84:], 11) // last_data_sent
	binary.NativeEndian.PutUint32(b[88:], 12) // last_data_recv
	binary.NativeEndian.PutUint32(b[92:], 13) // last_ack_recv

	got, err := DecodeInfo(b)
	if err != nil {
		t.Fatal(err)
	}
	want := Info{
		Size: 96, Subflows: 3, AddAddrAccepted: 3, SubflowsMax: 3, AddAddrAcceptedMax: 3,
		Flags: 2, Token: 0x11223344, WriteSeq: 100, SndUna: 90, RcvNxt: 80,
		LocalAddrUsed: 1, LocalAddrMax: 2, CsumEnabled: true,
		Retransmits: 5, BytesRetrans: 6, BytesSent: 7, BytesReceived: 8, BytesAcked: 9,
		SubflowsTotal: 4, EndpLaminarMax: 1, EndpFullmeshMax: 2,
		LastDataSent: 11, LastDataRecv: 12, LastAckRecv: 13,
	}
	if got != want {
		t.Fatalf("got  %+v\nwant %+v", got, want)
	}
}

// TestDecodeInfoOlderKernels truncates the reply to the size each kernel
// revision returns and checks that exactly the covered fields survive.
func TestDecodeInfoOlderKernels(t *testing.T) {
	full := sampleInfo()

	v59 := Info{
		Size:     InfoSizeMin,
		Subflows: full.Subflows, AddAddrSignal: full.AddAddrSignal, AddAddrAccepted: full.AddAddrAccepted,
		SubflowsMax: full.SubflowsMax, AddAddrSignalMax: full.AddAddrSignalMax,
		AddAddrAcceptedMax: full.AddAddrAcceptedMax, Flags: full.Flags, Token: full.Token,
		WriteSeq: full.WriteSeq, SndUna: full.SndUna, RcvNxt: full.RcvNxt,
	}
	v514 := v59
	v514.Size = InfoSizeLocalAddr
	v514.LocalAddrUsed, v514.LocalAddrMax, v514.CsumEnabled = full.LocalAddrUsed, full.LocalAddrMax, full.CsumEnabled
	v65 := v514
	v65.Size = InfoSizeCounters
	v65.Retransmits, v65.BytesRetrans, v65.BytesSent = full.Retransmits, full.BytesRetrans, full.BytesSent
	v65.BytesReceived, v65.BytesAcked = full.BytesReceived, full.BytesAcked
	v68 := v65
	v68.Size = InfoSizeSubflowsTotal
	v68.SubflowsTotal, v68.EndpLaminarMax, v68.EndpFullmeshMax = full.SubflowsTotal, full.EndpLaminarMax, full.EndpFullmeshMax

	cases := []struct {
		name                 string
		want                 Info
		counters, total, lst bool
	}{
		{"5.9", v59, false, false, false},
		{"5.14", v514, false, false, false},
		{"6.5", v65, true, false, false},
		{"6.8", v68, true, true, false},
		{"6.10", full, true, true, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			// Older kernels return their (smaller) struct, whose padding
			// the kernel zeroes; newer fields are simply absent.
			got, err := DecodeInfo(encodeInfo(tc.want)[:tc.want.Size])
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Fatalf("got  %+v\nwant %+v", got, tc.want)
			}
			if got.HasCounters() != tc.counters || got.HasSubflowsTotal() != tc.total || got.HasLastTimes() != tc.lst {
				t.Errorf("Has*: counters=%v total=%v last=%v", got.HasCounters(), got.HasSubflowsTotal(), got.HasLastTimes())
			}
		})
	}
	// Without subflows_total, TotalSubflows falls back to Subflows+1.
	got, _ := DecodeInfo(encodeInfo(v65)[:InfoSizeCounters])
	if n := got.TotalSubflows(); n != int(full.Subflows)+1 {
		t.Errorf("TotalSubflows on 6.5 layout = %d, want %d", n, full.Subflows+1)
	}
}

func TestDecodeInfoPartialField(t *testing.T) {
	// A length that ends in the middle of bytes_sent: that field and
	// everything after it must stay zero.
	raw := encodeInfo(sampleInfo())
	got, err := DecodeInfo(raw[:offBytesSent+3])
	if err != nil {
		t.Fatal(err)
	}
	if got.BytesRetrans != sampleInfo().BytesRetrans {
		t.Errorf("BytesRetrans = %d", got.BytesRetrans)
	}
	if got.BytesSent != 0 || got.BytesReceived != 0 || got.SubflowsTotal != 0 {
		t.Errorf("fields past the end decoded: %+v", got)
	}
	if got.HasCounters() {
		t.Error("HasCounters true for a truncated reply")
	}
}

func TestDecodeInfoShort(t *testing.T) {
	for _, n := range []int{0, 1, 8, InfoSizeMin - 1} {
		_, err := DecodeInfo(make([]byte, n))
		if !errors.Is(err, ErrShortInfo) {
			t.Errorf("len %d: err = %v, want ErrShortInfo", n, err)
		}
	}
	if _, err := DecodeInfo(nil); !errors.Is(err, ErrShortInfo) {
		t.Errorf("nil: err = %v", err)
	}
}

func TestDecodeInfoLonger(t *testing.T) {
	// A future kernel may return a longer struct; the extra bytes are
	// ignored and Size is capped at what was decoded.
	raw := append(encodeInfo(sampleInfo()), 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff)
	got, err := DecodeInfo(raw)
	if err != nil {
		t.Fatal(err)
	}
	if got != sampleInfo() {
		t.Fatalf("got %+v", got)
	}
}

func TestFallbackFlag(t *testing.T) {
	i := sampleInfo()
	i.Flags = InfoFlagFallback
	got, err := DecodeInfo(encodeInfo(i))
	if err != nil {
		t.Fatal(err)
	}
	if !got.Fallback() || got.RemoteKeyReceived() {
		t.Errorf("flags: fallback=%v remoteKey=%v", got.Fallback(), got.RemoteKeyReceived())
	}
}

func FuzzDecodeInfo(f *testing.F) {
	full := encodeInfo(sampleInfo())
	for _, n := range []int{0, InfoSizeMin - 1, InfoSizeMin, InfoSizeLocalAddr, InfoSizeCounters, InfoSizeSubflowsTotal, InfoSize} {
		f.Add(full[:n])
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		info, err := DecodeInfo(b)
		if len(b) < InfoSizeMin {
			if err == nil {
				t.Fatalf("no error for %d bytes", len(b))
			}
			return
		}
		if err != nil {
			t.Fatalf("error for %d bytes: %v", len(b), err)
		}
		if want := min(len(b), InfoSize); info.Size != want {
			t.Fatalf("Size = %d, want %d", info.Size, want)
		}
		// Re-encoding the decoded struct must reproduce every byte that
		// belongs to a field (padding/reserved bytes are not kept).
		re := encodeInfo(info)
		for _, r := range fieldRanges {
			if r[1] > info.Size {
				continue
			}
			for k := r[0]; k < r[1]; k++ {
				got := re[k]
				want := b[k]
				if k == offCsumEnabled {
					want = boolByte(b[k] != 0)
				}
				if got != want {
					t.Fatalf("byte %d: re-encoded %#x, input %#x", k, got, want)
				}
			}
		}
	})
}

func boolByte(v bool) byte {
	if v {
		return 1
	}
	return 0
}

// fieldRanges lists [start,end) byte ranges of every decoded field.
var fieldRanges = [][2]int{
	{0, 6}, {offFlags, offFlags + 4}, {offToken, offToken + 4},
	{offWriteSeq, offRcvNxt + 8},
	{offLocalAddrUsed, offCsumEnabled + 1},
	{offRetransmits, offRetransmits + 4}, {offBytesRetrans, offBytesAcked + 8},
	{offSubflowsTotal, offEndpFullmeshMax + 1},
	{offLastDataSent, offLastAckRecv + 4},
}
