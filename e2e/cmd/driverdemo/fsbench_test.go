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

package main

import (
	"bytes"
	"encoding/json"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/e2e/bench"
	"github.com/mpnbd/mpnbd/internal/testenv/topo"
)

func TestParseArgsFio(t *testing.T) {
	var stderr bytes.Buffer
	o, err := parseArgs(nil, &stderr)
	if err != nil {
		t.Fatal(err)
	}
	if o.fio || o.volumeSize != defaultVolumeSize {
		t.Errorf("without --fio: fio %t, volume size %d", o.fio, o.volumeSize)
	}
	for _, tc := range []struct {
		args    []string
		size    int64
		seconds time.Duration
	}{
		{[]string{"--fio"}, defaultFioVolumeSize, 10 * time.Second},
		{[]string{"--fio", "--fio-seconds", "5s", "--volume-size", "4GiB"}, 4 << 30, 5 * time.Second},
		{[]string{"--fio-seconds=1s", "--fio"}, defaultFioVolumeSize, time.Second},
		{[]string{"--fio", "--volume-size", "1GiB", "--size", "64MiB"}, 1 << 30, 10 * time.Second},
	} {
		o, err := parseArgs(tc.args, &stderr)
		if err != nil {
			t.Errorf("%q: %v", tc.args, err)
			continue
		}
		if !o.fio || o.volumeSize != tc.size || o.fioTime != tc.seconds {
			t.Errorf("%q: fio %t, volume size %d, seconds %s; want true, %d, %s", tc.args, o.fio, o.volumeSize, o.fioTime, tc.size, tc.seconds)
		}
	}
	for _, args := range [][]string{
		{"--fio-seconds", "5s"}, // without --fio
		{"--fio", "--fio-seconds", "0s"},
		{"--fio", "--fio-seconds", "500ms"},
		{"--fio", "--fio-seconds", "-5s"},
		{"--fio", "--fio-seconds", "11m"},
		{"--fio", "--fio-seconds", "1500500us"}, // fio counts milliseconds
		{"--fio", "--fio-seconds", "ten"},
		{"--fio", "--volume-size", "512MiB"}, // no room for xfs and the file
		{"--fio=maybe"},
	} {
		if _, err := parseArgs(args, &stderr); err == nil {
			t.Errorf("%q: no error", args)
		}
	}
}

func TestFioSpan(t *testing.T) {
	for in, want := range map[int64]int64{2 << 30: 1 << 30, 1 << 30: 512 << 20, 3<<30 + 3<<20: 1536<<20 + 1<<20, 1<<30 + 1: 512 << 20} {
		if got := fioSpan(in); got != want {
			t.Errorf("fioSpan(%d) = %d, want %d", in, got, want)
		}
	}
}

func readTestdata(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func near(a, b float64) bool { return math.Abs(a-b) < 1e-6*math.Max(1, math.Abs(b)) }

// The testdata are fio 3.33's reports of the kinds of runs the
// measurement makes: 4 KiB random writes with libaio and O_DIRECT at
// QD 32, a buffered write ended by fsync, and a write that ran out of
// space on a 1 MiB tmpfs.
func TestFioCell(t *testing.T) {
	for _, tc := range []struct {
		file             string
		mbps, iops, secs float64
	}{
		{"fio-randwrite-libaio.json", 306.528927, 74804.195804, 1.001},
		{"fio-buffered-write.json", 849.479291, 810.126582, 0.079},
	} {
		c, err := fioCell(readTestdata(t, tc.file))
		if err != nil {
			t.Errorf("%s: %v", tc.file, err)
			continue
		}
		if !near(c.MBps, tc.mbps) || !near(c.IOPS, tc.iops) || !near(c.Seconds, tc.secs) {
			t.Errorf("%s: %+v, want %.6f MB/s, %.6f IOPS, %.3f s", tc.file, c, tc.mbps, tc.iops, tc.secs)
		}
	}
	if c, err := fioCell(readTestdata(t, "fio-enospc.json")); err == nil || !strings.Contains(err.Error(), "28") {
		t.Errorf("a run that failed with ENOSPC: %+v, %v", c, err)
	}
	for _, bad := range []string{"", "fio: no JSON", `{"jobs": []}`, `{"jobs": [{"jobname": "x", "error": 0}]}`, `{"jobs": [`} {
		if c, err := fioCell([]byte(bad)); err == nil {
			t.Errorf("%q: %+v, want an error", bad, c)
		}
	}
}

func TestNbdloadCell(t *testing.T) {
	report := func(edit func(*bench.LoadReport)) []byte {
		r := bench.LoadReport{Export: "pvc-1/secret", RW: "write", Bytes: 4 << 30, Ops: 4096, Seconds: 10,
			MBps: 429.5, IOPS: 409.6, MPTCP: []bool{true}, Subflows: []int{4}, SubflowsMax: []int{4}}
		edit(&r)
		b, err := json.Marshal(r)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	c, subflows, err := nbdloadCell(report(func(*bench.LoadReport) {}))
	if err != nil || c.MBps != 429.5 || c.IOPS != 409.6 || c.Seconds != 10 || subflows != 4 {
		t.Errorf("got %+v, %d subflows, %v", c, subflows, err)
	}
	for name, edit := range map[string]func(*bench.LoadReport){
		"TCP fallback": func(r *bench.LoadReport) { r.MPTCP = []bool{false}; r.Subflows = []int{0} },
		"no MPTCP":     func(r *bench.LoadReport) { r.MPTCP = nil },
		"I/O errors":   func(r *bench.LoadReport) { r.Errors, r.FirstError = 3, "EIO" },
		"no data":      func(r *bench.LoadReport) { r.Bytes, r.Ops = 0, 0 },
	} {
		if c, _, err := nbdloadCell(report(edit)); err == nil {
			t.Errorf("%s: %+v, want an error", name, c)
		}
	}
	if _, _, err := nbdloadCell([]byte("nbdload: connection refused")); err == nil {
		t.Error("no report: no error")
	}
}

func TestMaskedExport(t *testing.T) {
	if got := maskedExport("pvc-1/0123abcd"); got != "pvc-1/********" {
		t.Errorf("got %q", got)
	}
	if got := maskedExport("plain"); got != "plain" {
		t.Errorf("got %q", got)
	}
}

// hasArgs reports whether args holds every one of want.
func hasArgs(args []string, want ...string) bool {
	for _, w := range want {
		if !slices.Contains(args, w) {
			return false
		}
	}
	return true
}

func TestFioArgs(t *testing.T) {
	seqw, randr := directWorkloads[0], directWorkloads[3]
	a := fioArgs(seqw, "/dev/loop7", 1<<30, 5*time.Second, 2*time.Second)
	if !hasArgs(a, "--output-format=json", "--filename=/dev/loop7", "--rw=write", "--bs=1048576", "--iodepth=8",
		"--ioengine=libaio", "--direct=1", "--time_based", "--runtime=5000ms", "--ramp_time=2000ms", "--size=1073741824") ||
		hasArgs(a, "--norandommap") {
		t.Errorf("seqwrite: %q", a)
	}
	a = fioArgs(randr, "/mnt/f", 1<<30, 5*time.Second, 2*time.Second)
	if !hasArgs(a, "--rw=randread", "--bs=4096", "--iodepth=32", "--norandommap", "--randrepeat=0", "--direct=1") {
		t.Errorf("randread: %q", a)
	}
	a = fioArgs(seqw, "/mnt/f", 1<<30, 0, 0) // one pass
	if hasArgs(a, "--time_based") || !hasArgs(a, "--direct=1", "--size=1073741824") {
		t.Errorf("one pass: %q", a)
	}
	bw, br := bufferedWorkloads[0], bufferedWorkloads[1]
	a = fioArgs(bw, "/mnt/b", 1<<30, 0, 0)
	if !hasArgs(a, "--ioengine=psync", "--direct=0", "--end_fsync=1", "--fallocate=none", "--rw=write") || hasArgs(a, "--time_based") {
		t.Errorf("buffered write: %q", a)
	}
	a = fioArgs(br, "/mnt/b", 1<<30, 0, 0)
	if !hasArgs(a, "--ioengine=psync", "--direct=0", "--rw=read") || hasArgs(a, "--end_fsync=1") {
		t.Errorf("buffered read: %q", a)
	}
	// fio itself accepts every command line.
	if _, err := exec.LookPath("fio"); err != nil {
		t.Logf("fio is not installed: its parsing is not checked (%v)", err)
		return
	}
	for _, w := range append(append([]fsWorkload{}, directWorkloads...), bufferedWorkloads...) {
		args := append([]string{"--parse-only"}, fioArgs(w, filepath.Join(t.TempDir(), "f"), 1<<20, time.Second, time.Second)...)
		if out, err := exec.Command("fio", args...).CombinedOutput(); err != nil {
			t.Errorf("fio %q: %v: %s", args, err, out)
		}
	}
}

// sampleBench is a measurement with round numbers.
func sampleBench() *FSBench {
	b := newFSBench()
	b.Seconds, b.RampSeconds, b.SpanBytes, b.BackingFS = 10, 2, 1<<30, "tmpfs"
	for col, mbps := range map[string]float64{colRaw: 400, colBlock: 300, colExt4: 200, colXFS: 100} {
		b.set("seqwrite", col, &FSCell{MBps: mbps, IOPS: mbps / 1.048576})
		b.set("seqread", col, &FSCell{MBps: mbps / 2, IOPS: mbps / 2 / 1.048576})
		b.set("randwrite", col, &FSCell{MBps: mbps / 10, IOPS: mbps / 10 * 1e6 / 4096})
	}
	// randread: no raw result, so no ratios.
	b.set("randread", colBlock, &FSCell{MBps: 20, IOPS: 4883})
	b.set("buffered-write", colExt4, &FSCell{MBps: 600})
	b.set("buffered-read", colXFS, &FSCell{MBps: 50})
	b.computeRatios()
	return b
}

func TestComputeRatios(t *testing.T) {
	b := sampleBench()
	for _, tc := range []struct {
		workload, col string
		want          float64
	}{
		{"seqwrite", colRaw, 0}, // raw has no ratio to itself
		{"seqwrite", colBlock, 0.75},
		{"seqwrite", colExt4, 0.5},
		{"seqread", colXFS, 0.25},
		{"randwrite", colExt4, 0.5},
		{"randread", colBlock, 0},        // no raw result
		{"buffered-write", colExt4, 1.5}, // to raw seqwrite
		{"buffered-read", colXFS, 0.25},  // to raw seqread
	} {
		c := b.row(tc.workload).Results[tc.col]
		if !near(c.Ratio, tc.want) {
			t.Errorf("%s %s: ratio %g, want %g", tc.workload, tc.col, c.Ratio, tc.want)
		}
	}
	if b.row("nope") != nil {
		t.Error("a row for an unknown workload")
	}
}

func TestWriteFSTable(t *testing.T) {
	var out bytes.Buffer
	if err := writeFSTable(&out, sampleBench()); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimRight(out.String(), "\n"), "\n")
	if len(lines) != 1+len(directWorkloads)+len(bufferedWorkloads)+1 {
		t.Fatalf("%d lines:\n%s", len(lines), out.String())
	}
	if f := strings.Fields(lines[0]); !slices.Equal(f, []string{"MB/s", "raw", "block", "ext4", "xfs"}) {
		t.Errorf("header %q", f)
	}
	// Columns line up: each column starts where its header does.
	at := strings.Index(lines[0], "ext4")
	for i, want := range map[int]string{1: "200 (0.50x)", 3: "20.0 / 4883 IOPS (0.50x)", 5: "600 (1.50x)"} {
		if !strings.HasPrefix(lines[i][at:], want) {
			t.Errorf("line %d, ext4 column %q, want %q:\n%s", i, lines[i][at:], want, out.String())
		}
	}
	for i, want := range map[int]string{
		1: "  seqwrite 1MiB QD8 ",
		2: "  seqread 1MiB QD8 ",
		3: "  randwrite 4KiB QD32 ",
		4: "  randread 4KiB QD32 ",
		5: "  buffered-write 1MiB (page cache) ",
		6: "  buffered-read 1MiB (page cache) ",
	} {
		if !strings.HasPrefix(lines[i], want) {
			t.Errorf("line %d %q, want it to start with %q", i, lines[i], want)
		}
	}
	if f := strings.Fields(lines[4]); f[3] != "-" || !strings.Contains(lines[4], "20.0 / 4883 IOPS   ") {
		t.Errorf("randread without raw: %q", lines[4])
	}
	raw, block := strings.Index(lines[0], "raw"), strings.Index(lines[0], "block")
	if got := strings.TrimSpace(lines[1][raw:block]); got != "400" {
		t.Errorf("seqwrite raw column %q, want 400 and no ratio", got)
	}
	if !strings.Contains(lines[len(lines)-1], "10s per run after 2s ramp, span 1GiB, backing files on tmpfs") {
		t.Errorf("footnote %q", lines[len(lines)-1])
	}
}

func TestDiskStat(t *testing.T) {
	// /sys/block/vda/stat of a running machine.
	const a = " 4058817   616706 242242194  4517899  3007102  1170296 425495936  7719907        0   806280 12430252   895428       70 470397376   139750   225058    52694\n"
	s, err := parseDiskStat(a)
	if err != nil {
		t.Fatal(err)
	}
	if s != (ioCounts{reads: 4058817, readBytes: 242242194 * 512, writes: 3007102, writtenBytes: 425495936 * 512, flushes: 225058}) {
		t.Errorf("parsed %+v", s)
	}
	// Before Linux 5.5: no flush counters.
	if s, err := parseDiskStat("1 0 8 0 2 0 16 0 0 0 0"); err != nil || s != (ioCounts{reads: 1, readBytes: 4096, writes: 2, writtenBytes: 8192}) {
		t.Errorf("11 fields: %+v, %v", s, err)
	}
	for _, bad := range []string{"", "1 2 3", "1 2 x 4 5 6 7 8", "1 0 8 0 2 0 16 0 0 0 0 0 0 0 0 -1"} {
		if _, err := parseDiskStat(bad); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}

func TestMeanRequest(t *testing.T) {
	a := ioCounts{reads: 5, readBytes: 5 << 20, writes: 7, writtenBytes: 7 << 12, flushes: 1}
	// 100 writes of 1 MiB and 10 reads of 4 KiB: the writes moved more.
	b := ioCounts{reads: a.reads + 10, readBytes: a.readBytes + 10<<12, writes: a.writes + 100, writtenBytes: a.writtenBytes + 100<<20, flushes: 4}
	d := b.sub(a)
	if d != (ioCounts{reads: 10, readBytes: 10 << 12, writes: 100, writtenBytes: 100 << 20, flushes: 3}) {
		t.Errorf("difference %+v", d)
	}
	if got := d.meanRequestKiB(); got != 1024 {
		t.Errorf("mean of the writes: %g KiB, want 1024", got)
	}
	b.readBytes += 1 << 30 // now the reads moved more
	if got, want := b.sub(a).meanRequestKiB(), float64(10<<12+1<<30)/1024/10; got != want {
		t.Errorf("mean of the reads: %g KiB, want %g", got, want)
	}
	if got := a.sub(a).meanRequestKiB(); got != 0 {
		t.Errorf("nothing done: %g", got)
	}
}

// testdata/agent-metrics.txt is what our server's /metrics served after
// 64 KiB writes and 4 KiB random reads on export pvc-0a1b2c3d.
func TestParseAgentMetrics(t *testing.T) {
	f, err := os.Open(filepath.Join("testdata", "agent-metrics.txt"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	c, err := parseAgentMetrics(f, "pvc-0a1b2c3d")
	if err != nil {
		t.Fatal(err)
	}
	if c != (ioCounts{reads: 4591, readBytes: 18804736, writes: 3722, writtenBytes: 243924992}) {
		t.Errorf("parsed %+v", c)
	}
	if got := c.meanRequestKiB(); got != 64 {
		t.Errorf("mean request %g KiB, want 64", got)
	}
	const two = `# HELP mpnbd_server_requests_total Requests handled.
mpnbd_server_requests_total{cmd="flush",export="pvc-a"} 12
mpnbd_server_requests_total{cmd="write",export="pvc-a"} 3
mpnbd_server_requests_total{cmd="trim",export="pvc-a"} 9
mpnbd_server_requests_total{cmd="write",export="pvc-b"} 5
mpnbd_server_written_bytes_total{export="pvc-b"} 5.24288e+06
mpnbd_server_written_bytes_total{export="pvc-a"} 12288
`
	for export, want := range map[string]ioCounts{
		"pvc-a": {writes: 3, writtenBytes: 12288, flushes: 12},
		"pvc-b": {writes: 5, writtenBytes: 5 << 20},
	} {
		if c, err := parseAgentMetrics(strings.NewReader(two), export); err != nil || c != want {
			t.Errorf("%s: %+v, %v; want %+v", export, c, err, want)
		}
	}
	if _, err := parseAgentMetrics(strings.NewReader(two), "pvc-c"); err == nil {
		t.Error("an export without counters: no error")
	}
	if _, err := parseAgentMetrics(strings.NewReader(`mpnbd_server_written_bytes_total{export="pvc-a"} lots`), "pvc-a"); err == nil {
		t.Error("a value that is no number: no error")
	}
}

func TestMountAt(t *testing.T) {
	const mi = `22 27 0:21 / /proc rw,relatime - proc proc rw
412 27 7:3 / /w/kubelet/staging/pvc-1 rw,relatime - xfs /dev/loop3 rw,attr2,inode64,logbufs=8,noquota
413 27 7:3 / /w/kubelet/pod\040x/volume rw,relatime - xfs /dev/loop3 rw,attr2,inode64,logbufs=8,noquota
414 27 0:6 /loop4 /w/kubelet/pod-block/volume rw,nosuid - devtmpfs udev rw,size=1k
`
	m, ok := mountAt([]byte(mi), "/w/kubelet/pod x/volume")
	if !ok || m.fsType != "xfs" || m.source != "/dev/loop3" || m.root != "/" ||
		m.opts != "rw,relatime,rw,attr2,inode64,logbufs=8,noquota" {
		t.Errorf("got %+v, %t", m, ok)
	}
	if m, ok := mountAt([]byte(mi), "/w/kubelet/pod-block/volume"); !ok || m.root != "/loop4" || m.fsType != "devtmpfs" {
		t.Errorf("bind of a device: %+v, %t", m, ok)
	}
	if _, ok := mountAt([]byte(mi), "/w/kubelet"); ok {
		t.Error("found a mount at a path that is none")
	}
}

func TestFormatQueue(t *testing.T) {
	q := map[string]string{"dio": "1", "max_sectors_kb": "1280", "read_ahead_kb": "128", "other": "x"}
	if got, want := formatQueue(q), "max_sectors_kb 1280, read_ahead_kb 128, dio 1"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

// TestDemoFio runs the demo with --fio, short runs on the smallest
// volume it takes: every column must have measured every workload it
// runs over all 4 paths, and nothing may be left afterwards. The numbers
// themselves are not judged: they depend on the machine.
func TestDemoFio(t *testing.T) {
	bin := requireDemo(t)
	for _, tool := range []string{"fio", "mkfs.xfs"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("--fio needs %s", tool)
		}
	}
	// The raw client is a command of this module.
	cmd := exec.Command("go", "build", "-trimpath", "-o", bin+"/", "github.com/mpnbd/mpnbd/e2e/cmd/nbdload")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building nbdload: %v\n%s", err, out)
	}
	name := topo.UniqueName(namePrefix)
	work := filepath.Join(t.TempDir(), "work")
	code, output, r := runDemo(t, bin, name, work, "--fio", "--fio-seconds", "1s", "--volume-size", "1GiB")
	t.Logf("demo output:\n%s", output)
	if code != 0 || !r.OK {
		t.Fatalf("exit code %d, ok %t, error %q", code, r.OK, r.Error)
	}
	b := r.FS
	if b == nil {
		t.Fatal("no fs_bench in the results")
	}
	if b.SpanBytes != 512<<20 || b.Seconds != 1 || len(b.Columns) != len(fsColumns) {
		t.Errorf("span %d, seconds %g, %d columns", b.SpanBytes, b.Seconds, len(b.Columns))
	}
	for i, c := range b.Columns {
		if c.Name != fsColumns[i] || c.Subflows != 4 {
			t.Errorf("column %d: %s with %d subflows, want %s with 4", i, c.Name, c.Subflows, fsColumns[i])
		}
		if c.Name != colRaw && (!strings.HasPrefix(c.Device, "/dev/") || c.Queue["max_sectors_kb"] == "") {
			t.Errorf("column %s: device %q, queue %v", c.Name, c.Device, c.Queue)
		}
		if (c.Name == colExt4 || c.Name == colXFS) != (c.MountOptions != "") {
			t.Errorf("column %s: mount options %q", c.Name, c.MountOptions)
		}
	}
	for _, row := range b.Rows {
		for _, col := range fsColumns {
			c := row.Results[col]
			want := !row.Buffered || col == colExt4 || col == colXFS
			if (c != nil) != want {
				t.Errorf("%s on %s: result %+v, want one: %t", row.Workload, col, c, want)
				continue
			}
			if c == nil {
				continue
			}
			if c.MBps <= 0 || c.IOPS <= 0 || (col != colRaw) != (c.Ratio > 0) {
				t.Errorf("%s on %s: %+v", row.Workload, col, c)
			}
			if col != colRaw && !row.Buffered && c.DeviceRequestKiB <= 0 {
				t.Errorf("%s on %s: no request size at the device", row.Workload, col)
			}
			// The raw client's requests reach the storage agent as
			// they are.
			if col == colRaw && c.AgentRequestKiB != float64(row.BlockSize)/1024 || c.AgentRequestKiB <= 0 {
				t.Errorf("%s on %s: %g KiB per request at the storage agent", row.Workload, col, c.AgentRequestKiB)
			}
		}
	}
	for _, want := range []string{"tear down the raw column's volume", "tear down the xfs column's volume", "buffered-read 1MiB (page cache)"} {
		if !strings.Contains(output, want) {
			t.Errorf("output lacks %q", want)
		}
	}
	if strings.Contains(output, "leftovers removed") {
		t.Errorf("the orderly teardown left something for the sweep")
	}
	if left, _ := filepath.Glob("*.state"); len(left) > 0 {
		t.Errorf("fio left files in the working directory: %v", left)
	}
	checkNothingLeft(t, bin, name, work)
}
