package vm

import (
	"strings"
	"testing"
)

// TestVMSmokeMPTCP boots the kernel of hack/vm-kernel-mptcp.sh, which has
// no modules (nbd, veth, tbf, brd are built in), and runs the same guest
// smoke test as TestVMSmoke: the init script and the guest tools must work
// without a single insmod.
func TestVMSmokeMPTCP(t *testing.T) {
	cfg := DefaultMPTCP(t)
	if len(cfg.Modules) != 0 {
		t.Fatalf("modules %v for a kernel without module support", cfg.Modules)
	}
	res := RunGoTestWith(t, cfg, "./internal/testenv/vm/guest", "^TestGuestNBDDevice$")
	if !strings.Contains(res.Output, "--- PASS: TestGuestNBDDevice") {
		t.Errorf("guest output lacks the PASS line of TestGuestNBDDevice")
	}
}
