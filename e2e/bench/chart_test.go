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
	"encoding/xml"
	"errors"
	"io"
	"strings"
	"testing"
)

func TestLineChartSVG(t *testing.T) {
	c := LineChart{
		Title: "Volumes <bound>", Subtitle: "one node & one server", XLabel: "PVCs", YLabel: "seconds",
		X: []string{"10", "25", "100"},
		Series: []ChartSeries{
			{Name: "bound", Color: "#1f6fb2", Y: []float64{4, 9.5, 41}, Labels: true},
			{Name: "deleted", Color: "#e67e22", Y: []float64{3, 7, 33}},
		},
	}
	svg := c.SVG()
	d := xml.NewDecoder(strings.NewReader(svg))
	for {
		if _, err := d.Token(); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("not well-formed XML: %v\n%s", err, svg)
		}
	}
	for _, want := range []string{"Volumes &lt;bound&gt;", "one node &amp; one server", ">100<", ">41<", ">9.5<", "bound", "deleted", "PVCs"} {
		if !strings.Contains(svg, want) {
			t.Errorf("SVG lacks %q", want)
		}
	}
	if n := strings.Count(svg, "<polyline"); n != 2 {
		t.Errorf("%d lines, want 2", n)
	}
	// Only the labelled series writes its values.
	if strings.Contains(svg, ">33<") {
		t.Error("the unlabelled series' value is written")
	}
	if strings.Contains(svg, "stroke-dasharray") {
		t.Error("a reference line without Ref")
	}
}
