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

// Package buildinfo is what every component of the driver says about its
// own build on /metrics: the registry each one serves starts from
// Registry, which holds the Go runtime's and the process's collectors and
// mpnbd_build_info, one series of value 1 whose labels name the
// component, its version (the one its log and the CSI identity give, and
// the chart's appVersion for a release), the source revision and the Go
// release it was built with. Dashboards and alerts join on it to tell which
// version a node or storage agent runs during an upgrade.
package buildinfo

import (
	"runtime"
	"runtime/debug"
	"slices"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	dto "github.com/prometheus/client_model/go"
)

// Version is the driver's version, set at build time (-ldflags
// "-X github.com/mpnbd/mpnbd/pkg/buildinfo.Version=..."); every binary
// logs it, the CSI identity reports it and mpnbd_build_info carries it.
var Version = "dev"

// MetricName is the build's info metric.
const MetricName = "mpnbd_build_info"

// Revision is the source revision the binary was built from (the VCS
// stamp of the Go build, "+dirty" when the tree had changes), or
// "unknown" when it was built without one.
func Revision() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "unknown"
	}
	rev, dirty := "", false
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	if rev == "" {
		return "unknown"
	}
	if dirty {
		rev += "+dirty"
	}
	return rev
}

// Collector is mpnbd_build_info of component at version (Version, but
// for tests).
func Collector(component, version string) prometheus.Collector {
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: MetricName,
		Help: "Always 1; the labels name the component, its version, source revision and Go release.",
		ConstLabels: prometheus.Labels{
			"component":  component,
			"version":    version,
			"revision":   Revision(),
			"go_version": runtime.Version(),
		},
	})
	g.Set(1)
	return g
}

// Registry is a new registry with the Go runtime's and the process's
// collectors and component's mpnbd_build_info at Version.
func Registry(component string) *prometheus.Registry {
	return registry(component, Version)
}

func registry(component, version string) *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		Collector(component, version),
	)
	return reg
}

// Merge gathers from first and then from more, leaving out the metric
// families of more that an earlier gatherer has already given (a library's
// registry, controller-runtime's, may hold its own Go runtime and process
// collectors: gathered side by side they would clash and fail the
// scrape).
func Merge(first prometheus.Gatherer, more ...prometheus.Gatherer) prometheus.Gatherer {
	return merged(append([]prometheus.Gatherer{first}, more...))
}

type merged []prometheus.Gatherer

func (m merged) Gather() ([]*dto.MetricFamily, error) {
	var out []*dto.MetricFamily
	seen := map[string]bool{}
	var errs prometheus.MultiError
	for _, g := range m {
		mfs, err := g.Gather()
		if err != nil {
			errs.Append(err)
		}
		for _, mf := range mfs {
			if !seen[mf.GetName()] {
				seen[mf.GetName()] = true
				out = append(out, mf)
			}
		}
	}
	slices.SortFunc(out, func(a, b *dto.MetricFamily) int { return strings.Compare(a.GetName(), b.GetName()) })
	return out, errs.MaybeUnwrap()
}
