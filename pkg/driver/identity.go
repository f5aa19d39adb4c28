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

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/mpnbd/mpnbd/pkg/buildinfo"
)

// DriverName is the CSI driver name.
const DriverName = "nbd.mptcp.mpnbd.io"

// Identity serves the CSI Identity service for both the controller and the
// node plugin. Both report the plugin's capabilities (a Controller
// service exists, topology, online expansion): they describe the plugin as
// a whole, whichever of its parts answers.
type Identity struct {
	csi.UnimplementedIdentityServer
	// Ready reports readiness (nil: always ready).
	Ready func(context.Context) error
}

func (i *Identity) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: DriverName, VendorVersion: buildinfo.Version}, nil
}

func (i *Identity) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	caps := []*csi.PluginCapability{
		svcCap(csi.PluginCapability_Service_CONTROLLER_SERVICE),
		svcCap(csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS),
		{Type: &csi.PluginCapability_VolumeExpansion_{
			VolumeExpansion: &csi.PluginCapability_VolumeExpansion{Type: csi.PluginCapability_VolumeExpansion_ONLINE},
		}},
	}
	return &csi.GetPluginCapabilitiesResponse{Capabilities: caps}, nil
}

func svcCap(t csi.PluginCapability_Service_Type) *csi.PluginCapability {
	return &csi.PluginCapability{Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{Type: t}}}
}

func (i *Identity) Probe(ctx context.Context, _ *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	if i.Ready != nil {
		if err := i.Ready(ctx); err != nil {
			return &csi.ProbeResponse{Ready: wrapperspb.Bool(false)}, nil
		}
	}
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil
}
