// Package fakecsi is a small CSI plugin for the stand-ins' tests: a real
// gRPC server on a unix socket whose answers the test sets and whose
// requests it records.
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
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// Plugin answers the Identity and Controller services.
type Plugin struct {
	csi.UnimplementedIdentityServer
	csi.UnimplementedControllerServer

	Name           string
	ControllerCaps []csi.ControllerServiceCapability_RPC_Type
	// Topology adds VOLUME_ACCESSIBILITY_CONSTRAINTS, Expansion the
	// ONLINE volume expansion plugin capability.
	Topology, Expansion bool

	mu       sync.Mutex
	notReady bool
	probeErr error
	create   func(*csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error)
	expand   func(*csi.ControllerExpandVolumeRequest) (*csi.ControllerExpandVolumeResponse, error)
	capacity func(*csi.GetCapacityRequest) (*csi.GetCapacityResponse, error)
	creates  []*csi.CreateVolumeRequest
	deletes  []string
	expands  []*csi.ControllerExpandVolumeRequest
	probes   int
	capCalls int
}

// SetReady sets what Probe answers: ready or not, or err.
func (p *Plugin) SetReady(ready bool, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.notReady, p.probeErr = !ready, err
}

// OnCreate, OnExpand and OnCapacity set the answers of those calls.
func (p *Plugin) OnCreate(f func(*csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error)) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.create = f
}

func (p *Plugin) OnExpand(f func(*csi.ControllerExpandVolumeRequest) (*csi.ControllerExpandVolumeResponse, error)) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.expand = f
}

func (p *Plugin) OnCapacity(f func(*csi.GetCapacityRequest) (*csi.GetCapacityResponse, error)) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.capacity = f
}

// Creates, Deletes and Expands return the requests received so far.
func (p *Plugin) Creates() []*csi.CreateVolumeRequest {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]*csi.CreateVolumeRequest(nil), p.creates...)
}

func (p *Plugin) Deletes() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.deletes...)
}

func (p *Plugin) Expands() []*csi.ControllerExpandVolumeRequest {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]*csi.ControllerExpandVolumeRequest(nil), p.expands...)
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
	caps := []*csi.PluginCapability{{Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{
		Type: csi.PluginCapability_Service_CONTROLLER_SERVICE}}}}
	if p.Topology {
		caps = append(caps, &csi.PluginCapability{Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{
			Type: csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS}}})
	}
	if p.Expansion {
		caps = append(caps, &csi.PluginCapability{Type: &csi.PluginCapability_VolumeExpansion_{
			VolumeExpansion: &csi.PluginCapability_VolumeExpansion{Type: csi.PluginCapability_VolumeExpansion_ONLINE}}})
	}
	return &csi.GetPluginCapabilitiesResponse{Capabilities: caps}, nil
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

func (p *Plugin) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	var out []*csi.ControllerServiceCapability
	for _, t := range p.ControllerCaps {
		out = append(out, &csi.ControllerServiceCapability{Type: &csi.ControllerServiceCapability_Rpc{
			Rpc: &csi.ControllerServiceCapability_RPC{Type: t}}})
	}
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: out}, nil
}

func (p *Plugin) CreateVolume(_ context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	p.mu.Lock()
	p.creates = append(p.creates, proto.Clone(req).(*csi.CreateVolumeRequest))
	f := p.create
	p.mu.Unlock()
	if f == nil {
		return nil, status.Error(codes.Unimplemented, "no CreateVolume answer set")
	}
	return f(req)
}

func (p *Plugin) DeleteVolume(_ context.Context, req *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.deletes = append(p.deletes, req.GetVolumeId())
	return &csi.DeleteVolumeResponse{}, nil
}

func (p *Plugin) ControllerExpandVolume(_ context.Context, req *csi.ControllerExpandVolumeRequest) (*csi.ControllerExpandVolumeResponse, error) {
	p.mu.Lock()
	p.expands = append(p.expands, proto.Clone(req).(*csi.ControllerExpandVolumeRequest))
	f := p.expand
	p.mu.Unlock()
	if f == nil {
		return nil, status.Error(codes.Unimplemented, "no ControllerExpandVolume answer set")
	}
	return f(req)
}

// CapacityCalls counts the GetCapacity calls.
func (p *Plugin) CapacityCalls() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.capCalls
}

func (p *Plugin) GetCapacity(_ context.Context, req *csi.GetCapacityRequest) (*csi.GetCapacityResponse, error) {
	p.mu.Lock()
	p.capCalls++
	f := p.capacity
	p.mu.Unlock()
	if f == nil {
		return nil, status.Error(codes.Unimplemented, "no GetCapacity answer set")
	}
	return f(req)
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
	csi.RegisterControllerServer(srv, p)
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
