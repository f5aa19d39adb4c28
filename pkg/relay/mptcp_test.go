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

package relay

import (
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// The remote dialled with MPTCP on loopback stays MPTCP across a restart.
func TestMPTCPRemote(t *testing.T) {
	if err := mptcp.Available(); err != nil {
		t.Skipf("no MPTCP here: %v", err)
	}
	checkGoroutines(t)
	const size = 16 << 20
	ts := newTestServer(t, size, true)
	rg := newServerRig(t, ts, Options{ReconnectBackoff: 20 * time.Millisecond, MaxBackoff: 100 * time.Millisecond})

	checkMPTCP := func(when string) {
		t.Helper()
		st := rg.relay.Stats()
		if !st.Connected || !mptcp.IsMPTCP(st.Remote) {
			t.Fatalf("%s: remote is not MPTCP (stats %+v)", when, st)
		}
		info, err := mptcp.GetInfo(st.Remote)
		if err != nil {
			t.Fatalf("%s: MPTCP_INFO: %v", when, err)
		}
		t.Logf("%s: MPTCP, %d extra subflows", when, info.Subflows)
	}

	src := randomData(size, 51)
	if _, err := rg.client.WriteAt(src[:size/2], 0); err != nil {
		t.Fatal(err)
	}
	checkMPTCP("first connection")

	ts.kill()
	time.Sleep(100 * time.Millisecond)
	ts.start()
	if _, err := rg.client.WriteAt(src[size/2:], size/2); err != nil {
		t.Fatal(err)
	}
	if rg.relay.Stats().Reconnects != 1 {
		t.Fatalf("stats %+v, want one reconnect", rg.relay.Stats())
	}
	checkMPTCP("after reconnect")

	got := make([]byte, size)
	if _, err := rg.client.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if sum(got) != sum(src) {
		t.Fatal("data read back over MPTCP differs")
	}
}
