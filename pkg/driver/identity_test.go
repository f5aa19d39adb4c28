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
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

func TestIdentity(t *testing.T) {
	ctx := context.Background()
	ctrl := &Identity{}
	info, err := ctrl.GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
	if err != nil || info.Name != DriverName || info.VendorVersion == "" {
		t.Fatalf("plugin info %+v %v", info, err)
	}
	caps, _ := ctrl.GetPluginCapabilities(ctx, nil)
	var hasCtrl, hasTopo, hasExpand bool
	for _, c := range caps.Capabilities {
		switch {
		case c.GetService().GetType() == csi.PluginCapability_Service_CONTROLLER_SERVICE:
			hasCtrl = true
		case c.GetService().GetType() == csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS:
			hasTopo = true
		case c.GetVolumeExpansion().GetType() == csi.PluginCapability_VolumeExpansion_ONLINE:
			hasExpand = true
		}
	}
	if !hasCtrl || !hasTopo || !hasExpand {
		t.Fatalf("controller capabilities %v", caps.Capabilities)
	}
	p, _ := ctrl.Probe(ctx, nil)
	if !p.Ready.Value {
		t.Fatal("not ready")
	}
	down := &Identity{Ready: func(context.Context) error { return errors.New("agent unreachable") }}
	if p, err := down.Probe(ctx, nil); err != nil || p.Ready.Value {
		t.Fatalf("probe of a not-ready plugin: %+v %v", p, err)
	}
}
