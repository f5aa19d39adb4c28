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
	"math"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
)

func readTestdata(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func near(a, b float64) bool { return math.Abs(a-b) <= 1e-6*math.Max(1, math.Abs(b)) }

// The samples are real fio 3.33 reports of the nbd engine against nbdkit
// over the test topology (the engine prints a line before the JSON).
func TestParseFio(t *testing.T) {
	tests := []struct {
		file      string
		bytes     int64
		ops       int64
		mbps      float64
		iops      float64
		seconds   float64
		cpuSecond float64
		errno     int
	}{
		{"fio-randread.json", 238342144, 58158, 119.052019, 29049.95005, 2.002, (4.647676 + 65.117441) / 100 * 2.001, 0},
		{"fio-seqwrite.json", 982515712, 930, 325.121016, 307.743216, 3.022, -1, 0},
		// fio exits 1 here but leaves the job's error 0: only the exit
		// status and the missing bytes tell.
		{"fio-refused.json", 0, 0, 0, 0, 0, -1, 0},
	}
	for _, tc := range tests {
		t.Run(tc.file, func(t *testing.T) {
			r, err := ParseFio(readTestdata(t, tc.file))
			if err != nil {
				t.Fatal(err)
			}
			if r.Jobs != 1 || r.Error != tc.errno || r.Bytes != tc.bytes || r.Ops != tc.ops {
				t.Errorf("got jobs %d error %d bytes %d ops %d, want 1 %d %d %d", r.Jobs, r.Error, r.Bytes, r.Ops, tc.errno, tc.bytes, tc.ops)
			}
			if !near(r.MBps, tc.mbps) || !near(r.IOPS, tc.iops) || !near(r.Seconds, tc.seconds) {
				t.Errorf("got %.6f MB/s %.6f IOPS %.3f s, want %.6f %.6f %.3f", r.MBps, r.IOPS, r.Seconds, tc.mbps, tc.iops, tc.seconds)
			}
			if tc.cpuSecond >= 0 && !near(r.CPUSeconds, tc.cpuSecond) {
				t.Errorf("CPU %.6f s, want %.6f", r.CPUSeconds, tc.cpuSecond)
			}
		})
	}
}

func TestParseFioJobError(t *testing.T) {
	r, err := ParseFio([]byte(`{"jobs": [{"jobname": "a", "error": 0, "read": {"io_bytes": 10, "total_ios": 1}},
		{"jobname": "b", "error": 5, "write": {"io_bytes": 20, "total_ios": 2, "bw_bytes": 2e6, "runtime": 1500}}]}`))
	if err != nil {
		t.Fatal(err)
	}
	if r.Jobs != 2 || r.Error != 5 || r.Bytes != 30 || r.Ops != 3 || r.MBps != 2 || r.Seconds != 1.5 {
		t.Fatalf("%+v", r)
	}
}

func TestParseFioErrors(t *testing.T) {
	for _, in := range []string{"", "fio: connected to NBD server\n", `{"jobs": []}`, `{"jobs": [`, "error {"} {
		if _, err := ParseFio([]byte(in)); err == nil {
			t.Errorf("ParseFio(%q) succeeded", in)
		}
	}
}

func TestFioArgs(t *testing.T) {
	args := FioArgs(AllWorkloads[2], "nbd://10.77.1.2:10809/bench", 10*time.Second, 1500*time.Millisecond)
	for _, want := range []string{"--ioengine=nbd", "--uri=nbd://10.77.1.2:10809/bench", "--rw=randread", "--bs=4096",
		"--iodepth=32", "--time_based", "--runtime=10000ms", "--ramp_time=1500ms", "--output-format=json", "--norandommap"} {
		if !slices.Contains(args, want) {
			t.Errorf("fio args %q lack %q", args, want)
		}
	}
	args = FioArgs(AllWorkloads[1], "nbd://x/bench", time.Second, 0)
	for _, a := range args {
		if strings.HasPrefix(a, "--ramp_time") || a == "--norandommap" {
			t.Errorf("sequential workload without ramp got %q", a)
		}
	}
}

func TestParseProcStat(t *testing.T) {
	// The command name may contain spaces and parentheses.
	line := "4242 (nbd (server) x) S 1 4242 4242 0 -1 4194560 1069 0 0 0 1234 567 89 10 20 0 7 0 1953 1260036096 2431 18446744073709551615 1 1 0 0 0 0 0 4096 0 0 0 0 17 1 0 0 0 0 0 0 0 0 0 0 0 0 0\n"
	s, err := ParseProcStat([]byte(line))
	if err != nil {
		t.Fatal(err)
	}
	want := ProcStat{PID: 4242, Comm: "nbd (server) x", State: 'S', PPID: 1, UTime: 1234, STime: 567, CUTime: 89, CSTime: 10}
	if s != want {
		t.Fatalf("got %+v, want %+v", s, want)
	}
	if got := s.CPUSeconds(); !near(got, (1234+567+89+10)/100.0) {
		t.Errorf("CPUSeconds %v", got)
	}
	for _, bad := range []string{"", "12 foo S 1", "12 (foo) S 1 2 3", "x (foo) S 1 1 1 0 -1 0 0 0 0 0 1 2 3 4 5", "12 (foo) S 1 1 1 0 -1 0 0 0 0 0 a 2 3 4 5"} {
		if _, err := ParseProcStat([]byte(bad)); err == nil {
			t.Errorf("ParseProcStat(%q) succeeded", bad)
		}
	}
}

func TestReadProcStatSelf(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("skipping: /proc/PID/stat is Linux-only")
	}
	s, err := ReadProcStat(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if s.PID != os.Getpid() || s.PPID != os.Getppid() {
		t.Fatalf("pid %d ppid %d, want %d %d", s.PID, s.PPID, os.Getpid(), os.Getppid())
	}
	// Burn a little CPU so the test does not depend on a zero count.
	x := 0
	for i := range 50_000_000 {
		x += i
	}
	_ = x
	cpu, err := TreeCPU(os.Getpid())
	if err != nil || cpu <= 0 {
		t.Fatalf("TreeCPU = %v, %v; want > 0", cpu, err)
	}
}

func TestDescendants(t *testing.T) {
	procs := []ProcStat{
		{PID: 1, PPID: 0}, {PID: 10, PPID: 1}, {PID: 11, PPID: 10}, {PID: 12, PPID: 10},
		{PID: 13, PPID: 12}, {PID: 20, PPID: 1},
	}
	var got []int
	for _, p := range Descendants(procs, 10) {
		got = append(got, p.PID)
	}
	slices.Sort(got)
	if !slices.Equal(got, []int{11, 12, 13}) {
		t.Fatalf("descendants of 10: %v", got)
	}
	if d := Descendants(procs, 13); len(d) != 0 {
		t.Fatalf("leaf has descendants %v", d)
	}
}

// ip-link-stats.json is `ip -s -j link show` of a server namespace.
func TestParseLinkStats(t *testing.T) {
	m, err := ParseLinkStats(readTestdata(t, "ip-link-stats.json"))
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := m["lo"]; ok || len(m) != 4 {
		t.Fatalf("interfaces %v: want the 4 veths without lo", m)
	}
	if got := m["cap-s1"]; got != (LinkBytes{RX: 200277296, TX: 271012}) {
		t.Errorf("cap-s1 %+v", got)
	}
	sum := SumLinks(m)
	if want := (LinkBytes{RX: 200277296 + 199847035 + 198682913 + 1226, TX: 271012 + 246904 + 230474 + 1230}); sum != want {
		t.Errorf("sum %+v, want %+v", sum, want)
	}
	if _, err := ParseLinkStats([]byte(`[{"ifname":"x","link_type":"ether"}]`)); err == nil {
		t.Error("counters without statistics accepted")
	}
}

func TestParseSize(t *testing.T) {
	for in, want := range map[string]int64{"4096": 4096, "4k": 4096, "4K": 4096, "1M": 1 << 20, "1MiB": 1 << 20,
		"2G": 2 << 30, "2GB": 2 << 30, "1T": 1 << 40, "0": 0} {
		if got, err := ParseSize(in); err != nil || got != want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "k", "-1", "1.5M", "1X", "99999999999T"} {
		if _, err := ParseSize(bad); err == nil {
			t.Errorf("ParseSize(%q) succeeded", bad)
		}
	}
}

func TestNewMatrix(t *testing.T) {
	m, err := NewMatrix("", "all", "", "")
	if err != nil {
		t.Fatal(err)
	}
	if m.Size() != (4*2-1)*5*4 {
		t.Fatalf("full matrix has %d cells", m.Size())
	}
	m, err = NewMatrix("nbdkit,ours", "mptcp4", "ours, fio", "seqread,seqread")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(m.Servers, []string{"ours", "nbdkit"}) || len(m.Networks) != 1 || m.Networks[0].Name != "mptcp4" ||
		!slices.Equal(m.Clients, []string{"fio", "ours"}) || len(m.Workloads) != 1 {
		t.Fatalf("selection %+v", m)
	}
	if m, err = NewMatrix("nbdkit,ours-b,ours", "tcp1", "fio", "seqread"); err != nil || !slices.Equal(m.Servers, []string{"ours", "ours-b", "nbdkit"}) {
		t.Fatalf("ours-b named: %v %v", m.Servers, err)
	}
	if m, _ = NewMatrix("all", "tcp1", "fio", "seqread"); slices.Contains(m.Servers, ServerOursB) {
		t.Fatalf("all selects ours-b, which needs a second build: %v", m.Servers)
	}
	for _, bad := range [][4]string{{"qemu", "", "", ""}, {"", "tcp9", "", ""}, {"", "", "nbd-client", ""}, {"", "", "", "mixed"}, {",", "", "", ""}} {
		if _, err := NewMatrix(bad[0], bad[1], bad[2], bad[3]); err == nil {
			t.Errorf("NewMatrix%q succeeded", bad)
		}
	}
}

func TestLineRates(t *testing.T) {
	want := map[string]float64{"tcp1": 125, "mptcp4": 500, "asym": 387.5, "asym-backup": 375, "asym-auto": 375}
	for _, n := range AllNetworks {
		if got := n.PlanLineRateMBps(); got != want[n.Name] {
			t.Errorf("%s line rate %v, want %v", n.Name, got, want[n.Name])
		}
	}
	if n, _ := NetworkByName("asym-backup"); !n.Config("x").Paths[3].Backup {
		t.Error("asym-backup: slow path not flagged backup")
	}
}

// ss-asym-backup.txt is `ss -tniH state established` in the client
// namespace during a write over the asym-backup network: three busy
// subflows and one idle backup subflow.
func TestSummarizeSubflows(t *testing.T) {
	subs, err := topo.ParseSubflows(string(readTestdata(t, "ss-asym-backup.txt")))
	if err != nil {
		t.Fatal(err)
	}
	tp, err := topo.Plan(topo.Asymmetric("x"))
	if err != nil {
		t.Fatal(err)
	}
	// A listing before the connection existed and an extra, idle
	// connection must not matter.
	idle := topo.Subflow{Local: netip.MustParseAddrPort("10.77.1.1:40000"), Remote: netip.MustParseAddrPort("10.77.1.2:10809"), Token: 1, Flags: "Mmec", BytesSent: 10}
	s := SummarizeSubflows([][]topo.Subflow{nil, append(slices.Clone(subs), idle)}, tp.PathOf, 4)
	if s.Total != 4 || s.Active != 3 || s.Backup != 1 || s.Samples != 2 {
		t.Fatalf("summary %+v, want 4 subflows, 3 active, 1 backup", s)
	}
	if s.PathBytes[3] != 0 || s.PathBytes[0] < 1e8 {
		t.Errorf("path bytes %v", s.PathBytes)
	}
	if got := s.String(); got != "4 (3 act,1 bk)" {
		t.Errorf("String() = %q", got)
	}
	if s := SummarizeSubflows(nil, tp.PathOf, 4); s.Total != 0 || s.String() != "0" {
		t.Errorf("no samples: %+v %q", s, s.String())
	}
	var none *SubflowSample
	if none.String() != "-" {
		t.Error("nil sample should print as -")
	}
}
