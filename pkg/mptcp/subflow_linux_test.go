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
	} {
		if c.got != c.want {
			t.Errorf("tcpi_%s at %d, x/sys says %d", c.name, c.got, c.want)
		}
	}
	if TCPInfoSize > unix.SizeofTCPInfo {
		t.Errorf("TCPInfoSize %d > sizeof(struct tcp_info) %d", TCPInfoSize, unix.SizeofTCPInfo)
	}
}
