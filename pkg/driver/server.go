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

package driver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
)

// Listen opens a CSI endpoint: unix:///path (a stale socket file is
// replaced), unix:path, /path, or tcp://host:port.
func Listen(endpoint string) (net.Listener, error) {
	network, addr, err := ParseEndpoint(endpoint)
	if err != nil {
		return nil, err
	}
	if network == "unix" {
		if err := os.MkdirAll(filepath.Dir(addr), 0o750); err != nil {
			return nil, fmt.Errorf("endpoint %s: %w", endpoint, err)
		}
		if err := os.Remove(addr); err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("endpoint %s: remove the old socket: %w", endpoint, err)
		}
	}
	l, err := net.Listen(network, addr)
	if err != nil {
		return nil, fmt.Errorf("endpoint %s: %w", endpoint, err)
	}
	return l, nil
}

// ParseEndpoint splits a CSI endpoint into a network and an address.
func ParseEndpoint(endpoint string) (network, addr string, err error) {
	switch {
	case strings.HasPrefix(endpoint, "unix://"):
		network, addr = "unix", strings.TrimPrefix(endpoint, "unix://")
	case strings.HasPrefix(endpoint, "unix:"):
		network, addr = "unix", strings.TrimPrefix(endpoint, "unix:")
	case strings.HasPrefix(endpoint, "tcp://"):
		network, addr = "tcp", strings.TrimPrefix(endpoint, "tcp://")
	case strings.HasPrefix(endpoint, "/"):
		network, addr = "unix", endpoint
	default:
		return "", "", fmt.Errorf("%w: endpoint %q (want unix:///path or tcp://host:port)", ErrInvalidArgument, endpoint)
	}
	if addr == "" {
		return "", "", fmt.Errorf("%w: endpoint %q has no address", ErrInvalidArgument, endpoint)
	}
	return network, addr, nil
}

// NewGRPCServer returns a gRPC server that logs every call: failures at
// warning level, the rest at debug level.
func NewGRPCServer(log *slog.Logger, m *Metrics) *grpc.Server {
	return grpc.NewServer(grpc.UnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		start := time.Now()
		resp, err := m.unary(ctx, req, info, h)
		attrs := []any{"method", info.FullMethod, "duration", time.Since(start).Round(time.Microsecond)}
		if err != nil {
			st, _ := status.FromError(err)
			log.Warn("call failed", append(attrs, "code", st.Code().String(), "error", st.Message())...)
		} else {
			log.Debug("call", attrs...)
		}
		return resp, err
	}))
}

// Serve serves s on l until ctx ends, then stops gracefully (calls in
// flight finish, for at most grace).
func Serve(ctx context.Context, s *grpc.Server, l net.Listener, grace time.Duration) error {
	errc := make(chan error, 1)
	go func() { errc <- s.Serve(l) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	done := make(chan struct{})
	go func() {
		s.GracefulStop()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(grace):
		s.Stop()
	}
	// Serve returns nil once stopped, unless the listener failed first.
	return <-errc
}
