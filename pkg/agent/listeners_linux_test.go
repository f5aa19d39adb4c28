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

package agent

import (
	"net/netip"
	"testing"

	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// TestListenersBindAbsentAddress: a storage address not on the host yet
// (its NIC comes up later) binds all the same, over MPTCP too.
func TestListenersBindAbsentAddress(t *testing.T) {
	for _, useMPTCP := range []bool{false, true} {
		if useMPTCP && mptcp.Available() != nil {
			t.Logf("MPTCP unavailable (%v): plain TCP only", mptcp.Available())
			continue
		}
		ls := NewListeners(&nbd.Server{Logger: testLogger(t)}, 0, useMPTCP, testLogger(t))
		// 192.0.2.0/24 is TEST-NET-1: on no host.
		if err := ls.Bind([]netip.Addr{netip.MustParseAddr("192.0.2.77")}); err != nil {
			t.Errorf("MPTCP %v: %v", useMPTCP, err)
		}
		ls.Close()
	}
}
