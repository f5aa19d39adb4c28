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

package capability

import "testing"

func TestIn(t *testing.T) {
	// This machine's: every capability but CAP_SYS_RESOURCE (bit 24).
	const status = "Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t000001fffeffffff\nCapBnd:\t000001ffffffffff\n"
	if in(status, Effective, SysResource) {
		t.Error("CAP_SYS_RESOURCE found in an effective set without bit 24")
	}
	if !in(status, Effective, 21) || !in(status, Bounding, SysResource) {
		t.Error("a capability of the set not found")
	}
	if !in("Name:\tx\n", Effective, SysResource) || !in("CapEff:\tzz\n", Effective, SysResource) {
		t.Error("an unreadable set must answer true")
	}
}
