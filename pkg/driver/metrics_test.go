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
	"io"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// TestCallMetrics: a CSI server counts its calls by method and code (an
// unimplemented one too) and times them; ServeMetrics serves them.
func TestCallMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "csi.sock")
	l, err := Listen("unix://" + sock)
	if err != nil {
		t.Fatal(err)
	}
	s := NewGRPCServer(slog.New(slog.DiscardHandler), m)
	csi.RegisterIdentityServer(s, &Identity{})
	csi.RegisterControllerServer(s, csi.UnimplementedControllerServer{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, s, l, time.Second) }()
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	for range 2 {
		if _, err := csi.NewIdentityClient(conn).GetPluginInfo(ctx, &csi.GetPluginInfoRequest{}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := csi.NewControllerClient(conn).CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "x"}); err == nil {
		t.Fatal("an unimplemented CreateVolume succeeded")
	}
	want := `# HELP mpnbd_csi_requests_total CSI calls served, by method and gRPC status code.
# TYPE mpnbd_csi_requests_total counter
mpnbd_csi_requests_total{code="OK",method="GetPluginInfo"} 2
mpnbd_csi_requests_total{code="Unimplemented",method="CreateVolume"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "mpnbd_csi_requests_total"); err != nil {
		t.Error(err)
	}
	if n := testutil.CollectAndCount(m.latency, "mpnbd_csi_request_duration_seconds"); n != 2 {
		t.Errorf("%d latency series, want 2 (one per method)", n)
	}

	// Served over HTTP.
	hl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := hl.Addr().String()
	hl.Close()
	if err := ServeMetrics(ctx, addr, reg, slog.New(slog.DiscardHandler)); err != nil {
		t.Fatal(err)
	}
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(b), `mpnbd_csi_requests_total{code="OK",method="GetPluginInfo"} 2`) {
		t.Errorf("/metrics:\n%.2000s", b)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Serve: %v", err)
	}
}

// TestStorageNodeReadyMetric: the gauge follows the nodes given, and a
// node no longer there loses its series.
func TestStorageNodeReadyMetric(t *testing.T) {
	reg := prometheus.NewRegistry()
	m, err := NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	m.storageNodes(map[string]bool{"a": true, "b": false})
	m.storageNodes(map[string]bool{"a": false, "c": true})
	want := `# HELP mpnbd_controller_storage_node_ready 1 while the controller holds the storage node Ready (its agent renews its lease and reports), 0 otherwise.
# TYPE mpnbd_controller_storage_node_ready gauge
mpnbd_controller_storage_node_ready{storage_node="a"} 0
mpnbd_controller_storage_node_ready{storage_node="c"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "mpnbd_controller_storage_node_ready"); err != nil {
		t.Error(err)
	}
	var none *Metrics
	none.storageNodes(map[string]bool{"a": true}) // a nil *Metrics counts nothing
	none.primaryChanged("FailedOver")
}
