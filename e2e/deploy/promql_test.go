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

package deploy

import (
	"fmt"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"unicode"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/mpnbd/mpnbd/pkg/buildinfo"
	"github.com/mpnbd/mpnbd/pkg/driver"
	"github.com/mpnbd/mpnbd/pkg/nbdmetrics"
	"github.com/mpnbd/mpnbd/pkg/nodeid"
)

// targetLabels are the labels a scrape adds to every series: Prometheus's
// own, the Prometheus Operator's for a PodMonitor, and node, which the
// chart's PodMonitors and ServiceMonitor set.
var targetLabels = []string{"job", "instance", "namespace", "pod", "container", "endpoint", "node"}

// registerRecorder is a prometheus.Registerer that keeps what is
// registered on it, to list the metrics of code that registers its own.
type registerRecorder struct{ collectors []prometheus.Collector }

func (r *registerRecorder) Register(c prometheus.Collector) error {
	r.collectors = append(r.collectors, c)
	return nil
}

func (r *registerRecorder) MustRegister(cs ...prometheus.Collector) {
	r.collectors = append(r.collectors, cs...)
}

func (r *registerRecorder) Unregister(prometheus.Collector) bool { return false }

var (
	descName   = regexp.MustCompile(`fqName: "([^"]+)"`)
	descLabels = regexp.MustCompile(`variableLabels: \{([^}]*)\}`)
)

// exportedMetrics lists the metrics the driver's code exports and the
// labels of each: the node plugin's collector and the controller's and
// plugin's CSI metrics (pkg/driver), the storage agent's (pkg/nbdmetrics),
// the slow-path decisions, the certificates' validity and
// mpnbd_build_info, as they describe themselves; a
// histogram's series _bucket (with le), _sum and _count.
func exportedMetrics(t testing.TB) map[string][]string {
	t.Helper()
	var rec registerRecorder
	if _, err := nbdmetrics.New(&rec); err != nil {
		t.Fatal(err)
	}
	rec.collectors = append(rec.collectors, driver.NewNodeCollector(nil, nil), nodeid.CertCollector(nodeid.Node, nil),
		nbdmetrics.NewPathDecisions("mpnbd_node"), nbdmetrics.NewPathDecisions("mpnbd_server"))
	if _, err := driver.NewMetrics(&rec); err != nil {
		t.Fatal(err)
	}
	rec.collectors = append(rec.collectors, buildinfo.Collector("x", "y"))
	out := map[string][]string{}
	for _, c := range rec.collectors {
		_, histogram := c.(*prometheus.HistogramVec)
		ch := make(chan *prometheus.Desc, 32)
		go func() {
			c.Describe(ch)
			close(ch)
		}()
		for d := range ch {
			s := d.String()
			m := descName.FindStringSubmatch(s)
			l := descLabels.FindStringSubmatch(s)
			if m == nil || l == nil {
				t.Fatalf("cannot read the name and labels of %s", s)
			}
			var labels []string
			if l[1] != "" {
				labels = strings.Split(l[1], ",")
			}
			if !histogram {
				out[m[1]] = labels
				continue
			}
			out[m[1]+"_bucket"] = append(slices.Clone(labels), "le")
			out[m[1]+"_sum"] = labels
			out[m[1]+"_count"] = labels
		}
	}
	if len(out) < 20 || out["mpnbd_node_volume_connected"] == nil || out["mpnbd_server_request_duration_seconds_bucket"] == nil {
		t.Fatalf("the code's metrics are not what was expected: %v", out)
	}
	return out
}

// promqlRefs is what an expression refers to.
type promqlRefs struct {
	metrics []string
	// matchers are the label names matched in each metric's braces.
	matchers map[string][]string
	// grouping are the labels of by, without, on, ignoring, group_left
	// and group_right lists; by the labels of by lists alone.
	grouping, by []string
}

var promqlKeywords = map[string]bool{
	"and": true, "or": true, "unless": true, "bool": true, "offset": true, "atan2": true,
	"inf": true, "nan": true, "Inf": true, "NaN": true,
}

var promqlGrouping = map[string]bool{
	"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
}

// lexPromQL splits a PromQL expression into identifiers and punctuation;
// strings, numbers, durations, comments and Grafana's $variables are
// dropped.
func lexPromQL(expr string) ([]string, error) {
	var toks []string
	r := []rune(expr)
	isIdent := func(c rune, first bool) bool {
		return c == '_' || c == ':' || unicode.IsLetter(c) || (!first && unicode.IsDigit(c))
	}
	for i := 0; i < len(r); {
		c := r[i]
		switch {
		case unicode.IsSpace(c):
			i++
		case c == '"' || c == '\'' || c == '`':
			j := i + 1
			for ; j < len(r) && r[j] != c; j++ {
				if r[j] == '\\' && c != '`' {
					j++
				}
			}
			if j >= len(r) {
				return nil, fmt.Errorf("unterminated string in %q", expr)
			}
			i = j + 1
		case c == '#':
			for i < len(r) && r[i] != '\n' {
				i++
			}
		case c == '$':
			i++
			if i < len(r) && r[i] == '{' {
				for i < len(r) && r[i] != '}' {
					i++
				}
				i++
				continue
			}
			for i < len(r) && isIdent(r[i], false) {
				i++
			}
		case unicode.IsDigit(c) || (c == '.' && i+1 < len(r) && unicode.IsDigit(r[i+1])):
			for i < len(r) && (isIdent(r[i], false) || r[i] == '.') {
				i++
			}
		case isIdent(c, true):
			j := i
			for j < len(r) && isIdent(r[j], false) {
				j++
			}
			toks = append(toks, string(r[i:j]))
			i = j
		default:
			toks = append(toks, string(c))
			i++
		}
	}
	return toks, nil
}

// parsePromQL finds the metrics and labels an expression refers to. It is
// no parser, only enough of one for the expressions of the chart's rules
// and dashboard: an identifier followed by "(" (or by and without) is a
// function or an aggregation, one in braces a label, and any other a
// metric name.
func parsePromQL(expr string) (promqlRefs, error) {
	toks, err := lexPromQL(expr)
	if err != nil {
		return promqlRefs{}, err
	}
	refs := promqlRefs{matchers: map[string][]string{}}
	// until returns the identifiers up to the closing token and the index
	// after it.
	until := func(i int, closing string) ([]string, int, error) {
		var ids []string
		for ; i < len(toks); i++ {
			switch t := toks[i]; {
			case t == closing:
				return ids, i + 1, nil
			case len(t) > 1 || unicode.IsLetter([]rune(t)[0]) || t == "_":
				ids = append(ids, t)
			}
		}
		return nil, 0, fmt.Errorf("no %q closes %q", closing, expr)
	}
	last := "" // the metric just named, whose braces may follow
	for i := 0; i < len(toks); {
		t := toks[i]
		next := ""
		if i+1 < len(toks) {
			next = toks[i+1]
		}
		switch {
		case t == "[":
			_, j, err := until(i+1, "]")
			if err != nil {
				return refs, err
			}
			i, last = j, ""
		case t == "{":
			ids, j, err := until(i+1, "}")
			if err != nil {
				return refs, err
			}
			if last == "" {
				return refs, fmt.Errorf("a selector without a metric name in %q", expr)
			}
			// The label names are every other identifier: name op "value"
			// lost its value with the strings.
			refs.matchers[last] = append(refs.matchers[last], ids...)
			i, last = j, ""
		case promqlGrouping[t] && next == "(":
			ids, j, err := until(i+2, ")")
			if err != nil {
				return refs, err
			}
			refs.grouping = append(refs.grouping, ids...)
			if t == "by" {
				refs.by = append(refs.by, ids...)
			}
			i, last = j, ""
		case promqlGrouping[t] || promqlKeywords[t]:
			i, last = i+1, ""
		case len(t) > 1 || unicode.IsLetter([]rune(t)[0]) || t == "_":
			if next == "(" || next == "by" || next == "without" {
				i, last = i+1, "" // a function or an aggregation
				continue
			}
			refs.metrics = append(refs.metrics, t)
			i, last = i+1, t
		default:
			i, last = i+1, ""
		}
	}
	if len(refs.metrics) == 0 {
		return refs, fmt.Errorf("no metric in %q", expr)
	}
	return refs, nil
}

// checkPromQL reports every metric of expr the code does not export and
// every label it matches or groups on that the metrics do not have (nor
// the scrape adds); with a legend (Grafana's {{label}} format), also every
// label of the legend the result cannot have.
func checkPromQL(known map[string][]string, expr, legend string) []string {
	refs, err := parsePromQL(expr)
	if err != nil {
		return []string{err.Error()}
	}
	var problems []string
	all := map[string]bool{}
	for _, l := range targetLabels {
		all[l] = true
	}
	for _, m := range refs.metrics {
		labels, ok := known[m]
		if !ok {
			problems = append(problems, fmt.Sprintf("metric %s: the code exports no such metric", m))
			continue
		}
		for _, l := range labels {
			all[l] = true
		}
		for _, l := range refs.matchers[m] {
			if !slices.Contains(labels, l) && !slices.Contains(targetLabels, l) {
				problems = append(problems, fmt.Sprintf("%s{%s}: the metric has labels %v (and the scrape's %v)", m, l, labels, targetLabels))
			}
		}
	}
	for _, l := range refs.grouping {
		if !all[l] {
			problems = append(problems, fmt.Sprintf("label %s: none of %v has it", l, refs.metrics))
		}
	}
	if legend != "" {
		result := all
		if len(refs.by) > 0 { // an aggregation by these labels
			result = map[string]bool{}
			for _, l := range refs.by {
				result[l] = l != "le"
			}
		}
		for _, m := range regexp.MustCompile(`\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}`).FindAllStringSubmatch(legend, -1) {
			if !result[m[1]] {
				problems = append(problems, fmt.Sprintf("legend %q: the result has no label %s", legend, m[1]))
			}
		}
	}
	return problems
}

// TestPromQLCheckCanFail feeds the check expressions with an unknown
// metric, an unknown label and a legend label the result lacks, and one
// that is right.
func TestPromQLCheckCanFail(t *testing.T) {
	known := exportedMetrics(t)
	for _, tc := range []struct {
		expr, legend string
		want         []string // substrings of the problems, in order; none: no problem
	}{
		{`sum by (volume, node) (increase(mpnbd_node_volume_reconnects_total{volume=~"$volume", transport!="tcp"}[$__rate_interval]))`,
			"{{volume}} on {{node}}", nil},
		{`histogram_quantile(0.99, sum by (export, le) (rate(mpnbd_server_request_duration_seconds_bucket[5m]))) > 0.5`,
			"{{export}}", nil},
		{`100 * (1 - mpnbd_server_available_bytes / mpnbd_server_capacity_bytes) > 85`, "{{node}}", nil},
		{`node_filesystem_avail_bytes{mountpoint="/"} / node_filesystem_size_bytes`, "",
			[]string{"metric node_filesystem_avail_bytes", "metric node_filesystem_size_bytes"}},
		{`rate(mpnbd_node_volume_reconnect_total[5m])`, "", []string{"metric mpnbd_node_volume_reconnect_total"}},
		{`mpnbd_server_read_bytes_total{volume="pvc-1"}`, "", []string{"mpnbd_server_read_bytes_total{volume}"}},
		{`sum by (export) (mpnbd_node_volume_connected)`, "", []string{"label export"}},
		{`sum by (export) (rate(mpnbd_server_requests_total[5m]))`, "{{export}} {{cmd}}", []string{"no label cmd"}},
		{`sum(rate(x{`, "", []string{"no \"}\" closes"}},
		{`{__name__="mpnbd_node_volume_connected"}`, "", []string{"without a metric name"}},
	} {
		got := checkPromQL(known, tc.expr, tc.legend)
		ok := len(got) == len(tc.want)
		for i := 0; ok && i < len(got); i++ {
			ok = strings.Contains(got[i], tc.want[i])
		}
		if !ok {
			t.Errorf("checkPromQL(%q, %q) = %q, want problems containing %q", tc.expr, tc.legend, got, tc.want)
		}
	}
}

// TestExportedMetrics prints the metrics the check knows, as the code
// describes them.
func TestExportedMetrics(t *testing.T) {
	known := exportedMetrics(t)
	var names []string
	for n := range known {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		t.Logf("%s %v", n, known[n])
	}
	for _, n := range []string{"mpnbd_node_volume_subflows", "mpnbd_server_capacity_bytes", "mpnbd_server_read_bytes_total"} {
		if _, ok := known[n]; !ok {
			t.Errorf("%s is not among the code's metrics", n)
		}
	}
	if l := known["mpnbd_node_volume_subflows"]; !slices.Equal(l, []string{"volume", "transport", "connection"}) {
		t.Errorf("mpnbd_node_volume_subflows labels %v", l)
	}
	for _, n := range []string{"mpnbd_node_volume_path_sent_bytes_total", "mpnbd_node_volume_path_received_bytes_total"} {
		if l := known[n]; !slices.Equal(l, []string{"volume", "transport", "connection", "local", "remote"}) {
			t.Errorf("%s labels %v", n, l)
		}
	}
}
