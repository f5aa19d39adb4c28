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

//go:build linux

package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/pki"
	"github.com/mpnbd/mpnbd/internal/testenv/topo"
)

// Run executes the matrix and returns every run; the report holds what
// was measured until then also when ctx is cancelled or setup fails
// (together with the error). Everything it starts is removed before it
// returns: processes, namespaces and export files.
func Run(ctx context.Context, o Options) (*Report, error) {
	o.defaults()
	rep := &Report{Meta: Meta{
		Started:  time.Now(),
		Duration: o.Duration.String(),
		Ramp:     o.Ramp.String(),
		Repeat:   o.Repeat,
		CPUs:     runtime.NumCPU(),
		Go:       runtime.Version(),
		Versions: toolVersions(o.Matrix),
	}}
	rep.Meta.Host, _ = os.Hostname()
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		rep.Meta.Kernel = strings.TrimSpace(string(b))
	}
	rep.Meta.Notes = []string{
		"MB/s = 10^6 bytes/s measured by the client after the ramp",
		"% line = MB/s relative to the network's line rate (path 1 for tcp1; sum of the non-backup paths for MPTCP)",
		"CPU s/GB = CPU seconds of the server process tree (or the client process) over the whole client run, divided by the 10^9 bytes the server's interfaces carried in the data direction over the same interval",
		"order: workloads in matrix order; with several servers they all listen at once (ports from the base port up) and each repeat runs every server in turn (--sequential: one server after the other), every client per server (fio first); every server's export file is allocated in full before its runs (no run pays for tmpfs page allocation)",
	}
	line := map[string]float64{}
	for _, n := range o.Matrix.Networks {
		l := n.PlanLineRateMBps()
		line[n.Name] = l
		rep.Networks = append(rep.Networks, NetInfo{Network: n, LineMBps: l})
	}
	finish := func(err error) (*Report, error) {
		rep.Meta.Finished = time.Now()
		rep.Meta.Elapsed = rep.Meta.Finished.Sub(rep.Meta.Started).Round(time.Second).String()
		rep.Cells = Aggregate(rep.Runs, line)
		SortCells(rep.Cells)
		return rep, err
	}
	if missing := MissingTools(o.Matrix); len(missing) > 0 {
		return finish(fmt.Errorf("missing tools: %s (hack/install-deps.sh installs them)", strings.Join(missing, ", ")))
	}
	for _, bin := range []string{o.ServerBin, o.CandidateBin, o.LoadBin} {
		if bin == "" {
			continue
		}
		if _, err := os.Stat(bin); err != nil {
			return finish(fmt.Errorf("%w (run make build / hack/bench.sh)", err))
		}
	}

	total := o.Matrix.Size() * o.Repeat
	r := &runner{o: o, total: total, rep: rep}
	for _, msg := range cleanLeftovers(o.Name, o.TmpDir) {
		r.logf("leftover of an earlier run: %s", msg)
	}
	defer func() {
		if err := r.down(); err != nil {
			r.logf("tearing the topology down: %v", err)
		}
	}()
	for _, n := range o.Matrix.Networks {
		if err := ctx.Err(); err != nil {
			return finish(err)
		}
		if err := r.network(ctx, n); err != nil {
			return finish(err)
		}
	}
	if err := r.down(); err != nil {
		return finish(err)
	}
	return finish(ctx.Err())
}

type runner struct {
	o     Options
	total int
	done  int
	rep   *Report
	// The current topology, kept for the next network if it is of the
	// same kind.
	topo     *topo.Topology
	topoKind string
}

// down removes the current topology, if any.
func (r *runner) down() error {
	if r.topo == nil {
		return nil
	}
	err := r.topo.Down()
	r.topo, r.topoKind = nil, ""
	return err
}

func (r *runner) logf(format string, args ...any) {
	fmt.Fprintf(r.o.Progress, "%s "+format+"\n", append([]any{time.Now().Format("15:04:05")}, args...)...)
}

// network runs every server of the matrix on the network's topology,
// created unless the previous network used the same kind.
func (r *runner) network(ctx context.Context, n Network) error {
	if r.topo == nil || r.topoKind != n.Topology || n.Topology == "" {
		if err := r.down(); err != nil {
			return err
		}
		r.logf("network %s: %s: creating topology %q (%s)", n.Name, n.Desc, r.o.Name, n.Topology)
		t, err := topo.Up(n.Config(r.o.Name))
		if err != nil {
			return err
		}
		r.topo, r.topoKind = t, n.Topology
	} else {
		r.logf("network %s: %s: on the same topology", n.Name, n.Desc)
	}
	t := r.topo
	if n.AutoBackup {
		stop := startAutoBackup(t, r.o.Progress)
		defer func() {
			if err := stop(); err != nil {
				r.logf("network %s: slow-path watch: %v", n.Name, err)
			}
		}()
	}
	env := &serverEnv{topo: t, mptcp: n.MPTCP, port: r.o.Port, serverBin: r.o.ServerBin,
		candidateBin: r.o.CandidateBin, tmpDir: r.o.TmpDir, tag: r.o.Name}
	if slices.Contains(r.o.Matrix.Servers, ServerOursTLS) {
		dir, err := writeBenchPKI(r.o.TmpDir, r.o.Name, t.ServerAddr(1).String())
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		env.pkiDir = dir
	}
	if !r.o.Sequential {
		return r.sideBySide(ctx, env, n, r.o.Matrix.Servers)
	}
	for _, s := range r.o.Matrix.Servers {
		if err := r.sideBySide(ctx, env, n, []string{s}); err != nil {
			return err
		}
	}
	return nil
}

// liveServer is one server of sideBySide with its own port.
type liveServer struct {
	name string
	env  *serverEnv
	srv  *serverProc // nil while it could not be started
	err  error       // why it could not be started
}

// sideBySide runs servers on network n at the same time, each listening
// on a port of its own (env.port and up), and takes every repeat of every
// workload on each server in turn (Options.Sequential calls it with one
// server at a time). Whatever else loads the machine over the minutes of
// a matrix then falls on every server alike, where one server's runs
// after another's would each meet a different machine; the same-run
// ratios between servers (CPU per GB above all) are what the matrix is
// for. An idle server costs the others nothing but its memory. A server
// that cannot be started has every run of it recorded as failed, with
// the reason; one that dies is started again before its next run.
func (r *runner) sideBySide(ctx context.Context, env *serverEnv, n Network, servers []string) error {
	start := func(ls *liveServer) {
		srv, err := startServer(ctx, ls.env, ls.name)
		if err != nil {
			ls.srv, ls.err = nil, fmt.Errorf("network %s: server %s: %w", n.Name, ls.name, err)
			r.logf("%v", ls.err)
			return
		}
		r.logf("network %s: server %s listening on %s (pid %d)", n.Name, ls.name, ls.env.addr(), srv.pid)
		ls.srv = srv
	}
	var live []*liveServer
	defer func() {
		for _, ls := range live {
			if ls.srv == nil {
				continue
			}
			if err := ls.srv.stop(); err != nil {
				r.logf("network %s: stopping %s: %v", n.Name, ls.name, err)
			}
		}
	}()
	for i, name := range servers {
		if err := ctx.Err(); err != nil {
			return err
		}
		e := *env
		e.port = env.port + i
		ls := &liveServer{name: name, env: &e}
		start(ls)
		live = append(live, ls)
	}
	for _, w := range r.o.Matrix.Workloads {
		for rep := 1; rep <= r.o.Repeat; rep++ {
			for _, ls := range live {
				for _, c := range r.o.Matrix.Clients {
					if !Pairs(ls.name, c) {
						continue
					}
					if err := ctx.Err(); err != nil {
						return err
					}
					if ls.srv != nil && !ls.srv.alive() {
						r.logf("network %s: server %s died (%s); restarting it", n.Name, ls.name, ls.srv.log)
						if err := ls.srv.stop(); err != nil {
							r.logf("network %s: server %s: %v", n.Name, ls.name, err)
						}
						start(ls)
					}
					if ls.srv == nil {
						r.record(RunResult{Key: Key{ls.name, c, n.Name, w.Name}, Repeat: rep, Started: time.Now(),
							Error: ls.err.Error()})
						continue
					}
					run := r.one(ctx, ls.env, n, ls.srv, c, w, rep)
					if ctx.Err() != nil {
						return ctx.Err()
					}
					r.record(run)
				}
			}
		}
	}
	return nil
}

// writeBenchPKI writes the certificates of ours-tls (the server's naming
// host) into a new directory under tmp, removed by the caller.
func writeBenchPKI(tmp, tag, host string) (string, error) {
	p, err := pki.New(host)
	if err != nil {
		return "", err
	}
	dir, err := os.MkdirTemp(tmp, leftoverMarker(tag)+"pki-")
	if err != nil {
		return "", err
	}
	if err := p.WriteDir(dir); err != nil {
		os.RemoveAll(dir)
		return "", err
	}
	return dir, nil
}

func (r *runner) record(run RunResult) {
	r.done++
	r.rep.Runs = append(r.rep.Runs, run)
	msg := fmt.Sprintf("[%d/%d] %s #%d: ", r.done, r.total, run.Key, run.Repeat)
	if run.OK {
		msg += fmt.Sprintf("%.1f MB/s, %.0f IOPS, server %.3f CPU s/GB, client %.3f CPU s/GB",
			run.MBps, run.IOPS, run.ServerCPUPerGB, run.ClientCPUPerGB)
		if run.Subflows != nil {
			msg += ", subflows " + run.Subflows.String()
		}
	} else {
		msg += "FAILED: " + run.Error
	}
	for _, note := range run.Notes {
		msg += "; " + note
	}
	r.logf("%s", msg)
	if r.o.OnRun != nil {
		r.o.OnRun(run)
	}
}

// serverBytes returns the byte counters summed over the server
// namespace's interfaces.
func serverBytes(t *topo.Topology) (LinkBytes, error) {
	out, err := exec.Command("ip", "-n", t.ServerNS, "-s", "-j", "link", "show").Output()
	if err != nil {
		return LinkBytes{}, fmt.Errorf("ip -s link in %s: %w", t.ServerNS, err)
	}
	m, err := ParseLinkStats(out)
	if err != nil {
		return LinkBytes{}, err
	}
	return SumLinks(m), nil
}

// clientArgv returns the command line of one client run against server.
func (r *runner) clientArgv(env *serverEnv, n Network, server, client string, w Workload) []string {
	tls := server == ServerOursTLS
	switch client {
	case ClientFio:
		uri := "nbd://" + env.addr() + "/" + ExportName
		return inNS(env.topo.ClientNS, n.MPTCP, append([]string{"fio"}, FioArgs(w, uri, r.o.Duration, r.o.Ramp)...)...)
	default:
		argv := []string{r.o.LoadBin, "--addr", env.addr(), "--export", ExportName,
			"--rw", w.RW, "--bs", strconv.Itoa(w.BlockSize), "--qd", strconv.Itoa(w.QueueDepth),
			"--time", r.o.Duration.String(), "--warmup", r.o.Ramp.String()}
		if n.MPTCP {
			argv = append(argv, "--mptcp")
		}
		if tls {
			argv = append(argv, "--tls-certificates", env.pkiDir)
		}
		return inNS(env.topo.ClientNS, false, argv...)
	}
}

// one performs a single run.
func (r *runner) one(ctx context.Context, env *serverEnv, n Network, srv *serverProc, client string, w Workload, repeat int) RunResult {
	run := RunResult{Key: Key{srv.name, client, n.Name, w.Name}, Repeat: repeat, Started: time.Now()}
	fail := func(format string, args ...any) RunResult {
		run.OK = false
		run.Error = fmt.Sprintf(format, args...)
		return run
	}
	if !srv.alive() {
		return fail("server not running")
	}
	cpu0, err := TreeCPU(srv.pid)
	if err != nil {
		return fail("server CPU: %v", err)
	}
	wire0, err := serverBytes(env.topo)
	if err != nil {
		return fail("%v", err)
	}

	argv := r.clientArgv(env, n, srv.name, client, w)
	cctx, cancel := context.WithTimeout(ctx, r.o.Ramp+r.o.Duration+60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(cctx, argv[0], argv[1:]...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Start(); err != nil {
		return fail("starting %s: %v", client, err)
	}
	var sample chan *SubflowSample
	if n.MPTCP {
		sample = make(chan *SubflowSample, 1)
	}
	sctx, stopSampling := context.WithCancel(cctx)
	defer stopSampling()
	if sample != nil {
		go func() { sample <- sampleSubflows(sctx, env.topo) }()
	}
	waitErr := cmd.Wait()
	stopSampling()
	if sample != nil {
		run.Subflows = <-sample
	}
	if ps := cmd.ProcessState; ps != nil {
		run.ClientCPUSeconds = (ps.UserTime() + ps.SystemTime()).Seconds()
	}
	srv.settle()
	cpu1, cpuErr := TreeCPU(srv.pid)
	wire1, wireErr := serverBytes(env.topo)
	if ctx.Err() != nil {
		return fail("interrupted")
	}
	if cctx.Err() != nil {
		return fail("%s did not finish within %v", client, r.o.Ramp+r.o.Duration+60*time.Second)
	}

	// What the client measured.
	tail := func(s string) string {
		s = strings.TrimSpace(s)
		if len(s) > 400 {
			s = "..." + s[len(s)-400:]
		}
		return s
	}
	switch client {
	case ClientFio:
		fr, err := ParseFio(stdout.Bytes())
		if err != nil {
			return fail("fio: %v (exit: %v; stderr: %s)", err, waitErr, tail(stderr.String()+stdout.String()))
		}
		run.Bytes, run.Ops, run.Seconds, run.MBps, run.IOPS = fr.Bytes, fr.Ops, fr.Seconds, fr.MBps, fr.IOPS
		switch {
		case fr.Error != 0:
			return fail("fio job error %d (%s): %s", fr.Error, syscall.Errno(fr.Error), tail(stderr.String()))
		case waitErr != nil:
			return fail("fio: %v: %s", waitErr, tail(stderr.String()))
		}
		run.MPTCP = run.Subflows != nil && run.Subflows.Total > 0
	default:
		var lr LoadReport
		if err := json.Unmarshal(stdout.Bytes(), &lr); err != nil {
			return fail("nbdload: %v (exit: %v): %s", err, waitErr, tail(stderr.String()))
		}
		run.Bytes, run.Ops, run.Seconds, run.MBps, run.IOPS = lr.Bytes, lr.Ops, lr.Seconds, lr.MBps, lr.IOPS
		run.ClientSubflows = lr.Subflows
		run.MPTCP = len(lr.MPTCP) > 0
		for _, m := range lr.MPTCP {
			run.MPTCP = run.MPTCP && m
		}
		if !lr.OK() {
			return fail("nbdload: %s", lr.Problem())
		}
		if waitErr != nil {
			return fail("nbdload: %v: %s", waitErr, tail(stderr.String()))
		}
	}
	if run.Bytes <= 0 || run.Ops <= 0 {
		return fail("no data moved")
	}
	if n.MPTCP && !run.MPTCP {
		return fail("the connection was not carried by MPTCP (no subflows; fallback to TCP?)")
	}
	if n.MPTCP && run.Subflows != nil && run.Subflows.Total != len(env.topo.Paths) {
		run.Notes = append(run.Notes, fmt.Sprintf("%d subflows, expected %d", run.Subflows.Total, len(env.topo.Paths)))
	}
	if !srv.alive() {
		return fail("server exited during the run: %s", srv.log)
	}

	// CPU per GB over the whole client run.
	if cpuErr != nil || wireErr != nil {
		run.Notes = append(run.Notes, fmt.Sprintf("no CPU figures: %v", errors.Join(cpuErr, wireErr)))
	} else {
		run.ServerCPUSeconds = cpu1 - cpu0
		moved := wire1.TX - wire0.TX
		if w.Write() {
			moved = wire1.RX - wire0.RX
		}
		run.WireBytes = int64(moved)
		if moved > 0 {
			gb := float64(moved) / 1e9
			run.ServerCPUPerGB = run.ServerCPUSeconds / gb
			run.ClientCPUPerGB = run.ClientCPUSeconds / gb
		}
	}
	run.OK = true
	return run
}

// subflowInterval is how often the client's subflows are listed while a
// client runs on an MPTCP network.
const subflowInterval = time.Second

// sampleSubflows lists the client's MPTCP subflows every subflowInterval
// until ctx ends and summarises the connection that moved the most data.
func sampleSubflows(ctx context.Context, t *topo.Topology) *SubflowSample {
	var samples [][]topo.Subflow
	tick := time.NewTicker(subflowInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return SummarizeSubflows(samples, t.PathOf, len(t.Paths))
		case <-tick.C:
			if subs, err := t.ClientSubflows(); err == nil && ctx.Err() == nil {
				samples = append(samples, subs)
			}
		}
	}
}

// SummarizeSubflows takes successive `ss` listings of the client's
// subflows and describes the MPTCP connection (by token) that moved the
// most bytes: its largest number of subflows listed at once, how many of
// them carried at least 1% of its bytes, how many are backup subflows and
// the bytes per path. Byte counts are those of the last listing that
// showed each subflow. pathOf maps an address to its 1-based path (0:
// unknown).
func SummarizeSubflows(samples [][]topo.Subflow, pathOf func(a netip.Addr) int, paths int) *SubflowSample {
	type key struct {
		token         uint32
		local, remote netip.AddrPort
	}
	last := map[key]topo.Subflow{}
	count := map[uint32]int{} // most subflows listed at once, per token
	for _, sample := range samples {
		n := map[uint32]int{}
		for _, s := range sample {
			last[key{s.Token, s.Local, s.Remote}] = s
			n[s.Token]++
		}
		for tok, c := range n {
			count[tok] = max(count[tok], c)
		}
	}
	bytesOf := func(s topo.Subflow) uint64 { return s.BytesSent + s.BytesReceived }
	moved := map[uint32]uint64{}
	for k, s := range last {
		moved[k.token] += bytesOf(s)
	}
	out := &SubflowSample{Samples: len(samples)}
	var best uint32
	found := false
	for tok := range count {
		if !found || moved[tok] > moved[best] || (moved[tok] == moved[best] && count[tok] > count[best]) {
			best, found = tok, true
		}
	}
	if !found {
		return out
	}
	out.Total = count[best]
	out.PathBytes = make([]uint64, paths)
	for k, s := range last {
		if k.token != best {
			continue
		}
		b := bytesOf(s)
		if b > 0 && b*100 >= moved[best] {
			out.Active++
		}
		if s.Backup() {
			out.Backup++
		}
		if p := pathOf(k.local.Addr()); p >= 1 && p <= paths {
			out.PathBytes[p-1] += b
		}
	}
	return out
}

// toolVersions asks the external programs of the matrix for their
// versions (first line of output).
func toolVersions(m Matrix) map[string]string {
	out := map[string]string{}
	ask := func(name string, args ...string) {
		if _, err := exec.LookPath(name); err != nil {
			return
		}
		b, _ := exec.Command(name, args...).CombinedOutput()
		if l, _, _ := strings.Cut(strings.TrimSpace(string(b)), "\n"); l != "" {
			out[name] = l
		}
	}
	for _, t := range RequiredTools(m) {
		switch t {
		case "nbdkit", "fio":
			ask(t, "--version")
		case "nbd-server":
			ask(t, "-V")
		}
	}
	return out
}
