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

package buildinfo

import (
	"runtime"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestRegistry: the registry holds one mpnbd_build_info series of value
// 1 with the component, version and Go release, beside the Go runtime's
// and the process's metrics.
func TestRegistry(t *testing.T) {
	reg := registry("controller", "1.2.3")
	want := `# HELP mpnbd_build_info Always 1; the labels name the component, its version, source revision and Go release.
# TYPE mpnbd_build_info gauge
mpnbd_build_info{component="controller",go_version="` + runtime.Version() + `",revision="` + Revision() + `",version="1.2.3"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), MetricName); err != nil {
		t.Error(err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	have := map[string]bool{}
	for _, mf := range mfs {
		have[mf.GetName()] = true
	}
	for _, n := range []string{"go_goroutines", "process_start_time_seconds"} {
		if !have[n] && (n != "process_start_time_seconds" || runtime.GOOS == "linux") {
			t.Errorf("no %s in the registry", n)
		}
	}
	if r := Revision(); r == "" {
		t.Error("empty revision")
	}
}

// TestMerge: families a later gatherer repeats (its own Go collector) are
// left out, so the scrape does not fail; the others are all there.
func TestMerge(t *testing.T) {
	other := prometheus.NewRegistry()
	other.MustRegister(collectors.NewGoCollector())
	extra := prometheus.NewCounter(prometheus.CounterOpts{Name: "extra_total", Help: "x"})
	other.MustRegister(extra)
	first := registry("agent", "1")
	if _, err := (prometheus.Gatherers{first, other}).Gather(); err == nil {
		t.Fatal("the two registries gathered side by side did not clash: the test shows nothing")
	}
	mfs, err := Merge(first, other).Gather()
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]int{}
	for _, mf := range mfs {
		names[mf.GetName()]++
	}
	for _, n := range []string{MetricName, "go_goroutines", "extra_total"} {
		if names[n] != 1 {
			t.Errorf("%s gathered %d times", n, names[n])
		}
	}
}
