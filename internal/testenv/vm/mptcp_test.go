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
