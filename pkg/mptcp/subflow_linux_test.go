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
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// TestTCPInfoOffsets checks the struct tcp_info offsets against x/sys's
// generated struct.
func TestTCPInfoOffsets(t *testing.T) {
	var ti unix.TCPInfo
	for _, c := range []struct {
		name      string
		got, want uintptr
	}{
		{"state", offTCPState, unsafe.Offsetof(ti.State)},
		{"bytes_acked", offTCPBytesAcked, unsafe.Offsetof(ti.Bytes_acked)},
		{"bytes_received", offTCPBytesReceived, unsafe.Offsetof(ti.Bytes_received)},
		{"bytes_sent", offTCPBytesSent, unsafe.Offsetof(ti.Bytes_sent)},
		{"bytes_retrans", offTCPBytesRetrans, unsafe.Offsetof(ti.Bytes_retrans)},
		{"rtt", offTCPRTT, unsafe.Offsetof(ti.Rtt)},
		{"delivery_rate", offTCPDeliveryRate, unsafe.Offsetof(ti.Delivery_rate)},
	} {
		if c.got != c.want {
			t.Errorf("tcpi_%s at %d, x/sys says %d", c.name, c.got, c.want)
		}
	}
	if TCPInfoSize > unix.SizeofTCPInfo {
		t.Errorf("TCPInfoSize %d > sizeof(struct tcp_info) %d", TCPInfoSize, unix.SizeofTCPInfo)
	}
}
