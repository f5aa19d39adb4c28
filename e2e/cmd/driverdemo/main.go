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

// Command driverdemo shows the CSI driver at work on one machine, as a
// container orchestrator would use it: a volume is created, published to
// a worker node, staged and mounted, and a file written through it and
// read back over NBD on MPTCP, across four shaped paths.
//
// It builds a topology of two network namespaces joined by four 1 Gbit/s
// paths (internal/testenv/topo): the client namespace is the worker node, the server
// namespace the storage node. A real API server (etcd + kube-apiserver)
// runs on the host's loopback; the storage agent (bin/nbd-server
// --cluster) runs in the server namespace and reaches it through a
// forwarder, the controller (bin/controller) on the host, and the node
// plugin (bin/node) in the client namespace, so the volume's data path
// crosses the four paths. Everything is driven through the CSI gRPC API;
// afterwards everything is torn down again, in reverse, also when a step
// fails.
//
// With --fio it then measures the data path as users see it, through the
// block device and through ext4 and xfs, against the raw NBD client
// (bin/nbdload) on the same four paths in the same run: fsbench.go.
//
// Needs root (namespaces, mounts, loop devices, FUSE). It builds nothing:
// hack/demo.sh builds the commands into bin/ first.
//
//	bin/driverdemo [--size 256MiB] [--transport fuse] [--out out/driverdemo.json]
//	bin/driverdemo --fio [--fio-seconds 10s] [--volume-size 2GiB]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/attach"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// options are the demo's flags.
type options struct {
	binDir     string
	fileSize   int64
	volumeSize int64
	transport  string
	fsType     string
	rateMbit   int
	name       string
	workDir    string
	out        string
	keep       bool
	// fio turns on the measurement of fsbench.go, each run fioTime
	// long.
	fio     bool
	fioTime time.Duration
}

// Defaults and bounds of the --fio measurement.
const (
	defaultVolumeSize    = 1 << 30
	defaultFioVolumeSize = 2 << 30
	minFioVolumeSize     = 1 << 30
	minFioTime           = time.Second
	maxFioTime           = 10 * time.Minute
)

func parseArgs(args []string, stderr io.Writer) (*options, error) {
	o := &options{}
	exeDir := "bin"
	if exe, err := os.Executable(); err == nil {
		exeDir = filepath.Dir(exe)
	}
	fs := flag.NewFlagSet("driverdemo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.binDir, "bin", exeDir, "`DIR` holding controller, node and nbd-server (default: this program's directory)")
	size := fs.String("size", "256MiB", "size of the file written through the volume")
	volSize := fs.String("volume-size", formatBytes(defaultVolumeSize), "size of the volume (default "+formatBytes(defaultFioVolumeSize)+" with --fio)")
	fs.StringVar(&o.transport, "transport", string(attach.FUSE), "how the node attaches the volume: fuse (any kernel), or kernel, relay, multiconn, tcp (kernels with nbd), or auto")
	fs.StringVar(&o.fsType, "fs", "ext4", "file system of the volume: ext4 or xfs")
	fs.IntVar(&o.rateMbit, "rate", topo.DefaultRateMbit, "rate of each of the 4 paths in Mbit/s")
	fs.StringVar(&o.name, "name", "", "topology `NAME` (default: drvdemo plus 4 random hex digits)")
	fs.StringVar(&o.workDir, "work-dir", "", "`DIR` for logs, sockets, mounts and backing files (default: a new temporary directory, removed afterwards)")
	fs.StringVar(&o.out, "out", filepath.Join("out", "driverdemo.json"), "write the results as JSON to `FILE`")
	fs.BoolVar(&o.keep, "keep-logs", false, "keep the work directory's logs (the directory is removed otherwise)")
	fs.BoolVar(&o.fio, "fio", false, "after the demo, measure with fio through the block device, ext4 and xfs against the raw NBD client (nbdload), each on a volume of its own; the work directory defaults to one on /dev/shm")
	fs.DurationVar(&o.fioTime, "fio-seconds", 10*time.Second, "measured `DURATION` of each --fio run (after an unmeasured ramp)")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if o.fio && !set["volume-size"] {
		*volSize = formatBytes(defaultFioVolumeSize)
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	var err error
	if o.fileSize, err = parseSize(*size); err != nil {
		return nil, fmt.Errorf("--size: %v", err)
	}
	if o.volumeSize, err = parseSize(*volSize); err != nil {
		return nil, fmt.Errorf("--volume-size: %v", err)
	}
	// The file system takes some of the volume.
	if o.fileSize > o.volumeSize*3/4 {
		return nil, fmt.Errorf("--size %s does not fit in a --volume-size %s volume (at most three quarters of it)",
			formatBytes(o.fileSize), formatBytes(o.volumeSize))
	}
	if t, err := attach.ParseTransport(o.transport); err != nil {
		return nil, fmt.Errorf("--transport: %v", err)
	} else {
		o.transport = string(t)
	}
	if o.fsType != "ext4" && o.fsType != "xfs" {
		return nil, fmt.Errorf("--fs %q: want ext4 or xfs", o.fsType)
	}
	if o.rateMbit <= 0 {
		return nil, fmt.Errorf("--rate %d: must be positive", o.rateMbit)
	}
	if set["fio-seconds"] && !o.fio {
		return nil, errors.New("--fio-seconds needs --fio")
	}
	if o.fio {
		if o.fioTime < minFioTime || o.fioTime > maxFioTime || o.fioTime%time.Millisecond != 0 {
			return nil, fmt.Errorf("--fio-seconds %s: want whole milliseconds from %s to %s", o.fioTime, minFioTime, maxFioTime)
		}
		if o.volumeSize < minFioVolumeSize {
			return nil, fmt.Errorf("--volume-size %s: --fio needs at least %s (xfs needs 300 MiB, and the measured file is half the volume)",
				formatBytes(o.volumeSize), formatBytes(minFioVolumeSize))
		}
	}
	if o.name == "" {
		o.name = topo.UniqueName(namePrefix)
	}
	return o, nil
}

// namePrefix starts the default topology name.
const namePrefix = "drvdemo"

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o, err := parseArgs(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "driverdemo: %v\n", err)
		return 2
	}
	if runtime.GOOS != "linux" || os.Geteuid() != 0 {
		fmt.Fprintln(stderr, "driverdemo: needs root on Linux (network namespaces, mounts, loop devices, FUSE)")
		return 1
	}
	// The API server helpers log through controller-runtime; the demo
	// prints its own progress.
	ctrllog.SetLogger(logr.Discard())
	d := &demo{o: o, out: stdout, res: &Result{Transport: o.transport, FileBytes: o.fileSize}}
	runErr := d.run(ctx)
	cleanErr := d.cleanup()
	err = errors.Join(runErr, cleanErr)
	d.res.OK = err == nil && d.res.ChecksumOK
	if err != nil {
		d.res.Error = err.Error()
	} else if !d.res.OK {
		d.res.Error = "checksum mismatch"
	}
	fmt.Fprintln(stdout, "\nSummary")
	_ = writeSummary(stdout, d.res)
	if b := d.res.FS; b != nil {
		b.computeRatios()
		fmt.Fprintf(stdout, "\nThe data path through the block device and the file systems vs the raw NBD client (%d x %d Mbit/s, MPTCP)\n", d.res.Paths, o.rateMbit)
		_ = writeFSTable(stdout, b)
	}
	if werr := writeJSON(o.out, d.res); werr != nil {
		fmt.Fprintf(stderr, "driverdemo: writing %s: %v\n", o.out, werr)
		if d.res.OK {
			return 1
		}
	} else {
		fmt.Fprintf(stdout, "\nResults written to %s\n", o.out)
	}
	if !d.res.OK {
		fmt.Fprintf(stderr, "driverdemo: FAILED: %s\n", strings.ReplaceAll(d.res.Error, "\n", "\n  "))
		return 1
	}
	return 0
}

// undo is one step of the teardown.
type undo struct {
	name string
	fn   func(ctx context.Context) error
}

// demo is one run.
type demo struct {
	o     *options
	out   io.Writer
	res   *Result
	undos []undo
	nstep int

	dir  string
	topo *topo.Topology
	// nodeToken is the worker's token (made here, in the node plugin's
	// state directory, so that its Node can announce the hash).
	nodeToken string
}

// step runs fn as a numbered, timed step and records it.
func (d *demo) step(name string, fn func() error) error {
	d.nstep++
	fmt.Fprintf(d.out, "\n[%2d] %s\n", d.nstep, name)
	start := time.Now()
	err := fn()
	if err == nil {
		err = failpoint(name)
	}
	el := time.Since(start)
	s := Step{Name: name, Seconds: el.Seconds()}
	if err != nil {
		s.Error = err.Error()
		fmt.Fprintf(d.out, "     FAILED after %s: %v\n", round(el), err)
		err = fmt.Errorf("%s: %w", name, err)
	} else {
		fmt.Fprintf(d.out, "     done in %s\n", round(el))
	}
	d.res.Steps = append(d.res.Steps, s)
	return err
}

// failpoint lets tests fail a step after it did its work.
var failpoint = func(step string) error { return nil }

// onCleanup pushes a teardown step; cleanup runs them last in, first out.
func (d *demo) onCleanup(name string, fn func(ctx context.Context) error) {
	d.undos = append(d.undos, undo{name: name, fn: fn})
}

// cleanup runs all the teardown steps.
func (d *demo) cleanup() error {
	if len(d.undos) > 0 {
		fmt.Fprintln(d.out, "\nTeardown")
	}
	return d.unwind(0, "  ")
}

// unwind runs the teardown steps pushed since the first mark ones, last
// in, first out, each at most two minutes, all of them even when some
// fail, and forgets them. Each prints a line starting with indent.
func (d *demo) unwind(mark int, indent string) error {
	var errs []error
	for i := len(d.undos) - 1; i >= mark; i-- {
		u := d.undos[i]
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		start := time.Now()
		err := u.fn(ctx)
		cancel()
		el := time.Since(start)
		s := Step{Name: "teardown: " + u.name, Seconds: el.Seconds()}
		if err != nil {
			s.Error = err.Error()
			fmt.Fprintf(d.out, "%s%-54s FAILED after %s: %v\n", indent, u.name, round(el), err)
			errs = append(errs, fmt.Errorf("teardown: %s: %w", u.name, err))
		} else {
			fmt.Fprintf(d.out, "%s%-54s %s\n", indent, u.name, round(el))
		}
		d.res.Steps = append(d.res.Steps, s)
	}
	d.undos = d.undos[:mark]
	return errors.Join(errs...)
}

func round(d time.Duration) time.Duration {
	if d < time.Second {
		return d.Round(time.Millisecond)
	}
	return d.Round(10 * time.Millisecond)
}

// primary is the storage node's address the node plugin dials: path 1.
func (d *demo) primary() netip.AddrPort {
	return netip.AddrPortFrom(d.topo.ServerAddr(1), nbdPort)
}
