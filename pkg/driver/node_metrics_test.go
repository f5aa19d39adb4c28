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

package driver

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/relay"
)

type fakeLister map[string]attach.Transport

func (f fakeLister) Volumes() map[string]attach.Transport { return f }

func TestNodeCollector(t *testing.T) {
	f := newNodeFixture(t)
	req := f.stageReq("pv-1", mountCap(rwo, ""))
	req.PublishContext[PublishContextStorageNode] = "storage-1"
	req.VolumeContext[VolumeContextPVCName] = "data"
	req.VolumeContext[VolumeContextPVCNamespace] = "apps"
	if _, err := f.node.NodeStageVolume(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	c := NewNodeCollector(f.node, fakeLister{"pv-1": attach.FUSE, "pv-gone": attach.Relay})
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)

	f.att.mu.Lock()
	f.att.health["pv-1"] = attach.Health{Connected: true, MPTCP: true, Subflows: []int{2, 1}, Reconnects: 3, Replaced: 2, Replayed: 7, Resent: 5, Retained: 4,
		InFlight: 12, InFlightBytes: 49152,
		Paths: []attach.PathStats{
			{Connection: 0, Local: netip.MustParseAddrPort("10.77.1.1:40000"), Remote: netip.MustParseAddrPort("10.77.1.2:10809"), SentBytes: 1000, ReceivedBytes: 2000,
				RetransBytes: 10, RTT: 1500 * time.Microsecond, DeliveryRate: 100 << 20},
			{Connection: 0, Local: netip.MustParseAddrPort("10.77.2.1:40001"), Remote: netip.MustParseAddrPort("10.77.2.2:10900"), SentBytes: 3000, ReceivedBytes: 4000,
				RetransBytes: 20, RTT: 2 * time.Millisecond, DeliveryRate: 50 << 20},
			// A second subflow between the same addresses: summed (the
			// longest RTT).
			{Connection: 0, Local: netip.MustParseAddrPort("10.77.2.1:40002"), Remote: netip.MustParseAddrPort("10.77.2.2:10900"), SentBytes: 5, ReceivedBytes: 6,
				RetransBytes: 1, RTT: 5 * time.Millisecond, DeliveryRate: 1 << 20},
			{Connection: 1, Local: netip.MustParseAddrPort("[fd00::1]:40003"), Remote: netip.MustParseAddrPort("[fd00::2]:10809"), SentBytes: 1 << 40},
		}}
	f.att.mu.Unlock()
	want := `
# HELP mpnbd_node_volume_connected 1 when the volume's data path is connected to its storage node.
# TYPE mpnbd_node_volume_connected gauge
mpnbd_node_volume_connected{transport="fuse",volume="pv-1"} 1
# HELP mpnbd_node_volume_degraded 1 when NodeGetVolumeHealth reports the volume DEGRADED (missing subflows).
# TYPE mpnbd_node_volume_degraded gauge
mpnbd_node_volume_degraded{transport="fuse",volume="pv-1"} 1
# HELP mpnbd_node_volume_expected_subflows Subflows a healthy connection has: the storage node's addresses.
# TYPE mpnbd_node_volume_expected_subflows gauge
mpnbd_node_volume_expected_subflows{transport="fuse",volume="pv-1"} 2
# HELP mpnbd_node_volume_inaccessible 1 when NodeGetVolumeHealth reports the volume INACCESSIBLE.
# TYPE mpnbd_node_volume_inaccessible gauge
mpnbd_node_volume_inaccessible{transport="fuse",volume="pv-1"} 0
# HELP mpnbd_node_volume_inflight_bytes What the requests in flight hold, as counted against the session's bound (userspace transports).
# TYPE mpnbd_node_volume_inflight_bytes gauge
mpnbd_node_volume_inflight_bytes{transport="fuse",volume="pv-1"} 49152
# HELP mpnbd_node_volume_inflight_requests Requests the node sent to the volume and the session has not answered yet (userspace transports).
# TYPE mpnbd_node_volume_inflight_requests gauge
mpnbd_node_volume_inflight_requests{transport="fuse",volume="pv-1"} 12
# HELP mpnbd_node_volume_info 1 for each attached volume, with the storage node serving it, the claim it was made for and its block device (node_exporter's device label; each empty when unknown); join the other series on volume.
# TYPE mpnbd_node_volume_info gauge
mpnbd_node_volume_info{device="fake0",namespace="apps",pvc="data",storage_node="storage-1",transport="fuse",volume="pv-1"} 1
# HELP mpnbd_node_volume_mptcp 1 when the volume's data path runs over MPTCP.
# TYPE mpnbd_node_volume_mptcp gauge
mpnbd_node_volume_mptcp{transport="fuse",volume="pv-1"} 1
# HELP mpnbd_node_volume_outage_seconds How long the volume has been waiting for its storage node (I/O waits meanwhile); 0 while connected.
# TYPE mpnbd_node_volume_outage_seconds gauge
mpnbd_node_volume_outage_seconds{transport="fuse",volume="pv-1"} 0
# HELP mpnbd_node_volume_path_delivery_rate_bytes The kernel's latest estimate of the bytes per second the MPTCP subflows of a connection between a local and a remote address deliver to the storage node.
# TYPE mpnbd_node_volume_path_delivery_rate_bytes gauge
mpnbd_node_volume_path_delivery_rate_bytes{connection="0",local="10.77.1.1",remote="10.77.1.2",transport="fuse",volume="pv-1"} 1.048576e+08
mpnbd_node_volume_path_delivery_rate_bytes{connection="0",local="10.77.2.1",remote="10.77.2.2",transport="fuse",volume="pv-1"} 5.3477376e+07
# HELP mpnbd_node_volume_path_received_bytes_total Bytes received over the MPTCP subflows of a connection between a local and a remote address; restarts from zero when the subflows or the connection are replaced.
# TYPE mpnbd_node_volume_path_received_bytes_total counter
mpnbd_node_volume_path_received_bytes_total{connection="0",local="10.77.1.1",remote="10.77.1.2",transport="fuse",volume="pv-1"} 2000
mpnbd_node_volume_path_received_bytes_total{connection="0",local="10.77.2.1",remote="10.77.2.2",transport="fuse",volume="pv-1"} 4006
mpnbd_node_volume_path_received_bytes_total{connection="1",local="fd00::1",remote="fd00::2",transport="fuse",volume="pv-1"} 0
# HELP mpnbd_node_volume_path_retransmitted_bytes_total Bytes sent again over the MPTCP subflows of a connection between a local and a remote address (lost or late on that path); restarts from zero when the subflows or the connection are replaced.
# TYPE mpnbd_node_volume_path_retransmitted_bytes_total counter
mpnbd_node_volume_path_retransmitted_bytes_total{connection="0",local="10.77.1.1",remote="10.77.1.2",transport="fuse",volume="pv-1"} 10
mpnbd_node_volume_path_retransmitted_bytes_total{connection="0",local="10.77.2.1",remote="10.77.2.2",transport="fuse",volume="pv-1"} 21
mpnbd_node_volume_path_retransmitted_bytes_total{connection="1",local="fd00::1",remote="fd00::2",transport="fuse",volume="pv-1"} 0
# HELP mpnbd_node_volume_path_rtt_seconds Smoothed round-trip time of the MPTCP subflows of a connection between a local and a remote address (the longest, when several share the pair).
# TYPE mpnbd_node_volume_path_rtt_seconds gauge
mpnbd_node_volume_path_rtt_seconds{connection="0",local="10.77.1.1",remote="10.77.1.2",transport="fuse",volume="pv-1"} 0.0015
mpnbd_node_volume_path_rtt_seconds{connection="0",local="10.77.2.1",remote="10.77.2.2",transport="fuse",volume="pv-1"} 0.005
# HELP mpnbd_node_volume_path_sent_bytes_total Bytes sent (retransmissions included) over the MPTCP subflows of a connection between a local and a remote address; restarts from zero when the subflows or the connection are replaced.
# TYPE mpnbd_node_volume_path_sent_bytes_total counter
mpnbd_node_volume_path_sent_bytes_total{connection="0",local="10.77.1.1",remote="10.77.1.2",transport="fuse",volume="pv-1"} 1000
mpnbd_node_volume_path_sent_bytes_total{connection="0",local="10.77.2.1",remote="10.77.2.2",transport="fuse",volume="pv-1"} 3005
mpnbd_node_volume_path_sent_bytes_total{connection="1",local="fd00::1",remote="fd00::2",transport="fuse",volume="pv-1"} 1.099511627776e+12
# HELP mpnbd_node_volume_replaced_connections_total Working connections swapped for new ones with more MPTCP subflows, after a path's join failed (userspace transports).
# TYPE mpnbd_node_volume_replaced_connections_total counter
mpnbd_node_volume_replaced_connections_total{transport="fuse",volume="pv-1"} 2
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
# HELP mpnbd_node_volume_subflows MPTCP subflows of each of the volume's connections.
# TYPE mpnbd_node_volume_subflows gauge
mpnbd_node_volume_subflows{connection="0",transport="fuse",volume="pv-1"} 2
mpnbd_node_volume_subflows{connection="1",transport="fuse",volume="pv-1"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want)); err != nil {
		t.Fatal(err)
	}

	// Disconnected: inaccessible, not degraded.
	f.att.mu.Lock()
	f.att.health["pv-1"] = attach.Health{Connected: false, Outage: 90 * time.Second}
	f.att.mu.Unlock()
	if err := testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP mpnbd_node_volume_outage_seconds How long the volume has been waiting for its storage node (I/O waits meanwhile); 0 while connected.
# TYPE mpnbd_node_volume_outage_seconds gauge
mpnbd_node_volume_outage_seconds{transport="fuse",volume="pv-1"} 90
# HELP mpnbd_node_volume_inaccessible 1 when NodeGetVolumeHealth reports the volume INACCESSIBLE.
# TYPE mpnbd_node_volume_inaccessible gauge
mpnbd_node_volume_inaccessible{transport="fuse",volume="pv-1"} 1
# HELP mpnbd_node_volume_degraded 1 when NodeGetVolumeHealth reports the volume DEGRADED (missing subflows).
# TYPE mpnbd_node_volume_degraded gauge
mpnbd_node_volume_degraded{transport="fuse",volume="pv-1"} 0
`), "mpnbd_node_volume_inaccessible", "mpnbd_node_volume_degraded", "mpnbd_node_volume_outage_seconds"); err != nil {
		t.Fatal(err)
	}
}

// TestNewVolumeInfo: the claim and device names go into labels as they
// are, and anything that is no plain name is left out.
// TestNodeCollectorRequests: the session's request counts are exported as
// a histogram by volume, transport and op (cumulative buckets up to
// +Inf) and a counter by op and result.
func TestNodeCollectorRequests(t *testing.T) {
	f := newNodeFixture(t)
	if _, err := f.node.NodeStageVolume(context.Background(), f.stageReq("pv-1", mountCap(rwo, ""))); err != nil {
		t.Fatal(err)
	}
	c := NewNodeCollector(f.node, fakeLister{"pv-1": attach.Ublk})
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)
	buckets := make([]uint64, len(relay.LatencyBounds)+1)
	buckets[0], buckets[3], buckets[len(relay.LatencyBounds)] = 2, 1, 1 // ≤100µs, ≤800µs, beyond the last bound
	f.att.mu.Lock()
	f.att.health["pv-1"] = attach.Health{Connected: true, Requests: []relay.RequestStats{
		{Op: "read", Buckets: buckets, Sum: 200 * time.Second, OK: 3, Failed: 1},
		{Op: "flush", Buckets: []uint64{1}, Sum: 50 * time.Microsecond, Errors: 1},
	}}
	f.att.mu.Unlock()
	var want strings.Builder
	want.WriteString(`# HELP mpnbd_node_volume_request_duration_seconds Time from the session taking a request of the node's block layer to answering it, by command, whatever the answer (the storage node's reply, EIO after deadConnTimeout, the session's end); a request replayed after a reconnect counts its outage (userspace transports; since the process serving the volume started).
# TYPE mpnbd_node_volume_request_duration_seconds histogram
`)
	for _, h := range []struct {
		op     string
		counts []uint64
		sum    string
	}{{"flush", []uint64{1}, "5e-05"}, {"read", buckets, "200"}} {
		var n uint64
		for i, b := range relay.LatencyBounds {
			if i < len(h.counts) {
				n += h.counts[i]
			}
			fmt.Fprintf(&want, "mpnbd_node_volume_request_duration_seconds_bucket{op=%q,transport=\"ublk\",volume=\"pv-1\",le=\"%g\"} %d\n", h.op, b, n)
		}
		var total uint64
		for _, b := range h.counts {
			total += b
		}
		fmt.Fprintf(&want, "mpnbd_node_volume_request_duration_seconds_bucket{op=%q,transport=\"ublk\",volume=\"pv-1\",le=\"+Inf\"} %d\n", h.op, total)
		fmt.Fprintf(&want, "mpnbd_node_volume_request_duration_seconds_sum{op=%q,transport=\"ublk\",volume=\"pv-1\"} %s\n", h.op, h.sum)
		fmt.Fprintf(&want, "mpnbd_node_volume_request_duration_seconds_count{op=%q,transport=\"ublk\",volume=\"pv-1\"} %d\n", h.op, total)
	}
	want.WriteString(`# HELP mpnbd_node_volume_requests_total Requests of the node's block layer the session answered, by command and result: ok and error (the storage node's replies), failed (EIO of the session's own after deadConnTimeout, or its end) (userspace transports; since the process serving the volume started).
# TYPE mpnbd_node_volume_requests_total counter
mpnbd_node_volume_requests_total{op="flush",result="error",transport="ublk",volume="pv-1"} 1
mpnbd_node_volume_requests_total{op="flush",result="failed",transport="ublk",volume="pv-1"} 0
mpnbd_node_volume_requests_total{op="flush",result="ok",transport="ublk",volume="pv-1"} 0
mpnbd_node_volume_requests_total{op="read",result="error",transport="ublk",volume="pv-1"} 0
mpnbd_node_volume_requests_total{op="read",result="failed",transport="ublk",volume="pv-1"} 1
mpnbd_node_volume_requests_total{op="read",result="ok",transport="ublk",volume="pv-1"} 3
`)
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want.String()),
		"mpnbd_node_volume_request_duration_seconds", "mpnbd_node_volume_requests_total"); err != nil {
		t.Fatal(err)
	}
}

func TestNewVolumeInfo(t *testing.T) {
	for _, tc := range []struct {
		ctx    map[string]string
		device string
		want   volumeInfo
	}{
		{map[string]string{VolumeContextPVCName: "data", VolumeContextPVCNamespace: "apps"}, "/dev/loop3", volumeInfo{PVC: "data", Namespace: "apps", Device: "loop3"}},
		{nil, "", volumeInfo{}},
		{map[string]string{VolumeContextPVCName: "a b", VolumeContextPVCNamespace: `x"y`}, "/dev/nbd0", volumeInfo{Device: "nbd0"}},
		{map[string]string{VolumeContextPVCName: strings.Repeat("a", 254)}, "/dev/ublkb1", volumeInfo{Device: "ublkb1"}},
	} {
		if got := newVolumeInfo(tc.ctx, tc.device); got != tc.want {
			t.Errorf("newVolumeInfo(%v, %q) = %+v, want %+v", tc.ctx, tc.device, got, tc.want)
		}
	}
}
