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

package bench

import (
	"bytes"
	"math"
	"strings"
	"testing"
)

func TestJain(t *testing.T) {
	for _, c := range []struct {
		xs   []float64
		want float64
	}{
		{[]float64{100, 100, 100, 100}, 1},
		{[]float64{400, 0, 0, 0}, 0.25},
		{[]float64{300, 100}, 0.8},
		{nil, 0},
		{[]float64{0, 0}, 0},
	} {
		if got := Jain(c.xs); math.Abs(got-c.want) > 1e-9 {
			t.Errorf("Jain(%v) = %v, want %v", c.xs, got, c.want)
		}
	}
}

func TestWriteManyTable(t *testing.T) {
	rep := &ManyReport{LineMBps: 500, Steps: []ManyStep{
		{Volumes: 1, MBps: 451, PctLine: 90.2, MinMBps: 451, MedianMBps: 451, MaxMBps: 451, Fairness: 1, Subflows: 4, ServerRSSMiB: 38},
		{Volumes: 32, MBps: 470, PctLine: 94, MinMBps: 10, MedianMBps: 14.5, MaxMBps: 20, Fairness: 0.97, Subflows: 3, Errors: []string{"v3: refused"}},
	}}
	var b bytes.Buffer
	if err := WriteManyTable(&b, rep); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"volumes", "fairness", "451.0", "0.970", "1 FAILED", "line 500 MB/s"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, b.String())
		}
	}
}

func TestManySVG(t *testing.T) {
	rep := &ManyReport{LineMBps: 500, Steps: []ManyStep{
		{Volumes: 1, MBps: 451, MinMBps: 451}, {Volumes: 8, MBps: 470, MinMBps: 50}, {Volumes: 32, MBps: 468, MinMBps: 9},
	}}
	svg := ManySVG(rep, "4 x 1 Gbit/s <test>")
	for _, want := range []string{"<svg", "</svg>", "line 500 MB/s", ">32<", ">470<", "&lt;test&gt;", "polyline"} {
		if !strings.Contains(svg, want) {
			t.Errorf("SVG lacks %q", want)
		}
	}
}
