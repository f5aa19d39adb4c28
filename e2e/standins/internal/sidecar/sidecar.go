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

// Package sidecar holds what the CSI sidecar stand-ins of the cluster
// suite share: strict flag parsing, slog logging (klog routed into it),
// the CSI socket connection and the driver's name, and the chart's args.
package sidecar

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/go-logr/logr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/klog/v2"
)

// NewFlagSet returns a flag set that reports errors instead of exiting,
// so an unknown flag is an error the caller returns. Both -flag and
// --flag spellings are accepted, as with the real sidecars.
func NewFlagSet(name string, out io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(out)
	return fs
}

// Parse parses args and refuses positional arguments, which the real
// sidecars ignore silently and which always mean a mistake here.
func Parse(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("%s: unexpected arguments %q", fs.Name(), fs.Args())
	}
	return nil
}

// Level maps klog's -v verbosity to a slog level: debug from 4 up.
func Level(v int) slog.Level {
	if v >= 4 {
		return slog.LevelDebug
	}
	return slog.LevelInfo
}

// NewLogger returns a text logger on w at the level for verbosity v, and
// routes klog (client-go, the gRPC libraries) into it.
func NewLogger(w io.Writer, v int) *slog.Logger {
	h := slog.NewTextHandler(w, &slog.HandlerOptions{Level: Level(v)})
	klog.SetLogger(logr.FromSlogHandler(h))
	return slog.New(h)
}

// SignalContext is cancelled on SIGTERM or SIGINT.
func SignalContext() (context.Context, context.CancelFunc) {
	return signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
}

// Target turns a --csi-address (a socket path or a unix:// URL) into a
// gRPC target.
func Target(address string) string {
	if strings.HasPrefix(address, "unix:") {
		return address
	}
	return "unix:" + address
}

// Dial returns a client of the CSI socket at address. It does not wait:
// calls wait for the socket (WaitForReady) until their context ends.
func Dial(address string) (*grpc.ClientConn, error) {
	cc, err := grpc.NewClient(Target(address),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.WaitForReady(true)))
	if err != nil {
		return nil, fmt.Errorf("csi address %s: %w", address, err)
	}
	return cc, nil
}

// DriverName asks the plugin for its name (GetPluginInfo), retrying until
// it answers or ctx ends: the plugin container may start after ours.
func DriverName(ctx context.Context, log *slog.Logger, cc grpc.ClientConnInterface) (string, error) {
	ids := csi.NewIdentityClient(cc)
	for {
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		resp, err := ids.GetPluginInfo(cctx, &csi.GetPluginInfoRequest{})
		cancel()
		if err == nil {
			if resp.GetName() == "" {
				return "", errors.New("GetPluginInfo: empty driver name")
			}
			return resp.GetName(), nil
		}
		if ctx.Err() != nil {
			return "", fmt.Errorf("GetPluginInfo: %w", err)
		}
		log.Info("waiting for the CSI driver", "error", err)
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

// Fatal logs err and exits non-zero.
func Fatal(log *slog.Logger, err error) {
	log.Error("exiting", "error", err)
	os.Exit(1)
}
