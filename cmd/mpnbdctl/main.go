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

// Command mpnbdctl shows an operator where each volume and storage node
// of the driver stands, joining two sources: the API server (NBDVolumes
// and NBDStorageNodes, the PVs and claims bound to the volumes, the node
// plugin pods) and the node plugins' Prometheus metrics
// (mpnbd_node_volume_*, pkg/driver's NodeCollector), which it reads
// through the API server.
//
//	mpnbdctl [flags] [volumes]      every volume, one row per node it is published to
//	mpnbdctl [flags] volume NAME    one volume (its ID, or NAMESPACE/CLAIM) in detail
//	mpnbdctl [flags] storage-nodes  every storage node and what it holds
//	mpnbdctl [flags] uninstall-check  fails, listing them, while volumes exist
//	mpnbdctl [flags] cordon NODE    no new volume or replica on storage node NODE
//	mpnbdctl [flags] uncordon NODE  undoes cordon and drain
//	mpnbdctl [flags] drain NODE     moves every volume and replica off NODE, waiting up to --wait
//	mpnbdctl [flags] forget NODE    deletes the NBDStorageNode of a storage node gone for good
//	mpnbdctl [flags] version        its version, and the images the driver's workloads run
//	mpnbdctl [flags] support-bundle one archive of what support needs about the driver
//
// Per volume: its PV and claim, storage node, size, phase and publications;
// per published node: the transport, connected, MPTCP, subflows of each
// connection against the storage node's addresses, reconnects, outage and
// health (degraded, inaccessible); and the last fault it can tell (a data
// path that is down or degraded now, a failed condition of the NBDVolume,
// a Warning Event the node plugin recorded on the claim, or past
// reconnects). --storage-node NAME keeps the volumes with data on that
// storage node (primary, only copy or replica), --node NAME those
// published to that node, --unhealthy those whose health is not Healthy
// (Unknown, for a node whose metrics could not be read, and Unpublished
// included).
//
// storage-nodes shows each NBDStorageNode: its Ready condition (status and
// reason, as the controller sets it from the agent's lease), cordoned and
// draining (spec.unschedulable, spec.drain), capacity and available bytes
// as its agent reports them, the volumes it serves as primary, the
// unreplicated volumes it holds, the replicas it holds and its orphan
// files (backing files with no NBDVolume). Volumes on a storage node that
// has no NBDStorageNode are a warning.
//
// The node plugins serve metrics on the chart's node.metricsPort (9811
// by default; 0 turns them off), declared as their container port named
// metrics. By default mpnbdctl reads them through the API server's pod
// proxy, so it needs to reach nothing but the API server: for each node a
// volume is published to it finds the node plugin pod running there
// (labels app.kubernetes.io/name=mpnbd, app.kubernetes.io/component=node,
// in --namespace or every namespace) and GETs
// /api/v1/namespaces/NS/pods/POD:PORT/proxy/metrics as the kubeconfig's
// user, who needs list on pods and get on pods/proxy. --metrics-port
// PORT reads http://INTERNAL-IP:PORT/metrics of every node directly
// instead (the node plugin runs on the host network), and --metrics-url
// NODE=URL names one node's endpoint (it wins over both). Every node is
// read in parallel, each within --timeout. A node without a node plugin
// pod, whose pod declares no metrics port, or that does not answer is
// shown as such; the command still succeeds.
//
// uninstall-check is the chart's pre-delete hook: helm uninstall refuses
// while volumes exist.
//
// cordon, uncordon and drain set the NBDStorageNode's spec.unschedulable
// and spec.drain; the controller does the moving (docs/replication.md,
// "Storage-node maintenance"). drain then prints what the node still holds
// as it changes, until it holds nothing or --wait ends (0: do not wait).
//
// forget is the last step for a storage node gone for good: it deletes
// the node's NBDStorageNode, only while the controller says its agent is
// not reporting (Ready False, AgentNotReporting), and says what happens to
// each volume it held: replicas are replaced, primaries have failed over,
// unreplicated volumes are lost (their publications are released, and
// deleting their claims completes, the data written off).
//
// version prints mpnbdctl's version (pkg/buildinfo) and, for each
// Deployment and DaemonSet labelled app.kubernetes.io/name=mpnbd (in
// --namespace, or every namespace), its component, namespace, name and the
// image of its main container (the one named after its component:
// controller, node, datapath, storage-agent), and whether they all run the
// same image. It needs list on deployments and daemonsets (apps); a list
// refused is a warning.
//
// support-bundle writes one gzipped tar (-o FILE; - for stdout; by
// default mpnbd-support-TIME.tar.gz in the current directory, TIME in
// UTC) of what support needs, all read through the API server: the
// driver's own objects (every kind of api/v1alpha1), its CSIDriver, the
// CSINodes, its StorageClasses, PVs, the claims bound to them or waiting
// on its classes, its VolumeAttachments, VolumeSnapshotClasses and
// VolumeSnapshotContents (when the snapshot API is installed), the Nodes;
// in the driver's namespaces (-n, else those of its workloads) the pods,
// DaemonSets, Deployments, ConfigMaps and Leases, never a Secret (not
// even listed); the Events of those namespaces and of every object
// collected; each container's log of the driver's pods (--since, its
// last --log-bytes; the previous container's too after a restart); the
// metrics of each of them with a port named metrics, through the pod
// proxy; the version's output; and summary.txt, which lists every file
// and every error met. An error collecting one part is in the summary
// and on stderr, and the rest is still collected; only failing to write
// the archive fails. managedFields are left out of every object.
//
// Exit codes: 0 shown or done, 1 failed (no API server, no such volume or
// storage node, volumes exist for uninstall-check, volumes left on a
// drained node, a node to forget whose agent reports), 2 usage. version
// fails only without an answer from the API server.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/kubeconfig"
)

func main() {
	// controller-runtime's client logs through this; a CLI says what
	// matters itself.
	ctrllog.SetLogger(logr.Discard())
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// Commands.
const (
	cmdVolumes        = "volumes"
	cmdVolume         = "volume"
	cmdUninstallCheck = "uninstall-check"
	cmdCordon         = "cordon"
	cmdUncordon       = "uncordon"
	cmdDrain          = "drain"
	cmdForget         = "forget"
	cmdVersion        = "version"
	cmdStorageNodes   = "storage-nodes"
	cmdSupportBundle  = "support-bundle"
)

// Output formats.
const (
	outputTable = "table"
	outputJSON  = "json"
)

type options struct {
	kubeconfig  string
	output      string
	metricsPort int
	// metricsURLs maps node names to their metrics endpoints
	// (--metrics-url), which win over --metrics-port.
	metricsURLs map[string]string
	// namespace is where the node plugin pods are looked for ("": every
	// namespace).
	namespace string
	timeout   time.Duration

	// wait bounds how long drain follows the moves.
	wait time.Duration

	// The logs of support-bundle: since how long ago (0: all), and at
	// most their last logBytes each.
	since    time.Duration
	logBytes int

	// The filters of volumes: data on storageNode (--storage-node),
	// published to publishedTo (--node), health not Healthy
	// (--unhealthy).
	storageNode string
	publishedTo string
	unhealthy   bool

	command string
	volume  string // NAME of cmdVolume
	node    string // NODE of cordon, uncordon, drain, forget
}

func newFlagSet(o *options) *flag.FlagSet {
	fs := flag.NewFlagSet("mpnbdctl", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig (default: $KUBECONFIG, in-cluster, ~/.kube/config)")
	fs.StringVar(&o.output, "output", outputTable, "table or json; support-bundle: the archive's file (default mpnbd-support-<UTC time>.tar.gz; - for stdout)")
	fs.StringVar(&o.output, "o", outputTable, "short for --output")
	fs.IntVar(&o.metricsPort, "metrics-port", 0,
		"read the node plugins' /metrics directly at each node's InternalIP and this port (the chart's node.metricsPort, 9811 unless set); 0, the default: through the API server's pod proxy")
	fs.Func("metrics-url", "NODE=URL: read NODE's node plugin metrics directly from URL (repeatable; wins over --metrics-port and the API server; a URL without a path gets /metrics)", func(s string) error {
		node, u, err := parseMetricsURL(s)
		if err != nil {
			return err
		}
		if _, dup := o.metricsURLs[node]; dup {
			return fmt.Errorf("node %s given twice", node)
		}
		if o.metricsURLs == nil {
			o.metricsURLs = map[string]string{}
		}
		o.metricsURLs[node] = u
		return nil
	})
	fs.StringVar(&o.namespace, "namespace", "", "namespace of the driver: of the node plugin pods whose metrics are read through the API server, of the workloads version shows, of the pods, workloads, ConfigMaps, Leases and Events support-bundle collects (default: every namespace; support-bundle: those of the driver's workloads)")
	fs.StringVar(&o.namespace, "n", "", "short for --namespace")
	fs.DurationVar(&o.timeout, "timeout", 5*time.Second, "time limit of each API request and of each node's metrics fetch")
	fs.DurationVar(&o.wait, "wait", time.Hour, "drain: how long to follow the moves until the node holds nothing (0: mark it draining and return)")
	fs.StringVar(&o.storageNode, "storage-node", "", "volumes: only those with data on this storage node (its primary, its only copy or a replica)")
	fs.StringVar(&o.publishedTo, "node", "", "volumes: only those published to this node")
	fs.BoolVar(&o.unhealthy, "unhealthy", false, "volumes: only those whose health is not Healthy (Unknown and Unpublished included)")
	fs.DurationVar(&o.since, "since", defaultLogSince, "support-bundle: the logs of this last while (0: since each container started)")
	fs.IntVar(&o.logBytes, "log-bytes", defaultLogBytes, "support-bundle: keep at most the last this many bytes of each container's log")
	return fs
}

// filtered reports whether a filter of volumes is set.
func (o *options) filtered() bool {
	return o.storageNode != "" || o.publishedTo != "" || o.unhealthy
}

// parseMetricsURL splits NODE=URL and checks the URL.
func parseMetricsURL(s string) (node, raw string, err error) {
	node, raw, ok := strings.Cut(s, "=")
	node, raw = strings.TrimSpace(node), strings.TrimSpace(raw)
	if !ok || node == "" || raw == "" {
		return "", "", fmt.Errorf("%q: want NODE=URL", s)
	}
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return "", "", fmt.Errorf("%q: want an http:// or https:// URL", raw)
	}
	if u.Path == "" || u.Path == "/" {
		u.Path = "/metrics"
	}
	return node, u.String(), nil
}

// parseArgs reads flags before and after the command and its argument,
// so that both `mpnbdctl -o json volume x` and `mpnbdctl volume x -o json`
// work.
func parseArgs(args []string) (*options, error) {
	o := &options{}
	fs := newFlagSet(o)
	var words []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		if fs.NArg() == 0 {
			break
		}
		words = append(words, fs.Arg(0))
		args = fs.Args()[1:]
	}
	outputSet := false
	fs.Visit(func(f *flag.Flag) { outputSet = outputSet || f.Name == "output" || f.Name == "o" })
	o.command = cmdVolumes
	if len(words) > 0 {
		o.command, words = words[0], words[1:]
	}
	switch o.command {
	case cmdVolumes, cmdUninstallCheck, cmdVersion, cmdStorageNodes, cmdSupportBundle:
		if len(words) > 0 {
			return nil, fmt.Errorf("unexpected argument %q", words[0])
		}
	case cmdVolume:
		if len(words) != 1 {
			return nil, errors.New("volume: want one NAME (a volume ID, or NAMESPACE/CLAIM)")
		}
		o.volume = words[0]
	case cmdCordon, cmdUncordon, cmdDrain, cmdForget:
		if len(words) != 1 {
			return nil, fmt.Errorf("%s: want one NODE (a storage node's name)", o.command)
		}
		o.node = words[0]
	default:
		return nil, fmt.Errorf("unknown command %q (want volumes, volume NAME, storage-nodes, uninstall-check, cordon NODE, uncordon NODE, drain NODE, forget NODE, version or support-bundle)", o.command)
	}
	if o.command == cmdSupportBundle && !outputSet {
		o.output = "" // its default file name, made when it runs
	}
	switch {
	case o.filtered() && o.command != cmdVolumes:
		return nil, fmt.Errorf("--storage-node, --node and --unhealthy filter volumes, not %s", o.command)
	case o.command == cmdSupportBundle && (o.output == outputTable || o.output == outputJSON):
		// Surely a mistake, not a file name.
		return nil, fmt.Errorf("support-bundle: --output %q: it names the archive's file", o.output)
	case o.command != cmdSupportBundle && o.output != outputTable && o.output != outputJSON:
		return nil, fmt.Errorf("--output %q (want table or json)", o.output)
	case o.metricsPort < 0 || o.metricsPort > 65535:
		return nil, fmt.Errorf("--metrics-port %d (want 1-65535, or 0: off)", o.metricsPort)
	case o.timeout <= 0:
		return nil, errors.New("--timeout must be positive")
	case o.wait < 0:
		return nil, errors.New("--wait must not be negative")
	case o.since < 0:
		return nil, errors.New("--since must not be negative")
	case o.logBytes <= 0:
		return nil, errors.New("--log-bytes must be positive")
	}
	return o, nil
}

func usage() string {
	var b strings.Builder
	b.WriteString(`Usage:
  mpnbdctl [flags] [volumes]      every volume: storage node, size, phase, and per node
                                  it is published to its data path and health; only
                                  those with data on --storage-node NAME, published to
                                  --node NAME, or not Healthy (--unhealthy)
  mpnbdctl [flags] volume NAME    one volume in detail (NAME: volume ID, or NAMESPACE/CLAIM)
  mpnbdctl [flags] storage-nodes  every storage node: Ready, cordoned, draining, capacity and
                                  available bytes, the volumes it serves and the replicas
                                  it holds, its orphan files
  mpnbdctl [flags] uninstall-check
                                  fails, listing them, while volumes exist (the chart's
                                  pre-delete hook: helm uninstall refuses meanwhile)
  mpnbdctl [flags] cordon NODE    no new volume or replica goes to storage node NODE
  mpnbdctl [flags] uncordon NODE  NODE takes new volumes again (a drain stops)
  mpnbdctl [flags] drain NODE     cordons NODE and moves every volume and replica off
                                  it (a copy made in sync elsewhere first, a primary
                                  handed to an in-sync copy); waits up to --wait for
                                  NODE to hold nothing.
  mpnbdctl [flags] forget NODE    NODE is gone for good: deletes its NBDStorageNode (only
                                  while its agent is not reporting) and says what that
                                  does to each volume it held (docs/operations.md)
  mpnbdctl [flags] version        mpnbdctl's version, and the image each of the driver's
                                  Deployments and DaemonSets runs (labelled
                                  app.kubernetes.io/name=mpnbd): whether they agree
  mpnbdctl [flags] support-bundle one archive (-o FILE, - for stdout; default
                                  mpnbd-support-<UTC time>.tar.gz) of what support needs:
                                  the driver's objects and the Kubernetes objects of the
                                  driver (never a Secret), their Events, the logs
                                  (--since, --log-bytes) and metrics of its pods in -n
                                  (default: its workloads' namespaces), the version and
                                  summary.txt, listing what was collected and every error

The data path (transport, MPTCP subflows, reconnects, health) comes from the node
plugins' metrics, read through the API server's pod proxy from the node plugin pod
on each node (the container port named metrics, the chart's node.metricsPort): the
kubeconfig's user needs list on pods and get on pods/proxy. --metrics-port reads
each node's InternalIP:PORT directly instead, --metrics-url NODE=URL one node's
endpoint.

Flags:
`)
	fs := newFlagSet(&options{})
	fs.SetOutput(&b)
	fs.PrintDefaults()
	return b.String()
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o, err := parseArgs(args)
	if errors.Is(err, flag.ErrHelp) {
		fmt.Fprint(stdout, usage())
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "mpnbdctl: %v\nRun 'mpnbdctl --help' for usage.\n", err)
		return 2
	}
	conn, err := newAPIConn(o.kubeconfig)
	switch {
	case o.command == cmdVersion && err != nil:
		// mpnbdctl's own version still.
		err = version(ctx, o, nil, err, stdout)
	case o.command == cmdVersion:
		err = version(ctx, o, conn.client, nil, stdout)
	case o.command == cmdSupportBundle && err == nil:
		err = supportBundle(ctx, o, conn, stdout, stderr)
	case err == nil:
		err = runCommand(ctx, o, conn, stdout)
	}
	if errors.Is(err, errVolumesExist) {
		return 1
	}
	if err != nil {
		fmt.Fprintf(stderr, "mpnbdctl: %v\n", err)
		return 1
	}
	return 0
}

// runCommand runs o's command against the API server of conn.
func runCommand(ctx context.Context, o *options, conn *apiConn, stdout io.Writer) error {
	c := conn.client
	switch o.command {
	case cmdUninstallCheck:
		return uninstallCheck(ctx, o, c, stdout)
	case cmdCordon:
		if err := setMaintenance(ctx, c, o.node, true, false); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "storage node %s cordoned: no new volume or replica goes there; what it holds stays\n", o.node)
		return nil
	case cmdUncordon:
		if err := setMaintenance(ctx, c, o.node, false, false); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "storage node %s uncordoned: it takes new volumes and replicas again (a drain stops)\n", o.node)
		return nil
	case cmdDrain:
		return drain(ctx, c, o.node, o.wait, 2*time.Second, stdout)
	case cmdForget:
		return forget(ctx, c, o.node, stdout)
	case cmdStorageNodes:
		return storageNodes(ctx, o, c, stdout)
	}
	return show(ctx, o, c, metricsClients{direct: &http.Client{}, proxy: conn.proxy}, stdout)
}

// apiConn is what mpnbdctl reaches the API server with.
type apiConn struct {
	// client reads the resources mpnbdctl shows and writes the storage
	// nodes' spec.
	client client.Client
	// proxy reaches the node plugin pods through the API server.
	proxy *apiProxy
}

// newAPIConn connects to the API server of the kubeconfig at path (""
// for the default ones).
func newAPIConn(path string) (*apiConn, error) {
	cfg, err := kubeconfig.Load(path)
	if err != nil && path == "" {
		return nil, fmt.Errorf("no API server configuration (--kubeconfig, $KUBECONFIG, in-cluster, ~/.kube/config): %w", err)
	}
	if err != nil {
		return nil, err
	}
	cfg.UserAgent = "mpnbdctl"
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		return nil, err
	}
	if err := v1alpha1.AddToScheme(scheme); err != nil {
		return nil, err
	}
	// One authenticated HTTP client for the API and the pod proxy.
	hc, err := rest.HTTPClientFor(cfg)
	if err != nil {
		return nil, fmt.Errorf("API client for %s: %w", cfg.Host, err)
	}
	base, _, err := rest.DefaultServerUrlFor(cfg)
	if err != nil {
		return nil, fmt.Errorf("API server %q: %w", cfg.Host, err)
	}
	c, err := client.New(cfg, client.Options{Scheme: scheme, HTTPClient: hc})
	if err != nil {
		return nil, fmt.Errorf("API client for %s: %w", cfg.Host, err)
	}
	return &apiConn{client: c, proxy: &apiProxy{base: base, hc: hc}}, nil
}

// show reads the API and the node plugins' metrics, joins them and writes
// the report in o.output.
func show(ctx context.Context, o *options, api client.Reader, mc metricsClients, w io.Writer) error {
	inv, err := readInventory(ctx, api, o)
	if err != nil {
		return err
	}
	nodes := scrapeNodes(ctx, mc, metricsTargets(o, inv, mc.proxy), o.timeout)
	rep := buildReport(inv, nodes)
	rep.filtered = o.filtered()
	if o.unhealthy {
		rep.keepUnhealthy()
	}
	switch {
	case o.output == outputJSON:
		return writeJSON(w, rep)
	case o.command == cmdVolume:
		return writeDetail(w, rep)
	default:
		return writeTable(w, rep)
	}
}
