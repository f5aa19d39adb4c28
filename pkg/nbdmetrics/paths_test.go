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

package nbdmetrics

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// TestPathDecisions: each decision is counted; the flag follows slow,
// probe and recovered, and a released path loses its series.
func TestPathDecisions(t *testing.T) {
	p := NewPathDecisions("mpnbd_node")
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(p)
	a, b := netip.MustParseAddr("10.77.3.1"), netip.MustParseAddr("10.77.4.1")
	for _, e := range []mptcp.PathEvent{
		{Addr: a, Kind: mptcp.PathSlow}, {Addr: a, Kind: mptcp.PathProbe}, {Addr: a, Kind: mptcp.PathStillSlow},
		{Addr: b, Kind: mptcp.PathSlow}, {Addr: b, Kind: mptcp.PathProbe}, {Addr: b, Kind: mptcp.PathRecovered},
		{Addr: b, Kind: mptcp.PathGone},
	} {
		p.Observe(e)
	}
	want := `# HELP mpnbd_node_slow_path_flagged 1 while the MPTCP endpoint of a local address is flagged backup for being much slower than the other paths, 0 once probed or recovered.
# TYPE mpnbd_node_slow_path_flagged gauge
mpnbd_node_slow_path_flagged{address="10.77.3.1"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "mpnbd_node_slow_path_flagged"); err != nil {
		t.Error(err)
	}
	if n := testutil.ToFloat64(p.decisions.WithLabelValues("10.77.4.1", "recovered")); n != 1 {
		t.Errorf("recovered decisions of b: %v", n)
	}
	if n, err := testutil.GatherAndCount(reg, "mpnbd_node_slow_path_decisions_total"); err != nil || n != 7 {
		t.Errorf("%d decision series, %v; want 7", n, err)
	}
}
