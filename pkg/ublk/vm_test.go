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
