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
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"
)

// Key identifies one cell of the matrix.
type Key struct {
	Server   string `json:"server"`
	Client   string `json:"client"`
	Network  string `json:"network"`
	Workload string `json:"workload"`
}

func (k Key) String() string {
	return fmt.Sprintf("%s %s/%s %s", k.Network, k.Server, k.Client, k.Workload)
}

// SubflowSample is what `ss` showed of the client's MPTCP connection
// during a run.
type SubflowSample struct {
	// Total established subflows of the busiest connection.
	Total int `json:"total"`
	// Active subflows carried at least 1% of the connection's bytes.
	Active int `json:"active"`
	// Backup subflows (B/b flag).
	Backup int `json:"backup"`
	// PathBytes is the number of bytes each path (index = path - 1)
	// carried, sent plus received by the client.
	PathBytes []uint64 `json:"path_bytes,omitempty"`
	// Samples is the number of ss listings taken.
	Samples int `json:"samples"`
}

func (s *SubflowSample) String() string {
	if s == nil {
		return "-"
	}
	str := fmt.Sprint(s.Total)
	var notes []string
	if s.Active != s.Total {
		notes = append(notes, fmt.Sprintf("%d act", s.Active))
	}
	if s.Backup > 0 {
		notes = append(notes, fmt.Sprintf("%d bk", s.Backup))
	}
	if len(notes) > 0 {
		str += " (" + strings.Join(notes, ",") + ")"
	}
	return str
}

// RunResult is the result of one repeat of one cell.
type RunResult struct {
	Key
	Repeat  int       `json:"repeat"`
	Started time.Time `json:"started"`
	OK      bool      `json:"ok"`
	Error   string    `json:"error,omitempty"`

	// Client-reported measurement (after the ramp).
	Bytes   int64   `json:"bytes"`
	Ops     int64   `json:"ops"`
	Seconds float64 `json:"seconds"`
	MBps    float64 `json:"mb_per_s"`
	IOPS    float64 `json:"iops"`

	// CPU time of the server process tree and of the client process over
	// the whole client run (connect, ramp, measurement, disconnect), and
	// the payload bytes the server's interfaces carried in the data
	// direction over the same interval.
	ServerCPUSeconds float64 `json:"server_cpu_s"`
	ClientCPUSeconds float64 `json:"client_cpu_s"`
	WireBytes        int64   `json:"wire_bytes"`
	ServerCPUPerGB   float64 `json:"server_cpu_s_per_gb"`
	ClientCPUPerGB   float64 `json:"client_cpu_s_per_gb"`

	// MPTCP is whether the client's connection used MPTCP (nbdload's own
	// report, or subflows seen by ss for fio).
	MPTCP bool `json:"mptcp"`
	// Subflows sampled with ss in the client namespace (MPTCP networks).
	Subflows *SubflowSample `json:"subflows,omitempty"`
	// ClientSubflows is nbdload's own count per connection (MPTCP_INFO).
	ClientSubflows []int `json:"client_subflows,omitempty"`

	Notes []string `json:"notes,omitempty"`
}

// Cell aggregates the repeats of one key.
type Cell struct {
	Key
	Runs   int     `json:"runs"`
	Failed int     `json:"failed"`
	MBps   float64 `json:"mb_per_s"`
	// MinMBps and MaxMBps are the spread of the successful repeats.
	MinMBps   float64 `json:"min_mb_per_s"`
	MaxMBps   float64 `json:"max_mb_per_s"`
	IOPS      float64 `json:"iops"`
	LineMBps  float64 `json:"line_mb_per_s"`
	PctLine   float64 `json:"pct_line_rate"`
	ServerCPU float64 `json:"server_cpu_s_per_gb"`
	ClientCPU float64 `json:"client_cpu_s_per_gb"`
	// Ratios of MBps; 0 when the reference cell is missing or failed.
	VsTCP1   float64 `json:"ratio_vs_tcp1,omitempty"`
	VsNbdkit float64 `json:"ratio_vs_nbdkit,omitempty"`
	// CPUVsNbdkit is the median over the repeats of the server's CPU per
	// GB over nbdkit's in the same repeat (the servers take turns in
	// every repeat); CPUPairs counts those repeats and CPUPairsBelow the
	// ones where this server used less.
	CPUVsNbdkit   float64 `json:"server_cpu_vs_nbdkit,omitempty"`
	CPUPairs      int     `json:"server_cpu_pairs,omitempty"`
	CPUPairsBelow int     `json:"server_cpu_pairs_below,omitempty"`
	// VsPlain is a TLS server's MBps over the same server's without TLS
	// (what encryption costs).
	VsPlain  float64        `json:"ratio_vs_plain,omitempty"`
	Subflows *SubflowSample `json:"subflows,omitempty"`
	Errors   []string       `json:"errors,omitempty"`
}

// OK reports whether every repeat succeeded.
func (c *Cell) OK() bool { return c.Failed == 0 && c.Runs > 0 }

// Median returns the median of xs (the mean of the two middle values for
// an even count), 0 for none.
func Median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	sort.Float64s(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// Ratio returns a/b, or 0 when either is not positive.
func Ratio(a, b float64) float64 {
	if a <= 0 || b <= 0 {
		return 0
	}
	return a / b
}

// Aggregate groups runs by key, in the order of the matrix, computes the
// medians of the successful repeats and the ratios. line gives the line
// rate of a network by name.
func Aggregate(runs []RunResult, line map[string]float64) []*Cell {
	var cells []*Cell
	byKey := map[Key]*Cell{}
	vals := map[Key]map[string][]float64{}
	for _, r := range runs {
		c := byKey[r.Key]
		if c == nil {
			c = &Cell{Key: r.Key, LineMBps: line[r.Network]}
			byKey[r.Key] = c
			vals[r.Key] = map[string][]float64{}
			cells = append(cells, c)
		}
		c.Runs++
		if !r.OK {
			c.Failed++
			c.Errors = append(c.Errors, fmt.Sprintf("repeat %d: %s", r.Repeat, r.Error))
			continue
		}
		v := vals[r.Key]
		v["mbps"] = append(v["mbps"], r.MBps)
		v["iops"] = append(v["iops"], r.IOPS)
		if r.ServerCPUPerGB > 0 {
			v["scpu"] = append(v["scpu"], r.ServerCPUPerGB)
		}
		if r.ClientCPUPerGB > 0 {
			v["ccpu"] = append(v["ccpu"], r.ClientCPUPerGB)
		}
		if r.Subflows != nil && (c.Subflows == nil || r.Subflows.Total > c.Subflows.Total) {
			c.Subflows = r.Subflows
		}
	}
	for _, c := range cells {
		v := vals[c.Key]
		c.MBps = Median(v["mbps"])
		if len(v["mbps"]) > 0 {
			c.MinMBps, c.MaxMBps = slices.Min(v["mbps"]), slices.Max(v["mbps"])
		}
		c.IOPS = Median(v["iops"])
		c.ServerCPU = Median(v["scpu"])
		c.ClientCPU = Median(v["ccpu"])
		if c.LineMBps > 0 {
			c.PctLine = 100 * c.MBps / c.LineMBps
		}
	}
	usable := func(k Key) float64 {
		if c := byKey[k]; c != nil && c.OK() {
			return c.MBps
		}
		return 0
	}
	pairCPU(cells, runs)
	for _, c := range cells {
		if !c.OK() {
			continue
		}
		ref := c.Key
		ref.Network = "tcp1"
		c.VsTCP1 = Ratio(c.MBps, usable(ref))
		ref = c.Key
		ref.Server = ServerNbdkit
		c.VsNbdkit = Ratio(c.MBps, usable(ref))
		if plain, ok := strings.CutSuffix(c.Server, "-tls"); ok {
			ref = c.Key
			ref.Server = plain
			c.VsPlain = Ratio(c.MBps, usable(ref))
		}
	}
	return cells
}

// pairCPU sets the CPU ratios to nbdkit of every cell, pairing the runs
// of the same repeat.
func pairCPU(cells []*Cell, runs []RunResult) {
	type rep struct {
		Key
		n int
	}
	cpu := map[rep]float64{}
	for _, r := range runs {
		if r.OK && r.ServerCPUPerGB > 0 {
			cpu[rep{r.Key, r.Repeat}] = r.ServerCPUPerGB
		}
	}
	for _, c := range cells {
		if c.Server == ServerNbdkit {
			continue
		}
		var ratios []float64
		for k, v := range cpu {
			if k.Key != c.Key {
				continue
			}
			ref := k
			ref.Server = ServerNbdkit
			if nb := cpu[ref]; nb > 0 {
				ratios = append(ratios, v/nb)
				if v < nb {
					c.CPUPairsBelow++
				}
			}
		}
		c.CPUPairs = len(ratios)
		c.CPUVsNbdkit = Median(ratios)
	}
}

// SortCells orders cells by network, workload, client and server in the
// order of the full matrix, so that the servers compared with each other
// stand on adjacent lines.
func SortCells(cells []*Cell) {
	idx := func(list []string, s string) int {
		if i := slices.Index(list, s); i >= 0 {
			return i
		}
		return len(list)
	}
	var nets, wls []string
	for _, n := range AllNetworks {
		nets = append(nets, n.Name)
	}
	for _, w := range AllWorkloads {
		wls = append(wls, w.Name)
	}
	sort.SliceStable(cells, func(i, j int) bool {
		a, b := cells[i], cells[j]
		for _, d := range [][2]int{
			{idx(nets, a.Network), idx(nets, b.Network)},
			{idx(wls, a.Workload), idx(wls, b.Workload)},
			{idx(AllClients, a.Client), idx(AllClients, b.Client)},
			{idx(serverOrder, a.Server), idx(serverOrder, b.Server)},
		} {
			if d[0] != d[1] {
				return d[0] < d[1]
			}
		}
		return false
	})
}

func fmtFloat(v float64, prec int) string {
	if v == 0 {
		return "-"
	}
	return fmt.Sprintf("%.*f", prec, v)
}

func fmtRatio(v float64) string {
	if v == 0 {
		return "-"
	}
	return fmt.Sprintf("%.2fx", v)
}

// WriteTable prints cells as an aligned text table followed by the
// reasons of failed runs.
func WriteTable(w io.Writer, cells []*Cell) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "network\tworkload\tclient\tserver\tMB/s\tmin-max\tIOPS\t% line\tvs tcp1\tvs nbdkit\tvs plain\tsrv CPU s/GB\tvs nbdkit (below)\tcli CPU s/GB\tsubflows\tstatus\t")
	var prev Key
	for i, c := range cells {
		if i > 0 && (c.Network != prev.Network || c.Workload != prev.Workload) {
			fmt.Fprintln(tw, "\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t")
		}
		prev = c.Key
		status := "ok"
		if c.Failed > 0 {
			status = fmt.Sprintf("FAILED %d/%d", c.Failed, c.Runs)
		}
		mbps, iops, pct := fmtFloat(c.MBps, 1), fmtFloat(c.IOPS, 0), fmtFloat(c.PctLine, 1)
		if c.Failed == c.Runs {
			mbps, iops, pct = "FAILED", "-", "-"
		}
		spread := "-"
		if c.Runs-c.Failed > 1 {
			spread = fmt.Sprintf("%.0f-%.0f", c.MinMBps, c.MaxMBps)
		}
		cpuPairs := "-"
		if c.CPUPairs > 0 {
			cpuPairs = fmt.Sprintf("%s (%d/%d)", fmtRatio(c.CPUVsNbdkit), c.CPUPairsBelow, c.CPUPairs)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t\n",
			c.Network, c.Workload, c.Client, c.Server, mbps, spread, iops, pct,
			fmtRatio(c.VsTCP1), fmtRatio(c.VsNbdkit), fmtRatio(c.VsPlain), fmtFloat(c.ServerCPU, 3), cpuPairs, fmtFloat(c.ClientCPU, 3),
			c.Subflows.String(), status)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, c := range cells {
		for _, e := range c.Errors {
			fmt.Fprintf(w, "FAILED %s: %s\n", c.Key, e)
		}
	}
	return nil
}

// Report is the JSON document written to out/bench.json.
type Report struct {
	Meta     Meta        `json:"meta"`
	Networks []NetInfo   `json:"networks"`
	Runs     []RunResult `json:"runs"`
	Cells    []*Cell     `json:"medians"`
}

// NetInfo describes a network of the report.
type NetInfo struct {
	Network
	LineMBps float64 `json:"line_mb_per_s"`
}

// Meta describes the benchmark environment and settings.
type Meta struct {
	Started  time.Time         `json:"started"`
	Finished time.Time         `json:"finished"`
	Elapsed  string            `json:"elapsed"`
	Duration string            `json:"duration"`
	Ramp     string            `json:"ramp"`
	Repeat   int               `json:"repeat"`
	Host     string            `json:"host"`
	Kernel   string            `json:"kernel"`
	CPUs     int               `json:"cpus"`
	Go       string            `json:"go"`
	Versions map[string]string `json:"versions,omitempty"`
	Args     []string          `json:"args,omitempty"`
	Notes    []string          `json:"notes,omitempty"`
}

// WriteJSON writes v, indented, to path (creating its directory).
func WriteJSON(path string, v any) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}
