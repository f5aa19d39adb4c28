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
	"github.com/prometheus/client_golang/prometheus"

	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// PathDecisions counts what the slow-path watch (mptcp.SlowPathPolicy)
// decides about this host's storage paths, by local address, and shows
// which are flagged backup now: <prefix>_slow_path_decisions_total{address,
// decision} (decision: slow, still-slow, probe, recovered, released) and
// <prefix>_slow_path_flagged{address}, 1 while flagged, 0 while probed or
// after it recovered. Observe is its SlowPathPolicy.OnEvent.
type PathDecisions struct {
	decisions *prometheus.CounterVec
	flagged   *prometheus.GaugeVec
}

// NewPathDecisions returns the metrics, named from prefix ("mpnbd_node",
// "mpnbd_server").
func NewPathDecisions(prefix string) *PathDecisions {
	return &PathDecisions{
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: prefix + "_slow_path_decisions_total",
			Help: "Decisions of the slow-path watch about the MPTCP endpoint of a local address: slow (flagged backup), still-slow, probe (flag cleared to measure it), recovered, released.",
		}, []string{"address", "decision"}),
		flagged: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: prefix + "_slow_path_flagged",
			Help: "1 while the MPTCP endpoint of a local address is flagged backup for being much slower than the other paths, 0 once probed or recovered.",
		}, []string{"address"}),
	}
}

// Observe records one decision.
func (p *PathDecisions) Observe(e mptcp.PathEvent) {
	addr := e.Addr.String()
	p.decisions.WithLabelValues(addr, string(e.Kind)).Inc()
	switch e.Kind {
	case mptcp.PathSlow, mptcp.PathStillSlow:
		p.flagged.WithLabelValues(addr).Set(1)
	case mptcp.PathProbe, mptcp.PathRecovered:
		p.flagged.WithLabelValues(addr).Set(0)
	case mptcp.PathGone:
		p.flagged.DeleteLabelValues(addr)
	}
}

func (p *PathDecisions) Describe(ch chan<- *prometheus.Desc) {
	p.decisions.Describe(ch)
	p.flagged.Describe(ch)
}

func (p *PathDecisions) Collect(ch chan<- prometheus.Metric) {
	p.decisions.Collect(ch)
	p.flagged.Collect(ch)
}
