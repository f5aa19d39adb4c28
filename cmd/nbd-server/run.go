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
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/signal"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"

	"github.com/mpnbd/mpnbd/internal/hostaddr"
	"github.com/mpnbd/mpnbd/pkg/agent"
	"github.com/mpnbd/mpnbd/pkg/buildinfo"
	"github.com/mpnbd/mpnbd/pkg/logging/kubelog"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
	"github.com/mpnbd/mpnbd/pkg/nbdmetrics"
)

// Exit codes.
const (
	exitOK      = 0
	exitFailure = 1
	exitUsage   = 2
)

// run is the whole command: it parses args, serves until ctx ends, shuts
// down gracefully and returns the exit code. SIGHUP reloads the config
// file while it runs.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	opts, err := parseArgs(args)
	if errors.Is(err, flag.ErrHelp) {
		fs, _ := newFlagSet()
		fmt.Fprint(stdout, usage(fs))
		return exitOK
	}
	if err != nil {
		fmt.Fprintf(stderr, "nbd-server: %v\nRun 'nbd-server --help' for usage.\n", err)
		return exitUsage
	}
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	return serve(ctx, opts, newLogger(stderr, opts), hup)
}

// newLogger is the process's logger; klog and controller-runtime log
// through it, and processes it starts log as it does.
func newLogger(w io.Writer, o *options) *slog.Logger {
	return kubelog.Setup(w, o.logLevel, o.logFormat)
}

// daemon is the state of one running server.
type daemon struct {
	opts    *options
	log     *slog.Logger
	srv     *nbd.Server
	metrics *nbdmetrics.Observer
	// reg is the registry /metrics serves.
	reg     *prometheus.Registry
	exports map[string]*openExport
	// retired are removed exports whose connections did not drain in time.
	retired []*openExport
	// incarnations changes the server's incarnation when an export's
	// final sync fails.
	incarnations nbd.IncarnationStore
}

// incarnationFile, in the storage agent's data directory, keeps what made
// the incarnation change (nbd.IncarnationStore).
const incarnationFile = ".incarnation-salt"

// lostWrites is called when the final sync of an export failed as it
// closed: its writeback error is consumed, and clients that reconnect
// later would not learn that writes they were told are written may be
// gone. A new incarnation makes every session send again what it retains.
func (d *daemon) lostWrites(export string) {
	inc, err := d.incarnations.Lost()
	d.srv.SetIncarnation(inc)
	if err != nil {
		d.log.Error("acknowledged writes may be lost: the incarnation changed, but could not be recorded for the next start", "export", export, "error", err)
		return
	}
	d.log.Error("acknowledged writes may be lost: the incarnation changed, so clients send again what they retain", "export", export)
}

type openExport struct {
	cfg     ExportConfig
	backend *nbd.FileBackend
}

// serve runs the server described by opts until ctx ends. Each value
// received on reload re-reads the config file.
func serve(ctx context.Context, opts *options, log *slog.Logger, reload <-chan os.Signal) int {
	component := "nbd-server"
	if opts.cluster != nil {
		component = "storage-agent"
	}
	reg := buildinfo.Registry(component)
	obs, err := nbdmetrics.New(reg)
	if err != nil {
		log.Error("registering metrics failed", "error", err)
		return exitFailure
	}
	d := &daemon{
		opts:    opts,
		log:     log,
		metrics: obs,
		reg:     reg,
		exports: make(map[string]*openExport),
		srv: &nbd.Server{
			Logger:      log,
			DisableList: opts.noList,
			Observer:    obs,
			Limits:      opts.limits,
			TLSConfig:   opts.tls,
			TLSRequired: opts.tlsRequired,
		},
	}
	// File and device backends write through to the kernel: only a reboot
	// of this host loses acknowledged writes, so clients need to send
	// their unflushed writes again only after one, or after an export's
	// final sync failed (lostWrites). The storage agent keeps the record
	// of the latter in its data directory.
	if opts.cluster != nil {
		d.incarnations.Path = filepath.Join(opts.cluster.dataDir, incarnationFile)
	}
	if inc, err := d.incarnations.Current(); err == nil {
		d.srv.Incarnation = inc
	} else {
		log.Warn("no incarnation from the boot ID: every restart counts as a new incarnation", "error", err)
	}

	// Open every backend before listening, so that a bad path fails the
	// start instead of clients.
	for _, e := range opts.exports {
		if err := d.addExport(e); err != nil {
			log.Error("cannot serve export", "export", e.Name, "error", err)
			d.closeBackends()
			return exitFailure
		}
	}
	if len(opts.exports) == 0 && opts.cluster == nil {
		log.Warn("no exports yet; add some to the config file and send SIGHUP", "config", opts.configPath)
	}

	// Standalone: every --listen address. Cluster mode: the port on the
	// storage addresses, and on the signal NICs' addresses as the agent
	// finds them.
	var listeners []net.Listener
	var clusterListeners *agent.Listeners
	closeListeners := func() {
		for _, l := range listeners {
			l.Close()
		}
		if clusterListeners != nil {
			clusterListeners.Close()
		}
	}
	var bound []string
	var storageAddrs []netip.Addr
	if co := opts.cluster; co != nil {
		// A CIDR stands for the host's addresses inside it now.
		if storageAddrs, err = co.addresses.Resolve(hostAddrs); err != nil {
			log.Error("no storage addresses", "error", err)
			return exitFailure
		}
		clusterListeners = agent.NewListeners(d.srv, co.port, !opts.tcp, log)
		if err := clusterListeners.Bind(storageAddrs); err != nil {
			log.Error("cannot listen on the storage addresses", "error", err)
			closeListeners()
			return exitFailure
		}
		for _, l := range clusterListeners.Listeners() {
			bound = append(bound, l.Addr().String())
			d.logListener(l, l.Addr().String())
		}
	}
	for _, addr := range opts.listen {
		if opts.cluster != nil {
			break // the storage addresses, above
		}
		l, err := mptcp.Listen(ctx, "tcp", addr, !opts.tcp)
		if err != nil {
			log.Error("cannot listen", "addr", addr, "error", err)
			closeListeners()
			d.closeBackends()
			return exitFailure
		}
		listeners = append(listeners, l)
		bound = append(bound, l.Addr().String())
		d.logListener(l, addr)
	}

	var ca *clusterAgent
	if opts.cluster != nil {
		ca, err = d.startAgent(ctx, clusterListeners, hostaddr.Strings(storageAddrs))
		if err != nil {
			log.Error("cannot start the storage agent", "error", err)
			closeListeners()
			return exitFailure
		}
	}

	var healthy atomic.Bool
	healthy.Store(true)
	ready := healthy.Load
	if ca != nil {
		ready = func() bool { return healthy.Load() && ca.agent.Started() }
	}
	var metricsSrv *http.Server
	metricsAddr := ""
	if opts.metricsAddr != "" {
		ml, err := net.Listen("tcp", opts.metricsAddr)
		if err != nil {
			log.Error("cannot listen for metrics", "addr", opts.metricsAddr, "error", err)
			closeListeners()
			if ca != nil {
				ca.stop()
				if err := <-ca.done; err != nil {
					log.Error("storage agent", "error", err)
				}
				ca.agent.Close()
			}
			d.closeBackends()
			return exitFailure
		}
		metricsAddr = ml.Addr().String()
		// In cluster mode the agent's controller-runtime metrics too
		// (its watches' work queues, its API requests).
		var g prometheus.Gatherer = reg
		if opts.cluster != nil {
			g = buildinfo.Merge(reg, ctrlmetrics.Registry)
		}
		metricsSrv = newMetricsServer(g, reg, &healthy, ready, log)
		go func() {
			if err := metricsSrv.Serve(ml); err != nil && !errors.Is(err, http.ErrServerClosed) {
				log.Error("metrics server failed", "error", err)
			}
		}()
		log.Info("metrics listening", "addr", metricsAddr)
	}

	var serving sync.WaitGroup
	for _, l := range listeners {
		serving.Go(func() {
			if err := d.srv.Serve(l); err != nil && !errors.Is(err, nbd.ErrClosed) {
				log.Error("serving failed", "addr", l.Addr().String(), "error", err)
			}
		})
	}
	if clusterListeners != nil {
		clusterListeners.Serve()
	}
	log.Info("ready", "listen", bound, "metrics_addr", metricsAddr, "exports", len(d.exports), "version", buildinfo.Version)

	code := exitOK
	var agentDone <-chan error
	if ca != nil {
		agentDone = ca.done
	}
	reason := ""
	for done := false; !done; {
		select {
		case <-ctx.Done():
			done = true
			reason = context.Cause(ctx).Error()
		case err := <-agentDone:
			// The manager stopped on its own: it cannot go on.
			log.Error("storage agent stopped", "error", err)
			agentDone, done, code = nil, true, exitFailure
			reason = "storage agent stopped"
		case sig := <-reload:
			if ca != nil {
				log.Info("SIGHUP ignored in cluster mode", "signal", sig.String())
				continue
			}
			d.reload(sig)
		}
	}

	healthy.Store(false)
	log.Info("shutting down", "reason", reason, "timeout", opts.shutdownTimeout.String())
	if ca != nil {
		// Stop reconciling first, so no export comes or goes while the
		// server drains.
		ca.stop()
		if agentDone != nil {
			if err := <-agentDone; err != nil {
				log.Error("storage agent", "error", err)
				code = exitFailure
			}
		}
	}
	sctx, cancel := context.WithTimeout(context.Background(), opts.shutdownTimeout)
	if err := d.srv.Shutdown(sctx); err != nil {
		log.Warn("connections did not drain in time and were closed", "error", err)
	}
	cancel()
	serving.Wait()
	if clusterListeners != nil {
		clusterListeners.Close()
	}
	if ca != nil {
		if err := ca.agent.Close(); err != nil {
			log.Error("closing volumes failed", "error", err)
			code = exitFailure
		}
	}
	if !d.closeBackends() {
		code = exitFailure
	}
	if metricsSrv != nil {
		mctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if err := metricsSrv.Shutdown(mctx); err != nil {
			log.Warn("metrics server: requests did not finish in time and were closed", "error", err)
		}
		cancel()
	}
	log.Info("stopped", "exit_code", code)
	return code
}

// logListener logs a listener and whether it really runs MPTCP; not
// getting MPTCP when it was asked for is a warning.
func (d *daemon) logListener(l net.Listener, requested string) {
	attrs := []any{"addr", l.Addr().String()}
	if requested != l.Addr().String() {
		attrs = append(attrs, "requested", requested)
	}
	if d.opts.tcp {
		d.log.Info("listening", append(attrs, "mptcp", false, "reason", "--tcp")...)
		return
	}
	on, err := listenerMPTCP(l)
	switch {
	case err != nil:
		d.log.Warn("listening", append(attrs, "mptcp", "unknown", "error", err)...)
	case on:
		d.log.Info("listening", append(attrs, "mptcp", true)...)
	default:
		reason := "the kernel gave a plain TCP socket"
		if err := mptcp.Available(); err != nil {
			reason = err.Error()
		}
		d.log.Warn("listening", append(attrs, "mptcp", false, "reason", reason)...)
	}
}

// newMetricsServer serves g's metrics (promhttp's own registered in reg)
// on /metrics, and the probes.
func newMetricsServer(g prometheus.Gatherer, reg *prometheus.Registry, healthy *atomic.Bool, ready func() bool, log *slog.Logger) *http.Server {
	errLog := slog.NewLogLogger(log.Handler(), slog.LevelError)
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(g, promhttp.HandlerOpts{
		ErrorLog: errLog,
		Registry: reg,
	}))
	// A probe that went away before its answer is no error of ours.
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		if !healthy.Load() {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = io.WriteString(w, "shutting down\n")
			return
		}
		_, _ = io.WriteString(w, "ok\n")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		if !ready() {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = io.WriteString(w, "not ready\n")
			return
		}
		_, _ = io.WriteString(w, "ok\n")
	})
	return &http.Server{
		Handler:           mux,
		ReadHeaderTimeout: 10 * time.Second,
		ErrorLog:          errLog,
	}
}

// openBackend opens the file or block device of an export.
func openBackend(e ExportConfig) (*nbd.FileBackend, error) {
	st, err := os.Stat(e.Path)
	switch {
	case errors.Is(err, fs.ErrNotExist) && e.ReadOnly:
		return nil, fmt.Errorf("%s does not exist", e.Path)
	case errors.Is(err, fs.ErrNotExist) && !e.Create:
		return nil, fmt.Errorf("%s does not exist (add the create option, with a size, to make it)", e.Path)
	case err == nil && !st.Mode().IsRegular() && (st.Mode()&fs.ModeDevice == 0 || st.Mode()&fs.ModeCharDevice != 0):
		return nil, fmt.Errorf("%s is not a regular file or block device (mode %s)", e.Path, st.Mode())
	case err != nil && !errors.Is(err, fs.ErrNotExist):
		return nil, err
	}
	b, err := nbd.OpenFile(e.Path, int64(e.Size), e.Create, e.ReadOnly)
	if err != nil {
		return nil, err
	}
	if b.Size() == 0 {
		b.Close()
		return nil, fmt.Errorf("%s is empty; give a size (with create, or to grow it)", e.Path)
	}
	return b, nil
}

// addExport opens an export's backend and starts serving it.
func (d *daemon) addExport(e ExportConfig) error {
	b, err := openBackend(e)
	if err != nil {
		return err
	}
	if e.Size > 0 && b.Size() > int64(e.Size) {
		d.log.Warn("file is larger than the size given; serving all of it",
			"export", e.Name, "path", e.Path, "size", int64(e.Size), "file_size", b.Size())
	}
	err = d.srv.AddExport(&nbd.Export{
		Name:        e.Name,
		Description: e.Description,
		Backend:     b,
		ReadOnly:    e.ReadOnly,
	})
	if err != nil {
		b.Close()
		return err
	}
	d.exports[e.Name] = &openExport{cfg: e, backend: b}
	d.metrics.ExportAdded(e.Name)
	d.log.Info("serving export", "export", e.Name, "path", e.Path, "size", b.Size(), "read_only", e.ReadOnly)
	return nil
}

// removeExport drains an export's connections, then flushes and closes
// its backend.
func (d *daemon) removeExport(name string) {
	oe := d.exports[name]
	ctx, cancel := context.WithTimeout(context.Background(), d.opts.shutdownTimeout)
	defer cancel()
	err := d.srv.RemoveExport(ctx, name)
	delete(d.exports, name)
	d.metrics.ExportRemoved(name)
	if err != nil {
		// The connections were closed hard, but requests they had in
		// flight may still be running on the backend: it is closed only
		// at shutdown, once the server has waited for every connection.
		d.log.Warn("export connections did not drain in time and were closed; its file stays open until shutdown",
			"export", name, "error", err)
		d.retired = append(d.retired, oe)
		return
	}
	d.closeBackend(name, oe)
}

func (d *daemon) closeBackend(name string, oe *openExport) bool {
	ok := true
	if !oe.cfg.ReadOnly {
		if err := oe.backend.Sync(); err != nil {
			d.log.Error("flush failed", "export", name, "error", err)
			d.lostWrites(name)
			ok = false
		}
	}
	if err := oe.backend.Close(); err != nil {
		d.log.Error("close failed", "export", name, "error", err)
		ok = false
	}
	return ok
}

// closeBackends flushes and closes every backend; false if one failed.
func (d *daemon) closeBackends() bool {
	ok := true
	for name, oe := range d.exports {
		ok = d.closeBackend(name, oe) && ok
		delete(d.exports, name)
	}
	for _, oe := range d.retired {
		ok = d.closeBackend(oe.cfg.Name, oe) && ok
	}
	d.retired = nil
	return ok
}

// reload re-reads the config file and makes the served exports match it
// plus the --export flags: exports that disappeared or changed are
// drained and removed, new or changed ones are (re)opened.
func (d *daemon) reload(sig os.Signal) {
	log := d.log.With("signal", sig.String())
	if d.opts.configPath == "" {
		log.Warn("no --config file to reload; ignoring the signal")
		return
	}
	fc, err := loadConfig(d.opts.configPath)
	if err != nil {
		log.Error("reload failed; keeping the current exports", "error", err)
		return
	}
	want, err := mergeExports(fc.Exports, d.opts.flagExports)
	if err != nil {
		log.Error("reload failed; keeping the current exports", "config", d.opts.configPath, "error", err)
		return
	}
	byName := make(map[string]ExportConfig, len(want))
	for _, e := range want {
		byName[e.Name] = e
	}
	var removed, added, failed int
	for name, oe := range d.exports {
		if e, ok := byName[name]; !ok || e != oe.cfg {
			d.removeExport(name)
			removed++
		}
	}
	for _, e := range want {
		if _, ok := d.exports[e.Name]; ok {
			continue
		}
		if err := d.addExport(e); err != nil {
			log.Error("cannot serve export", "export", e.Name, "error", err)
			failed++
			continue
		}
		added++
	}
	log.Info("config reloaded", "config", d.opts.configPath,
		"exports", len(d.exports), "added", added, "removed", removed, "failed", failed)
}
