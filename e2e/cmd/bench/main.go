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

// Command bench compares NBD servers and clients side by side over the
// multi-path test topology (package internal/testenv/topo) and prints one
// table.
//
// Matrix (every dimension selectable; the default is all of it):
//
//	servers:   ours (bin/nbd-server), ours-tls (the same with TLS required, 1.3; our
//	           client only), nbdkit (file plugin), nbd-server (Debian's)
//	networks:  tcp1 (plain TCP, path 1), mptcp4 (MPTCP, 4 x 1 Gbit/s),
//	           asym (MPTCP, 3 x 1 Gbit/s + 100 Mbit/s), asym-backup (slow path backup),
//	           asym-auto (the slow-path watch of node plugin and storage agent)
//	clients:   fio (nbd engine), ours (nbdload)
//	workloads: seqread, seqwrite (1 MiB, QD 8), randread, randwrite (4 KiB, QD 32)
//
// Third-party servers and fio run under `mptcpize run` on MPTCP networks.
// Every server exports a fresh 2 GiB file on tmpfs, allocated beforehand. Each run lasts
// --ramp + --duration and is repeated --repeat times; the table shows the
// medians, out/bench.json every repeat. On each network all servers listen
// at once (--port and up) and every repeat takes each server in turn, so
// that what else loads the machine falls on all of them alike
// (--sequential: one server's runs after the other's).
//
// --profile demo runs the demo instead: our server and client, seqread and
// seqwrite, plain TCP on one path then MPTCP on four, 5 s each, and writes
// out/demo.json and the chart out/demo.svg.
//
// Needs root (network namespaces). Everything it creates (processes,
// namespaces, export files) is removed on exit, also on Ctrl-C.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/mpnbd/mpnbd/e2e/bench"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var (
		servers   = fs.String("servers", "all", "comma-separated servers: "+strings.Join(bench.AllServers, ","))
		networks  = fs.String("networks", "all", "comma-separated networks: tcp1,mptcp4,asym,asym-backup,asym-auto")
		clients   = fs.String("clients", "all", "comma-separated clients: "+strings.Join(bench.AllClients, ","))
		workloads = fs.String("workloads", "all", "comma-separated workloads: seqread,seqwrite,randread,randwrite")
		duration  = fs.Duration("duration", 10*time.Second, "measured time of every run")
		ramp      = fs.Duration("ramp", time.Second, "unmeasured warm-up before every run")
		repeat    = fs.Int("repeat", 3, "repeats of every run (the table shows medians)")
		quick     = fs.Bool("quick", false, "smoke run: --duration 3s --repeat 1")
		profile   = fs.String("profile", "full", "full (the matrix), demo (TCP vs MPTCP with our server and client, chart in out/demo.svg) or many (one server, many volumes written at once: --volumes)")
		binDir    = fs.String("bin", "bin", "directory with nbd-server and nbdload")
		binB      = fs.String("bin-b", "", "directory with a second build of nbd-server, the server ours-b (--servers ours,ours-b,nbdkit compares a change in the same run)")
		outPath   = fs.String("out", "", "JSON report (default out/bench.json, out/demo.json for the demo)")
		svgPath   = fs.String("svg", "out/demo.svg", "demo chart")
		tmpDir    = fs.String("tmpdir", "/dev/shm", "tmpfs directory for the export files (a private tmpfs is mounted if it is not one)")
		name      = fs.String("name", "mpbench", "topology name (prefix of namespaces and interfaces, at most 11 characters)")
		port      = fs.Int("port", 10809, "NBD port of the first server (the others listen on the next ones)")
		seq       = fs.Bool("sequential", false, "run one server's repeats after the other's instead of taking every server in turn in each repeat")
		list      = fs.Bool("list", false, "print the selected matrix and exit")
		volumes   = fs.String("volumes", "1,2,4,8,16,32", "profile many: comma-separated numbers of volumes written at once")
		staleLoss = fs.Int("stale-loss-count", 0, "profile many: set net.mptcp.stale_loss_cnt on both ends to `N` (default: the driver's, which the topology sets)")
	)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: bench [flags]   (needs root; see go -C e2e doc ./cmd/bench)")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })

	demo := false
	switch *profile {
	case "many":
		counts, err := parseCounts(*volumes)
		if err != nil {
			fmt.Fprintln(stderr, "bench: --volumes:", err)
			return 2
		}
		if *staleLoss < 0 {
			fmt.Fprintln(stderr, "bench: --stale-loss-count: want a positive count, or 0 for the driver's")
			return 2
		}
		if *outPath == "" {
			*outPath = "out/many.json"
		}
		return runMany(ctx, bench.ManyOptions{
			Counts: counts, Duration: *duration, Ramp: *ramp, Span: 64 << 20,
			RW: "write", BlockSize: 1 << 20, QueueDepth: 8,
			ServerBin: filepath.Join(*binDir, "nbd-server"), LoadBin: filepath.Join(*binDir, "nbdload"),
			Name: *name, Port: *port, Progress: stderr, StaleLossCount: *staleLoss,
		}, *tmpDir, *outPath, stdout, stderr)
	case "full":
	case "demo":
		demo = true
		*servers, *clients = strings.Join(bench.DemoServers, ","), strings.Join(bench.DemoClients, ",")
		*networks, *workloads = strings.Join(bench.DemoNetworks, ","), strings.Join(bench.DemoWorkloads, ",")
		if !set["duration"] {
			*duration = 5 * time.Second
		}
		if !set["repeat"] {
			*repeat = 1
		}
	default:
		fmt.Fprintf(stderr, "bench: unknown profile %q (full or demo)\n", *profile)
		return 2
	}
	if *quick {
		if !set["duration"] {
			*duration = 3 * time.Second
		}
		if !set["repeat"] {
			*repeat = 1
		}
	}
	if *outPath == "" {
		*outPath = "out/bench.json"
		if demo {
			*outPath = "out/demo.json"
		}
	}
	m, err := bench.NewMatrix(*servers, *networks, *clients, *workloads)
	if err != nil {
		fmt.Fprintln(stderr, "bench:", err)
		return 2
	}
	if contains(m.Servers, bench.ServerOursB) && *binB == "" {
		fmt.Fprintln(stderr, "bench: server ours-b needs --bin-b DIR (a second build of nbd-server)")
		return 2
	}
	if *duration <= 0 || *repeat < 1 || *ramp < 0 {
		fmt.Fprintln(stderr, "bench: --duration must be positive, --repeat at least 1, --ramp not negative")
		return 2
	}
	per := *ramp + *duration + 2*time.Second
	fmt.Fprintf(stderr, "matrix: servers %s; networks %s; clients %s; workloads %s\n",
		strings.Join(m.Servers, ","), netNames(m), strings.Join(m.Clients, ","), wlNames(m))
	fmt.Fprintf(stderr, "%d runs x %d repeats of %v + %v ramp: about %v\n", m.Size(), *repeat, *duration, *ramp,
		(time.Duration(m.Size()**repeat) * per).Round(time.Minute/2))
	if *list {
		return 0
	}
	if os.Geteuid() != 0 {
		fmt.Fprintln(stderr, "bench: needs root to create network namespaces")
		return 1
	}
	if missing := bench.MissingTools(m); len(missing) > 0 {
		fmt.Fprintf(stderr, "bench: missing tools: %s (hack/install-deps.sh installs them)\n", strings.Join(missing, ", "))
		return 1
	}
	dir, unmount, err := bench.EnsureTmpfs(*tmpDir)
	if err != nil {
		fmt.Fprintln(stderr, "bench:", err)
		return 1
	}
	defer unmount()

	opts := bench.Options{
		Matrix: m, Duration: *duration, Ramp: *ramp, Repeat: *repeat,
		ServerBin: filepath.Join(*binDir, "nbd-server"),
		LoadBin:   filepath.Join(*binDir, "nbdload"),
		TmpDir:    dir, Name: *name, Port: *port, Progress: stderr, Sequential: *seq,
	}
	if !contains(m.Servers, bench.ServerOurs) && !contains(m.Servers, bench.ServerOursTLS) {
		opts.ServerBin = ""
	}
	if contains(m.Servers, bench.ServerOursB) {
		opts.CandidateBin = filepath.Join(*binB, "nbd-server")
	}
	if !contains(m.Clients, bench.ClientOurs) {
		opts.LoadBin = ""
	}
	for _, p := range []*string{&opts.ServerBin, &opts.CandidateBin, &opts.LoadBin} {
		if *p != "" {
			if abs, err := filepath.Abs(*p); err == nil {
				*p = abs
			}
		}
	}
	rep, runErr := bench.Run(ctx, opts)
	rep.Meta.Args = args

	fmt.Fprintln(stdout)
	code := 0
	if demo {
		rows := bench.DemoRows(rep.Cells)
		if err := bench.WriteDemoTable(stdout, rows); err != nil {
			fmt.Fprintln(stderr, "bench:", err)
			code = 1
		}
		sub := fmt.Sprintf("our nbd-server and client (pkg/nbd), 1 MiB requests, queue depth 8, %v per run; paths of 1 Gbit/s each", *duration)
		if err := os.MkdirAll(filepath.Dir(*svgPath), 0o755); err == nil {
			err = os.WriteFile(*svgPath, []byte(bench.DemoSVG(rows, sub)), 0o644)
			if err != nil {
				fmt.Fprintln(stderr, "bench:", err)
				code = 1
			} else {
				fmt.Fprintf(stdout, "\nchart: %s\n", *svgPath)
			}
		}
		if err := bench.WriteJSON(*outPath, struct {
			Rows []bench.DemoRow `json:"demo"`
			*bench.Report
		}{rows, rep}); err != nil {
			fmt.Fprintln(stderr, "bench:", err)
			code = 1
		}
		for _, r := range rows {
			if r.Failed {
				code = 1
			}
		}
	} else {
		if err := bench.WriteTable(stdout, rep.Cells); err != nil {
			fmt.Fprintln(stderr, "bench:", err)
			code = 1
		}
		fmt.Fprintln(stdout)
		writeLegend(stdout, rep, *duration, *repeat)
		if err := bench.WriteJSON(*outPath, rep); err != nil {
			fmt.Fprintln(stderr, "bench:", err)
			code = 1
		}
	}
	fmt.Fprintf(stdout, "report: %s (elapsed %s)\n", *outPath, rep.Meta.Elapsed)
	if runErr != nil {
		fmt.Fprintln(stderr, "bench:", runErr)
		if ctx.Err() != nil {
			return 130
		}
		return 1
	}
	return code
}

func writeLegend(w io.Writer, rep *bench.Report, d time.Duration, repeat int) {
	fmt.Fprintf(w, "medians of %d repeat(s) of %v each (after a %s ramp); MB/s = 10^6 bytes/s.\n", repeat, d, rep.Meta.Ramp)
	for _, n := range rep.Networks {
		fmt.Fprintf(w, "  %-11s line %.1f MB/s: %s\n", n.Name, n.LineMBps, n.Desc)
	}
	fmt.Fprintln(w, "vs tcp1: MB/s relative to the same server/client/workload on tcp1; vs nbdkit: relative to nbdkit with the same client/network/workload.")
	fmt.Fprintln(w, "CPU s/GB: CPU seconds of the server process tree (client process) over the whole client run per 10^9 bytes carried in the data direction.")
	fmt.Fprintln(w, "subflows: most established subflows of the client's MPTCP connection listed by ss during the run (act: carried >= 1% of its bytes, bk: backup).")
	fmt.Fprintln(w, "Each server gets a fresh export, its tmpfs pages allocated before its runs.")
}

func netNames(m bench.Matrix) string {
	var s []string
	for _, n := range m.Networks {
		s = append(s, n.Name)
	}
	return strings.Join(s, ",")
}

func wlNames(m bench.Matrix) string {
	var s []string
	for _, w := range m.Workloads {
		s = append(s, w.Name)
	}
	return strings.Join(s, ",")
}

// parseCounts parses "1,2,4": positive numbers.
func parseCounts(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			return nil, fmt.Errorf("%q is not a positive number", f)
		}
		out = append(out, n)
	}
	return out, nil
}

// runMany runs the many-volumes profile and prints its table.
func runMany(ctx context.Context, o bench.ManyOptions, tmpDir, outPath string, stdout, stderr io.Writer) int {
	if os.Geteuid() != 0 {
		fmt.Fprintln(stderr, "bench: needs root to create network namespaces")
		return 1
	}
	dir, unmount, err := bench.EnsureTmpfs(tmpDir)
	if err != nil {
		fmt.Fprintln(stderr, "bench:", err)
		return 1
	}
	defer unmount()
	o.TmpDir = dir
	for _, p := range []*string{&o.ServerBin, &o.LoadBin} {
		if abs, err := filepath.Abs(*p); err == nil {
			*p = abs
		}
	}
	rep, err := bench.RunMany(ctx, o)
	if rep != nil {
		fmt.Fprintln(stdout)
		if werr := bench.WriteManyTable(stdout, rep); werr != nil {
			fmt.Fprintln(stderr, "bench:", werr)
		}
		if werr := bench.WriteJSON(outPath, rep); werr != nil {
			fmt.Fprintln(stderr, "bench:", werr)
		} else {
			fmt.Fprintln(stdout, "report:", outPath)
		}
		svg := strings.TrimSuffix(outPath, ".json") + ".svg"
		sub := fmt.Sprintf("4 x 1 Gbit/s, one MPTCP connection per volume, 1 MiB writes at QD 8, %v each", o.Duration)
		if werr := os.WriteFile(svg, []byte(bench.ManySVG(rep, sub)), 0o644); werr != nil {
			fmt.Fprintln(stderr, "bench:", werr)
		} else {
			fmt.Fprintln(stdout, "chart:", svg)
		}
	}
	if err != nil {
		fmt.Fprintln(stderr, "bench:", err)
		return 1
	}
	return 0
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}
