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

// Package fakecsi is a small CSI plugin for the stand-ins' tests: a real
// gRPC server of the Identity service on a unix socket whose Probe answer
// the test sets and whose Probe calls it counts.
package fakecsi

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// Plugin answers the Identity service.
type Plugin struct {
	csi.UnimplementedIdentityServer

	Name string

	mu       sync.Mutex
	notReady bool
	probeErr error
	probes   int
}

// SetReady sets what Probe answers: ready or not, or err.
func (p *Plugin) SetReady(ready bool, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.notReady, p.probeErr = !ready, err
}

// Probes counts the Probe calls.
func (p *Plugin) Probes() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.probes
}

func (p *Plugin) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: p.Name, VendorVersion: "test"}, nil
}

func (p *Plugin) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	return &csi.GetPluginCapabilitiesResponse{Capabilities: []*csi.PluginCapability{{Type: &csi.PluginCapability_Service_{
		Service: &csi.PluginCapability_Service{Type: csi.PluginCapability_Service_CONTROLLER_SERVICE}}}}}, nil
}

func (p *Plugin) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.probes++
	if p.probeErr != nil {
		return nil, p.probeErr
	}
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(!p.notReady)}, nil
}

// Serve serves p on a unix socket in a new short directory (socket paths
// are limited to 108 bytes) until t ends, and returns the socket's path.
func Serve(t testing.TB, p *Plugin) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "fakecsi")
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "csi.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	csi.RegisterIdentityServer(srv, p)
	// Serve returns nil once stopped: an error is a failure while the
	// test runs.
	go func() {
		if err := srv.Serve(lis); err != nil {
			t.Errorf("fake CSI driver: %v", err)
		}
	}()
	t.Cleanup(func() {
		srv.Stop()
		os.RemoveAll(dir)
	})
	return sock
}

// Log is a writer for a stand-in's logger in a test: it keeps the lines
// and prints them when the test fails.
type Log struct {
	mu  sync.Mutex
	buf []byte
}

// NewLog returns a Log whose lines t prints if it fails.
func NewLog(t testing.TB) *Log {
	l := &Log{}
	t.Cleanup(func() {
		if t.Failed() {
			l.mu.Lock()
			defer l.mu.Unlock()
			t.Logf("stand-in log:\n%s", l.buf)
		}
	})
	return l
}

func (l *Log) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.buf = append(l.buf, p...)
	return len(p), nil
}
