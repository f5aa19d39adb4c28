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
	"fmt"
	"html"
	"strings"
)

// LineChart is a chart of series of values against a few labelled points
// on the x axis (the steps of a benchmark: volume counts), drawn as SVG.
type LineChart struct {
	Title, Subtitle string
	XLabel, YLabel  string
	// X are the labels of the points, evenly spaced.
	X []string
	// Series are drawn in order; each has one value per point.
	Series []ChartSeries
	// Ref, when above zero, is drawn as a dashed horizontal line labelled
	// RefLabel (a line rate).
	Ref      float64
	RefLabel string
}

// ChartSeries is one line of a LineChart.
type ChartSeries struct {
	Name  string
	Color string // an SVG colour
	Y     []float64
	// Labels writes each value above its point.
	Labels bool
}

// SVG draws the chart.
func (c LineChart) SVG() string {
	const (
		width, height = 800, 460
		left, right   = 80, 30
		top, bottom   = 80, 80
		plotW         = width - left - right
		plotH         = height - top - bottom
		refColor      = "#c0392b"
		fontFamily    = "DejaVu Sans, Helvetica, Arial, sans-serif"
	)
	ymaxData := c.Ref
	for _, s := range c.Series {
		for _, v := range s.Y {
			ymaxData = max(ymaxData, v)
		}
	}
	ymax, step := niceScale(ymaxData)
	y := func(v float64) float64 { return top + plotH - plotH*v/ymax }
	n := len(c.X)
	x := func(i int) float64 {
		if n < 2 {
			return left + plotW/2
		}
		return left + 20 + float64(plotW-40)*float64(i)/float64(n-1)
	}
	var b strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&b, format+"\n", args...) }
	esc := html.EscapeString
	p(`<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="%s">`, width, height, width, height, fontFamily)
	p(`<rect x="0" y="0" width="%d" height="%d" fill="#ffffff"/>`, width, height)
	p(`<text x="24" y="32" font-size="19" font-weight="bold" fill="#1a1a1a">%s</text>`, esc(c.Title))
	p(`<text x="24" y="54" font-size="13" fill="#444444">%s</text>`, esc(c.Subtitle))
	for i := 0; float64(i)*step <= ymax+step/100; i++ {
		v := step * float64(i)
		p(`<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#e3e3e3" stroke-width="1"/>`, left, y(v), width-right, y(v))
		p(`<text x="%d" y="%.1f" font-size="13" fill="#555555" text-anchor="end">%g</text>`, left-8, y(v)+4, v)
	}
	p(`<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="#888888"/>`, left, top+plotH, width-right, top+plotH)
	p(`<text x="22" y="%d" font-size="13" fill="#333333" text-anchor="middle" transform="rotate(-90 22 %d)">%s</text>`, top+plotH/2, top+plotH/2, esc(c.YLabel))
	p(`<text x="%d" y="%d" font-size="13" fill="#333333" text-anchor="middle">%s</text>`, left+plotW/2, top+plotH+44, esc(c.XLabel))
	if c.Ref > 0 {
		p(`<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="%s" stroke-width="2" stroke-dasharray="6,4"/>`, left, y(c.Ref), width-right, y(c.Ref), refColor)
		p(`<text x="%d" y="%.1f" font-size="12" fill="%s" text-anchor="end">%s</text>`, width-right, y(c.Ref)-6, refColor, esc(c.RefLabel))
	}
	for _, s := range c.Series {
		var pts []string
		for i, v := range s.Y {
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", x(i), y(v)))
		}
		p(`<polyline points="%s" fill="none" stroke="%s" stroke-width="3"/>`, strings.Join(pts, " "), s.Color)
		for i, v := range s.Y {
			p(`<circle cx="%.1f" cy="%.1f" r="4" fill="%s"/>`, x(i), y(v), s.Color)
			if s.Labels {
				p(`<text x="%.1f" y="%.1f" font-size="12" fill="%s" text-anchor="middle">%s</text>`, x(i), y(v)-10, s.Color, trimFloat(v))
			}
		}
	}
	for i, l := range c.X {
		p(`<text x="%.1f" y="%d" font-size="13" fill="#1a1a1a" text-anchor="middle">%s</text>`, x(i), top+plotH+20, esc(l))
	}
	lx, ly := left, height-16
	for _, s := range c.Series {
		p(`<rect x="%d" y="%d" width="14" height="4" fill="%s"/>`, lx, ly-6, s.Color)
		p(`<text x="%d" y="%d" font-size="12" fill="#333333">%s</text>`, lx+20, ly, esc(s.Name))
		lx += 40 + 7*len(s.Name)
	}
	p(`</svg>`)
	return b.String()
}

// trimFloat formats a chart value: whole numbers without decimals, small
// ones with one.
func trimFloat(v float64) string {
	if v >= 10 || v == float64(int64(v)) {
		return fmt.Sprintf("%.0f", v)
	}
	return fmt.Sprintf("%.1f", v)
}
