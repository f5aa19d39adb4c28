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

package main

import (
	"errors"
	"flag"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/mpnbd/mpnbd/internal/hostaddr"
	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/agent"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// Cluster mode defaults.
const (
	defaultDataDir   = "/var/lib/mpnbd/volumes"
	defaultHeartbeat = 10 * time.Second
)

// clusterFlags are the flags of --cluster mode as given.
type clusterFlags struct {
	enabled          bool
	nodeName         string
	dataDir          string
	namespace        string
	storageAddresses listFlag
	signalNICs       listFlag
	autoBackup       bool
	staleLoss        int
	topology         string
	heartbeat        time.Duration
	kubeconfig       string
	identity         bool
	reserved         int
	leaseDuration    time.Duration
	rebuildRate      float64
}

// clusterOnly are the flags that mean something only with --cluster.
var clusterOnly = []string{"node-name", "data-dir", "namespace", "storage-address", "signal-nic", "auto-backup", "mptcp-stale-loss-count", "topology", "heartbeat", "kubeconfig", "identity", "reserved-handshakes", "lease-duration", "rebuild-rate"}

// clusterOptions is the resolved configuration of the storage agent.
type clusterOptions struct {
	nodeName  string
	dataDir   string
	namespace string
	// addresses are the storage addresses as given (IP addresses and
	// CIDRs), resolved into the host's when serving starts.
	addresses  hostaddr.List
	signalNICs []mptcp.NICSpec
	autoBackup bool
	staleLoss  int
	topology   map[string]string
	heartbeat  time.Duration
	kubeconfig string
	identity   bool
	// port is the NBD port, bound on the storage addresses and on the
	// addresses of signalNICs only (0: any free one).
	port int
	// reservedHandshakes are the handshake slots kept for the published
	// nodes (nbd.Limits.ReservedHandshakes; -1: none).
	reservedHandshakes int
	// leaseDuration is the storage node's lease's (agent.Config).
	leaseDuration time.Duration
	// rebuildRate bounds a replica's rebuild, in bytes per second (0:
	// none).
	rebuildRate float64
}

func addClusterFlags(fs *flag.FlagSet, c *clusterFlags) {
	fs.BoolVar(&c.enabled, "cluster", false, "run as the storage agent of a Kubernetes node (see Cluster mode); not with --export or --config")
	fs.StringVar(&c.nodeName, "node-name", "", "cluster mode: this storage node's `NAME` (default $NODE_NAME)")
	fs.StringVar(&c.dataDir, "data-dir", defaultDataDir, "cluster mode: `DIR` holding the volumes' backing files")
	fs.StringVar(&c.namespace, "namespace", "", "cluster mode: `NAMESPACE` of the CA bundle ConfigMap the storage certificate is checked with (default $POD_NAMESPACE)")
	fs.Var(&c.storageAddresses, "storage-address", "cluster mode: this node's storage addresses, reported to clients: IP addresses, or CIDRs standing for every global address of the host inside them (found at start; one without any is an error); repeatable or comma-separated; required")
	fs.Var(&c.signalNICs, "signal-nic", "cluster mode: keep MPTCP signal endpoints on these storage NICs (interface names or CIDRs); repeatable or comma-separated")
	fs.BoolVar(&c.autoBackup, "auto-backup", true, "cluster mode: flag backup the signal endpoint of a path much slower than the others while it stays slow (needs --signal-nic)")
	fs.IntVar(&c.staleLoss, "mptcp-stale-loss-count", mptcp.DefaultStaleLossCount, "cluster mode: raise net.mptcp.stale_loss_cnt to at least this while the signal endpoints are kept (0: leave it; needs --signal-nic), so that subflows queued behind many others are not taken for dead")
	fs.StringVar(&c.topology, "topology", "", "cluster mode: topology labels reported for the node")
	fs.DurationVar(&c.heartbeat, "heartbeat", defaultHeartbeat, "cluster mode: report the node's capacity every `DURATION`")
	fs.StringVar(&c.kubeconfig, "kubeconfig", "", "cluster mode: kubeconfig `FILE` (default $KUBECONFIG, else in-cluster)")
	fs.IntVar(&c.reserved, "reserved-handshakes", nbd.DefaultReservedHandshakes,
		"cluster mode: keep `N` of the --max-handshakes slots for connections from the storage addresses of the nodes a volume is published to; other sources share the rest; 0: none kept (default: half of --max-handshakes)")
	fs.DurationVar(&c.leaseDuration, "lease-duration", agent.DefaultLeaseDuration,
		"cluster mode: the storage node's lease lasts `DURATION` (renewed every third of it): the controller fails a replicated volume over from a primary whose lease it has not seen renewed for that long, and a primary that could not renew it for two thirds of it stops serving its replicated volumes")
	fs.Float64Var(&c.rebuildRate, "rebuild-rate", 0, "cluster mode: copy at most `MBPS` MiB per second to a replica being rebuilt, so that the nodes' I/O keeps the rest of the storage links (0: no bound)")
	fs.BoolVar(&c.identity, "identity", true, "cluster mode: get this storage node's certificate from the controller (CertificateSigningRequest) and offer STARTTLS with it; nodes then open volumes with their node certificates")
}

// checkModeFlags refuses flags of the other mode.
func checkModeFlags(v *flagValues, set map[string]bool) error {
	if v.cluster.enabled {
		for _, f := range []string{"export", "config"} {
			if set[f] {
				return fmt.Errorf("--%s cannot be combined with --cluster (cluster mode serves the node's NBDVolumes)", f)
			}
		}
		for _, f := range []string{"tls", "tls-cert", "tls-key", "tls-ca"} {
			if set[f] {
				return fmt.Errorf("--%s cannot be combined with --cluster (cluster mode's TLS uses the certificate of --identity)", f)
			}
		}
		return nil
	}
	for _, f := range clusterOnly {
		if set[f] {
			return fmt.Errorf("--%s needs --cluster", f)
		}
	}
	return nil
}

// splitList splits repeatable, comma-separated flag values.
func splitList(vals []string) []string {
	var out []string
	for _, v := range vals {
		for _, s := range strings.Split(v, ",") {
			if s = strings.TrimSpace(s); s != "" {
				out = append(out, s)
			}
		}
	}
	return out
}

// resolve checks the cluster flags and fills in environment defaults.
func (c *clusterFlags) resolve(set map[string]bool) (*clusterOptions, error) {
	o := &clusterOptions{
		nodeName:   c.nodeName,
		dataDir:    c.dataDir,
		namespace:  c.namespace,
		heartbeat:  c.heartbeat,
		autoBackup: c.autoBackup,
		staleLoss:  c.staleLoss,
		kubeconfig: c.kubeconfig,
		identity:   c.identity,

		leaseDuration: c.leaseDuration,
		rebuildRate:   c.rebuildRate * (1 << 20),
	}
	if !set["node-name"] {
		o.nodeName = os.Getenv("NODE_NAME")
	}
	if !set["namespace"] {
		o.namespace = os.Getenv("POD_NAMESPACE")
	}
	switch {
	case o.nodeName == "":
		return nil, errors.New("cluster mode needs a node name: give --node-name or set $NODE_NAME")
	case len(validation.IsDNS1123Subdomain(o.nodeName)) > 0:
		return nil, fmt.Errorf("invalid --node-name %q: %s", o.nodeName, strings.Join(validation.IsDNS1123Subdomain(o.nodeName), "; "))
	case o.namespace == "":
		return nil, errors.New("cluster mode needs the namespace of the publication secrets: give --namespace or set $POD_NAMESPACE")
	case len(validation.IsDNS1123Label(o.namespace)) > 0:
		return nil, fmt.Errorf("invalid --namespace %q: %s", o.namespace, strings.Join(validation.IsDNS1123Label(o.namespace), "; "))
	case o.dataDir == "":
		return nil, errors.New("--data-dir is empty")
	case o.heartbeat <= 0:
		return nil, fmt.Errorf("invalid --heartbeat %s: must be positive", o.heartbeat)
	case o.leaseDuration < 3*time.Second:
		return nil, fmt.Errorf("invalid --lease-duration %s: must be 3s or more (the lease is renewed every third of it)", o.leaseDuration)
	case c.rebuildRate < 0:
		return nil, fmt.Errorf("invalid --rebuild-rate %g: want MiB per second, or 0 for no bound", c.rebuildRate)
	}
	switch {
	case c.reserved < 0:
		return nil, fmt.Errorf("invalid --reserved-handshakes %d: want a number of handshakes, or 0 for none", c.reserved)
	case !set["reserved-handshakes"]:
		// nbd's default: half of --max-handshakes, whatever it is.
	case c.reserved == 0:
		o.reservedHandshakes = -1
	default:
		o.reservedHandshakes = c.reserved
	}
	if o.staleLoss < 0 {
		return nil, fmt.Errorf("invalid --mptcp-stale-loss-count %d: want 0 (leave it) or more", o.staleLoss)
	}
	addrs, err := hostaddr.Parse("--storage-address", splitList(c.storageAddresses))
	if err != nil {
		return nil, err
	}
	if len(addrs.Entries) == 0 {
		return nil, errors.New("cluster mode needs at least one --storage-address (the node's storage IPs or CIDRs)")
	}
	o.addresses = addrs
	for _, n := range splitList(c.signalNICs) {
		if strings.Contains(n, "/") {
			if _, err := netip.ParsePrefix(n); err != nil {
				return nil, fmt.Errorf("invalid --signal-nic %q: neither an interface name nor a CIDR", n)
			}
		}
		o.signalNICs = append(o.signalNICs, mptcp.NICSpec(n))
	}
	topo, err := access.ParseTopology(c.topology)
	if err != nil {
		return nil, fmt.Errorf("invalid --topology: %v", err)
	}
	o.topology = topo
	return o, nil
}

// clusterPort is the port of cluster mode's one --listen address, which
// must not name a host: the agent binds the port on its storage addresses
// only.
func clusterPort(listen []string) (int, error) {
	if len(listen) != 1 {
		return 0, fmt.Errorf("cluster mode takes one --listen address (:PORT), not %d", len(listen))
	}
	host, port, err := net.SplitHostPort(listen[0])
	if err != nil {
		return 0, fmt.Errorf("invalid --listen %q: want :PORT", listen[0])
	}
	if host != "" {
		return 0, fmt.Errorf("in cluster mode --listen gives only the port (:%s, not %q): the agent binds it on its --storage-address addresses and the addresses of its --signal-nic NICs, never on every address", port, listen[0])
	}
	n, err := strconv.ParseUint(port, 10, 16)
	if err != nil {
		return 0, fmt.Errorf("invalid --listen %q: the port is not a number from 0 to 65535", listen[0])
	}
	return int(n), nil
}
