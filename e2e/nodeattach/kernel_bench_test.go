package nodeattach

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/e2e/topo"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/attach/fuse"
	"github.com/mpnbd/mpnbd/pkg/ublk"
)

// envBench enables TestBenchTransportsMPTCPKernelInVM (hack/bench-vm.sh
// sets it); envBenchMB is the amount each transport writes and reads.
const (
	envBench   = "MPNBD_VM_BENCH"
	envBenchMB = "MPNBD_BENCH_MB"
)

// benchAttacher returns an attacher of mode whose connections leave from
// the client namespace, and a check that a detach left nothing behind.
func benchAttacher(t *testing.T, tp *topo.Topology, mode attach.Transport) (attach.Attacher, func(*storage)) {
	t.Helper()
	switch mode {
	case attach.Ublk:
		return newUblkAttacher(t, tp, t.TempDir()), func(st *storage) { waitServerConns(t, st, 0) }
	case attach.FUSE:
		a := fuse.New(fuse.Config{StateDir: t.TempDir(), InProcess: true, Logger: testLogger(t), DialContext: clientDialer(tp.ClientNS)})
		return a, func(st *storage) { waitServerConns(t, st, 0) }
	}
	a, nl := newAttacher(t, tp, mode)
	return a, func(st *storage) { waitGone(t, nl, st) }
}

// TestBenchTransportsMPTCPKernelInVM boots the MPTCP kernel and prints
// kernel, ublk, relay, fuse, multiconn and tcp side by side (same VM, same four paths,
// same workload). Only with MPNBD_VM_BENCH=1: it is a measurement, not a
// check, and takes minutes under TCG.
func TestBenchTransportsMPTCPKernelInVM(t *testing.T) {
	if os.Getenv("MPNBD_IN_VM") == "1" {
		t.Skip("already inside the VM")
	}
	if os.Getenv(envBench) != "1" {
		t.Skipf("a benchmark: set %s=1 (hack/bench-vm.sh)", envBench)
	}
	env := map[string]string{}
	if mb := os.Getenv(envBenchMB); mb != "" {
		env[envBenchMB] = mb
	}
	runMPTCPKernelVM(t, []string{"TestBenchTransports"}, env)
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

// measured is one direction of one transport's run.
type measured struct {
	mbps     float64 // MB/s (10^6 bytes)
	cpuPerGB float64 // busy CPU seconds of the whole guest per GB moved
}

// timeIO runs fn, which moves n bytes, and measures wall time and the
// guest's busy CPU time.
func timeIO(t *testing.T, n int64, fn func() error) measured {
	t.Helper()
	j0, err := cpuJiffies()
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := fn(); err != nil {
		t.Fatal(err)
	}
	el := time.Since(start).Seconds()
	j1, err := cpuJiffies()
	if err != nil {
		t.Fatal(err)
	}
	gb := float64(n) / 1e9
	return measured{mbps: float64(n) / 1e6 / el, cpuPerGB: float64(j1-j0) / userHZ / gb}
}

// benchBlock is the O_DIRECT request size, the same as dd bs=1M.
const benchBlock = 1 << 20

// stampBlock makes block i of the benchmark data: base with i in its
// first eight bytes, so that a misplaced block does not verify.
func stampBlock(buf, base []byte, i int) {
	copy(buf, base)
	binary.LittleEndian.PutUint64(buf, uint64(i))
}

func benchWrite(dev string, base []byte, blocks int) error {
	f, err := os.OpenFile(dev, os.O_WRONLY|unix.O_DIRECT, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	buf := alignedBuf(benchBlock)
	for i := 0; i < blocks; i++ {
		stampBlock(buf, base, i)
		if _, err := f.WriteAt(buf, int64(i)*benchBlock); err != nil {
			return fmt.Errorf("write block %d: %w", i, err)
		}
	}
	if err := f.Sync(); err != nil {
		return err
	}
	return f.Close()
}

func benchRead(dev string, base []byte, blocks int) error {
	f, err := os.OpenFile(dev, os.O_RDONLY|unix.O_DIRECT, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	buf := alignedBuf(benchBlock)
	want := make([]byte, benchBlock)
	for i := 0; i < blocks; i++ {
		if _, err := f.ReadAt(buf, int64(i)*benchBlock); err != nil {
			return fmt.Errorf("read block %d: %w", i, err)
		}
		stampBlock(want, base, i)
		if !bytes.Equal(buf, want) {
			return fmt.Errorf("block %d reads back different data", i)
		}
	}
	return nil
}

// TestBenchTransports (guest, MPTCP kernel) writes and reads the same
// amount sequentially with 1 MiB O_DIRECT requests through each
// transport's device and prints throughput and CPU seconds per GB (the
// whole guest: client, server and relay share it), with ratios to tcp.
// Nothing is asserted but that the data reads back.
func TestBenchTransports(t *testing.T) {
	requireMPTCPKernel(t)
	mb := 256
	if s := os.Getenv(envBenchMB); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v <= 0 || v > volSize>>20 {
			t.Fatalf("%s=%q: want 1..%d", envBenchMB, s, volSize>>20)
		}
		mb = v
	}
	blocks := mb
	n := int64(blocks) * benchBlock
	base := make([]byte, benchBlock)
	rand.Read(base)

	type row struct {
		mode        attach.Transport
		write, read measured
	}
	var rows []row
	modes := []attach.Transport{attach.TCP, attach.MultiConn, attach.Relay, attach.Kernel}
	if ublk.Available() == nil {
		modes = append(modes, attach.Ublk)
	} else {
		t.Logf("no ublk in this kernel: %v", ublk.Available())
	}
	if fuse.Available() == nil {
		modes = append(modes, attach.FUSE)
	}
	for _, mode := range modes {
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
			w := timeIO(t, n, func() error { return benchWrite(att.Device, base, blocks) })
			r := timeIO(t, n, func() error { return benchRead(att.Device, base, blocks) })
			rows = append(rows, row{mode, w, r})
			if err := a.Detach(context.Background(), tg.VolumeID); err != nil {
				t.Fatal(err)
			}
			gone(st)
		})
	}
	if len(rows) == 0 || rows[0].mode != attach.TCP {
		t.Fatalf("no tcp baseline (rows %+v)", rows)
	}
	base0 := rows[0]
	var sb strings.Builder
	fmt.Fprintf(&sb, "%d MiB sequential, 1 MiB O_DIRECT, 4 paths, under qemu TCG (ratios matter, not absolutes)\n", mb)
	fmt.Fprintf(&sb, "%-10s %9s %9s %9s %9s %7s %7s %9s %9s\n", "transport", "write", "read", "w cpu", "r cpu",
		"w/tcp", "r/tcp", "wcpu/tcp", "rcpu/tcp")
	fmt.Fprintf(&sb, "%-10s %9s %9s %9s %9s %7s %7s %9s %9s\n", "", "MB/s", "MB/s", "s/GB", "s/GB", "", "", "", "")
	for _, r := range rows {
		fmt.Fprintf(&sb, "%-10s %9.1f %9.1f %9.2f %9.2f %7.2f %7.2f %9.2f %9.2f\n", r.mode,
			r.write.mbps, r.read.mbps, r.write.cpuPerGB, r.read.cpuPerGB,
			r.write.mbps/base0.write.mbps, r.read.mbps/base0.read.mbps,
			r.write.cpuPerGB/base0.write.cpuPerGB, r.read.cpuPerGB/base0.read.cpuPerGB)
	}
	t.Logf("transport benchmark:\n%s", sb.String())
	fmt.Print("BENCH-TABLE-BEGIN\n" + sb.String() + "BENCH-TABLE-END\n")
}
