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
	"log/slog"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

func TestParseEndpoint(t *testing.T) {
	for _, c := range []struct{ in, network, addr string }{
		{"unix:///csi/csi.sock", "unix", "/csi/csi.sock"},
		{"unix:/csi/csi.sock", "unix", "/csi/csi.sock"},
		{"/csi/csi.sock", "unix", "/csi/csi.sock"},
		{"tcp://127.0.0.1:10000", "tcp", "127.0.0.1:10000"},
	} {
		n, a, err := ParseEndpoint(c.in)
		if err != nil || n != c.network || a != c.addr {
			t.Errorf("ParseEndpoint(%q) = %q, %q, %v", c.in, n, a, err)
		}
	}
	for _, bad := range []string{"", "csi.sock", "unix://", "http://x"} {
		if _, _, err := ParseEndpoint(bad); err == nil {
			t.Errorf("ParseEndpoint(%q) succeeds", bad)
		}
	}
}

func TestServeIdentityOverUnixSocket(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "sub", "csi.sock")
	for range 2 { // the second round replaces the stale socket file
		l, err := Listen("unix://" + sock)
		if err != nil {
			t.Fatal(err)
		}
		s := NewGRPCServer(slog.New(slog.DiscardHandler), nil)
		csi.RegisterIdentityServer(s, &Identity{})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- Serve(ctx, s, l, time.Second) }()
		conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		info, err := csi.NewIdentityClient(conn).GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
		if err != nil || info.GetName() != DriverName {
			t.Fatalf("GetPluginInfo = %v, %v", info, err)
		}
		conn.Close()
		cancel()
		if err := <-done; err != nil {
			t.Fatalf("Serve: %v", err)
		}
	}
}
