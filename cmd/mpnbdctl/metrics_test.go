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

package main

import (
	"encoding/json"
	"strings"
	"testing"
)

// nodeMetricsText is a node plugin's /metrics as `go test ./pkg/driver
// -run TestNodeCollector -v` shows it, with a second volume whose two
// connections come out of order, the Go collector's series, and a
// metric this mpnbdctl does not know.
const nodeMetricsText = `# HELP go_goroutines Number of goroutines that currently exist.
# TYPE go_goroutines gauge
go_goroutines 42
# HELP mpnbd_node_volume_connected 1 when the volume's data path is connected to its storage node.
# TYPE mpnbd_node_volume_connected gauge
mpnbd_node_volume_connected{transport="fuse",volume="pv-1"} 1
mpnbd_node_volume_connected{transport="kernel",volume="pv-2"} 1
# HELP mpnbd_node_volume_degraded 1 when NodeGetVolumeHealth reports the volume DEGRADED (missing subflows).
# TYPE mpnbd_node_volume_degraded gauge
mpnbd_node_volume_degraded{transport="fuse",volume="pv-1"} 1
mpnbd_node_volume_degraded{transport="kernel",volume="pv-2"} 0
# HELP mpnbd_node_volume_expected_subflows Subflows a healthy connection has: the storage node's addresses.
# TYPE mpnbd_node_volume_expected_subflows gauge
mpnbd_node_volume_expected_subflows{transport="fuse",volume="pv-1"} 2
# HELP mpnbd_node_volume_inaccessible 1 when NodeGetVolumeHealth reports the volume INACCESSIBLE.
# TYPE mpnbd_node_volume_inaccessible gauge
mpnbd_node_volume_inaccessible{transport="fuse",volume="pv-1"} 0
mpnbd_node_volume_inaccessible{transport="kernel",volume="pv-2"} 0
# HELP mpnbd_node_volume_mptcp 1 when the volume's data path runs over MPTCP.
# TYPE mpnbd_node_volume_mptcp gauge
mpnbd_node_volume_mptcp{transport="fuse",volume="pv-1"} 1
mpnbd_node_volume_mptcp{transport="kernel",volume="pv-2"} 1
# HELP mpnbd_node_volume_outage_seconds How long the volume has been waiting for its storage node (I/O waits meanwhile); 0 while connected.
# TYPE mpnbd_node_volume_outage_seconds gauge
mpnbd_node_volume_outage_seconds{transport="fuse",volume="pv-1"} 0
mpnbd_node_volume_outage_seconds{transport="kernel",volume="pv-2"} 0
# HELP mpnbd_node_volume_replayed_requests_total Unanswered requests sent again after reconnects (userspace transports).
# TYPE mpnbd_node_volume_replayed_requests_total counter
mpnbd_node_volume_replayed_requests_total{transport="fuse",volume="pv-1"} 7
# HELP mpnbd_node_volume_resent_writes_total Acknowledged writes sent again to a storage server that may have lost them (userspace transports).
# TYPE mpnbd_node_volume_resent_writes_total counter
mpnbd_node_volume_resent_writes_total{transport="fuse",volume="pv-1"} 5
# HELP mpnbd_node_volume_retained_writes Acknowledged writes kept until a completed FLUSH covers them (userspace transports).
# TYPE mpnbd_node_volume_retained_writes gauge
mpnbd_node_volume_retained_writes{transport="fuse",volume="pv-1"} 4
# HELP mpnbd_node_volume_reconnects_total Redials of the volume's connections since it was attached.
# TYPE mpnbd_node_volume_reconnects_total counter
mpnbd_node_volume_reconnects_total{transport="fuse",volume="pv-1"} 3
mpnbd_node_volume_reconnects_total{transport="kernel",volume="pv-2"} 0
# HELP mpnbd_node_volume_subflows MPTCP subflows of each of the volume's connections.
# TYPE mpnbd_node_volume_subflows gauge
mpnbd_node_volume_subflows{connection="0",transport="fuse",volume="pv-1"} 2
mpnbd_node_volume_subflows{connection="1",transport="fuse",volume="pv-1"} 1
mpnbd_node_volume_subflows{connection="1",transport="kernel",volume="pv-2"} 3
mpnbd_node_volume_subflows{connection="0",transport="kernel",volume="pv-2"} 4
# HELP mpnbd_node_volume_path_received_bytes_total Bytes received over the MPTCP subflows of a connection between a local and a remote address; restarts from zero when the subflows or the connection are replaced.
# TYPE mpnbd_node_volume_path_received_bytes_total counter
mpnbd_node_volume_path_received_bytes_total{connection="0",local="10.77.2.1",remote="10.77.2.2",transport="fuse",volume="pv-1"} 4006
mpnbd_node_volume_path_received_bytes_total{connection="0",local="10.77.1.1",remote="10.77.1.2",transport="fuse",volume="pv-1"} 2000
# HELP mpnbd_node_volume_path_sent_bytes_total Bytes sent (retransmissions included) over the MPTCP subflows of a connection between a local and a remote address; restarts from zero when the subflows or the connection are replaced.
# TYPE mpnbd_node_volume_path_sent_bytes_total counter
mpnbd_node_volume_path_sent_bytes_total{connection="0",local="10.77.1.1",remote="10.77.1.2",transport="fuse",volume="pv-1"} 1000
mpnbd_node_volume_path_sent_bytes_total{connection="0",local="10.77.2.1",remote="10.77.2.2",transport="fuse",volume="pv-1"} 3005
mpnbd_node_volume_path_sent_bytes_total{connection="1",local="fd00::1",remote="fd00::2",transport="fuse",volume="pv-1"} 1.099511627776e+12
# HELP mpnbd_node_volume_future_thing Something a newer node plugin exports.
# TYPE mpnbd_node_volume_future_thing gauge
mpnbd_node_volume_future_thing{transport="fuse",volume="pv-1"} 9
`

func TestParseNodeMetrics(t *testing.T) {
	got, err := parseNodeMetrics(strings.NewReader(nodeMetricsText))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]*DataPath{
		"pv-1": {Transport: "fuse", Connected: true, MPTCP: true, Connections: []Connection{
			{Index: 0, Subflows: 2, Paths: []Path{
				{Local: "10.77.1.1", Remote: "10.77.1.2", SentBytes: 1000, ReceivedBytes: 2000},
				{Local: "10.77.2.1", Remote: "10.77.2.2", SentBytes: 3005, ReceivedBytes: 4006},
			}},
			// Sent only: the received counter is not there.
			{Index: 1, Subflows: 1, Paths: []Path{{Local: "fd00::1", Remote: "fd00::2", SentBytes: 1 << 40}}},
		}, ExpectedSubflows: intp(2),
			Reconnects: 3, Degraded: true, ReplayedRequests: 7, ResentWrites: 5, RetainedWrites: 4},
		// No expected_subflows: the node plugin restarted since staging.
		"pv-2": {Transport: "kernel", Connected: true, MPTCP: true, Connections: []Connection{{Index: 0, Subflows: 4, Paths: []Path{}}, {Index: 1, Subflows: 3, Paths: []Path{}}}},
	}
	g, _ := json.Marshal(got)
	w, _ := json.Marshal(want)
	if string(g) != string(w) {
		t.Errorf("parsed\n%s\nwant\n%s", g, w)
	}
	if s := subflowsText(got["pv-2"]); s != "4/?,3/?" {
		t.Errorf("subflows of pv-2: %q", s)
	}

	for name, text := range map[string]string{
		"not metrics":        "<html>hello</html>\n",
		"connection label":   "mpnbd_node_volume_subflows{connection=\"x\",transport=\"fuse\",volume=\"pv-1\"} 2\n",
		"path connection":    "mpnbd_node_volume_path_sent_bytes_total{connection=\"-1\",local=\"a\",remote=\"b\",transport=\"fuse\",volume=\"pv-1\"} 2\n",
		"truncated mid-line": "mpnbd_node_volume_connected{transport=\"fuse\",volume=",
	} {
		if _, err := parseNodeMetrics(strings.NewReader(text)); err == nil {
			t.Errorf("%s: parsed %q without an error", name, text)
		}
	}
}

func TestFormatBytes(t *testing.T) {
	for n, want := range map[int64]string{0: "0", 512: "512", 1024: "1Ki", 1536: "1.5Ki", 10 << 30: "10Gi", 300 << 20: "300Mi", 3 << 40: "3Ti"} {
		if got := formatBytes(n); got != want {
			t.Errorf("formatBytes(%d) = %q, want %q", n, got, want)
		}
	}
}
