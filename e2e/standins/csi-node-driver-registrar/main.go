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

// Command csi-node-driver-registrar stands in for the CSI
// node-driver-registrar sidecar in the cluster suite: it registers the
// node plugin with the kubelet through the plugin-registration socket
// (k8s.io/kubelet pluginregistration v1) and takes the same flags the
// chart passes.
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
	"path/filepath"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/mpnbd/mpnbd/e2e/standins/internal/sidecar"
)

type options struct {
	csiAddress     string
	kubeletRegPath string
	pluginRegPath  string
	httpEndpoint   string
	verbosity      int
}

func parseFlags(args []string, out io.Writer) (options, error) {
	var o options
	fs := sidecar.NewFlagSet("csi-node-driver-registrar", out)
	fs.StringVar(&o.csiAddress, "csi-address", "/run/csi/socket", "CSI endpoint of the node plugin (path or unix:// URL)")
	fs.StringVar(&o.kubeletRegPath, "kubelet-registration-path", "", "path of the plugin's CSI socket on the host, as the kubelet sees it")
	fs.StringVar(&o.pluginRegPath, "plugin-registration-path", "/registration", "directory of the kubelet's plugin registration sockets")
	fs.StringVar(&o.httpEndpoint, "http-endpoint", "", "address ([host]:port) of /healthz (empty: none)")
	fs.IntVar(&o.verbosity, "v", 0, "log verbosity (4 and up: debug)")
	if err := sidecar.Parse(fs, args); err != nil {
		return o, err
	}
	if o.kubeletRegPath == "" {
		return o, errors.New("--kubelet-registration-path is required")
	}
	if !filepath.IsAbs(o.kubeletRegPath) {
		return o, fmt.Errorf("--kubelet-registration-path %q: want an absolute path", o.kubeletRegPath)
	}
	return o, nil
}

// socketPath is where the kubelet's plugin watcher looks for the
// registration socket of driver.
func socketPath(dir, driver string) string {
	return filepath.Join(dir, driver+"-reg.sock")
}

// registrar answers the kubelet's plugin watcher.
type registrar struct {
	registerapi.UnimplementedRegistrationServer
	log      *slog.Logger
	driver   string
	endpoint string
	// failed receives the kubelet's error when it refused the plugin.
	failed chan error

	mu         sync.Mutex
	registered bool
}

func (r *registrar) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	// The kubelet asks, and so does every health check.
	r.log.Debug("asked for the plugin info")
	return &registerapi.PluginInfo{
		Type:              registerapi.CSIPlugin,
		Name:              r.driver,
		Endpoint:          r.endpoint,
		SupportedVersions: []string{"1.0.0"},
	}, nil
}

func (r *registrar) NotifyRegistrationStatus(_ context.Context, st *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	if !st.PluginRegistered {
		r.log.Error("the kubelet refused the plugin", "error", st.Error)
		select {
		case r.failed <- fmt.Errorf("registration refused by the kubelet: %s", st.Error):
		default:
		}
		return &registerapi.RegistrationStatusResponse{}, nil
	}
	r.mu.Lock()
	r.registered = true
	r.mu.Unlock()
	r.log.Info("registered with the kubelet", "driver", r.driver)
	return &registerapi.RegistrationStatusResponse{}, nil
}

func (r *registrar) isRegistered() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.registered
}

// healthz answers, as the real one does, 200 while the registration
// socket exists and answers GetInfo with the driver's name, 404 once the
// socket is gone, 500 otherwise.
func healthz(log *slog.Logger, sock, driver string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := os.Lstat(sock); errors.Is(err, os.ErrNotExist) {
			log.Warn("health check failed: the registration socket is gone", "socket", sock)
			http.Error(w, "registration socket does not exist", http.StatusNotFound)
			return
		} else if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if err := checkRegistrationSocket(r.Context(), sock, driver); err != nil {
			log.Warn("health check failed", "error", err)
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		fmt.Fprintln(w, "ok")
	})
}

// checkRegistrationSocket asks the registration socket for the plugin
// info, as the kubelet would.
func checkRegistrationSocket(ctx context.Context, sock, driver string) error {
	cc, err := grpc.NewClient("unix:"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	info, err := registerapi.NewRegistrationClient(cc).GetInfo(ctx, &registerapi.InfoRequest{})
	if err != nil {
		return fmt.Errorf("GetInfo on the registration socket: %w", err)
	}
	if info.GetName() != driver {
		return fmt.Errorf("the registration socket answers for %q, not %q", info.GetName(), driver)
	}
	return nil
}

func run(ctx context.Context, log *slog.Logger, o options) error {
	cc, err := sidecar.Dial(o.csiAddress)
	if err != nil {
		return err
	}
	driver, err := sidecar.DriverName(ctx, log, cc)
	cc.Close()
	if err != nil {
		return err
	}
	log.Info("driver found", "driver", driver)

	sock := socketPath(o.pluginRegPath, driver)
	if err := os.Remove(sock); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove stale socket: %w", err)
	}
	lis, err := net.Listen("unix", sock)
	if err != nil {
		return err
	}
	defer os.Remove(sock)

	reg := &registrar{log: log, driver: driver, endpoint: o.kubeletRegPath, failed: make(chan error, 1)}
	srv := grpc.NewServer()
	registerapi.RegisterRegistrationServer(srv, reg)
	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(lis) }()
	defer srv.Stop()
	log.Info("registration socket ready", "socket", sock, "endpoint", o.kubeletRegPath)

	if o.httpEndpoint != "" {
		mux := http.NewServeMux()
		mux.Handle("/healthz", healthz(log, sock, driver))
		hs := &http.Server{Addr: o.httpEndpoint, Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		go func() {
			if err := hs.ListenAndServe(); err != nil && !errors.Is(err, http.ErrServerClosed) {
				serveErr <- err
			}
		}()
		defer hs.Close()
	}

	select {
	case <-ctx.Done():
		log.Info("stopping", "registered", reg.isRegistered())
		return nil
	case err := <-reg.failed:
		// Let the kubelet have its answer before exiting.
		srv.GracefulStop()
		return err
	case err := <-serveErr:
		return err
	}
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
