// Command csi-resizer stands in for the CSI external-resizer sidecar in
// the cluster suite: it expands the driver's volumes when their claims
// ask for more (ControllerExpandVolume), updates the PV, and hands the
// node part to the kubelet the way the real one does for Kubernetes
// 1.34. It takes the flags the chart passes and refuses any other.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/mpnbd/mpnbd/e2e/standins/internal/sidecar"
)

type options struct {
	csiAddress     string
	leaderElection bool
	timeout        time.Duration
	verbosity      int
	kubeconfig     string
}

func parseFlags(args []string, out io.Writer) (options, error) {
	var o options
	fs := sidecar.NewFlagSet("csi-resizer", out)
	fs.StringVar(&o.csiAddress, "csi-address", "/run/csi/socket", "CSI endpoint of the controller plugin (path or unix:// URL)")
	fs.BoolVar(&o.leaderElection, "leader-election", false, "accepted; one replica needs no election")
	fs.DurationVar(&o.timeout, "timeout", 10*time.Second, "timeout of each CSI call")
	fs.IntVar(&o.verbosity, "v", 0, "log verbosity (4 and up: debug)")
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig (default: in-cluster, else $KUBECONFIG)")
	if err := sidecar.Parse(fs, args); err != nil {
		return o, err
	}
	if o.timeout <= 0 {
		return o, errors.New("--timeout must be positive")
	}
	return o, nil
}

func run(ctx context.Context, log *slog.Logger, o options) error {
	kube, err := sidecar.Client(o.kubeconfig, "csi-resizer")
	if err != nil {
		return err
	}
	cc, err := sidecar.Dial(o.csiAddress)
	if err != nil {
		return err
	}
	defer cc.Close()
	driver, err := sidecar.DriverName(ctx, log, cc)
	if err != nil {
		return err
	}
	r := &resizer{log: log, kube: kube, csi: csi.NewControllerClient(cc), driver: driver, opts: o}
	cctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	pc, err := csi.NewIdentityClient(cc).GetPluginCapabilities(cctx, &csi.GetPluginCapabilitiesRequest{})
	if err != nil {
		return fmt.Errorf("GetPluginCapabilities: %w", err)
	}
	expandable := false
	for _, c := range pc.GetCapabilities() {
		if c.GetVolumeExpansion() != nil {
			expandable = true
		}
	}
	cs, err := r.csi.ControllerGetCapabilities(cctx, &csi.ControllerGetCapabilitiesRequest{})
	if err != nil {
		return fmt.Errorf("ControllerGetCapabilities: %w", err)
	}
	for _, c := range cs.GetCapabilities() {
		switch c.GetRpc().GetType() {
		case csi.ControllerServiceCapability_RPC_EXPAND_VOLUME:
			r.controllerExpand = true
		case csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER:
			r.singleNodeMultiWriter = true
		}
	}
	if !expandable && !r.controllerExpand {
		return fmt.Errorf("driver %s: %w", driver, errNoExpand)
	}
	if o.leaderElection {
		log.Info("--leader-election: one replica, leading without an election")
	}
	return r.run(ctx)
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
