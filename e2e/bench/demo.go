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
	"io"
	"math"
	"strings"
	"text/tabwriter"
)

// Demo profile: our server and our client, sequential 1 MiB requests,
// first plain TCP on one path, then MPTCP over the four paths.
var (
	DemoServers   = []string{ServerOurs}
	DemoClients   = []string{ClientOurs}
	DemoNetworks  = []string{"tcp1", "mptcp4"}
	DemoWorkloads = []string{"seqread", "seqwrite"}
)

// DemoRow compares TCP and MPTCP for one workload.
type DemoRow struct {
	Workload      string  `json:"workload"`
	TCPMBps       float64 `json:"tcp_mb_per_s"`
	TCPLineMBps   float64 `json:"tcp_line_mb_per_s"`
	MPTCPMBps     float64 `json:"mptcp_mb_per_s"`
	MPTCPLineMBps float64 `json:"mptcp_line_mb_per_s"`
	Subflows      string  `json:"subflows"`
	SpeedUp       float64 `json:"speed_up"`
	Failed        bool    `json:"failed,omitempty"`
}

// TCPPct and MPTCPPct are the throughputs in percent of the line rates.
func (r DemoRow) TCPPct() float64   { return pct(r.TCPMBps, r.TCPLineMBps) }
func (r DemoRow) MPTCPPct() float64 { return pct(r.MPTCPMBps, r.MPTCPLineMBps) }

func pct(v, line float64) float64 {
	if line <= 0 {
		return 0
	}
	return 100 * v / line
}

// DemoRows extracts the demo comparison from aggregated cells (server
// and client "ours", networks tcp1 and mptcp4).
func DemoRows(cells []*Cell) []DemoRow {
	find := func(network, workload string) *Cell {
		for _, c := range cells {
			if c.Server == ServerOurs && c.Client == ClientOurs && c.Network == network && c.Workload == workload {
				return c
			}
		}
		return nil
	}
	var rows []DemoRow
	for _, w := range DemoWorkloads {
		tcp, mp := find("tcp1", w), find("mptcp4", w)
		if tcp == nil && mp == nil {
			continue
		}
		row := DemoRow{Workload: w}
		if tcp != nil {
			row.TCPMBps, row.TCPLineMBps = tcp.MBps, tcp.LineMBps
			row.Failed = row.Failed || !tcp.OK()
		} else {
			row.Failed = true
		}
		if mp != nil {
			row.MPTCPMBps, row.MPTCPLineMBps = mp.MBps, mp.LineMBps
			row.Subflows = mp.Subflows.String()
			row.Failed = row.Failed || !mp.OK()
		} else {
			row.Failed = true
		}
		row.SpeedUp = Ratio(row.MPTCPMBps, row.TCPMBps)
		rows = append(rows, row)
	}
	return rows
}

// WriteDemoTable prints the demo comparison.
func WriteDemoTable(w io.Writer, rows []DemoRow) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "workload\tTCP, 1 path MB/s\t% line\tMPTCP, 4 paths MB/s\t% line\tsubflows\tspeed-up\t")
	for _, r := range rows {
		status := ""
		if r.Failed {
			status = "  FAILED"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s%s\t\n", r.Workload,
			fmtFloat(r.TCPMBps, 1), fmtFloat(r.TCPPct(), 1),
			fmtFloat(r.MPTCPMBps, 1), fmtFloat(r.MPTCPPct(), 1),
			r.Subflows, fmtRatio(r.SpeedUp), status)
	}
	return tw.Flush()
}

// niceScale returns the top of a y axis for values up to v (with 10%
// headroom) and a round grid step (1, 2, 2.5 or 5 times a power of ten)
// that divides it into about six intervals.
func niceScale(v float64) (top, step float64) {
	if v <= 0 {
		return 1, 0.2
	}
	v *= 1.1
	raw := v / 6
	p := math.Pow(10, math.Floor(math.Log10(raw)))
	step = 10 * p
	for _, m := range []float64{1, 2, 2.5, 5} {
		if m*p >= raw {
			step = m * p
			break
		}
	}
	return math.Ceil(v/step) * step, step
}

// DemoSVG draws the demo as a grouped bar chart: per workload a TCP and
// an MPTCP bar, each with its line rate marked by a dashed line, and the
// speed-up above the group.
func DemoSVG(rows []DemoRow, subtitle string) string {
	const (
		width, height   = 800, 480
		left, right     = 80, 30
		top, bottom     = 90, 80
		barW, barGap    = 110, 24
		tcpColor        = "#9aa9bd"
		mptcpColor      = "#1f6fb2"
		lineColor       = "#c0392b"
		fontFamily      = "DejaVu Sans, Helvetica, Arial, sans-serif"
		plotW           = width - left - right
		plotH           = height - top - bottom
		labelFontSize   = 13
		captionFontSize = 12
	)
	ymaxData := 0.0
	for _, r := range rows {
		ymaxData = max(ymaxData, r.TCPMBps, r.MPTCPMBps, r.TCPLineMBps, r.MPTCPLineMBps)
	}
	ymax, step := niceScale(ymaxData)
	y := func(v float64) float64 { return top + plotH - plotH*v/ymax }

	var b strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&b, format+"\n", args...) }
	p(`<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="%s">`,
		width, height, width, height, fontFamily)
	p(`<rect x="0" y="0" width="%d" height="%d" fill="#ffffff"/>`, width, height)
	p(`<text x="24" y="32" font-size="19" font-weight="bold" fill="#1a1a1a">One NBD connection: plain TCP on 1 path vs MPTCP on 4 paths</text>`)
	p(`<text x="24" y="54" font-size="13" fill="#444444">%s</text>`, html.EscapeString(subtitle))

	// Grid and y axis.
	for i := 0; float64(i)*step <= ymax+step/100; i++ {
		v := step * float64(i)
		yy := y(v)
		p(`<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#e3e3e3" stroke-width="1"/>`, left, yy, width-right, yy)
		p(`<text x="%d" y="%.1f" font-size="%d" fill="#555555" text-anchor="end">%g</text>`, left-8, yy+4, labelFontSize, v)
	}
	p(`<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="#888888" stroke-width="1"/>`, left, top, left, top+plotH)
	p(`<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="#888888" stroke-width="1"/>`, left, top+plotH, width-right, top+plotH)
	p(`<text x="22" y="%d" font-size="%d" fill="#333333" text-anchor="middle" transform="rotate(-90 22 %d)">MB/s (10^6 bytes/s)</text>`,
		top+plotH/2, labelFontSize, top+plotH/2)

	groupW := float64(plotW) / float64(max(len(rows), 1))
	for i, r := range rows {
		gx := float64(left) + groupW*float64(i) + groupW/2 // group centre
		bars := []struct {
			x           float64
			v, line     float64
			color, name string
		}{
			{gx - barGap/2 - barW, r.TCPMBps, r.TCPLineMBps, tcpColor, "TCP"},
			{gx + barGap/2, r.MPTCPMBps, r.MPTCPLineMBps, mptcpColor, "MPTCP"},
		}
		for _, bar := range bars {
			yy := y(bar.v)
			h := float64(top+plotH) - yy
			p(`<rect x="%.1f" y="%.1f" width="%d" height="%.1f" fill="%s"/>`, bar.x, yy, barW, h, bar.color)
			cx := bar.x + barW/2
			switch {
			case bar.v <= 0:
				p(`<text x="%.1f" y="%d" font-size="%d" font-weight="bold" fill="%s" text-anchor="middle">FAILED</text>`,
					cx, top+plotH-8, labelFontSize, lineColor)
			case h >= 44:
				// Value and share of the line rate inside the bar.
				p(`<text x="%.1f" y="%.1f" font-size="%d" font-weight="bold" fill="#ffffff" text-anchor="middle">%.0f MB/s</text>`,
					cx, yy+20, labelFontSize+1, bar.v)
				if bar.line > 0 {
					p(`<text x="%.1f" y="%.1f" font-size="%d" fill="#ffffff" text-anchor="middle">%.0f%% of line</text>`,
						cx, yy+37, captionFontSize, pct(bar.v, bar.line))
				}
			default:
				p(`<text x="%.1f" y="%.1f" font-size="%d" font-weight="bold" fill="#1a1a1a" text-anchor="middle">%.0f MB/s</text>`,
					cx, yy-24, labelFontSize, bar.v)
			}
			if bar.line > 0 {
				ly := y(bar.line)
				p(`<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="%s" stroke-width="2" stroke-dasharray="6,4"/>`,
					bar.x-6, ly, bar.x+barW+6, ly, lineColor)
				p(`<text x="%.1f" y="%.1f" font-size="%d" fill="%s" text-anchor="middle">line %.0f MB/s</text>`,
					cx, ly-6, captionFontSize, lineColor, bar.line)
			}
		}
		name := map[string]string{"seqread": "sequential read", "seqwrite": "sequential write"}[r.Workload]
		if name == "" {
			name = r.Workload
		}
		p(`<text x="%.1f" y="%d" font-size="14" fill="#1a1a1a" text-anchor="middle">%s</text>`, gx, top+plotH+22, name)
		if r.SpeedUp > 0 {
			p(`<text x="%.1f" y="%d" font-size="13" fill="#1f6fb2" text-anchor="middle">MPTCP speed-up %.1fx</text>`, gx, top+plotH+42, r.SpeedUp)
		}
	}

	// Legend.
	lx, ly := left, height-18
	p(`<rect x="%d" y="%d" width="14" height="14" fill="%s"/>`, lx, ly-11, tcpColor)
	p(`<text x="%d" y="%d" font-size="%d" fill="#333333">plain TCP, path 1 only</text>`, lx+20, ly, captionFontSize)
	p(`<rect x="%d" y="%d" width="14" height="14" fill="%s"/>`, lx+190, ly-11, mptcpColor)
	p(`<text x="%d" y="%d" font-size="%d" fill="#333333">MPTCP, 4 subflows</text>`, lx+210, ly, captionFontSize)
	p(`<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="2" stroke-dasharray="6,4"/>`, lx+360, ly-4, lx+390, ly-4, lineColor)
	p(`<text x="%d" y="%d" font-size="%d" fill="#333333">line rate of the paths used (MB/s)</text>`, lx+396, ly, captionFontSize)
	p(`</svg>`)
	return b.String()
}
