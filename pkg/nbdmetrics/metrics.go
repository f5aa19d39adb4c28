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

// Package nbdmetrics exposes the events of an nbd.Server as Prometheus
// metrics. Observer implements nbd.Observer, and the storage agent's
// observer of exports and capacity (agent.ExportObserver); every metric it
// registers is named mpnbd_server_*.
//
// Label cardinality stays bounded: per-export series are keyed by export
// name (and the small fixed sets of commands and error values), and
// per-connection series exist only while the connection is open. Their
// values (MPTCP or not, MPTCP subflows) are read from the socket when the
// registry is scraped, never polled.
package nbdmetrics

import (
	"errors"
	"net"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
	"github.com/mpnbd/mpnbd/pkg/replica"
)

// Namespace prefixes every metric name: mpnbd_server_...
const (
	Namespace = "mpnbd"
	Subsystem = "server"
)

// LatencyBuckets are the request latency histogram buckets, in seconds,
// from 50 µs to 10 s.
var LatencyBuckets = []float64{
	50e-6, 100e-6, 250e-6, 500e-6,
	1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3,
	1, 2.5, 5, 10,
}

// Observer records nbd.Server events into Prometheus metrics. Its methods
// are safe for concurrent use and never block on I/O.
type Observer struct {
	readBytes     *prometheus.CounterVec
	writtenBytes  *prometheus.CounterVec
	requests      *prometheus.CounterVec
	requestErrors *prometheus.CounterVec
	duration      *prometheus.HistogramVec
	connsOpen     *prometheus.GaugeVec
	connsAccepted *prometheus.CounterVec
	// refused counts connections closed by the server's limits, by
	// reason (nbd.RefusalReasons): never by export, whose names may
	// carry secrets.
	refused    *prometheus.CounterVec
	strayJoins *prometheus.CounterVec
	clients    prometheus.Gauge
	handshakes prometheus.Gauge
	// capacity and available have no labels; their one series appears
	// with the storage agent's first report (a standalone server has
	// none).
	capacity  *prometheus.GaugeVec
	available *prometheus.GaugeVec
	// The replicas of the replicated volumes this node is the primary
	// of, by export and replica (its storage node).
	replicaInSync  *prometheus.GaugeVec
	replicaLacking *prometheus.GaugeVec
	replicaCopied  *prometheus.GaugeVec

	live *connCollector
}

var (
	_ nbd.Observer      = (*Observer)(nil)
	_ nbd.LimitObserver = (*Observer)(nil)
)

// New creates an Observer and registers its metrics on reg.
func New(reg prometheus.Registerer) (*Observer, error) {
	opts := func(name, help string) prometheus.Opts {
		return prometheus.Opts{Namespace: Namespace, Subsystem: Subsystem, Name: name, Help: help}
	}
	counter := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts(opts(name, help)), labels)
	}
	o := &Observer{
		readBytes: counter("read_bytes_total",
			"Bytes read from the export and sent to clients (successful NBD_CMD_READ payloads).", "export"),
		writtenBytes: counter("written_bytes_total",
			"Bytes received from clients and written to the export (successful NBD_CMD_WRITE payloads).", "export"),
		requests: counter("requests_total",
			"Requests handled, by export and command, whether they succeeded or not.", "export", "cmd"),
		requestErrors: counter("request_errors_total",
			"Requests answered with an error, by export, command and NBD error value.", "export", "cmd", "errno"),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: Namespace, Subsystem: Subsystem,
			Name:    "request_duration_seconds",
			Help:    "Time from a request being read to its reply being written, by export and command.",
			Buckets: LatencyBuckets,
		}, []string{"export", "cmd"}),
		connsOpen: prometheus.NewGaugeVec(prometheus.GaugeOpts(opts("connections",
			"Connections currently in the transmission phase, by export.")), []string{"export"}),
		connsAccepted: counter("connections_accepted_total",
			"Connections that completed negotiation and attached to the export.", "export"),
		refused: counter("refused_connections_total",
			"Connections closed by the server's limits, by reason: total, per_source (open connections), handshakes_total, handshakes_per_source (connections still negotiating), handshakes_unknown_sources (negotiating connections from sources other than the published nodes, over the slots not reserved for those), handshake_timeout (negotiation not finished in time), per_export (connections to the chosen export).", "reason"),
		strayJoins: counter("stray_subflow_connections_total",
			"Connections the storage agent closed because a subflow joined them from outside their node's published storage addresses, by export.", "export"),
		clients: prometheus.NewGauge(prometheus.GaugeOpts(opts("client_connections",
			"Open client connections, negotiating or in the transmission phase (what the total and per-source connection limits bound)."))),
		handshakes: prometheus.NewGauge(prometheus.GaugeOpts(opts("handshakes",
			"Open client connections that have not finished negotiation yet (what the handshake limits bound)."))),
		capacity: prometheus.NewGaugeVec(prometheus.GaugeOpts(opts("capacity_bytes",
			"Size of the filesystem holding the volumes' backing files, as the storage agent last measured it (NBDStorageNode status.capacityBytes).")), nil),
		available: prometheus.NewGaugeVec(prometheus.GaugeOpts(opts("available_bytes",
			"Bytes new volumes may take if every volume filled up: the filesystem's free space less what the sparse backing files may still allocate (NBDStorageNode status.availableBytes).")), nil),
		replicaInSync: prometheus.NewGaugeVec(prometheus.GaugeOpts(opts("replica_in_sync",
			"1 while the replica on another storage node of a replicated volume this node is the primary of is in the in-sync set (has every acknowledged change), else 0, by export and replica.")), []string{"export", "replica"}),
		replicaLacking: prometheus.NewGaugeVec(prometheus.GaugeOpts(opts("replica_lacking_bytes",
			"What a replica out of the in-sync set lacks: the bytes of the regions changed since it left, which its rebuild copies, by export and replica.")), []string{"export", "replica"}),
		replicaCopied: prometheus.NewGaugeVec(prometheus.GaugeOpts(opts("replica_rebuild_copied_bytes",
			"Bytes the rebuild under way of a replica has copied (0 when none runs), by export and replica.")), []string{"export", "replica"}),
		live: newConnCollector(),
	}
	for _, c := range []prometheus.Collector{
		o.readBytes, o.writtenBytes, o.requests, o.requestErrors, o.duration,
		o.connsOpen, o.connsAccepted, o.refused, o.strayJoins, o.clients, o.handshakes,
		o.capacity, o.available, o.replicaInSync, o.replicaLacking, o.replicaCopied, o.live,
	} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	for _, r := range nbd.RefusalReasons {
		o.refused.WithLabelValues(r)
	}
	return o, nil
}

// ExportAdded creates the per-export series with zero values, so that a
// new export shows up before its first connection or request.
func (o *Observer) ExportAdded(export string) {
	o.readBytes.WithLabelValues(export)
	o.writtenBytes.WithLabelValues(export)
	o.connsOpen.WithLabelValues(export)
	o.connsAccepted.WithLabelValues(export)
}

// ExportRemoved deletes every series of an export that is no longer
// served. Call it after the export's connections are drained.
func (o *Observer) ExportRemoved(export string) {
	l := prometheus.Labels{"export": export}
	o.readBytes.DeletePartialMatch(l)
	o.writtenBytes.DeletePartialMatch(l)
	o.requests.DeletePartialMatch(l)
	o.requestErrors.DeletePartialMatch(l)
	o.duration.DeletePartialMatch(l)
	o.connsOpen.DeletePartialMatch(l)
	o.connsAccepted.DeletePartialMatch(l)
	o.strayJoins.DeletePartialMatch(l)
	o.replicaInSync.DeletePartialMatch(l)
	o.replicaLacking.DeletePartialMatch(l)
	o.replicaCopied.DeletePartialMatch(l)
}

// Replicas records where the replicas of export, a replicated volume
// this node is the primary of, stand.
func (o *Observer) Replicas(export string, states []replica.ReplicaState) {
	for _, st := range states {
		in := 0.0
		if st.State == "InSync" {
			in = 1
		}
		o.replicaInSync.WithLabelValues(export, st.Name).Set(in)
		o.replicaLacking.WithLabelValues(export, st.Name).Set(float64(st.Lacking))
		o.replicaCopied.WithLabelValues(export, st.Name).Set(float64(st.Copied))
	}
}

// StrayJoin counts a connection of export closed for a subflow from
// outside its node's published addresses.
func (o *Observer) StrayJoin(export string) {
	o.strayJoins.WithLabelValues(export).Inc()
}

// Capacity records the storage node's room as the storage agent measured
// it, the numbers it reports in its NBDStorageNode, so that a node filling
// up can be alerted on without reading the API.
func (o *Observer) Capacity(capacityBytes, availableBytes int64) {
	o.capacity.WithLabelValues().Set(float64(capacityBytes))
	o.available.WithLabelValues().Set(float64(availableBytes))
}

// ConnOpened implements nbd.Observer.
func (o *Observer) ConnOpened(c nbd.ConnInfo, export string) {
	o.connsAccepted.WithLabelValues(export).Inc()
	o.connsOpen.WithLabelValues(export).Inc()
	o.live.add(c, export)
}

// ConnClosed implements nbd.Observer.
func (o *Observer) ConnClosed(c nbd.ConnInfo, export string) {
	o.live.remove(c)
	o.connsOpen.WithLabelValues(export).Dec()
}

// ConnRefused implements nbd.LimitObserver.
func (o *Observer) ConnRefused(_ nbd.ConnInfo, reason string) {
	o.refused.WithLabelValues(reason).Inc()
}

// ConnCounts implements nbd.LimitObserver.
func (o *Observer) ConnCounts(conns, handshakes int) {
	o.clients.Set(float64(conns))
	o.handshakes.Set(float64(handshakes))
}

// Request implements nbd.Observer.
func (o *Observer) Request(export string, cmd uint16, bytes int, d time.Duration, errno uint32) {
	name := nbd.CmdName(cmd)
	o.requests.WithLabelValues(export, name).Inc()
	o.duration.WithLabelValues(export, name).Observe(d.Seconds())
	if errno != 0 {
		o.requestErrors.WithLabelValues(export, name, nbd.ErrnoName(errno)).Inc()
		return
	}
	if bytes > 0 {
		switch cmd {
		case nbd.CmdRead:
			o.readBytes.WithLabelValues(export).Add(float64(bytes))
		case nbd.CmdWrite:
			o.writtenBytes.WithLabelValues(export).Add(float64(bytes))
		}
	}
}

// liveConn is one connection in the transmission phase.
type liveConn struct {
	conn   net.Conn
	export string
	remote string
	mptcp  bool // carried by MPTCP when it was opened
}

// connCollector reports per-connection series for the connections that
// are open at scrape time.
type connCollector struct {
	mptcpDesc    *prometheus.Desc
	subflowsDesc *prometheus.Desc
	// getInfo reads MPTCP_INFO; tests replace it.
	getInfo func(net.Conn) (mptcp.Info, error)

	mu    sync.Mutex
	conns map[net.Conn]*liveConn
}

func newConnCollector() *connCollector {
	labels := []string{"export", "remote"}
	return &connCollector{
		mptcpDesc: prometheus.NewDesc(
			prometheus.BuildFQName(Namespace, Subsystem, "connection_mptcp"),
			"1 if the open connection is carried by Multipath TCP, 0 for plain TCP (or a fallback to it).",
			labels, nil),
		subflowsDesc: prometheus.NewDesc(
			prometheus.BuildFQName(Namespace, Subsystem, "connection_mptcp_subflows"),
			"Additional MPTCP subflows (joined with MP_JOIN, not counting the initial one) of the open connection, from MPTCP_INFO.",
			labels, nil),
		getInfo: mptcp.GetInfo,
		conns:   make(map[net.Conn]*liveConn),
	}
}

func (cc *connCollector) add(c nbd.ConnInfo, export string) {
	if c.Conn == nil {
		return
	}
	remote := ""
	if c.RemoteAddr != nil {
		remote = c.RemoteAddr.String()
	}
	lc := &liveConn{conn: c.Conn, export: export, remote: remote, mptcp: mptcp.IsMPTCP(c.Conn)}
	cc.mu.Lock()
	cc.conns[c.Conn] = lc
	cc.mu.Unlock()
}

func (cc *connCollector) remove(c nbd.ConnInfo) {
	cc.mu.Lock()
	delete(cc.conns, c.Conn)
	cc.mu.Unlock()
}

// Describe implements prometheus.Collector.
func (cc *connCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- cc.mptcpDesc
	ch <- cc.subflowsDesc
}

// Collect implements prometheus.Collector. The socket options are read
// outside the lock so that scrapes never hold up ConnOpened/ConnClosed.
func (cc *connCollector) Collect(ch chan<- prometheus.Metric) {
	cc.mu.Lock()
	conns := make([]*liveConn, 0, len(cc.conns))
	for _, lc := range cc.conns {
		conns = append(conns, lc)
	}
	cc.mu.Unlock()

	type key struct{ export, remote string }
	seen := make(map[key]bool, len(conns))
	for _, lc := range conns {
		// Two live connections with the same export and remote address can
		// only come through different local addresses; one series is
		// reported for them, as duplicates would fail the whole scrape.
		k := key{lc.export, lc.remote}
		if seen[k] {
			continue
		}
		seen[k] = true

		isMPTCP := lc.mptcp
		subflows := -1
		if isMPTCP {
			info, err := cc.getInfo(lc.conn)
			switch {
			case err == nil:
				subflows = int(info.Subflows)
			case errors.Is(err, mptcp.ErrNotMPTCP):
				// Fell back to plain TCP after it was opened.
				isMPTCP = false
			default:
				// Closing under us, or no MPTCP_INFO on this platform:
				// keep what was seen at open time, without subflows.
			}
		}
		v := 0.0
		if isMPTCP {
			v = 1
		}
		ch <- prometheus.MustNewConstMetric(cc.mptcpDesc, prometheus.GaugeValue, v, lc.export, lc.remote)
		if subflows >= 0 {
			ch <- prometheus.MustNewConstMetric(cc.subflowsDesc, prometheus.GaugeValue, float64(subflows), lc.export, lc.remote)
		}
	}
}
