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
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/internal/backoff"
	"github.com/mpnbd/mpnbd/internal/hostaddr"
	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/attach/fuse"
	"github.com/mpnbd/mpnbd/pkg/attach/nbddev"
	"github.com/mpnbd/mpnbd/pkg/attach/ublkdev"
	"github.com/mpnbd/mpnbd/pkg/buildinfo"
	"github.com/mpnbd/mpnbd/pkg/datapath"
	"github.com/mpnbd/mpnbd/pkg/driver"
	"github.com/mpnbd/mpnbd/pkg/kubeconfig"
	"github.com/mpnbd/mpnbd/pkg/kubeevents"
	"github.com/mpnbd/mpnbd/pkg/logging/kubelog"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd/nbdnl"
	"github.com/mpnbd/mpnbd/pkg/nbdmetrics"
	"github.com/mpnbd/mpnbd/pkg/nodeid"
	"github.com/mpnbd/mpnbd/pkg/relay"
)

type options struct {
	endpoint     string
	nodeID       string
	topology     map[string]string
	maxVolumes   int64
	stateDir     string
	transports   []attach.Transport
	storageNICs  []mptcp.NICSpec
	backupNICs   []mptcp.NICSpec
	autoBackup   bool
	staleLoss    int
	storageAddrs hostaddr.List
	kubeconfig   string
	metricsAddr  string
	logLevel     slog.Level
	logFormat    string
	// datapathSocket: the plugin drives a datapath component there
	// instead of running the transports itself; serveDatapath: this
	// process is that component, serving there.
	datapathSocket string
	serveDatapath  string
	// namespace holds the CA bundle; identity gets the node certificate.
	namespace  string
	identity   bool
	readyFile  string
	generation int64
}

func newFlagSet(o *options) *flag.FlagSet {
	fs := flag.NewFlagSet("node", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.StringVar(&o.endpoint, "endpoint", "unix:///csi/csi.sock", "CSI endpoint: unix:///path or tcp://host:port")
	fs.StringVar(&o.nodeID, "node-id", os.Getenv("NODE_NAME"), "this node's ID, the Kubernetes node name (default $NODE_NAME)")
	fs.Func("topology", "accessible topology segments, key=value[,key=value] (default "+access.TopologyKey+"="+access.DefaultTopology+"; storage agents must report the same)", func(s string) error {
		m, err := access.ParseTopology(s)
		o.topology = m
		return err
	})
	fs.Int64Var(&o.maxVolumes, "max-volumes", 0, "most volumes this node takes (0: no limit)")
	fs.StringVar(&o.stateDir, "state-dir", "/var/lib/mpnbd/node", "where attach state is kept across restarts")
	fs.Func("transports", "transports this node may use, comma-separated (default: every one it supports)", func(s string) error {
		for _, name := range splitList(s) {
			t, err := attach.ParseTransport(name)
			if err != nil || t == attach.Auto {
				return fmt.Errorf("unknown transport %q (want kernel, ublk, relay, multiconn, tcp or fuse)", name)
			}
			o.transports = append(o.transports, t)
		}
		return nil
	})
	fs.Func("storage-nic", "storage NIC (interface name or CIDR) that gets an MPTCP subflow endpoint; repeatable or comma-separated", func(s string) error {
		for _, n := range splitList(s) {
			o.storageNICs = append(o.storageNICs, mptcp.NICSpec(n))
		}
		return nil
	})
	fs.Func("backup-nic", "storage NIC whose endpoint gets the backup flag (used only when the others fail); repeatable", func(s string) error {
		for _, n := range splitList(s) {
			o.backupNICs = append(o.backupNICs, mptcp.NICSpec(n))
		}
		return nil
	})
	fs.BoolVar(&o.autoBackup, "auto-backup", true, "flag backup the endpoint of a storage NIC whose path is much slower than the others while it stays slow")
	fs.IntVar(&o.staleLoss, "mptcp-stale-loss-count", mptcp.DefaultStaleLossCount, "raise the host's net.mptcp.stale_loss_cnt to at least this while the storage NICs are kept (0: leave it), so that subflows queued behind many others are not taken for dead")
	o.storageAddrs.Flag = "--storage-address"
	fs.Func("storage-address", "this node's storage addresses, published on its Node object so exports accept only them: IP addresses, or CIDRs standing for every global address of the host inside them (found at start; one without any is an error) (default: every global address of the host); repeatable or comma-separated", func(s string) error {
		return o.storageAddrs.Add(splitList(s)...)
	})
	fs.StringVar(&o.metricsAddr, "metrics-addr", "", "serve Prometheus metrics of the attached volumes (connected, MPTCP subflows, health) at http://ADDR/metrics; empty: off")
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig for publishing the storage addresses and the token's hash (default: in-cluster, then $KUBECONFIG)")
	fs.StringVar(&o.namespace, "namespace", os.Getenv("POD_NAMESPACE"), "the driver's namespace, which holds the CA bundle of the storage network (default $POD_NAMESPACE)")
	fs.BoolVar(&o.identity, "identity", true, "get this node's certificate for the storage network from the controller (a CertificateSigningRequest, renewed before it expires), kept in --state-dir/identity; needs --namespace")
	fs.Func("log-level", "debug, info, warn or error (default info)", func(s string) error {
		return o.logLevel.UnmarshalText([]byte(s))
	})
	fs.StringVar(&o.logFormat, "log-format", "text", "text or json")
	fs.StringVar(&o.datapathSocket, "datapath-socket", "", "drive the volumes' data path in the datapath component listening on this unix socket (its own container, which a restart of this one does not touch); empty: run it in this process")
	fs.StringVar(&o.serveDatapath, "serve-datapath", "", "run as the datapath component: attach and serve the volumes' data path for a node plugin on this unix socket (no CSI endpoint)")
	fs.Func("generation", "with --serve-datapath: this datapath's generation (its pod template's); it takes volumes over only from an older or unknown one, and hands them only to a newer or unknown one (empty or 0: unknown)", func(v string) error {
		if v == "" {
			o.generation = 0
			return nil
		}
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 0 {
			return fmt.Errorf("want a generation number, not %q", v)
		}
		o.generation = n
		return nil
	})
	fs.StringVar(&o.readyFile, "ready-file", "", "with --serve-datapath: create this file once the volumes of a running datapath were taken over and this one serves (a readiness probe's signal that the old one may go)")
	return fs
}

func parseArgs(args []string) (*options, error) {
	o := &options{}
	o.topology, _ = access.ParseTopology("")
	fs := newFlagSet(o)
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	if o.nodeID == "" {
		return nil, errors.New("--node-id is required (or set $NODE_NAME)")
	}
	if o.logFormat != "text" && o.logFormat != "json" {
		return nil, fmt.Errorf("--log-format %q (want text or json)", o.logFormat)
	}
	if o.staleLoss < 0 {
		return nil, fmt.Errorf("--mptcp-stale-loss-count %d: want 0 (leave it) or more", o.staleLoss)
	}
	if _, _, err := driver.ParseEndpoint(o.endpoint); err != nil {
		return nil, fmt.Errorf("--endpoint: %v", err)
	}
	if o.datapathSocket != "" && o.serveDatapath != "" {
		return nil, errors.New("--datapath-socket and --serve-datapath exclude each other: a process is the plugin or the datapath component")
	}
	return o, nil
}

func usage() string {
	var b strings.Builder
	b.WriteString("Usage: node [flags]\n\nThe CSI node plugin of " + driver.DriverName + ".\n\nFlags:\n")
	fs := newFlagSet(&options{})
	fs.SetOutput(&b)
	fs.PrintDefaults()
	return b.String()
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o, err := parseArgs(args)
	if errors.Is(err, flag.ErrHelp) {
		fmt.Fprint(stdout, usage())
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "node: %v\nRun 'node --help' for usage.\n", err)
		return 2
	}
	log := kubelog.Setup(stderr, o.logLevel, o.logFormat)
	if err := serve(ctx, o, log); err != nil {
		log.Error("node plugin failed", "error", err)
		return 1
	}
	return 0
}

// guardAgainstReclaim keeps a process that serves volumes' I/O in memory
// and from the OOM killer (a variable for the tests).
var guardAgainstReclaim = relay.GuardAgainstReclaim

func serve(ctx context.Context, o *options, log *slog.Logger) error {
	// The addresses to publish, found first: a CIDR that holds none of
	// the host's is a mistake to stop at.
	var storageAddrs []string
	if o.serveDatapath == "" {
		var err error
		storageAddrs, err = storageAddresses(o, hostAddrs)
		switch {
		case err != nil && len(o.storageAddrs.Entries) > 0:
			return err
		case err != nil:
			log.Error("cannot list the host's addresses, to publish as its storage addresses", "error", err)
		}
	}
	var mgr datapath.Service
	if o.datapathSocket != "" {
		// No volume's I/O runs here: the datapath component's process is
		// the one kept in memory and from the OOM killer.
		mgr = &datapath.Client{Path: o.datapathSocket}
		log.Info("the data path runs in the datapath component", "socket", o.datapathSocket)
	} else {
		// This process serves the volumes' I/O (the datapath component, or
		// a node plugin that runs its own data path).
		if err := guardAgainstReclaim(); err != nil {
			log.Warn("cannot guard against memory reclaim; relays may stall under memory pressure", "error", err)
		}
		m, closeAll, err := newManager(o, log)
		if err != nil {
			return err
		}
		defer closeAll()
		if o.serveDatapath != "" {
			// A datapath still running (a planned upgrade: the new one
			// starts beside it) hands its volumes over first; adoption
			// then takes what is left, as after a crash.
			taken, err := datapath.TakeOverGeneration(ctx, o.serveDatapath, o.generation, m, log)
			if errors.Is(err, datapath.ErrSuperseded) {
				// An old pod's container restarted after its volumes went
				// to a newer datapath: it must not take them back, nor
				// adopt them; it idles until its pod is deleted.
				log.Warn("a datapath of a later generation serves this node's volumes: idling", "generation", o.generation)
				<-ctx.Done()
				return nil
			}
			if err != nil {
				log.Error("taking the volumes over from the running datapath", "error", err, "taken", len(taken))
			}
		}
		adopt(ctx, m, log)
		if o.serveDatapath != "" {
			// Ready once the socket accepts: a node plugin or probe that
			// trusts the file must not meet a socket that refuses.
			ready := func() error {
				if o.readyFile != "" {
					if err := os.WriteFile(o.readyFile, []byte(strconv.Itoa(os.Getpid())+"\n"), 0o644); err != nil {
						return fmt.Errorf("ready file: %w", err)
					}
				}
				log.Info("datapath component serving", "socket", o.serveDatapath, "transports", m.Available(), "version", buildinfo.Version)
				return nil
			}
			return datapath.ServeGeneration(ctx, o.serveDatapath, m, log, o.generation, ready)
		}
		mgr = m
	}

	// The slow-path watch's decisions: metrics, and Events on the Node.
	paths := nbdmetrics.NewPathDecisions("mpnbd_node")
	if len(o.storageNICs) > 0 {
		onPath := paths.Observe
		if rec, stop := pathEventRecorder(o, log); rec != nil {
			defer stop()
			onPath = func(e mptcp.PathEvent) {
				paths.Observe(e)
				rec(e)
			}
		}
		go keepEndpoints(ctx, o, log, onPath)
	}
	// The node's token opens its volumes without encryption; the
	// controller learns only its hash, from the Node object.
	token, err := access.LoadOrCreateToken(filepath.Join(o.stateDir, "token"))
	if err != nil {
		return err
	}
	go publishAddresses(ctx, o, storageAddrs, access.TokenHash(token), log)
	if o.identity && o.namespace != "" {
		go keepIdentity(ctx, o, log)
	}

	cfg := driver.NodeConfig{
		NodeID:     o.nodeID,
		Topology:   o.topology,
		MaxVolumes: o.maxVolumes,
		Attacher:   mgr,
		Mounter:    driver.NewMounter(),
		Logger:     log,
		StateDir:   filepath.Join(o.stateDir, "node"),
		Token:      token,
	}
	if o.identity && o.namespace != "" {
		cfg.IdentityDir = identityDir(o)
	}
	watch := newVolumeWatch(o, log)
	if watch != nil {
		cfg.Observer = watch
	}
	node, err := driver.NewNode(cfg)
	if err != nil {
		return err
	}
	var metrics *driver.Metrics
	if o.metricsAddr != "" {
		reg := buildinfo.Registry("node")
		reg.MustRegister(driver.NewNodeCollector(node, mgr), paths)
		if cfg.IdentityDir != "" {
			reg.MustRegister(nodeid.CertCollector(nodeid.Node, nodeid.LeafFromDir(cfg.IdentityDir)))
		}
		if metrics, err = driver.NewMetrics(reg); err != nil {
			return err
		}
		if err := driver.ServeMetrics(ctx, o.metricsAddr, reg, log); err != nil {
			return fmt.Errorf("--metrics-addr: %w", err)
		}
	}
	if watch != nil {
		go watch.Run(ctx, node, mgr)
	}
	l, err := driver.Listen(o.endpoint)
	if err != nil {
		return err
	}
	s := driver.NewGRPCServer(log, metrics)
	csi.RegisterIdentityServer(s, &driver.Identity{})
	csi.RegisterNodeServer(s, node)
	log.Info("node plugin serving", "endpoint", o.endpoint, "node_id", o.nodeID,
		"transports", mgr.Available(), "version", buildinfo.Version)
	return driver.Serve(ctx, s, l, 30*time.Second)
}

// adopt takes over the volumes an earlier run of the data path left.
func adopt(ctx context.Context, m *attach.Manager, log *slog.Logger) {
	if atts, err := m.Adopt(ctx); err != nil {
		log.Error("some volumes of an earlier run were not re-adopted", "error", err)
	} else if len(atts) > 0 {
		log.Info("re-adopted volumes of an earlier run", "count", len(atts))
	}
}

// newManager builds the transports this node supports (restricted to
// o.transports when set) and a manager over them.
func newManager(o *options, log *slog.Logger) (*attach.Manager, func(), error) {
	want := func(t attach.Transport) bool {
		if len(o.transports) == 0 {
			return true
		}
		for _, w := range o.transports {
			if w == t {
				return true
			}
		}
		return false
	}
	attachers := map[attach.Transport]attach.Attacher{}
	var closers []func()
	closeAll := func() {
		for _, c := range closers {
			c()
		}
	}
	var netlinkModes []attach.Transport
	for _, t := range []attach.Transport{attach.Kernel, attach.Relay, attach.MultiConn, attach.TCP} {
		if want(t) {
			netlinkModes = append(netlinkModes, t)
		}
	}
	if len(netlinkModes) > 0 {
		nl, err := nbdnl.Dial()
		switch {
		case errors.Is(err, nbdnl.ErrFamilyNotFound):
			log.Warn("the kernel's nbd driver is not available; nbd transports disabled", "reason", err)
		case err != nil:
			return nil, closeAll, fmt.Errorf("nbd netlink: %w", err)
		default:
			closers = append(closers, func() { nl.Close() })
			for _, t := range netlinkModes {
				a, err := nbddev.New(nbddev.Config{
					Mode:     t,
					Kernel:   nl,
					Devices:  nbdnl.Sysfs{},
					Logger:   log,
					StateDir: filepath.Join(o.stateDir, "nbd"),
				})
				if err != nil {
					closeAll()
					return nil, nil, fmt.Errorf("transport %s: %w", t, err)
				}
				closers = append(closers, a.Close)
				attachers[t] = a
			}
		}
	}
	if want(attach.Ublk) {
		// Each volume served by a process of its own (node ublk-serve),
		// replaced when it dies while the kernel holds the device's I/O
		// (docs/transports.md).
		a, err := ublkdev.NewSupervisor(ublkdev.Config{StateDir: filepath.Join(o.stateDir, "ublk"), Logger: log})
		switch {
		case errors.Is(err, attach.ErrUnsupported):
			log.Warn("the kernel has no ublk; ublk transport disabled", "reason", err)
		case err != nil:
			closeAll()
			return nil, nil, fmt.Errorf("transport ublk: %w", err)
		default:
			closers = append(closers, a.Close)
			attachers[attach.Ublk] = a
		}
	}
	if want(attach.FUSE) {
		if _, err := os.Stat("/dev/fuse"); err != nil {
			log.Warn("/dev/fuse is missing; fuse transport disabled", "error", err)
		} else {
			attachers[attach.FUSE] = fuse.New(fuse.Config{StateDir: filepath.Join(o.stateDir, "fuse"), Logger: log})
		}
	}
	if len(attachers) == 0 {
		closeAll()
		return nil, nil, errors.New("no transport is available on this node (no nbd driver, no ublk, no /dev/fuse)")
	}
	m := attach.NewManager(attachers, log)
	// Where each volume keeps the storage nodes that hold it now, for the
	// process that serves it after this one (a drain may have moved it).
	m.KeepServersIn(filepath.Join(o.stateDir, "servers"))
	return m, closeAll, nil
}

// keepEndpoints keeps an MPTCP subflow endpoint on each storage NIC until
// ctx ends.
func keepEndpoints(ctx context.Context, o *options, log *slog.Logger, onPath func(mptcp.PathEvent)) {
	d := mptcp.Desired{NICs: o.storageNICs, Backup: o.backupNICs, Role: mptcp.RoleClient, StaleLossCount: o.staleLoss}
	var slow *mptcp.SlowPathPolicy
	if o.autoBackup {
		slow = &mptcp.SlowPathPolicy{OnEvent: onPath}
	}
	if err := mptcp.Keep(ctx, d, log, slow); err != nil {
		log.Error("storage NICs not configured for MPTCP", "error", err)
	}
}

// pathEventRecorder returns what records the slow-path watch's flags and
// recoveries as Events on this node's Node (aggregated: a path flagged
// again and again is one Event with a count), and what stops it; nil
// without API server access.
func pathEventRecorder(o *options, log *slog.Logger) (func(mptcp.PathEvent), func()) {
	c, err := apiClient(o)
	if err != nil {
		if !errors.Is(err, errNoAPIServer) {
			log.Warn("no Events on the Node for slow paths", "error", err)
		}
		return nil, nil
	}
	rec, stop := kubeevents.NewRecorder(c, "mpnbd-node", log)
	node := &corev1.ObjectReference{Kind: "Node", Name: o.nodeID, UID: types.UID(o.nodeID)}
	return func(e mptcp.PathEvent) { kubeevents.RecordPath(rec, node, e) }, stop
}

// newVolumeWatch returns what tells users of this node's volumes' data
// paths (Events on their claims, this node's entry in their NBDVolume's
// status), or nil without API server access.
func newVolumeWatch(o *options, log *slog.Logger) *driver.VolumeWatch {
	c, err := apiClient(o)
	if err != nil {
		level := slog.LevelWarn
		if errors.Is(err, errNoAPIServer) {
			level = slog.LevelInfo
		}
		log.Log(context.Background(), level, "no Events on claims nor status of volumes", "error", err)
		return nil
	}
	return &driver.VolumeWatch{
		Events: &driver.KubeEvents{Client: c, NodeID: o.nodeID, Log: log},
		Status: &driver.KubeAttachmentStatus{Client: c, NodeID: o.nodeID},
		Every:  volumeWatchInterval,
		Hold:   pathsHold,
		Log:    log,
	}
}

// volumeWatchInterval is how often the data paths are looked at.
const volumeWatchInterval = 5 * time.Second

// pathsHold is how long a volume's MPTCP paths stay degraded (or
// restored) before an Event says so: three looks.
const pathsHold = 3 * volumeWatchInterval

// hostAddrs is where the storage addresses are found (tests replace it).
var hostAddrs = hostaddr.System

// storageAddresses resolves --storage-address on src, a CIDR standing
// for the host's addresses inside it; without the flag they are every
// global address of src (the node plugin runs in the host's network
// namespace: the sources its connections to storage agents may come
// from).
func storageAddresses(o *options, src mptcp.AddrSource) ([]string, error) {
	var addrs []netip.Addr
	var err error
	if len(o.storageAddrs.Entries) == 0 {
		addrs, err = hostaddr.Global(src)
	} else {
		addrs, err = o.storageAddrs.Resolve(src)
	}
	if err != nil {
		return nil, err
	}
	return hostaddr.Strings(addrs), nil
}

// publishAddresses annotates this node's Node object with its storage
// addresses (from storageAddresses: the token is good from none other)
// and its token's hash, retrying until it works or ctx ends.
func publishAddresses(ctx context.Context, o *options, addrs []string, tokenHash string, log *slog.Logger) {
	if len(addrs) == 0 {
		log.Error("storage addresses not published: none given and none found on the host; volumes without encryption cannot be published here")
		return
	}
	c, err := apiClient(o)
	if err != nil {
		log.Error("storage addresses not published", "error", err)
		return
	}
	retry := backoff.New(time.Second, time.Minute)
	for {
		err := driver.PublishNodeAccess(ctx, c, o.nodeID, addrs, tokenHash)
		if err == nil {
			log.Info("storage addresses and token hash published", "addresses", addrs)
			return
		}
		delay := retry.Next()
		log.Warn("publishing storage addresses failed; retrying", "error", err, "retry_in", delay)
		if backoff.Sleep(ctx, delay) != nil {
			return
		}
	}
}

// identityDir keeps the node certificate and the CA bundle, where the
// data path (maybe another container) reads them at each dial.
func identityDir(o *options) string { return filepath.Join(o.stateDir, "identity") }

// keepIdentity gets this node's certificate and keeps it renewed, in
// --state-dir/identity, until ctx ends.
func keepIdentity(ctx context.Context, o *options, log *slog.Logger) {
	c, err := apiClient(o)
	if err != nil {
		log.Error("no node certificate", "error", err)
		return
	}
	id, err := nodeid.NewIdentity(nodeid.IdentityConfig{
		Client: c, Kind: nodeid.Node, NodeName: o.nodeID, Namespace: o.namespace,
		Dir: identityDir(o), Logger: log,
	})
	if err != nil {
		log.Error("no node certificate", "error", err)
		return
	}
	if err := id.Start(ctx, 0); err != nil && ctx.Err() == nil {
		log.Error("no node certificate", "error", err)
	}
}

// errNoAPIServer: no API server configuration (--kubeconfig, in-cluster).
var errNoAPIServer = errors.New("no API server access")

// apiClient is a client of the API server from --kubeconfig (or the
// in-cluster configuration); without one the error is errNoAPIServer.
func apiClient(o *options) (client.Client, error) {
	cfg, err := kubeconfig.Load(o.kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", errNoAPIServer, err)
	}
	return client.New(cfg, client.Options{})
}
