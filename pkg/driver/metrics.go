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
	"errors"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
)

// Metrics are what the controller and the node plugin count of their own
// work, beside the node plugin's volume metrics: CSI calls by method and
// gRPC code and their latency; in the controller, the storage nodes' Ready
// condition as it sets it, and the failovers and switchovers it makes.
// A nil *Metrics counts nothing.
type Metrics struct {
	calls     *prometheus.CounterVec
	latency   *prometheus.HistogramVec
	nodeReady *prometheus.GaugeVec
	failovers *prometheus.CounterVec
	// nodes are the storage nodes nodeReady has a series of (the
	// Failover's goroutine alone sets them).
	nodes map[string]bool
}

// NewMetrics registers the metrics in reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{
		nodes: map[string]bool{},
		calls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mpnbd_csi_requests_total",
			Help: "CSI calls served, by method and gRPC status code.",
		}, []string{"method", "code"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "mpnbd_csi_request_duration_seconds",
			Help: "Time to serve a CSI call, by method.",
			// From a capability query to a volume made, published or
			// deleted while an agent is slow (up to the wait timeout).
			Buckets: []float64{0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120},
		}, []string{"method"}),
		nodeReady: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "mpnbd_controller_storage_node_ready",
			Help: "1 while the controller holds the storage node Ready (its agent renews its lease and reports), 0 otherwise.",
		}, []string{"storage_node"}),
		failovers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mpnbd_controller_primary_changes_total",
			Help: "Replicated volumes whose primary the controller moved, by reason (FailedOver: the primary's node gone; SwitchedOver: a drain).",
		}, []string{"reason"}),
	}
	for _, c := range []prometheus.Collector{m.calls, m.latency, m.nodeReady, m.failovers} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// unary counts each call of a gRPC server.
func (m *Metrics) unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	start := time.Now()
	resp, err := h(ctx, req)
	if m != nil {
		method := methodName(info.FullMethod)
		m.calls.WithLabelValues(method, status.Code(err).String()).Inc()
		m.latency.WithLabelValues(method).Observe(time.Since(start).Seconds())
	}
	return resp, err
}

// methodName is the method of a full gRPC method name
// ("/csi.v1.Controller/CreateVolume": CreateVolume).
func methodName(full string) string {
	for i := len(full) - 1; i >= 0; i-- {
		if full[i] == '/' {
			return full[i+1:]
		}
	}
	return full
}

// storageNodes sets the Ready gauge of each storage node in ready and
// drops those of nodes no longer there. One goroutine calls it.
func (m *Metrics) storageNodes(ready map[string]bool) {
	if m == nil {
		return
	}
	for n := range m.nodes {
		if _, ok := ready[n]; !ok {
			m.nodeReady.DeleteLabelValues(n)
			delete(m.nodes, n)
		}
	}
	for n, r := range ready {
		m.nodes[n] = true
		v := 0.0
		if r {
			v = 1
		}
		m.nodeReady.WithLabelValues(n).Set(v)
	}
}

// primaryChanged counts a primary moved for reason.
func (m *Metrics) primaryChanged(reason string) {
	if m != nil {
		m.failovers.WithLabelValues(reason).Inc()
	}
}

// ServeMetrics serves g's metrics on http://addr/metrics until ctx ends.
func ServeMetrics(ctx context.Context, addr string, g prometheus.Gatherer, log *slog.Logger) error {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(g, promhttp.HandlerOpts{ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelError)}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		srv.Close()
	}()
	go func() {
		if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("metrics server stopped", "error", err)
		}
	}()
	log.Info("metrics served", "addr", l.Addr().String())
	return nil
}
