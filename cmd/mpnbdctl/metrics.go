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
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// The node plugin's per-volume metrics (pkg/driver/node_metrics.go): each
// has the labels volume and transport; subflows also connection, the
// bytes per path connection, local and remote. The tests scrape the real
// NodeCollector, so a rename there fails them.
const (
	metricPrefix       = "mpnbd_node_volume_"
	metricConnected    = metricPrefix + "connected"
	metricMPTCP        = metricPrefix + "mptcp"
	metricSubflows     = metricPrefix + "subflows"
	metricExpected     = metricPrefix + "expected_subflows"
	metricReconnects   = metricPrefix + "reconnects_total"
	metricDegraded     = metricPrefix + "degraded"
	metricInaccessible = metricPrefix + "inaccessible"
	metricOutage       = metricPrefix + "outage_seconds"
	metricReplayed     = metricPrefix + "replayed_requests_total"
	metricResent       = metricPrefix + "resent_writes_total"
	metricRetained     = metricPrefix + "retained_writes"
	metricPathSent     = metricPrefix + "path_sent_bytes_total"
	metricPathReceived = metricPrefix + "path_received_bytes_total"
	metricPathRetrans  = metricPrefix + "path_retransmitted_bytes_total"
	metricPathRTT      = metricPrefix + "path_rtt_seconds"
	metricPathRate     = metricPrefix + "path_delivery_rate_bytes"
)

// Metrics statuses of a node (NodeMetrics.Status) and of a publication
// (Publication.Metrics).
const (
	MetricsOK          = "ok"
	MetricsNotAttached = "not-attached" // the node answered without the volume
	MetricsOff         = "off"          // not read (uninstall-check reads none)
	MetricsNoAddress   = "no-address"   // --metrics-port: no InternalIP to find the node by
	MetricsNoPod       = "no-pod"       // no node plugin pod running on the node to read through the API server
	MetricsNoPort      = "no-port"      // its node plugin pod declares no container port named metrics
	MetricsUnreachable = "unreachable"  // no answer within --timeout
	MetricsError       = "error"        // an answer that is not metrics
)

// maxMetricsBytes bounds what is read from one node.
const maxMetricsBytes = 16 << 20

// NodeMetrics is one node plugin's metrics endpoint and how reading it
// went.
type NodeMetrics struct {
	Node string `json:"node"`
	// Pod is the node plugin pod read through the API server,
	// NAMESPACE/NAME; empty when the node's metrics are read directly.
	Pod    string `json:"pod,omitempty"`
	URL    string `json:"url,omitempty"`
	Status string `json:"status"`
	Error  string `json:"error,omitempty"`

	// viaAPI: URL is the API server's pod proxy.
	viaAPI bool
	// volumes are the data paths it reports, by volume ID.
	volumes map[string]*DataPath
}

// metricsClients are the HTTP clients that read the node plugins'
// metrics.
type metricsClients struct {
	// direct reads --metrics-url and --metrics-port endpoints.
	direct *http.Client
	// proxy goes through the API server; nil: no API server to go
	// through.
	proxy *apiProxy
}

// apiProxy reaches pods through the API server's pod proxy
// (pods/proxy), as the kubeconfig's user.
type apiProxy struct {
	// base is the API server's URL, with the path prefix of a proxy in
	// front of it, if any.
	base *url.URL
	hc   *http.Client
}

// podURL is the URL of path on port of pod NS/NAME through the API
// server.
func (p *apiProxy) podURL(ns, name string, port int32, path string) string {
	return p.base.JoinPath("api", "v1", "namespaces", ns, "pods", name+":"+strconv.Itoa(int(port)), "proxy", path).String()
}

// podLogURL is the URL of the log of pod NS/NAME's container, with the
// query q (previous, sinceSeconds...), on the API server.
func (p *apiProxy) podLogURL(ns, name string, q url.Values) string {
	u := p.base.JoinPath("api", "v1", "namespaces", ns, "pods", name, "log")
	u.RawQuery = q.Encode()
	return u.String()
}

// Connection is one NBD connection of a volume's data path.
type Connection struct {
	Index int `json:"index"`
	// Subflows counts the connection's MPTCP subflows, the first
	// included.
	Subflows int `json:"subflows"`
	// Paths are the bytes the connection's subflows carried, per pair of
	// local and remote address; empty when the node plugin reports none
	// (no MPTCP, or a kernel that does not list subflows).
	Paths []Path `json:"paths"`
}

// Path is the traffic of a connection's MPTCP subflows between one local
// address of the node and one address of the storage node, counted since
// those subflows were opened.
type Path struct {
	Local         string `json:"local"`
	Remote        string `json:"remote"`
	SentBytes     uint64 `json:"sentBytes"`
	ReceivedBytes uint64 `json:"receivedBytes"`
	// RetransBytes counts the bytes sent again on the path; RTTSeconds
	// is its smoothed round-trip time and DeliveryRate the bytes per
	// second the kernel last measured reaching the storage node (both
	// zero when the node plugin does not report them).
	RetransBytes uint64  `json:"retransBytes"`
	RTTSeconds   float64 `json:"rttSeconds,omitempty"`
	DeliveryRate uint64  `json:"deliveryRateBytes,omitempty"`
}

// DataPath is what a node plugin reports about one attached volume.
type DataPath struct {
	Transport   string       `json:"transport"`
	Connected   bool         `json:"connected"`
	MPTCP       bool         `json:"mptcp"`
	Connections []Connection `json:"connections"`
	// ExpectedSubflows is the storage node's address count, what each
	// connection should have; nil when the node plugin does not know it
	// (it forgets across its own restarts).
	ExpectedSubflows *int    `json:"expectedSubflows,omitempty"`
	Reconnects       int64   `json:"reconnects"`
	OutageSeconds    float64 `json:"outageSeconds"`
	Degraded         bool    `json:"degraded"`
	Inaccessible     bool    `json:"inaccessible"`
	ReplayedRequests int64   `json:"replayedRequests"`
	ResentWrites     int64   `json:"resentWrites"`
	RetainedWrites   int64   `json:"retainedWrites"`
}

// scrapeNodes reads the metrics of every target with a URL, in parallel,
// each within timeout; the others keep the status they have.
func scrapeNodes(ctx context.Context, mc metricsClients, targets []NodeMetrics, timeout time.Duration) []NodeMetrics {
	var wg sync.WaitGroup
	for i := range targets {
		t := &targets[i]
		if t.URL == "" {
			continue
		}
		hc := mc.direct
		if t.viaAPI {
			hc = mc.proxy.hc
		}
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(ctx, timeout)
			defer cancel()
			vols, err := scrape(ctx, hc, t.URL, t.viaAPI)
			var unreachable *unreachableError
			switch {
			case errors.As(err, &unreachable):
				t.Status, t.Error = MetricsUnreachable, err.Error()
			case err != nil:
				t.Status, t.Error = MetricsError, err.Error()
			default:
				t.Status, t.volumes = MetricsOK, vols
			}
		})
	}
	wg.Wait()
	return targets
}

// unreachableError is a fetch that got no answer.
type unreachableError struct{ err error }

func (e *unreachableError) Error() string { return e.err.Error() }
func (e *unreachableError) Unwrap() error { return e.err }

// scrape fetches one node plugin's metrics in the text format and returns
// the volumes' data paths; viaAPI: endpoint is the API server's pod proxy.
func scrape(ctx context.Context, hc *http.Client, endpoint string, viaAPI bool) (map[string]*DataPath, error) {
	body, err := get(ctx, hc, endpoint, acceptMetrics, viaAPI, needProxy)
	if err != nil {
		return nil, err
	}
	defer body.Close()
	vols, err := parseNodeMetrics(io.LimitReader(body, maxMetricsBytes))
	if err != nil {
		if ctx.Err() != nil {
			return nil, &unreachableError{fmt.Errorf("GET %s: %w", endpoint, ctx.Err())}
		}
		return nil, fmt.Errorf("GET %s: %w", endpoint, err)
	}
	return vols, nil
}

// What reading a pod's metrics and logs through the API server needs, as
// a refusal says.
const (
	needProxy = "reading metrics through the API server needs get on pods/proxy"
	needLog   = "reading logs through the API server needs get on pods/log"
)

// acceptMetrics asks for metrics in the text format.
var acceptMetrics = string(expfmt.NewFormat(expfmt.TypeTextPlain))

// get GETs endpoint, accepting accept ("": anything), and returns the
// body of a 200 answer, to be closed; viaAPI: endpoint is the API
// server's, whose refusal says need. No answer is an unreachableError.
func get(ctx context.Context, hc *http.Client, endpoint, accept string, viaAPI bool, need string) (io.ReadCloser, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, endpoint, nil)
	if err != nil {
		return nil, err
	}
	if accept != "" {
		req.Header.Set("Accept", accept)
	}
	resp, err := hc.Do(req)
	if err != nil {
		return nil, &unreachableError{err}
	}
	if resp.StatusCode == http.StatusOK {
		return resp.Body, nil
	}
	defer resp.Body.Close()
	if viaAPI {
		return nil, proxyError(endpoint, resp, need)
	}
	return nil, fmt.Errorf("GET %s: %s", endpoint, resp.Status)
}

// proxyError says why the API server did not return what a pod serves,
// from the Status it answers with: it could not reach the pod
// (unreachable), or refused (RBAC: need says what it takes).
func proxyError(endpoint string, resp *http.Response, need string) error {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	msg := strings.TrimSpace(string(b))
	var st metav1.Status
	isStatus := json.Unmarshal(b, &st) == nil && st.Kind == "Status"
	if isStatus {
		msg = st.Message
	}
	if len(msg) > 300 {
		msg = msg[:300] + "..."
	}
	err := fmt.Errorf("GET %s: %s: %s", endpoint, resp.Status, msg)
	switch {
	case isStatus && (resp.StatusCode == http.StatusBadGateway || resp.StatusCode == http.StatusServiceUnavailable ||
		resp.StatusCode == http.StatusGatewayTimeout):
		// The API server's answer for a pod it cannot reach.
		return &unreachableError{err}
	case resp.StatusCode == http.StatusForbidden || resp.StatusCode == http.StatusUnauthorized:
		return fmt.Errorf("%w (%s)", err, need)
	}
	return err
}

// parseNodeMetrics reads the per-volume data paths out of a node plugin's
// metrics in the Prometheus text format; other metrics are ignored.
func parseNodeMetrics(r io.Reader) (map[string]*DataPath, error) {
	p := expfmt.NewTextParser(model.UTF8Validation)
	families, err := p.TextToMetricFamilies(r)
	if err != nil {
		return nil, fmt.Errorf("metrics text: %w", err)
	}
	vols := map[string]*DataPath{}
	for name, f := range families {
		for _, m := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			id := labels["volume"]
			if id == "" || !strings.HasPrefix(name, metricPrefix) {
				continue
			}
			dp := vols[id]
			if dp == nil {
				dp = &DataPath{Connections: []Connection{}}
				vols[id] = dp
			}
			if t := labels["transport"]; t != "" {
				dp.Transport = t
			}
			if err := dp.set(name, labels, value(m)); err != nil {
				return nil, fmt.Errorf("%s{volume=%q}: %w", name, id, err)
			}
		}
	}
	for _, dp := range vols {
		slices.SortFunc(dp.Connections, func(a, b Connection) int { return a.Index - b.Index })
		for i := range dp.Connections {
			slices.SortFunc(dp.Connections[i].Paths, func(a, b Path) int {
				return cmp.Or(cmp.Compare(a.Local, b.Local), cmp.Compare(a.Remote, b.Remote))
			})
		}
	}
	return vols, nil
}

// set records one sample of a volume's metric, labels its labels;
// unknown names are ignored (a newer node plugin may export more).
func (dp *DataPath) set(name string, labels map[string]string, v float64) error {
	switch name {
	case metricSubflows, metricPathSent, metricPathReceived, metricPathRetrans, metricPathRTT, metricPathRate:
		i, err := strconv.Atoi(labels["connection"])
		if err != nil || i < 0 {
			return fmt.Errorf("connection label %q is not an index", labels["connection"])
		}
		c := dp.connection(i)
		if name == metricSubflows {
			c.Subflows = int(v)
			return nil
		}
		p := c.path(labels["local"], labels["remote"])
		switch name {
		case metricPathSent:
			p.SentBytes = uint64(v)
		case metricPathReceived:
			p.ReceivedBytes = uint64(v)
		case metricPathRetrans:
			p.RetransBytes = uint64(v)
		case metricPathRTT:
			p.RTTSeconds = v
		case metricPathRate:
			p.DeliveryRate = uint64(v)
		}
	case metricConnected:
		dp.Connected = v == 1
	case metricMPTCP:
		dp.MPTCP = v == 1
	case metricExpected:
		n := int(v)
		dp.ExpectedSubflows = &n
	case metricReconnects:
		dp.Reconnects = int64(v)
	case metricDegraded:
		dp.Degraded = v == 1
	case metricInaccessible:
		dp.Inaccessible = v == 1
	case metricOutage:
		dp.OutageSeconds = v
	case metricReplayed:
		dp.ReplayedRequests = int64(v)
	case metricResent:
		dp.ResentWrites = int64(v)
	case metricRetained:
		dp.RetainedWrites = int64(v)
	}
	return nil
}

// connection is the connection of index i, added if new.
func (dp *DataPath) connection(i int) *Connection {
	for k := range dp.Connections {
		if dp.Connections[k].Index == i {
			return &dp.Connections[k]
		}
	}
	dp.Connections = append(dp.Connections, Connection{Index: i, Paths: []Path{}})
	return &dp.Connections[len(dp.Connections)-1]
}

// path is the connection's path from local to remote, added if new.
func (c *Connection) path(local, remote string) *Path {
	for k := range c.Paths {
		if c.Paths[k].Local == local && c.Paths[k].Remote == remote {
			return &c.Paths[k]
		}
	}
	c.Paths = append(c.Paths, Path{Local: local, Remote: remote})
	return &c.Paths[len(c.Paths)-1]
}

// value is a sample's value whatever its type.
func value(m *dto.Metric) float64 {
	switch {
	case m.GetGauge() != nil:
		return m.GetGauge().GetValue()
	case m.GetCounter() != nil:
		return m.GetCounter().GetValue()
	case m.GetUntyped() != nil:
		return m.GetUntyped().GetValue()
	}
	return 0
}
