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
// tcp, multiconn, relay, kernel, ublk and fuse side by side (same VM, same
// four paths, same fio workloads). Only with MPNBD_VM_BENCH=1: it is a
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
	runMPTCPKernelVM(t, []string{"TestBenchTransports"}, env, benchVMTimeout(t))
}

// cpuJiffies returns the busy time of all CPUs (user, nice, system, irq,
// softirq, steal) from the first line of /proc/stat, in USER_HZ ticks.
func cpuJiffies() (uint64, error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, err
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return 0, fmt.Errorf("/proc/stat: unexpected first line %q", line)
	}
	var busy uint64
	for _, i := range []int{1, 2, 3, 6, 7, 8} { // user nice system irq softirq steal
		v, err := strconv.ParseUint(f[i], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("/proc/stat: %q: %v", line, err)
		}
		busy += v
	}
	return busy, nil
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
// boot and setup, then for each of up to six transports two random
// passes, mkfs, and the four sequential ones (device and ext4) at no less
// than 1 MB/s.
func benchVMTimeout(t *testing.T) time.Duration {
	mb, randTime := benchSettings(t)
	perTransport := 2*randTime + 4*time.Duration(mb)*time.Second + 2*time.Minute
	return 10*time.Minute + 6*perTransport
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
	j0, err := cpuJiffies()
	if err != nil {
		t.Fatal(err)
	}
	r := startFioArgs(t, args)
	res := r.wait(t, benchFioLimit, stuck)
	j1, err := cpuJiffies()
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

// benchResult is what one transport measured; failed is set when a pass
// or the attach failed.
type benchResult struct {
	mode         attach.Transport
	seqW, seqR   measured
	randW, randR measured
	// ext4W and ext4R are the sequential passes on a file of ext4 on the
	// same device.
	ext4W, ext4R measured
	failed       bool
}

// TestBenchTransports (guest, MPTCP kernel) runs fio on each transport's
// device, all O_DIRECT at queue depth 32: 1 MiB sequential write of the
// first MPNBD_BENCH_MB MiB with crc32c verify blocks, a sequential read of
// them that checks every block (its checksum, and the offset recorded in
// it), then 4 KiB random write and random read over the same region for
// MPNBD_BENCH_SECONDS each; then the same sequential passes on a file of
// ext4 made on the device. It prints throughput and CPU seconds per GB
// (the whole guest: client, server and relay share it) with ratios to
// tcp, one block per workload, and ext4's ratios to the device. Nothing
// is asserted but that the data reads back.
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
	var rows []benchResult
	for _, mode := range modes {
		row := benchResult{mode: mode, failed: true}
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
			size := "--size=" + strconv.FormatInt(n, 10)
			// The write fills every block with crc32c verify data; the read
			// pass checks each block it reads, so a transport that loses,
			// misplaces or corrupts a write fails here instead of posting a
			// number.
			verify := []string{"--bs=1M", size, "--verify=crc32c", "--verify_state_save=0"}
			row.seqW = fioPass(t, dev, "write", n, stuck, append(verify, "--rw=write", "--do_verify=0", "--end_fsync=1")...)
			row.seqR = fioPass(t, dev, "read", n, stuck, append(verify, "--rw=read", "--verify_fatal=1")...)
			random := []string{"--bs=4k", size, "--time_based", "--runtime=" + strconv.Itoa(int(randTime.Seconds())),
				"--randrepeat=0"}
			row.randW = fioPass(t, dev, "write", 0, stuck, append(random, "--rw=randwrite", "--end_fsync=1")...)
			row.randR = fioPass(t, dev, "read", 0, stuck, append(random, "--rw=randread")...)
			row.ext4W, row.ext4R = ext4SeqPasses(t, dev, verify, n, stuck)
			if err := a.Detach(context.Background(), tg.VolumeID); err != nil {
				t.Fatal(err)
			}
			gone(st)
			row.failed = false
		})
		rows = append(rows, row)
	}
	if len(rows) == 0 || rows[0].mode != attach.TCP || rows[0].failed {
		t.Fatalf("no tcp baseline (rows %+v)", rows)
	}
	table := benchTable(rows, mb, randTime)
	t.Logf("transport benchmark:\n%s", table)
	fmt.Print("BENCH-TABLE-BEGIN\n" + table + "BENCH-TABLE-END\n")
}

// ext4SeqPasses formats dev with ext4 (its inode tables and journal
// written out now, not in the background during the passes), mounts it
// and runs the sequential passes on a file of n bytes: what a pod's
// Filesystem volume gets of its transport.
func ext4SeqPasses(t *testing.T, dev string, verify []string, n int64, stuck func(string)) (w, r measured) {
	t.Helper()
	run(t, "mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", dev)
	mnt := t.TempDir()
	run(t, "mount", dev, mnt)
	file := filepath.Join(mnt, "bench")
	w = fioPass(t, file, "write", n, stuck, append(verify, "--rw=write", "--do_verify=0", "--end_fsync=1")...)
	r = fioPass(t, file, "read", n, stuck, append(verify, "--rw=read", "--verify_fatal=1")...)
	run(t, "umount", mnt)
	return w, r
}

// benchTable formats rows, one block per workload, with ratios to the
// first row (tcp).
func benchTable(rows []benchResult, mb int, randTime time.Duration) string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "fio, O_DIRECT, libaio, queue depth %d, 4 paths, under qemu TCG (ratios matter, not absolutes);\n", benchDepth)
	fmt.Fprintf(&sb, "cpu = busy CPU seconds of the whole guest (client, server, relay, fio) per GB moved\n")
	block := func(title string, iops bool, pick func(benchResult) (w, r measured)) {
		fmt.Fprintf(&sb, "\n%s\n", title)
		hdr := []string{"transport", "write", "read"}
		unit := []string{"", "MB/s", "MB/s"}
		if iops {
			hdr = append(hdr, "write", "read")
			unit = append(unit, "IOPS", "IOPS")
		}
		hdr = append(hdr, "w cpu", "r cpu", "w/tcp", "r/tcp", "wcpu/tcp", "rcpu/tcp")
		unit = append(unit, "s/GB", "s/GB", "", "", "", "")
		for _, line := range [][]string{hdr, unit} {
			fmt.Fprintf(&sb, "%-10s", line[0])
			for _, c := range line[1:] {
				fmt.Fprintf(&sb, " %9s", c)
			}
			sb.WriteString("\n")
		}
		bw, br := pick(rows[0])
		for _, r := range rows {
			if r.failed {
				fmt.Fprintf(&sb, "%-10s failed (see the log)\n", r.mode)
				continue
			}
			w, rd := pick(r)
			fmt.Fprintf(&sb, "%-10s %9.1f %9.1f", r.mode, w.mbps, rd.mbps)
			if iops {
				fmt.Fprintf(&sb, " %9.0f %9.0f", w.iops, rd.iops)
			}
			fmt.Fprintf(&sb, " %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f\n", w.cpuPerGB, rd.cpuPerGB,
				w.mbps/bw.mbps, rd.mbps/br.mbps, w.cpuPerGB/bw.cpuPerGB, rd.cpuPerGB/br.cpuPerGB)
		}
	}
	block(fmt.Sprintf("sequential 1 MiB: write %d MiB, then read it back verified (crc32c)", mb), false,
		func(r benchResult) (measured, measured) { return r.seqW, r.seqR })
	block(fmt.Sprintf("random 4 KiB over the same %d MiB: write %v, then read %v", mb, randTime, randTime), true,
		func(r benchResult) (measured, measured) { return r.randW, r.randR })

	fmt.Fprintf(&sb, "\next4, sequential 1 MiB on a file of %d MiB (the same passes), against the transport's block device\n", mb)
	fmt.Fprintf(&sb, "%-10s %9s %9s %9s %9s %9s %9s\n", "transport", "write", "read", "w cpu", "r cpu", "w/dev", "r/dev")
	fmt.Fprintf(&sb, "%-10s %9s %9s %9s %9s %9s %9s\n", "", "MB/s", "MB/s", "s/GB", "s/GB", "", "")
	for _, r := range rows {
		if r.failed {
			fmt.Fprintf(&sb, "%-10s failed (see the log)\n", r.mode)
			continue
		}
		fmt.Fprintf(&sb, "%-10s %9.1f %9.1f %9.2f %9.2f %9.2f %9.2f\n", r.mode, r.ext4W.mbps, r.ext4R.mbps,
			r.ext4W.cpuPerGB, r.ext4R.cpuPerGB, r.ext4W.mbps/r.seqW.mbps, r.ext4R.mbps/r.seqR.mbps)
	}
	return sb.String()
}
