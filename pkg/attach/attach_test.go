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

package attach

import (
	"encoding/json"
	"net/netip"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/relay"
)

// TestHealthJSON: Health crosses process boundaries as JSON (the FUSE
// control socket, the datapath socket); Paths must round-trip, be left
// out when empty, and a reply without them must still decode.
func TestHealthJSON(t *testing.T) {
	h := Health{Connected: true, MPTCP: true, Subflows: []int{2}, InFlight: 7, InFlightBytes: 28672, Paths: []PathStats{
		{Connection: 0, Local: netip.MustParseAddrPort("10.0.1.1:40000"), Remote: netip.MustParseAddrPort("10.0.1.2:10809"), SentBytes: 1 << 50, ReceivedBytes: 3,
			RetransBytes: 9, RTT: 1500 * time.Microsecond, DeliveryRate: 1 << 27},
		{Connection: 0, Local: netip.MustParseAddrPort("[fd00::1]:1"), Remote: netip.MustParseAddrPort("[fd00::2]:2"), SentBytes: 5},
	}}
	b, err := json.Marshal(h)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"paths":[`, `"local":"10.0.1.1:40000"`, `"remote":"[fd00::2]:2"`, `"sentBytes":1125899906842624`, `"receivedBytes":3`, `"connection":0`, `"retransBytes":9`, `"rtt":1500000`, `"inFlight":7`} {
		if !strings.Contains(string(b), want) {
			t.Errorf("%s lacks %s", b, want)
		}
	}
	var back Health
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, h) {
		t.Errorf("round trip: %+v, want %+v", back, h)
	}

	b, err = json.Marshal(Health{Connected: true})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(b), "paths") {
		t.Errorf("empty paths marshalled: %s", b)
	}
	// What an earlier process sends.
	var old Health
	if err := json.Unmarshal([]byte(`{"Connected":true,"MPTCP":true,"Subflows":[4],"Reconnects":1}`), &old); err != nil {
		t.Fatal(err)
	}
	if !old.Connected || len(old.Subflows) != 1 || old.Paths != nil {
		t.Errorf("old reply decoded as %+v", old)
	}
}

// TestSessionHealth: a session's requests in flight reach its health.
func TestSessionHealth(t *testing.T) {
	h := SessionHealth(relay.Stats{Connected: true, InFlight: 3, InFlightBytes: 12288, Retained: 2})
	if !h.Connected || h.InFlight != 3 || h.InFlightBytes != 12288 || h.Retained != 2 {
		t.Errorf("SessionHealth = %+v", h)
	}
}
