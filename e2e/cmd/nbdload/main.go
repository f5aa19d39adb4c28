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

// Command nbdload is a load generator for NBD servers built on the
// project's own client (pkg/nbd): it runs --qd concurrent workers on one
// pipelined client for --time and prints one JSON object with the
// throughput, the MPTCP subflows of every connection and its own CPU use.
//
//	nbdload --addr HOST:PORT --export NAME [--mptcp] [--conns 1]
//	        --rw read|write|randread|randwrite --bs 1M --qd 8 --time 10s
//	        [--warmup 0s | --measure-from TIME] [--span 2G] [--seed N]
//	        [--cpuprofile FILE]
//	nbdload --addr HOST:PORT --export NAME --verify [--bs 1M --qd 8 --span 256M]
//
// --export-file FILE reads the export name from FILE instead (/dev/stdin
// for a pipe): an export name that holds an access token (the driver's
// per-node exports) then stays out of the process list, and the report
// leaves the name out.
//
// Sequential patterns share one cursor: each worker takes the next block
// and the cursor wraps at --span. Random patterns pick block-aligned
// offsets uniformly in [0, span). Throughput counts only requests that
// complete in the measured window (after --warmup); MB/s is 10^6 bytes/s.
//
// --verify writes a pattern over the span, flushes, reads everything back
// and compares it (rand* patterns shuffle the block order).
//
// To run in the client namespace of the test topology:
//
//	ip netns exec "$CLIENT_NS" bin/nbdload --addr "$SERVER_ADDR1:10809" --export bench --mptcp --rw read
//
// Exit status: 0 when data moved without errors (and the verification
// matched), 1 when the run failed (the JSON report is still printed if
// the connection succeeded), 2 on a usage error.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime/pprof"
	"strings"
	"syscall"
	"time"

	"github.com/mpnbd/mpnbd/e2e/bench"
	"github.com/mpnbd/mpnbd/internal/testenv/pki"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// sizeFlag is a flag.Value holding a byte count parsed by bench.ParseSize.
type sizeFlag int64

func (s *sizeFlag) String() string { return fmt.Sprint(int64(*s)) }
func (s *sizeFlag) Set(v string) error {
	n, err := bench.ParseSize(v)
	if err != nil {
		return err
	}
	*s = sizeFlag(n)
	return nil
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("nbdload", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var (
		cfg  bench.LoadConfig
		bs   = sizeFlag(1 << 20)
		span sizeFlag
	)
	fs.StringVar(&cfg.Addr, "addr", "", "server `HOST:PORT` (required)")
	fs.StringVar(&cfg.Export, "export", "", "export `NAME`")
	exportFile := fs.String("export-file", "", "read the export name from `FILE` (/dev/stdin: a pipe); the report then leaves it out")
	fs.BoolVar(&cfg.MPTCP, "mptcp", false, "dial with Multipath TCP")
	fs.IntVar(&cfg.Conns, "conns", 1, "number of NBD connections (more than 1 needs a multi-conn server)")
	fs.StringVar(&cfg.RW, "rw", "read", "access pattern: read, write, randread or randwrite")
	fs.Var(&bs, "bs", "request `SIZE` (bytes or with suffix k, M, G)")
	fs.IntVar(&cfg.QueueDepth, "qd", 8, "requests in flight (concurrent workers)")
	fs.DurationVar(&cfg.Duration, "time", 10*time.Second, "measured `DURATION`")
	fs.DurationVar(&cfg.Warmup, "warmup", 0, "unmeasured `DURATION` before the measurement")
	fs.Func("measure-from", "start the measured window at `TIME` (RFC 3339, e.g. from date --rfc-3339=ns) instead of after --warmup, the load running from the start: clients started together measure the same window; a load that starts later fails", func(v string) error {
		t, err := time.Parse(time.RFC3339Nano, v)
		cfg.MeasureFrom = t
		return err
	})
	fs.Var(&span, "span", "use offsets in [0, `SIZE`); 0 = whole export")
	fs.Uint64Var(&cfg.Seed, "seed", 0, "seed of random offsets and data (0: random)")
	fs.BoolVar(&cfg.Verify, "verify", false, "correctness run: write a pattern over the span, read it back and compare")
	tlsDir := fs.String("tls-certificates", "", "upgrade with STARTTLS, trusting `DIR`/ca-cert.pem and presenting DIR/client-cert.pem and client-key.pem if there (libnbd's layout); the server must be named localhost in its certificate")
	indent := fs.Bool("pretty", false, "indent the JSON output")
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile of the whole run to `FILE` (go tool pprof)")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: nbdload --addr HOST:PORT --export NAME [flags]")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "nbdload: unexpected arguments %q\n", fs.Args())
		return 2
	}
	cfg.BlockSize, cfg.Span = int(bs), int64(span)
	if cfg.Addr == "" || !bench.ValidRW(cfg.RW) {
		fmt.Fprintln(stderr, "nbdload: --addr is required and --rw must be read, write, randread or randwrite")
		return 2
	}
	if *exportFile != "" {
		if cfg.Export != "" {
			fmt.Fprintln(stderr, "nbdload: --export and --export-file exclude each other")
			return 2
		}
		b, err := os.ReadFile(*exportFile)
		if err != nil {
			fmt.Fprintln(stderr, "nbdload: --export-file:", err)
			return 2
		}
		cfg.Export = strings.TrimRight(string(b), "\r\n")
	}
	if *tlsDir != "" {
		var err error
		if cfg.TLS, err = pki.LoadClientDir(*tlsDir, "localhost"); err != nil {
			fmt.Fprintln(stderr, "nbdload: --tls-certificates:", err)
			return 2
		}
	}

	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			fmt.Fprintln(stderr, "nbdload:", err)
			return 2
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			fmt.Fprintln(stderr, "nbdload:", err)
			return 2
		}
		defer pprof.StopCPUProfile()
	}
	rep, err := bench.RunLoad(ctx, cfg)
	if err != nil {
		fmt.Fprintln(stderr, "nbdload:", err)
		return 1
	}
	if *exportFile != "" {
		rep.Export = ""
	}
	enc := json.NewEncoder(stdout)
	if *indent {
		enc.SetIndent("", "  ")
	}
	if err := enc.Encode(rep); err != nil {
		fmt.Fprintln(stderr, "nbdload:", err)
		return 1
	}
	if !rep.OK() {
		fmt.Fprintln(stderr, "nbdload: run failed:", rep.Problem())
		return 1
	}
	return 0
}
