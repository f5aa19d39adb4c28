package ublk

import (
	"os"
	"strings"
	"testing"

	"github.com/mpnbd/mpnbd/internal/testenv/vm"
)

// guestTests run in the VM.
var guestTests = []string{"TestDeviceIO", "TestKeeperBuffers", "TestStarterRequests", "TestRecoverAfterKill"}

// TestUblkInVM boots Debian's stock 6.12 kernel (which has ublk_drv) and
// runs this package's ublk tests inside it.
func TestUblkInVM(t *testing.T) {
	if os.Getenv("MPNBD_IN_VM") == "1" {
		t.Skip("already inside the VM")
	}
	cfg := vm.DefaultUblk(t)
	cfg.MemoryMB = 1024
	res := vm.RunGoTestWith(t, cfg, "./pkg/ublk", "^("+strings.Join(guestTests, "|")+")$")
	for _, name := range guestTests {
		if !strings.Contains(res.Output, "--- PASS: "+name) {
			t.Errorf("%s did not pass in the VM", name)
		}
	}
}
