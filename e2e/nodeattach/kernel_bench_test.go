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

package nodeattach

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/e2e/bench"
	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/attach/fuse"
	"github.com/mpnbd/mpnbd/pkg/ublk"
)

// envBench enables TestBenchTransportsMPTCPKernelInVM (hack/bench-vm.sh
// sets it); envBenchMB is the amount each transport writes and reads
// sequentially, and the region the random passes cover; envBenchSeconds
// is the length of each random pass.
const (
	envBench        = "MPNBD_VM_BENCH"
	envBenchMB      = "MPNBD_BENCH_MB"
	envBenchSeconds = "MPNBD_BENCH_SECONDS"
	// envBenchOnly names the transports to measure besides tcp (the
	// baseline, always first), comma-separated; empty means all.
	envBenchOnly = "MPNBD_BENCH_TRANSPORTS"
)

// The defaults keep make bench-vm, boot included, to about 10 minutes
// under TCG on two idle host cores, under 25 on busy ones.
const (
	defaultBenchMB      = 256
	defaultBenchSeconds = 20
)

// benchAttacher returns an attacher of mode whose connections leave from
// the client namespace, and a check that a detach left nothing behind.
func benchAttacher(t *testing.T, tp *topo.Topology, mode attach.Transport) (attach.Attacher, func(*storage)) {
	t.Helper()
	switch mode {
	case attach.Ublk:
		return newUblkAttacher(t, tp, t.TempDir()), func(st *storage) { waitServerConns(t, st, 0) }
	case attach.FUSE:
		a := newFuseAttacher(t, tp, t.TempDir())
		return a, func(st *storage) { waitServerConns(t, st, 0) }
	}
	a, nl := newAttacher(t, tp, mode)
	return a, func(st *storage) { waitGone(t, nl, st) }
}

// newFuseAttacher makes a fuse Attacher whose volume server processes
// (this test binary, see TestMain) run in the topology's client network
// namespace.
func newFuseAttacher(t *testing.T, tp *topo.Topology, stateDir string) *fuse.Attacher {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return fuse.New(fuse.Config{StateDir: stateDir, Logger: testLogger(t),
		ServeCommand: []string{"nsenter", "--net=/run/netns/" + tp.ClientNS, "--", exe, fuse.ServeArg}})
}

// TestBenchTransportsMPTCPKernelInVM boots the MPTCP kernel and prints
// our raw client, tcp, multiconn, relay, kernel, ublk and fuse side by
// side (same VM, same four paths, same fio workloads on each device and
// on ext4 and xfs made on it). Only with MPNBD_VM_BENCH=1: it is a
// measurement, not a check, and takes minutes under TCG.
func TestBenchTransportsMPTCPKernelInVM(t *testing.T) {
	if os.Getenv("MPNBD_IN_VM") == "1" {
		t.Skip("already inside the VM")
	}
	if os.Getenv(envBench) != "1" {
		t.Skipf("a benchmark: set %s=1 (hack/bench-vm.sh)", envBench)
	}
	env := map[string]string{}
	for _, k := range []string{envBenchMB, envBenchSeconds, envBenchOnly} {
		if v := os.Getenv(k); v != "" {
			env[k] = v
		}
	}
	if _, err := exec.LookPath("fio"); err != nil {
		t.Fatalf("the benchmark runs fio in the VM, copied from the host, which lacks it (apt-get install fio): %v", err)
	}
	var tools []string
	if p, err := exec.LookPath("mkfs.xfs"); err == nil {
		tools = append(tools, p)
	} else {
		t.Logf("no mkfs.xfs on the host (apt-get install xfsprogs): xfs is not measured")
	}
	runMPTCPKernelVM(t, []string{"TestBenchTransports"}, env, benchVMTimeout(t), tools...)
}

// userHZ is the unit of /proc/stat (USER_HZ is 100 on x86).
const userHZ = 100

// benchSettings returns the amount each transport writes and reads
// sequentially, in MiB, and the length of each random pass.
func benchSettings(t *testing.T) (mb int, randTime time.Duration) {
	t.Helper()
	mb, secs := defaultBenchMB, defaultBenchSeconds
	if s := os.Getenv(envBenchMB); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v <= 0 || v > volSize>>20 {
			t.Fatalf("%s=%q: want 1..%d", envBenchMB, s, volSize>>20)
		}
		mb = v
	}
	if s := os.Getenv(envBenchSeconds); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v <= 0 {
			t.Fatalf("%s=%q: want a positive number of seconds", envBenchSeconds, s)
		}
		secs = v
	}
	return mb, time.Duration(secs) * time.Second
}

// onlyTransports keeps tcp and the transports of the comma-separated list
// (all of them when it is empty); a name that is not one of modes is an
// error.
func onlyTransports(modes []attach.Transport, list string) ([]attach.Transport, error) {
	if strings.TrimSpace(list) == "" {
		return modes, nil
	}
	want := map[attach.Transport]bool{attach.TCP: true}
	for _, name := range strings.Split(list, ",") {
		m := attach.Transport(strings.TrimSpace(name))
		if !slices.Contains(modes, m) {
			return nil, fmt.Errorf("%q is not one of %v", name, modes)
		}
		want[m] = true
	}
	var out []attach.Transport
	for _, m := range modes {
		if want[m] {
			out = append(out, m)
		}
	}
	return out, nil
}

// benchVMTimeout bounds the benchmark's VM run. It only catches a hang:
// boot and setup, the raw client's four passes, then for each of up to
// six transports the random passes and the sequential ones (no less than
// 1 MB/s) on the device, ext4 and xfs, and two mkfs.
func benchVMTimeout(t *testing.T) time.Duration {
	mb, randTime := benchSettings(t)
	perTransport := 6*randTime + 6*time.Duration(mb)*time.Second + 3*time.Minute
	return 10*time.Minute + 5*randTime + 6*perTransport
}

// measured is one fio pass of one transport.
type measured struct {
	mbps     float64 // MB/s (10^6 bytes) as fio reports it
	iops     float64
	cpuPerGB float64 // busy CPU seconds of the whole guest per GB moved
}

// fioDirection is the part of one direction of fio's JSON job report
// that the benchmark reads.
type fioDirection struct {
	IOBytes int64   `json:"io_bytes"`
	BW      int64   `json:"bw_bytes"` // bytes/s
	IOPS    float64 `json:"iops"`
}

// parseFioBench returns the direction of the one job in fio's JSON
// report out that moved data in direction dir ("read" or "write").
func parseFioBench(out []byte, dir string) (fioDirection, error) {
	var rep struct {
		Jobs []struct {
			Error int          `json:"error"`
			Read  fioDirection `json:"read"`
			Write fioDirection `json:"write"`
		} `json:"jobs"`
	}
	// fio may print notes before the report.
	if i := bytes.IndexByte(out, '{'); i >= 0 {
		out = out[i:]
	}
	if err := json.Unmarshal(out, &rep); err != nil {
		return fioDirection{}, fmt.Errorf("fio's report: %v", err)
	}
	if len(rep.Jobs) != 1 {
		return fioDirection{}, fmt.Errorf("fio's report has %d jobs, want 1", len(rep.Jobs))
	}
	j := rep.Jobs[0]
	if j.Error != 0 {
		return fioDirection{}, fmt.Errorf("fio's job failed with error %d", j.Error)
	}
	if dir == "read" {
		return j.Read, nil
	}
	return j.Write, nil
}

// benchFioLimit bounds one fio pass. It only catches a hang, so that the
// other transports still run; a pass takes seconds to a few minutes.
const benchFioLimit = 10 * time.Minute

// benchDepth is the queue depth of every pass.
const benchDepth = 32

// fioPass runs one fio job on dev, at queue depth benchDepth with
// O_DIRECT through libaio, and measures it: throughput and IOPS as fio
// reports them, busy CPU of the guest from /proc/stat around fio's run.
// want is the number of bytes the pass must move in direction dir (0:
// any, for time-based passes). stuck reports a pass that does not end.
func fioPass(t *testing.T, dev, dir string, want int64, stuck func(string), job ...string) measured {
	t.Helper()
	args := append([]string{"--name=bench", "--filename=" + dev, "--direct=1", "--ioengine=libaio",
		"--iodepth=" + strconv.Itoa(benchDepth), "--output-format=json"}, job...)
	j0, _, err := bench.CPUJiffies()
	if err != nil {
		t.Fatal(err)
	}
	r := startFioArgs(t, args)
	res := r.wait(t, benchFioLimit, stuck)
	j1, _, err := bench.CPUJiffies()
	if err != nil {
		t.Fatal(err)
	}
	if res.err != nil {
		t.Fatalf("fio %s: %v\n%s", strings.Join(job, " "), res.err, tail(res.output, 30))
	}
	d, err := parseFioBench(r.stdout.Bytes(), dir)
	if err != nil {
		t.Fatalf("fio %s: %v\n%s", strings.Join(job, " "), err, tail(res.output, 30))
	}
	if d.IOBytes <= 0 || want > 0 && d.IOBytes != want {
		t.Fatalf("fio %s: %s %d bytes, want %d\n%s", strings.Join(job, " "), dir, d.IOBytes, want, tail(res.output, 30))
	}
	gb := float64(d.IOBytes) / 1e9
	return measured{mbps: float64(d.BW) / 1e6, iops: d.IOPS, cpuPerGB: float64(j1-j0) / userHZ / gb}
}

// passes are the four fio passes of one surface: the sequential write and
// read, the random write and read. skipped says why a surface was not
// measured (no xfs in the kernel, say).
type passes struct {
	seqW, seqR, randW, randR measured
	skipped                  string
}

// surfaces are where the passes run: the transport's block device, and a
// file on ext4 and on xfs made on it (what a pod's Filesystem volume gets
// of its transport).
var surfaces = []string{"device", "ext4", "xfs"}

// raw is the row of our NBD client without a block device: the
// baseline every transport and file system is a ratio to.
const raw = attach.Transport("raw")

// benchResult is what one transport measured, per surface; failed is set
// when a pass or the attach failed.
type benchResult struct {
	mode     attach.Transport
	surfaces map[string]passes
	subflows int // the raw client's connection, most subflows seen
	failed   bool
}

// TestBenchTransports (guest, MPTCP kernel) first measures our raw NBD
// client (no block device, no file system) over MPTCP on the four paths,
// then runs fio on each transport's device, all O_DIRECT at queue depth
// 32: 1 MiB sequential write of the first MPNBD_BENCH_MB MiB with crc32c
// verify blocks, a sequential read of them that checks every block (its
// checksum, and the offset recorded in it), then 4 KiB random write and
// random read over the same region for MPNBD_BENCH_SECONDS each; then the
// same four passes on a file of ext4, and of xfs, made on the device. It
// prints throughput (IOPS for 4 KiB) and CPU seconds per GB (the whole
// guest: client, server and relay share it) with ratios to the raw
// client, one block per workload. Nothing is asserted but that the data
// reads back.
func TestBenchTransports(t *testing.T) {
	requireMPTCPKernel(t)
	if _, err := exec.LookPath("fio"); err != nil {
		t.Fatalf("fio is not in the VM: %v", err)
	}
	mb, randTime := benchSettings(t)
	n := int64(mb) << 20

	modes := []attach.Transport{attach.TCP, attach.MultiConn, attach.Relay, attach.Kernel}
	if err := ublk.Available(); err == nil {
		modes = append(modes, attach.Ublk)
	} else {
		t.Logf("no ublk in this kernel: %v", err)
	}
	if err := fuse.Available(); err == nil {
		modes = append(modes, attach.FUSE)
	} else {
		t.Logf("no fuse in this VM: %v", err)
	}
	modes, err := onlyTransports(modes, os.Getenv(envBenchOnly))
	if err != nil {
		t.Fatalf("%s: %v", envBenchOnly, err)
	}
	noXFS := xfsMissing()
	if noXFS != "" {
		t.Logf("xfs is not measured: %s", noXFS)
	}
	rows := []benchResult{rawPasses(t, n, randTime)}
	if rows[0].failed {
		t.Fatalf("no raw baseline: the raw client failed")
	}
	for _, mode := range modes {
		row := benchResult{mode: mode, failed: true, surfaces: map[string]passes{}}
		t.Run(string(mode), func(t *testing.T) {
			tp := guestTopology(t)
			useMPTCP := mode != attach.TCP && mode != attach.MultiConn
			st := newStorage(t, tp, volSize, useMPTCP)
			a, gone := benchAttacher(t, tp, mode)
			tg := st.target(volID(t))
			att, err := a.Attach(context.Background(), tg, attach.Options{})
			if err != nil {
				t.Fatal(err)
			}
			if useMPTCP {
				waitSubflows(t, a, tg.VolumeID, len(tp.Paths))
			}
			dev := att.Device
			stuck := attacherStuck(t, a, tg, dev)
			row.surfaces["device"] = fioPasses(t, dev, n, randTime, stuck)
			row.surfaces["ext4"] = fsPasses(t, "ext4", dev, n, randTime, stuck)
			if noXFS != "" {
				row.surfaces["xfs"] = passes{skipped: noXFS}
			} else {
				row.surfaces["xfs"] = fsPasses(t, "xfs", dev, n, randTime, stuck)
			}
			if err := a.Detach(context.Background(), tg.VolumeID); err != nil {
				t.Fatal(err)
			}
			gone(st)
			row.failed = false
		})
		rows = append(rows, row)
	}
	table := benchTable(rows, mb, randTime)
	t.Logf("transport benchmark:\n%s", table)
	fmt.Print("BENCH-TABLE-BEGIN\n" + table + "BENCH-TABLE-END\n")
}

// rawPasses measures our NBD client on its own: one MPTCP connection over
// the four paths to a fresh export, from this (the client) namespace, the
// same four workloads as fio's passes, each for randTime over the first n
// bytes, at the same queue depth.
func rawPasses(t *testing.T, n int64, randTime time.Duration) benchResult {
	row := benchResult{mode: raw, failed: true, surfaces: map[string]passes{}}
	t.Run(string(raw), func(t *testing.T) {
		tp := guestTopology(t)
		st := newStorage(t, tp, volSize, true)
		load := func(rw string, bs int) measured {
			t.Helper()
			j0, _, err := bench.CPUJiffies()
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), randTime+benchFioLimit)
			defer cancel()
			rep, err := bench.RunLoad(ctx, bench.LoadConfig{Addr: st.addr, Export: "vol", MPTCP: true, RW: rw,
				BlockSize: bs, QueueDepth: benchDepth, Duration: randTime, Span: n, Seed: 1})
			if err != nil {
				t.Fatalf("raw %s: %v", rw, err)
			}
			j1, _, err := bench.CPUJiffies()
			if err != nil {
				t.Fatal(err)
			}
			if !rep.OK() {
				t.Fatalf("raw %s: %s", rw, rep.Problem())
			}
			if len(rep.SubflowsMax) == 1 && rep.SubflowsMax[0] > row.subflows {
				row.subflows = rep.SubflowsMax[0]
			}
			gb := float64(rep.Bytes) / 1e9
			return measured{mbps: rep.MBps, iops: rep.IOPS, cpuPerGB: float64(j1-j0) / userHZ / gb}
		}
		var p passes
		p.seqW = load("write", 1<<20)
		p.seqR = load("read", 1<<20)
		p.randW = load("randwrite", 4<<10)
		p.randR = load("randread", 4<<10)
		// The raw client's own correctness pass over what it wrote.
		ctx, cancel := context.WithTimeout(context.Background(), benchFioLimit)
		defer cancel()
		rep, err := bench.RunLoad(ctx, bench.LoadConfig{Addr: st.addr, Export: "vol", MPTCP: true, RW: "write",
			BlockSize: 1 << 20, QueueDepth: 8, Span: n, Verify: true})
		if err != nil || !rep.OK() {
			t.Fatalf("raw verify: %v %s", err, rep.Problem())
		}
		row.surfaces["device"] = p
		row.failed = false
	})
	return row
}

// fioPasses runs the four passes on file (a device, or a file on a file
// system): the 1 MiB sequential write fills every block with crc32c verify
// data and the read pass checks each block it reads, so a transport that
// loses, misplaces or corrupts a write fails here instead of posting a
// number; then 4 KiB random write and read over the same region.
func fioPasses(t *testing.T, file string, n int64, randTime time.Duration, stuck func(string)) passes {
	t.Helper()
	size := "--size=" + strconv.FormatInt(n, 10)
	verify := []string{"--bs=1M", size, "--verify=crc32c", "--verify_state_save=0"}
	var p passes
	p.seqW = fioPass(t, file, "write", n, stuck, append(verify, "--rw=write", "--do_verify=0", "--end_fsync=1")...)
	p.seqR = fioPass(t, file, "read", n, stuck, append(verify, "--rw=read", "--verify_fatal=1")...)
	random := []string{"--bs=4k", size, "--time_based", "--runtime=" + strconv.Itoa(int(randTime.Seconds())),
		"--randrepeat=0"}
	p.randW = fioPass(t, file, "write", 0, stuck, append(random, "--rw=randwrite", "--end_fsync=1")...)
	p.randR = fioPass(t, file, "read", 0, stuck, append(random, "--rw=randread")...)
	return p
}

// fsPasses makes file system fs (ext4 or xfs) on dev, with its metadata
// written out now, not in the background during the passes, mounts it
// and runs the four passes on a file of n bytes.
func fsPasses(t *testing.T, fs, dev string, n int64, randTime time.Duration, stuck func(string)) passes {
	t.Helper()
	switch fs {
	case "ext4":
		run(t, "mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", dev)
	case "xfs":
		run(t, "mkfs.xfs", "-q", "-f", dev)
	default:
		t.Fatalf("no file system %q", fs)
	}
	mnt := t.TempDir()
	run(t, "mount", "-t", fs, dev, mnt)
	p := fioPasses(t, filepath.Join(mnt, "bench"), n, randTime, stuck)
	run(t, "umount", mnt)
	return p
}

// xfsMissing says why xfs cannot be measured in this guest, or "".
func xfsMissing() string {
	if _, err := exec.LookPath("mkfs.xfs"); err != nil {
		return "no mkfs.xfs in the VM (apt-get install xfsprogs on the host)"
	}
	b, err := os.ReadFile("/proc/filesystems")
	if err != nil {
		return err.Error()
	}
	for _, line := range strings.Split(string(b), "\n") {
		if strings.TrimSpace(line) == "xfs" {
			return ""
		}
	}
	return "the kernel has no xfs (XFS_FS)"
}

// benchTable formats rows (the raw client first), one block per workload:
// each transport's device, ext4 and xfs, each with its ratio to the raw
// client; then the guest's CPU per GB on each device.
func benchTable(rows []benchResult, mb int, randTime time.Duration) string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "fio, O_DIRECT, libaio, queue depth %d, 4 paths, under qemu TCG (ratios matter, not absolutes);\n", benchDepth)
	fmt.Fprintf(&sb, "raw = our NBD client alone over MPTCP (%d subflows), the same workloads at the same depth; (x) = ratio to raw\n", rows[0].subflows)
	for _, r := range rows {
		if p, ok := r.surfaces["xfs"]; ok && p.skipped != "" {
			fmt.Fprintf(&sb, "xfs not measured: %s\n", p.skipped)
			break
		}
	}
	base := rows[0].surfaces["device"]
	cell := func(v, b float64) string {
		if b <= 0 {
			return fmt.Sprintf("%7.1f      ", v)
		}
		return fmt.Sprintf("%7.1f (%.2f)", v, v/b)
	}
	block := func(title, unit string, pick func(passes) (w, r float64)) {
		fmt.Fprintf(&sb, "\n%s\n%-10s", title, "transport")
		for _, dir := range []string{"write", "read"} {
			for _, s := range surfaces {
				fmt.Fprintf(&sb, " %14s", s+" "+dir)
			}
		}
		fmt.Fprintf(&sb, "\n%-10s", "")
		for i := 0; i < 2*len(surfaces); i++ {
			fmt.Fprintf(&sb, " %14s", unit)
		}
		sb.WriteString("\n")
		bw, br := pick(base)
		for _, r := range rows {
			fmt.Fprintf(&sb, "%-10s", r.mode)
			if r.failed {
				sb.WriteString(" failed (see the log)\n")
				continue
			}
			for dir := 0; dir < 2; dir++ {
				for _, s := range surfaces {
					p, ok := r.surfaces[s]
					if !ok || p.skipped != "" {
						fmt.Fprintf(&sb, " %14s", "-")
						continue
					}
					w, rd := pick(p)
					v, b := w, bw
					if dir == 1 {
						v, b = rd, br
					}
					fmt.Fprintf(&sb, " %14s", cell(v, b))
				}
			}
			sb.WriteString("\n")
		}
	}
	block(fmt.Sprintf("sequential 1 MiB: write %d MiB, then read it back verified (crc32c)", mb), "MB/s",
		func(p passes) (float64, float64) { return p.seqW.mbps, p.seqR.mbps })
	block(fmt.Sprintf("random 4 KiB over the same %d MiB: write %v, then read %v", mb, randTime, randTime), "IOPS",
		func(p passes) (float64, float64) { return p.randW.iops, p.randR.iops })
	fmt.Fprintf(&sb, "\nbusy CPU seconds of the whole guest (client, server, relay, fio) per GB moved, on the device (x = ratio to raw)\n")
	fmt.Fprintf(&sb, "%-10s %14s %14s %14s %14s\n", "transport", "seq write", "seq read", "rand write", "rand read")
	for _, r := range rows {
		if r.failed {
			fmt.Fprintf(&sb, "%-10s failed (see the log)\n", r.mode)
			continue
		}
		d := r.surfaces["device"]
		fmt.Fprintf(&sb, "%-10s %14s %14s %14s %14s\n", r.mode, cpuCell(d.seqW, base.seqW), cpuCell(d.seqR, base.seqR),
			cpuCell(d.randW, base.randW), cpuCell(d.randR, base.randR))
	}
	return sb.String()
}

// cpuCell is one CPU-per-GB cell with its ratio to the baseline's.
func cpuCell(m, base measured) string {
	if base.cpuPerGB <= 0 {
		return fmt.Sprintf("%7.2f      ", m.cpuPerGB)
	}
	return fmt.Sprintf("%7.2f (%.2f)", m.cpuPerGB, m.cpuPerGB/base.cpuPerGB)
}

func TestBenchTable(t *testing.T) {
	p := func(seq, iops, cpu float64) passes {
		m := func(v float64) measured { return measured{mbps: v, iops: iops, cpuPerGB: cpu} }
		return passes{seqW: m(seq), seqR: m(2 * seq), randW: m(0), randR: m(0)}
	}
	rows := []benchResult{
		{mode: raw, subflows: 4, surfaces: map[string]passes{"device": p(100, 1000, 1)}},
		{mode: attach.Relay, surfaces: map[string]passes{"device": p(50, 500, 2), "ext4": p(90, 250, 3), "xfs": {skipped: "no xfs"}}},
		{mode: attach.Ublk, failed: true},
	}
	got := benchTable(rows, 256, 20*time.Second)
	for _, want := range []string{
		"(4 subflows)",
		"50.0 (0.50)",  // relay's device write against raw's 100
		"90.0 (0.90)",  // ext4 write
		"180.0 (0.90)", // ext4 read against raw's 200
		"500.0 (0.50)", // 4 KiB IOPS
		"2.00 (2.00)",  // CPU per GB
		"ublk       failed (see the log)",
		"xfs not measured: no xfs",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("the table lacks %q:\n%s", want, got)
		}
	}
	// relay's sequential row: device and ext4 cells of two fields each,
	// then xfs skipped.
	for _, line := range strings.Split(got, "\n") {
		if strings.HasPrefix(line, "relay ") {
			if f := strings.Fields(line); len(f) < 6 || f[5] != "-" {
				t.Errorf("relay's row should show xfs as -: %q", line)
			}
			break
		}
	}
	t.Logf("\n%s", got)
}
