package nodeattach

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/e2e/vm"
)

// TestNodeAttachInVM boots the test VM and runs this package's guest tests
// against the kernel's real nbd driver.
func TestNodeAttachInVM(t *testing.T) {
	if os.Getenv("MPNBD_IN_VM") == "1" {
		t.Skip("already inside the VM")
	}
	cfg := vm.Default(t)
	cfg.MemoryMB = 2048
	cfg.Timeout = 8 * time.Minute
	res := vm.RunGoTestWith(t, cfg, "./e2e/nodeattach", "^Test(AttachTransports|KernelTransportRefused|ServerRestartMidWrite|PathDownMidRead|WrongVolumeRefused|ReadoptAfterKill|MeasureTransports)$")
	for _, name := range []string{"TestAttachTransports", "TestKernelTransportRefused", "TestServerRestartMidWrite",
		"TestPathDownMidRead", "TestWrongVolumeRefused", "TestReadoptAfterKill", "TestMeasureTransports"} {
		if !strings.Contains(res.Output, "--- PASS: "+name) {
			t.Errorf("%s did not pass in the VM", name)
		}
	}
}
