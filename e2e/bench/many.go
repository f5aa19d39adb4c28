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
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// ManyOptions configure RunMany: one storage server with many volumes,
// each written by its own client over its own MPTCP connection (a subflow
// on each of the 4 paths), all at once.
type ManyOptions struct {
	// Counts are the numbers of volumes to measure, in order.
	Counts []int
	// Duration and Ramp of every step; Span is the region each client
	// writes over again and again (what tmpfs holds per volume).
	Duration, Ramp time.Duration
	Span           int64
	// RW is the access pattern (write by default), BlockSize and
	// QueueDepth each client's.
	RW                    string
	BlockSize, QueueDepth int
	ServerBin, LoadBin    string
	TmpDir, Name          string
	Port                  int
	Progress              io.Writer
	// StaleLossCount, if not 0, sets net.mptcp.stale_loss_cnt of both
	// namespaces to exactly that instead of the topology's (the driver's,
	// mptcp.DefaultStaleLossCount), to measure other values.
	StaleLossCount int
}

// ManyStep is one count of volumes.
type ManyStep struct {
	Volumes int `json:"volumes"`
	// MBps is the sum of the clients' rates; PctLine its share of the
	// line (the 4 paths).
	MBps    float64 `json:"mb_per_s"`
	PctLine float64 `json:"pct_line_rate"`
	// Per-volume rates: the slowest, the median and the fastest, and
	// Jain's fairness index (1: all equal, 1/n: one volume takes all).
	MinMBps    float64 `json:"min_mb_per_s"`
	MedianMBps float64 `json:"median_mb_per_s"`
	MaxMBps    float64 `json:"max_mb_per_s"`
	Fairness   float64 `json:"fairness"`
	// Subflows is the fewest established subflows a client's connection
	// had at the end.
	Subflows int `json:"min_subflows"`
	// ServerRSSMiB is the server's resident memory after the step and
	// ServerCPUPerGB its CPU seconds in the measured window per 10^9
	// bytes moved in it.
	ServerRSSMiB   float64 `json:"server_rss_mib"`
	ServerCPUPerGB float64 `json:"server_cpu_s_per_gb"`
	// HostBusyPct is how busy all CPUs of the host were in the window
	// (clients, server and network stack share them).
	HostBusyPct float64  `json:"host_cpu_busy_pct"`
	Errors      []string `json:"errors,omitempty"`
}

// ManyReport is the JSON document of a many-volumes run.
type ManyReport struct {
	Started  time.Time `json:"started"`
	LineMBps float64   `json:"line_mb_per_s"`
	// StaleLossCount is net.mptcp.stale_loss_cnt of both namespaces.
	StaleLossCount int        `json:"stale_loss_cnt"`
	Steps          []ManyStep `json:"steps"`
}

// Jain returns Jain's fairness index of xs: (sum x)^2 / (n * sum x^2).
func Jain(xs []float64) float64 {
	var s, s2 float64
	for _, x := range xs {
		s += x
		s2 += x * x
	}
	if len(xs) == 0 || s2 == 0 {
		return 0
	}
	return s * s / (float64(len(xs)) * s2)
}

// RunMany runs the steps on a fresh 4 x 1 Gbit/s topology with our
// server, which exports max(Counts) volumes from files on tmpfs (the span
// each client writes allocated beforehand).
func RunMany(ctx context.Context, o ManyOptions) (*ManyReport, error) {
	if len(o.Counts) == 0 {
		return nil, errors.New("no volume counts")
	}
	n := slices.Max(o.Counts)
	logf := func(format string, args ...any) {
		fmt.Fprintf(o.Progress, "%s "+format+"\n", append([]any{time.Now().Format("15:04:05")}, args...)...)
	}
	for _, msg := range cleanLeftovers(o.Name, o.TmpDir) {
		logf("leftover of an earlier run: %s", msg)
	}
	t, err := topo.Up(topo.Default4(o.Name))
	if err != nil {
		return nil, err
	}
	defer func() {
		if err := t.Down(); err != nil {
			logf("removing the topology: %v", err)
		}
	}()
	stale := mptcp.DefaultStaleLossCount
	if o.StaleLossCount > 0 {
		stale = o.StaleLossCount
		for _, ns := range []string{t.ClientNS, t.ServerNS} {
			if err := topo.WriteSysctl(ns, "net.mptcp.stale_loss_cnt", strconv.Itoa(stale)); err != nil {
				return nil, err
			}
		}
		logf("net.mptcp.stale_loss_cnt %d on both ends", stale)
	}
	rep := &ManyReport{Started: time.Now(), LineMBps: Network{MPTCP: true}.LineRateMBps(t), StaleLossCount: stale}

	e := &serverEnv{topo: t, mptcp: true, port: o.Port, serverBin: o.ServerBin, tmpDir: o.TmpDir, tag: o.Name}
	argv := inNS(t.ServerNS, false, o.ServerBin, "--listen", e.addr(),
		"--metrics-addr", "", "--log-level", "warn", "--shutdown-timeout", "2s")
	var files []string
	for i := range n {
		f := filepath.Join(o.TmpDir, fmt.Sprintf("%smany-%d.img", leftoverMarker(o.Name), i))
		if err := createExport(f, ExportSize, o.Span); err != nil {
			return nil, err
		}
		files = append(files, f)
		argv = append(argv, "--export", fmt.Sprintf("v%d=%s,size=%d", i, f, ExportSize))
	}
	defer func() {
		for _, f := range files {
			os.Remove(f)
		}
	}()
	s := &serverProc{name: ServerOurs, log: &tailBuffer{}}
	defer func() {
		if err := s.stop(); err != nil {
			logf("stopping the server: %v", err)
		}
	}()
	if err := s.start(ctx, e, argv); err != nil {
		return nil, err
	}
	logf("server with %d exports listening on %s (pid %d)", n, e.addr(), s.pid)

	for _, count := range o.Counts {
		if err := ctx.Err(); err != nil {
			return rep, err
		}
		step := o.step(ctx, e, s, count)
		logf("%d volumes: %.1f MB/s in all (%.1f%% of the line), per volume %.1f / %.1f / %.1f MB/s, fairness %.3f, server %.0f MiB, %.3f CPU s/GB, host CPU %.0f%% busy%s",
			count, step.MBps, step.PctLine, step.MinMBps, step.MedianMBps, step.MaxMBps, step.Fairness,
			step.ServerRSSMiB, step.ServerCPUPerGB, step.HostBusyPct, errSuffix(step.Errors))
		rep.Steps = append(rep.Steps, step)
	}
	return rep, nil
}

func errSuffix(errs []string) string {
	if len(errs) == 0 {
		return ""
	}
	return "; errors: " + strings.Join(errs, "; ")
}

// step runs count clients at once against the first count volumes.
func (o ManyOptions) step(ctx context.Context, e *serverEnv, s *serverProc, count int) ManyStep {
	st := ManyStep{Volumes: count}
	type result struct {
		rep *LoadReport
		err error
	}
	results := make(chan result, count)
	// Every client measures the same window, which begins once all of
	// them had time to start and connect and then o.Ramp: each one's own
	// window after its own start would overlap the others' only in part,
	// and their sum would count more than ran at once.
	ramp := o.Ramp + time.Second + time.Duration(count)*100*time.Millisecond
	start := time.Now().Add(ramp)
	from := start.Format(time.RFC3339Nano)
	for i := range count {
		go func() {
			argv := inNS(e.topo.ClientNS, false, o.LoadBin, "--addr", e.addr(), "--export", fmt.Sprintf("v%d", i),
				"--mptcp", "--rw", o.RW, "--bs", strconv.Itoa(o.BlockSize), "--qd", strconv.Itoa(o.QueueDepth),
				"--span", strconv.FormatInt(o.Span, 10), "--time", o.Duration.String(), "--measure-from", from)
			cctx, cancel := context.WithTimeout(ctx, ramp+o.Duration+60*time.Second)
			defer cancel()
			cmd := exec.CommandContext(cctx, argv[0], argv[1:]...)
			var out, errb bytes.Buffer
			cmd.Stdout, cmd.Stderr = &out, &errb
			if err := cmd.Run(); err != nil {
				results <- result{err: fmt.Errorf("v%d: %v: %s", i, err, strings.TrimSpace(errb.String()))}
				return
			}
			var r LoadReport
			if err := json.Unmarshal(out.Bytes(), &r); err != nil {
				results <- result{err: fmt.Errorf("v%d: %v", i, err)}
				return
			}
			results <- result{rep: &r}
		}()
	}
	// The server's and the host's CPU over the same window.
	sleepUntil(ctx, start)
	cpu0, cpuErr := TreeCPU(s.pid)
	busy0, total0, hostErr := CPUJiffies()
	sleepUntil(ctx, start.Add(o.Duration))
	cpu1, err := TreeCPU(s.pid)
	cpuErr = errors.Join(cpuErr, err)
	busy1, total1, err := CPUJiffies()
	hostErr = errors.Join(hostErr, err)
	if hostErr == nil && total1 > total0 {
		st.HostBusyPct = 100 * float64(busy1-busy0) / float64(total1-total0)
	}

	var rates []float64
	var bytesMoved int64
	st.Subflows = math.MaxInt
	for range count {
		r := <-results
		if r.err == nil && !r.rep.OK() {
			r.err = fmt.Errorf("%s: %s", r.rep.Export, r.rep.Problem())
		}
		if r.err != nil {
			st.Errors = append(st.Errors, r.err.Error())
			continue
		}
		rates = append(rates, r.rep.MBps)
		bytesMoved += r.rep.Bytes
		for _, sf := range r.rep.Subflows {
			st.Subflows = min(st.Subflows, sf)
		}
	}
	if st.Subflows == math.MaxInt {
		st.Subflows = 0
	}
	if len(rates) > 0 {
		for _, r := range rates {
			st.MBps += r
		}
		st.MinMBps, st.MaxMBps, st.MedianMBps = slices.Min(rates), slices.Max(rates), Median(rates)
		st.Fairness = Jain(rates)
		if line := (Network{MPTCP: true}).LineRateMBps(e.topo); line > 0 {
			st.PctLine = 100 * st.MBps / line
		}
	}
	if cpuErr == nil && bytesMoved > 0 {
		st.ServerCPUPerGB = (cpu1 - cpu0) / (float64(bytesMoved) / 1e9)
	}
	st.ServerRSSMiB = rssMiB(s.pid)
	return st
}

// sleepUntil waits until t or until ctx ends.
func sleepUntil(ctx context.Context, t time.Time) {
	tm := time.NewTimer(time.Until(t))
	defer tm.Stop()
	select {
	case <-ctx.Done():
	case <-tm.C:
	}
}

// rssMiB is a process's resident memory (VmRSS) in MiB, 0 if unknown.
func rssMiB(pid int) float64 {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "status"))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			f := strings.Fields(rest)
			if len(f) > 0 {
				kb, _ := strconv.ParseFloat(f[0], 64)
				return kb / 1024
			}
		}
	}
	return 0
}

// WriteManyTable prints the steps as a table.
func WriteManyTable(w io.Writer, rep *ManyReport) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "volumes\tMB/s\t% line\tmin\tmedian\tmax\tfairness\tsubflows\tsrv RSS MiB\tsrv CPU s/GB\thost CPU %\tstatus\t")
	for _, s := range rep.Steps {
		status := "ok"
		if len(s.Errors) > 0 {
			status = fmt.Sprintf("%d FAILED", len(s.Errors))
		}
		fmt.Fprintf(tw, "%d\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.3f\t%d\t%.0f\t%.3f\t%.0f\t%s\t\n", s.Volumes, s.MBps, s.PctLine,
			s.MinMBps, s.MedianMBps, s.MaxMBps, s.Fairness, s.Subflows, s.ServerRSSMiB, s.ServerCPUPerGB, s.HostBusyPct, status)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(w, "line %.0f MB/s (4 x 1 Gbit/s, one MPTCP connection per volume); min/median/max: MB/s of single volumes; fairness: Jain's index of their rates; host CPU: all of the machine's CPUs busy in the window.\n", rep.LineMBps)
	return nil
}

// ManySVG draws the steps as a line chart against the number of volumes:
// the sum of the volumes' rates, the slowest volume's rate times the
// number of volumes (the sum if every volume were as slow; the gap is the
// unfairness), and the line rate.
func ManySVG(rep *ManyReport, subtitle string) string {
	c := LineChart{
		Title: "One storage server, many volumes written at once", Subtitle: subtitle,
		XLabel: "volumes written at once", YLabel: "MB/s (10^6 bytes/s)",
		Ref: rep.LineMBps, RefLabel: fmt.Sprintf("line %.0f MB/s", rep.LineMBps),
		Series: []ChartSeries{
			{Name: "sum of the volumes", Color: "#1f6fb2", Labels: true},
			{Name: "slowest volume x number of volumes (equal to the sum when fair)", Color: "#e67e22"},
		},
	}
	for _, st := range rep.Steps {
		c.X = append(c.X, strconv.Itoa(st.Volumes))
		c.Series[0].Y = append(c.Series[0].Y, st.MBps)
		c.Series[1].Y = append(c.Series[1].Y, st.MinMBps*float64(st.Volumes))
	}
	return c.SVG()
}
