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

package nbd

import (
	"bytes"
	"errors"
	"reflect"
	"testing"
)

func TestRequestRoundTrip(t *testing.T) {
	for _, r := range []Request{
		{},
		{Flags: CmdFlagFUA, Type: CmdWrite, Handle: 0xdeadbeefcafef00d, Offset: 1 << 40, Length: MaxRequestSize},
		{Type: CmdTrim, Handle: 1, Offset: 4096, Length: 1},
	} {
		var b [requestHeaderSize]byte
		r.Encode(b[:])
		got, err := DecodeRequest(b[:])
		if err != nil || got != r {
			t.Errorf("round trip %+v: got %+v, %v", r, got, err)
		}
	}
}

func TestDecodeRequestErrors(t *testing.T) {
	var b [requestHeaderSize]byte
	(&Request{Type: CmdRead}).Encode(b[:])
	if _, err := DecodeRequest(b[:27]); !errors.Is(err, ErrProtocol) {
		t.Errorf("short header: %v", err)
	}
	b[0] ^= 0xff
	if _, err := DecodeRequest(b[:]); !errors.Is(err, ErrBadMagic) {
		t.Errorf("bad magic: %v", err)
	}
}

func TestReplyRoundTrip(t *testing.T) {
	r := Reply{Errno: EIO, Handle: 42}
	var b [replyHeaderSize]byte
	r.Encode(b[:])
	got, err := DecodeReply(b[:])
	if err != nil || got != r {
		t.Fatalf("got %+v, %v", got, err)
	}
	b[3]++
	if _, err := DecodeReply(b[:]); !errors.Is(err, ErrBadMagic) {
		t.Errorf("bad magic: %v", err)
	}
}

func TestOptionRoundTrip(t *testing.T) {
	o := option{Code: OptGo, Data: []byte("payload")}
	got, err := readOption(bytes.NewReader(o.encode()))
	if err != nil || !reflect.DeepEqual(got, o) {
		t.Fatalf("got %+v, %v", got, err)
	}
	big := option{Code: OptGo}
	enc := big.encode()
	be.PutUint32(enc[12:], maxOptionLen+1)
	if _, err := readOption(bytes.NewReader(enc)); !errors.Is(err, ErrTooBig) {
		t.Errorf("oversized option: %v", err)
	}
}

func TestOptReplyRoundTrip(t *testing.T) {
	r := optReply{Option: OptList, Type: RepServer, Data: encodeServerReply("disk")}
	got, err := readOptReply(bytes.NewReader(r.encode()))
	if err != nil || !reflect.DeepEqual(got, r) {
		t.Fatalf("got %+v, %v", got, err)
	}
	name, err := decodeServerReply(got.Data)
	if err != nil || name != "disk" {
		t.Fatalf("server reply: %q, %v", name, err)
	}
}

func TestInfoRequestRoundTrip(t *testing.T) {
	for _, q := range []InfoRequest{
		{Name: ""},
		{Name: "vol-1", Infos: []uint16{InfoBlockSize, InfoName}},
	} {
		got, err := decodeInfoRequest(q.encode())
		if err != nil || got.Name != q.Name || len(got.Infos) != len(q.Infos) {
			t.Errorf("round trip %+v: got %+v, %v", q, got, err)
		}
		for i := range q.Infos {
			if got.Infos[i] != q.Infos[i] {
				t.Errorf("info %d: %d != %d", i, got.Infos[i], q.Infos[i])
			}
		}
	}
	bad := [][]byte{
		nil,
		{0, 0, 0, 5, 'a'},                 // name longer than the payload
		{0, 0, 0, 0, 0, 2, 0, 3},          // two infos announced, one present
		{0, 0, 0x10, 0x01, 0, 0, 0, 0, 0}, // name over 4096 bytes
	}
	for _, b := range bad {
		if _, err := decodeInfoRequest(b); !errors.Is(err, ErrProtocol) {
			t.Errorf("decodeInfoRequest(%x) = %v, want ErrProtocol", b, err)
		}
	}
}

func TestApplyInfo(t *testing.T) {
	var e ExportInfo
	for _, b := range [][]byte{
		encodeInfoExport(1<<30, FlagHasFlags|FlagSendFlush),
		encodeInfoBlockSize(1, 4096, MaxRequestSize),
		encodeInfoString(InfoName, "n"),
		encodeInfoString(InfoDescription, "d"),
		{0, 99, 1, 2, 3}, // unknown info types are kept aside
	} {
		if err := e.applyInfo(b); err != nil {
			t.Fatal(err)
		}
	}
	want := ExportInfo{Name: "n", Description: "d", Size: 1 << 30, Flags: FlagHasFlags | FlagSendFlush, MinBlock: 1, PrefBlock: 4096, MaxBlock: MaxRequestSize,
		Infos: map[uint16][]byte{99: {1, 2, 3}}}
	if !reflect.DeepEqual(e, want) {
		t.Fatalf("got %+v want %+v", e, want)
	}
	for _, b := range [][]byte{{0}, {0, 0, 1}, {0, 3, 1, 2}} {
		if err := e.applyInfo(b); !errors.Is(err, ErrProtocol) {
			t.Errorf("applyInfo(%x) = %v", b, err)
		}
	}
}

func TestBufPool(t *testing.T) {
	for _, n := range []int{1, 4095, 4096, 4097, 1 << 20, MaxRequestSize} {
		b := getBuf(n)
		if len(b) != n || cap(b) < n {
			t.Fatalf("getBuf(%d): len %d cap %d", n, len(b), cap(b))
		}
		putBuf(b)
	}
}
