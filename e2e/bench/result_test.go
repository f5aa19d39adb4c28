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
	"encoding/json"
	"encoding/xml"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestMedian(t *testing.T) {
	for _, tc := range []struct {
		in   []float64
		want float64
	}{
		{nil, 0}, {[]float64{3}, 3}, {[]float64{3, 1, 2}, 2}, {[]float64{4, 1, 3, 2}, 2.5}, {[]float64{5, 5, 1}, 5},
	} {
		in := append([]float64(nil), tc.in...)
		if got := Median(tc.in); got != tc.want {
			t.Errorf("Median(%v) = %v, want %v", tc.in, got, tc.want)
		}
		for i := range in {
			if in[i] != tc.in[i] {
				t.Fatalf("Median reordered its input: %v", tc.in)
			}
		}
	}
}

func TestRatio(t *testing.T) {
	if Ratio(300, 100) != 3 || Ratio(0, 100) != 0 || Ratio(100, 0) != 0 || Ratio(-1, 2) != 0 {
		t.Fatal("Ratio")
	}
}

func run(server, client, network, workload string, repeat int, mbps float64) RunResult {
	return RunResult{Key: Key{server, client, network, workload}, Repeat: repeat, OK: true, MBps: mbps, IOPS: mbps,
		ServerCPUPerGB: mbps / 1000, ClientCPUPerGB: 0.5}
}

func testRuns() []RunResult {
	failed := run("nbd-server", "fio", "mptcp4", "seqread", 2, 0)
	failed.OK, failed.Error = false, "fio job error 5"
	return []RunResult{
		run("ours", "fio", "tcp1", "seqread", 1, 110),
		run("ours", "fio", "tcp1", "seqread", 2, 118),
		run("ours", "fio", "tcp1", "seqread", 3, 119),
		run("ours", "fio", "mptcp4", "seqread", 1, 460),
		run("ours", "fio", "mptcp4", "seqread", 2, 300),
		run("ours", "fio", "mptcp4", "seqread", 3, 450),
		run("ours-tls", "fio", "mptcp4", "seqread", 1, 414),
		run("ours-tls", "fio", "mptcp4", "seqread", 2, 405),
		run("nbdkit", "fio", "mptcp4", "seqread", 1, 400),
		run("nbdkit", "fio", "mptcp4", "seqread", 2, 500),
		run("nbd-server", "fio", "mptcp4", "seqread", 1, 470),
		failed,
		run("nbd-server", "fio", "mptcp4", "seqread", 3, 480),
		run("nbdkit", "ours", "asym", "seqwrite", 1, 0),
	}
}

func TestAggregate(t *testing.T) {
	runs := testRuns()
	runs[len(runs)-1].OK, runs[len(runs)-1].Error = false, "no data moved"
	cells := Aggregate(runs, map[string]float64{"tcp1": 125, "mptcp4": 500, "asym": 387.5})
	if len(cells) != 6 {
		t.Fatalf("%d cells", len(cells))
	}
	get := func(server, network string) *Cell {
		for _, c := range cells {
			if c.Server == server && c.Network == network {
				return c
			}
		}
		t.Fatalf("no cell %s %s", server, network)
		return nil
	}
	tcp := get("ours", "tcp1")
	if tcp.MBps != 118 || tcp.Runs != 3 || !tcp.OK() || tcp.PctLine != 100*118/125.0 || tcp.VsTCP1 != 1 {
		t.Errorf("tcp1 cell %+v", tcp)
	}
	if tcp.VsNbdkit != 0 {
		t.Errorf("no nbdkit on tcp1, ratio %v", tcp.VsNbdkit)
	}
	mp := get("ours", "mptcp4")
	if mp.MBps != 450 || mp.VsTCP1 != 450/118.0 || mp.VsNbdkit != 1 || mp.PctLine != 90 || mp.ServerCPU != 0.45 {
		t.Errorf("mptcp4 cell %+v", mp)
	}
	// Paired by repeat: 0.46/0.40 and 0.30/0.50; ours' third repeat has
	// no nbdkit run beside it.
	if want := (0.46/0.40 + 0.30/0.50) / 2; math.Abs(mp.CPUVsNbdkit-want) > 1e-9 || mp.CPUPairs != 2 || mp.CPUPairsBelow != 1 {
		t.Errorf("mptcp4 CPU against nbdkit %v (%d of %d pairs below), want %v (1 of 2)", mp.CPUVsNbdkit, mp.CPUPairsBelow, mp.CPUPairs, want)
	}
	if ns := get("nbd-server", "mptcp4"); ns.CPUPairs != 1 || math.Abs(ns.CPUVsNbdkit-0.47/0.40) > 1e-9 {
		t.Errorf("nbd-server CPU pairs: one repeat failed, one has no nbdkit run: %+v", ns)
	}
	if kit := get("nbdkit", "mptcp4"); kit.MBps != 450 || kit.VsNbdkit != 1 || kit.VsTCP1 != 0 || kit.CPUPairs != 0 {
		t.Errorf("nbdkit cell %+v", kit)
	}
	ns := get("nbd-server", "mptcp4")
	if ns.OK() || ns.Failed != 1 || ns.Runs != 3 || ns.MBps != 475 || len(ns.Errors) != 1 || ns.VsNbdkit != 0 {
		t.Errorf("partly failed cell %+v", ns)
	}
	if all := get("nbdkit", "asym"); all.OK() || all.MBps != 0 {
		t.Errorf("failed cell %+v", all)
	}
}

func TestWriteTable(t *testing.T) {
	cells := Aggregate(testRuns(), map[string]float64{"tcp1": 125, "mptcp4": 500, "asym": 387.5})
	SortCells(cells)
	order := []string{}
	for _, c := range cells {
		order = append(order, c.Network+"/"+c.Server)
	}
	if want := "tcp1/ours mptcp4/ours mptcp4/ours-tls mptcp4/nbdkit mptcp4/nbd-server asym/nbdkit"; strings.Join(order, " ") != want {
		t.Errorf("order %v, want %s", order, want)
	}
	var b bytes.Buffer
	if err := WriteTable(&b, cells); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	t.Log("\n" + out)
	for _, want := range []string{"MB/s", "vs tcp1", "vs nbdkit", "srv CPU s/GB", "3.81x", "FAILED 1/3",
		"FAILED nbd-server/fio mptcp4 seqread", "fio job error 5", "90.0", "min-max", "300-460", "470-480", "vs plain", "0.91x",
		"vs nbdkit (below)", "(1/2)"} {
		if !strings.Contains(out, want) && !strings.Contains(out, strings.ReplaceAll(want, "nbd-server/fio mptcp4", "mptcp4 nbd-server/fio")) {
			t.Errorf("table lacks %q", want)
		}
	}
}

func TestReportJSON(t *testing.T) {
	runs := testRuns()
	rep := &Report{Runs: runs, Cells: Aggregate(runs, map[string]float64{"tcp1": 125})}
	path := filepath.Join(t.TempDir(), "out", "bench.json")
	if err := WriteJSON(path, rep); err != nil {
		t.Fatal(err)
	}
	var back struct {
		Runs  []map[string]any `json:"runs"`
		Cells []map[string]any `json:"medians"`
	}
	b := readFile(t, path)
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if len(back.Runs) != len(runs) || len(back.Cells) != 6 || back.Runs[0]["server"] != "ours" || back.Runs[0]["mb_per_s"] != 110.0 {
		t.Fatalf("round trip: %d runs %d cells %v", len(back.Runs), len(back.Cells), back.Runs[0])
	}
}

func TestDemo(t *testing.T) {
	runs := []RunResult{
		run("ours", "ours", "tcp1", "seqread", 1, 119),
		run("ours", "ours", "mptcp4", "seqread", 1, 452),
		run("ours", "ours", "tcp1", "seqwrite", 1, 117),
		run("ours", "ours", "mptcp4", "seqwrite", 1, 0),
	}
	runs[1].Subflows = &SubflowSample{Total: 4, Active: 4}
	runs[3].OK, runs[3].Error = false, "boom"
	rows := DemoRows(Aggregate(runs, map[string]float64{"tcp1": 125, "mptcp4": 500}))
	if len(rows) != 2 || rows[0].SpeedUp != 452/119.0 || rows[0].Subflows != "4" || rows[0].Failed || !rows[1].Failed {
		t.Fatalf("rows %+v", rows)
	}
	var b bytes.Buffer
	if err := WriteDemoTable(&b, rows); err != nil {
		t.Fatal(err)
	}
	if out := b.String(); !strings.Contains(out, "3.80x") || !strings.Contains(out, "FAILED") || !strings.Contains(out, "90.4") {
		t.Errorf("demo table:\n%s", out)
	}
	svg := DemoSVG(rows, "subtitle <&>")
	// Well-formed XML with the numbers and line rates in it.
	d := xml.NewDecoder(strings.NewReader(svg))
	for {
		_, err := d.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("DemoSVG is not well-formed XML: %v\n%s", err, svg)
		}
	}
	for _, want := range []string{"<svg", "452 MB/s", "119 MB/s", "line 125 MB/s", "line 500 MB/s", "90% of line", "FAILED", "speed-up 3.8x", "subtitle &lt;&amp;&gt;"} {
		if !strings.Contains(svg, want) {
			t.Errorf("SVG lacks %q", want)
		}
	}
}

func TestNiceScale(t *testing.T) {
	for _, tc := range []struct{ in, top, step float64 }{
		{500, 600, 100}, {460, 600, 100}, {125, 150, 25}, {90, 100, 20}, {0, 1, 0.2}, {2100, 2500, 500},
	} {
		if top, step := niceScale(tc.in); top != tc.top || step != tc.step {
			t.Errorf("niceScale(%v) = %v, %v; want %v, %v", tc.in, top, step, tc.top, tc.step)
		}
	}
}

func readFile(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
