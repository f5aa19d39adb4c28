// Command csi-provisioner stands in for the CSI external-provisioner
// sidecar in the cluster suite: it provisions claims of the driver's
// StorageClasses through CreateVolume (with the provisioner library the
// real one uses), deletes released volumes, and publishes
// CSIStorageCapacity objects from GetCapacity. It takes the flags the
// chart passes and refuses any other.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"sigs.k8s.io/sig-storage-lib-external-provisioner/v13/controller"

	"github.com/mpnbd/mpnbd/e2e/standins/internal/sidecar"
)

type options struct {
	csiAddress          string
	featureGates        map[string]bool
	enableCapacity      bool
	ownerRefLevel       int
	extraCreateMetadata bool
	leaderElection      bool
	timeout             time.Duration
	defaultFSType       string
	verbosity           int
	kubeconfig          string
	// namespace and podName come from $NAMESPACE and $POD_NAME.
	namespace, podName string
	// topology: the Topology gate is on (the driver must also report
	// VOLUME_ACCESSIBILITY_CONSTRAINTS).
	topology bool
}

// knownGates are the feature gates accepted, with their defaults.
var knownGates = map[string]bool{"Topology": false}

// parseGates parses "Name=bool,Name=bool"; unknown names are errors.
func parseGates(s string) (map[string]bool, error) {
	out := map[string]bool{}
	for name, def := range knownGates {
		out[name] = def
	}
	if strings.TrimSpace(s) == "" {
		return out, nil
	}
	for _, kv := range strings.Split(s, ",") {
		name, val, ok := strings.Cut(strings.TrimSpace(kv), "=")
		if !ok {
			return nil, fmt.Errorf("feature gate %q: want Name=true|false", kv)
		}
		if _, known := knownGates[name]; !known {
			return nil, fmt.Errorf("unknown feature gate %q", name)
		}
		b, err := strconv.ParseBool(val)
		if err != nil {
			return nil, fmt.Errorf("feature gate %s: %w", name, err)
		}
		out[name] = b
	}
	return out, nil
}

func parseFlags(args []string, getenv func(string) string, out io.Writer) (options, error) {
	var o options
	var gates string
	fs := sidecar.NewFlagSet("csi-provisioner", out)
	fs.StringVar(&o.csiAddress, "csi-address", "/run/csi/socket", "CSI endpoint of the controller plugin (path or unix:// URL)")
	fs.StringVar(&gates, "feature-gates", "", "feature gates (Topology=true|false)")
	fs.BoolVar(&o.enableCapacity, "enable-capacity", false, "publish CSIStorageCapacity objects from GetCapacity")
	fs.IntVar(&o.ownerRefLevel, "capacity-ownerref-level", 1, "owner of the CSIStorageCapacity objects: how many owners up from the pod ($POD_NAME); -1: none")
	fs.BoolVar(&o.extraCreateMetadata, "extra-create-metadata", false, "pass the claim's and PV's names as CreateVolume parameters")
	fs.BoolVar(&o.leaderElection, "leader-election", false, "accepted; one replica needs no election")
	fs.DurationVar(&o.timeout, "timeout", 10*time.Second, "timeout of each CSI call")
	fs.StringVar(&o.defaultFSType, "default-fstype", "", "filesystem type when the StorageClass sets none")
	fs.IntVar(&o.verbosity, "v", 0, "log verbosity (4 and up: debug)")
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig (default: in-cluster, else $KUBECONFIG)")
	if err := sidecar.Parse(fs, args); err != nil {
		return o, err
	}
	var err error
	if o.featureGates, err = parseGates(gates); err != nil {
		return o, err
	}
	o.topology = o.featureGates["Topology"]
	if o.timeout <= 0 {
		return o, errors.New("--timeout must be positive")
	}
	if o.ownerRefLevel < -1 {
		return o, errors.New("--capacity-ownerref-level must be -1 or more")
	}
	o.namespace, o.podName = getenv("NAMESPACE"), getenv("POD_NAME")
	if o.enableCapacity && o.namespace == "" {
		return o, errors.New("--enable-capacity needs $NAMESPACE")
	}
	if o.enableCapacity && o.ownerRefLevel >= 0 && o.podName == "" {
		return o, errors.New("--capacity-ownerref-level >= 0 needs $POD_NAME")
	}
	return o, nil
}

// driverCaps is what the provisioner asks the driver once at start.
type driverCaps struct {
	createDelete, getCapacity, singleNodeMultiWriter, topology bool
}

func probeCaps(ctx context.Context, ids csi.IdentityClient, ctl csi.ControllerClient) (driverCaps, error) {
	var c driverCaps
	pc, err := ids.GetPluginCapabilities(ctx, &csi.GetPluginCapabilitiesRequest{})
	if err != nil {
		return c, fmt.Errorf("GetPluginCapabilities: %w", err)
	}
	for _, cp := range pc.GetCapabilities() {
		if cp.GetService().GetType() == csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS {
			c.topology = true
		}
	}
	cc, err := ctl.ControllerGetCapabilities(ctx, &csi.ControllerGetCapabilitiesRequest{})
	if err != nil {
		return c, fmt.Errorf("ControllerGetCapabilities: %w", err)
	}
	for _, cp := range cc.GetCapabilities() {
		switch cp.GetRpc().GetType() {
		case csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME:
			c.createDelete = true
		case csi.ControllerServiceCapability_RPC_GET_CAPACITY:
			c.getCapacity = true
		case csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER:
			c.singleNodeMultiWriter = true
		}
	}
	return c, nil
}

func run(ctx context.Context, log *slog.Logger, o options) error {
	kube, err := sidecar.Client(o.kubeconfig, "csi-provisioner")
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
	ids, ctl := csi.NewIdentityClient(cc), csi.NewControllerClient(cc)
	cctx, cancel := context.WithTimeout(ctx, o.timeout)
	caps, err := probeCaps(cctx, ids, ctl)
	cancel()
	if err != nil {
		return err
	}
	if !caps.createDelete {
		return fmt.Errorf("driver %s lacks CREATE_DELETE_VOLUME", driver)
	}
	o.topology = o.topology && caps.topology
	log.Info("driver found", "driver", driver, "topology", o.topology,
		"single_node_multi_writer", caps.singleNodeMultiWriter, "get_capacity", caps.getCapacity)
	if o.leaderElection {
		log.Info("--leader-election: one replica, leading without an election")
	}

	p := &provisioner{
		log: log, kube: kube, csi: ctl, driver: driver, opts: o,
		identity:              fmt.Sprintf("%d-%d-%s", time.Now().UnixMilli(), rand.IntN(10000), driver),
		singleNodeMultiWriter: caps.singleNodeMultiWriter,
	}
	pc := controller.NewProvisionController(ctx, kube, driver, p,
		controller.LeaderElection(false),
		controller.AddFinalizer(true),
		controller.FailedProvisionThreshold(0),
		controller.FailedDeleteThreshold(0),
		controller.Threadiness(4),
	)

	if o.enableCapacity {
		if !caps.getCapacity {
			return fmt.Errorf("--enable-capacity: driver %s lacks GET_CAPACITY", driver)
		}
		c := &capacity{log: log.With("part", "capacity"), kube: kube, csi: ctl, driver: driver, opts: o, period: 10 * time.Second}
		go c.run(ctx)
	}
	pc.Run(ctx)
	return nil
}

func main() {
	o, err := parseFlags(os.Args[1:], os.Getenv, os.Stderr)
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
