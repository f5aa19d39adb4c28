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
	"net/netip"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/relay"
)

// VolumeLister lists the volumes attached on this node and their
// transports (*attach.Manager).
type VolumeLister interface {
	Volumes() map[string]attach.Transport
}

var _ VolumeLister = (*attach.Manager)(nil)

// NodeCollector exposes the data path of every attached volume as
// Prometheus metrics (mpnbd_node_*), read when the registry is scraped:
// connected, MPTCP subflows per connection against the storage node's
// addresses, the bytes each path carried, reconnects, and the health the node reports
// (NodeGetVolumeHealth), so degraded volumes can be alerted on.
type NodeCollector struct {
	node    *Node
	volumes VolumeLister

	connected, mptcp, subflows, expected, reconnects, degraded, inaccessible *prometheus.Desc
	outage, replayed, resent, retained, replaced, inflight, inflightBytes    *prometheus.Desc
	pathSent, pathReceived, pathRetrans, pathRTT, pathRate                   *prometheus.Desc
	// requestDuration and requests are the session's answers to the
	// node's block layer (relay.Latency).
	requestDuration, requests *prometheus.Desc
	// info joins a volume's series to its storage node, for alerts
	// grouped by cause (a storage node down is one alert).
	info *prometheus.Desc
}

// NewNodeCollector returns a collector over the node service's volumes.
func NewNodeCollector(n *Node, v VolumeLister) *NodeCollector {
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc("mpnbd_node_volume_"+name, help, append([]string{"volume", "transport"}, labels...), nil)
	}
	return &NodeCollector{
		node:          n,
		volumes:       v,
		connected:     d("connected", "1 when the volume's data path is connected to its storage node."),
		mptcp:         d("mptcp", "1 when the volume's data path runs over MPTCP."),
		subflows:      d("subflows", "MPTCP subflows of each of the volume's connections.", "connection"),
		expected:      d("expected_subflows", "Subflows a healthy connection has: the storage node's addresses."),
		reconnects:    d("reconnects_total", "Redials of the volume's connections since it was attached."),
		degraded:      d("degraded", "1 when NodeGetVolumeHealth reports the volume DEGRADED (missing subflows)."),
		inaccessible:  d("inaccessible", "1 when NodeGetVolumeHealth reports the volume INACCESSIBLE."),
		outage:        d("outage_seconds", "How long the volume has been waiting for its storage node (I/O waits meanwhile); 0 while connected."),
		replayed:      d("replayed_requests_total", "Unanswered requests sent again after reconnects (userspace transports)."),
		resent:        d("resent_writes_total", "Acknowledged writes sent again to a storage server that may have lost them (userspace transports)."),
		retained:      d("retained_writes", "Acknowledged writes kept until a completed FLUSH covers them (userspace transports)."),
		inflight:      d("inflight_requests", "Requests the node sent to the volume and the session has not answered yet (userspace transports)."),
		inflightBytes: d("inflight_bytes", "What the requests in flight hold, as counted against the session's bound (userspace transports)."),
		replaced:      d("replaced_connections_total", "Working connections swapped for new ones with more MPTCP subflows, after a path's join failed (userspace transports)."),
		pathSent: d("path_sent_bytes_total", "Bytes sent (retransmissions included) over the MPTCP subflows of a connection between a local and a remote address; "+
			"restarts from zero when the subflows or the connection are replaced.", pathLabels...),
		pathRetrans: d("path_retransmitted_bytes_total", "Bytes sent again over the MPTCP subflows of a connection between a local and a remote address (lost or late on that path); "+
			"restarts from zero when the subflows or the connection are replaced.", pathLabels...),
		pathRTT:  d("path_rtt_seconds", "Smoothed round-trip time of the MPTCP subflows of a connection between a local and a remote address (the longest, when several share the pair).", pathLabels...),
		pathRate: d("path_delivery_rate_bytes", "The kernel's latest estimate of the bytes per second the MPTCP subflows of a connection between a local and a remote address deliver to the storage node.", pathLabels...),
		requestDuration: d("request_duration_seconds", "Time from the session taking a request of the node's block layer to answering it, by command, whatever the answer "+
			"(the storage node's reply, EIO after deadConnTimeout, the session's end); a request replayed after a reconnect counts its outage (userspace transports; "+
			"since the process serving the volume started).", "op"),
		requests: d("requests_total", "Requests of the node's block layer the session answered, by command and result: ok and error (the storage node's replies), "+
			"failed (EIO of the session's own after deadConnTimeout, or its end) (userspace transports; since the process serving the volume started).", "op", "result"),
		info: d("info", "1 for each attached volume, with the storage node serving it, the claim it was made for and its block device (node_exporter's device label; each empty when unknown); join the other series on volume.",
			"storage_node", "namespace", "pvc", "device"),
		pathReceived: d("path_received_bytes_total", "Bytes received over the MPTCP subflows of a connection between a local and a remote address; "+
			"restarts from zero when the subflows or the connection are replaced.", pathLabels...),
	}
}

func (c *NodeCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.connected, c.mptcp, c.subflows, c.expected, c.reconnects, c.degraded, c.inaccessible, c.outage, c.replayed, c.resent, c.retained, c.replaced, c.inflight, c.inflightBytes, c.requestDuration, c.requests, c.pathSent, c.pathReceived, c.pathRetrans, c.pathRTT, c.pathRate, c.info} {
		ch <- d
	}
}

func (c *NodeCollector) Collect(ch chan<- prometheus.Metric) {
	b := func(v bool) float64 {
		if v {
			return 1
		}
		return 0
	}
	for id, tr := range c.volumes.Volumes() {
		t := string(tr)
		_, h, err := c.node.cfg.Attacher.Health(id)
		if err != nil {
			continue // detached meanwhile
		}
		facts, _ := c.node.staged(id)
		ch <- prometheus.MustNewConstMetric(c.info, prometheus.GaugeValue, 1, id, t, facts.storageNode, facts.Namespace, facts.PVC, facts.Device)
		ch <- prometheus.MustNewConstMetric(c.connected, prometheus.GaugeValue, b(h.Connected), id, t)
		ch <- prometheus.MustNewConstMetric(c.mptcp, prometheus.GaugeValue, b(h.MPTCP), id, t)
		for i, n := range h.Subflows {
			ch <- prometheus.MustNewConstMetric(c.subflows, prometheus.GaugeValue, float64(n), id, t, strconv.Itoa(i))
		}
		for _, p := range pathTotals(h.Paths) {
			conn := strconv.Itoa(p.conn)
			ch <- prometheus.MustNewConstMetric(c.pathSent, prometheus.CounterValue, float64(p.sent), id, t, conn, p.local, p.remote)
			ch <- prometheus.MustNewConstMetric(c.pathReceived, prometheus.CounterValue, float64(p.received), id, t, conn, p.local, p.remote)
			ch <- prometheus.MustNewConstMetric(c.pathRetrans, prometheus.CounterValue, float64(p.retrans), id, t, conn, p.local, p.remote)
			if p.rtt > 0 {
				ch <- prometheus.MustNewConstMetric(c.pathRTT, prometheus.GaugeValue, p.rtt.Seconds(), id, t, conn, p.local, p.remote)
				ch <- prometheus.MustNewConstMetric(c.pathRate, prometheus.GaugeValue, float64(p.rate), id, t, conn, p.local, p.remote)
			}
		}
		if want, ok := c.node.expectedSubflows(id); ok {
			ch <- prometheus.MustNewConstMetric(c.expected, prometheus.GaugeValue, float64(want), id, t)
		}
		ch <- prometheus.MustNewConstMetric(c.reconnects, prometheus.CounterValue, float64(h.Reconnects), id, t)
		ch <- prometheus.MustNewConstMetric(c.outage, prometheus.GaugeValue, h.Outage.Seconds(), id, t)
		ch <- prometheus.MustNewConstMetric(c.replayed, prometheus.CounterValue, float64(h.Replayed), id, t)
		ch <- prometheus.MustNewConstMetric(c.resent, prometheus.CounterValue, float64(h.Resent), id, t)
		ch <- prometheus.MustNewConstMetric(c.retained, prometheus.GaugeValue, float64(h.Retained), id, t)
		ch <- prometheus.MustNewConstMetric(c.replaced, prometheus.CounterValue, float64(h.Replaced), id, t)
		ch <- prometheus.MustNewConstMetric(c.inflight, prometheus.GaugeValue, float64(h.InFlight), id, t)
		ch <- prometheus.MustNewConstMetric(c.inflightBytes, prometheus.GaugeValue, float64(h.InFlightBytes), id, t)
		c.collectRequests(ch, id, t, h.Requests)
		var degraded, inaccessible bool
		for _, e := range c.node.health(id).GetHealthStatuses() {
			switch e.GetReason() {
			case HealthMissingSubflows:
				degraded = true
			default:
				inaccessible = true
			}
		}
		ch <- prometheus.MustNewConstMetric(c.degraded, prometheus.GaugeValue, b(degraded), id, t)
		ch <- prometheus.MustNewConstMetric(c.inaccessible, prometheus.GaugeValue, b(inaccessible), id, t)
	}
}

// collectRequests sends the request histogram and counters of volume id.
func (c *NodeCollector) collectRequests(ch chan<- prometheus.Metric, id, t string, reqs []relay.RequestStats) {
	for _, s := range reqs {
		buckets := make(map[float64]uint64, len(relay.LatencyBounds))
		var n uint64
		for i, b := range relay.LatencyBounds {
			if i < len(s.Buckets) {
				n += s.Buckets[i]
			}
			buckets[b] = n
		}
		ch <- prometheus.MustNewConstHistogram(c.requestDuration, s.Count(), s.Sum.Seconds(), buckets, id, t, s.Op)
		for _, r := range []struct {
			result string
			n      uint64
		}{{"ok", s.OK}, {"error", s.Errors}, {"failed", s.Failed}} {
			ch <- prometheus.MustNewConstMetric(c.requests, prometheus.CounterValue, float64(r.n), id, t, s.Op, r.result)
		}
	}
}

// pathLabels are the labels of the bytes-per-path counters, after volume
// and transport: the connection's index and the path's local and remote
// IP addresses (no ports, which change with every subflow).
var pathLabels = []string{"connection", "local", "remote"}

// pathTotal is the bytes of the subflows of one connection between one
// pair of addresses.
type pathTotal struct {
	conn                          int
	local, remote                 string
	sent, received, retrans, rate uint64
	// rtt is the longest of the subflows'.
	rtt time.Duration
}

// pathTotals sums paths by connection and address pair (the longest
// RTT), in the order the pairs first appear.
func pathTotals(paths []attach.PathStats) []pathTotal {
	type key struct {
		conn          int
		local, remote netip.Addr
	}
	var totals []pathTotal
	index := map[key]int{}
	for _, p := range paths {
		k := key{p.Connection, p.Local.Addr(), p.Remote.Addr()}
		i, ok := index[k]
		if !ok {
			i = len(totals)
			index[k] = i
			totals = append(totals, pathTotal{conn: p.Connection, local: addrLabel(k.local), remote: addrLabel(k.remote)})
		}
		totals[i].sent += p.SentBytes
		totals[i].received += p.ReceivedBytes
		totals[i].retrans += p.RetransBytes
		totals[i].rate += p.DeliveryRate
		totals[i].rtt = max(totals[i].rtt, p.RTT)
	}
	return totals
}

// addrLabel is an address as a label value: empty when unknown.
func addrLabel(a netip.Addr) string {
	if !a.IsValid() {
		return ""
	}
	return a.String()
}
