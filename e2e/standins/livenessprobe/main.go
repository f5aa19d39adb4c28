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

// Command livenessprobe stands in for the CSI livenessprobe sidecar in
// the cluster suite: GET /healthz on --http-endpoint (or, without it, on
// all addresses at --health-port, deprecated in the real one) answers 200
// while the plugin's Probe succeeds and reports ready, 500 otherwise; with
// --http-endpoint, /metrics counts the probes. It takes the flags the
// chart passes and refuses any other.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/mpnbd/mpnbd/e2e/standins/internal/sidecar"
)

const defaultHealthPort = 9808

type options struct {
	csiAddress   string
	healthPort   int
	probeTimeout time.Duration
	httpEndpoint string
	verbosity    int
}

func parseFlags(args []string, out io.Writer) (options, error) {
	var o options
	fs := sidecar.NewFlagSet("livenessprobe", out)
	fs.StringVar(&o.csiAddress, "csi-address", "/run/csi/socket", "CSI endpoint of the plugin (path or unix:// URL)")
	fs.IntVar(&o.healthPort, "health-port", defaultHealthPort, "(deprecated) port of /healthz on all addresses; not with --http-endpoint")
	fs.DurationVar(&o.probeTimeout, "probe-timeout", time.Second, "timeout of the Probe call")
	fs.StringVar(&o.httpEndpoint, "http-endpoint", "", "address ([host]:port) of /healthz and /metrics")
	fs.IntVar(&o.verbosity, "v", 0, "log verbosity (4 and up: debug)")
	if err := sidecar.Parse(fs, args); err != nil {
		return o, err
	}
	if o.healthPort <= 0 || o.healthPort > 65535 {
		return o, fmt.Errorf("--health-port %d: want 1-65535", o.healthPort)
	}
	// As the real one: --health-port other than its default and
	// --http-endpoint exclude each other.
	if o.healthPort != defaultHealthPort && o.httpEndpoint != "" {
		return o, errors.New("only one of --health-port and --http-endpoint can be set")
	}
	if o.probeTimeout <= 0 {
		return o, errors.New("--probe-timeout must be positive")
	}
	return o, nil
}

// addr is where /healthz is served.
func (o options) addr() string {
	if o.httpEndpoint != "" {
		return o.httpEndpoint
	}
	return net.JoinHostPort("", strconv.Itoa(o.healthPort))
}

// prober answers /healthz from the plugin's Probe.
type prober struct {
	log     *slog.Logger
	ids     csi.IdentityClient
	timeout time.Duration

	mu     sync.Mutex
	counts map[string]int // probes by result: ok, not_ready, error
}

func (p *prober) count(result string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.counts == nil {
		p.counts = map[string]int{}
	}
	p.counts[result]++
}

func (p *prober) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), p.timeout)
	defer cancel()
	resp, err := p.ids.Probe(ctx, &csi.ProbeRequest{})
	switch {
	case err != nil:
		p.count("error")
		p.log.Warn("health check failed", "error", err)
		http.Error(w, "probe: "+err.Error(), http.StatusInternalServerError)
	case resp.GetReady() != nil && !resp.GetReady().GetValue():
		// An absent ready field means ready (CSI spec).
		p.count("not_ready")
		p.log.Warn("health check failed: the driver is not ready")
		http.Error(w, "driver is not ready", http.StatusInternalServerError)
	default:
		p.count("ok")
		p.log.Debug("health check succeeded")
		fmt.Fprintln(w, "ok")
	}
}

// metrics serves the probe counts in the Prometheus text format.
func (p *prober) metrics(w http.ResponseWriter, _ *http.Request) {
	p.mu.Lock()
	defer p.mu.Unlock()
	w.Header().Set("Content-Type", "text/plain; version=0.0.4")
	fmt.Fprintln(w, "# HELP livenessprobe_probes_total Probe calls /healthz made, by result.")
	fmt.Fprintln(w, "# TYPE livenessprobe_probes_total counter")
	for _, r := range []string{"ok", "not_ready", "error"} {
		fmt.Fprintf(w, "livenessprobe_probes_total{result=%q} %d\n", r, p.counts[r])
	}
}

func run(ctx context.Context, log *slog.Logger, o options) error {
	cc, err := sidecar.Dial(o.csiAddress)
	if err != nil {
		return err
	}
	defer cc.Close()
	// Like the real one, learn the driver's name first; the probe then
	// talks to a plugin known to be there.
	driver, err := sidecar.DriverName(ctx, log, cc)
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	p := &prober{log: log, ids: csi.NewIdentityClient(cc), timeout: o.probeTimeout}
	mux.Handle("/healthz", p)
	if o.httpEndpoint != "" {
		mux.HandleFunc("/metrics", p.metrics)
	}
	lis, err := net.Listen("tcp", o.addr())
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		srv.Close()
	}()
	log.Info("serving", "driver", driver, "address", lis.Addr().String(), "metrics", o.httpEndpoint != "")
	if err := srv.Serve(lis); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

func main() {
	o, err := parseFlags(os.Args[1:], os.Stderr)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	log := sidecar.NewLogger(os.Stderr, o.verbosity)
	ctx, stop := sidecar.SignalContext()
	defer stop()
	if err := run(ctx, log, o); err != nil {
		stop()
		sidecar.Fatal(log, err)
	}
}
