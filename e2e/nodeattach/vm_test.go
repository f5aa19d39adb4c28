package nodeattach

import (
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/e2e/vm"
)

// guestTests are the tests TestNodeAttachInVM runs inside the VM.
var guestTests = []string{"TestAttachTransports", "TestKernelTransportRefused", "TestServerRestartMidWrite",
	"TestPathDownMidRead", "TestWrongVolumeRefused", "TestReadoptAfterKill", "TestMeasureTransports",
	"TestNodeServiceKernelTransports"}

// TestNodeAttachInVM boots the test VM and runs this package's guest tests
// against the kernel's real nbd driver. MPNBD_VM_RUN, a regular
// expression, runs only the guest tests it matches.
func TestNodeAttachInVM(t *testing.T) {
	if os.Getenv("MPNBD_IN_VM") == "1" {
		t.Skip("already inside the VM")
	}
	names := guestTests
	if re := os.Getenv("MPNBD_VM_RUN"); re != "" {
		m, err := regexp.Compile(re)
		if err != nil {
			t.Fatalf("MPNBD_VM_RUN: %v", err)
		}
		names = nil
		for _, n := range guestTests {
			if m.MatchString(n) {
				names = append(names, n)
			}
		}
		if len(names) == 0 {
			t.Fatalf("MPNBD_VM_RUN=%q matches no guest test", re)
		}
	}
	cfg := vm.Default(t)
	cfg.MemoryMB = 2048
	cfg.Timeout = 10 * time.Minute
	res := vm.RunGoTestWith(t, cfg, "./e2e/nodeattach", "^("+strings.Join(names, "|")+")$")
	for _, name := range names {
		if !strings.Contains(res.Output, "--- PASS: "+name) {
			t.Errorf("%s did not pass in the VM", name)
		}
	}
}
