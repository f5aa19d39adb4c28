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
