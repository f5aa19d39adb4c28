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

// Command controller is the CSI controller plugin: the Identity and
// Controller services of the driver, run by a Deployment next to the
// external-provisioner, -attacher and -resizer sidecars. It never touches
// data: every call becomes a change of an NBDVolume that the volume's
// storage agent carries out. Run it with --help for the flags.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/validation"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/buildinfo"
	"github.com/mpnbd/mpnbd/pkg/driver"
	"github.com/mpnbd/mpnbd/pkg/kubeconfig"
	"github.com/mpnbd/mpnbd/pkg/kubeevents"
	"github.com/mpnbd/mpnbd/pkg/logging/kubelog"
	"github.com/mpnbd/mpnbd/pkg/nodeid"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

type options struct {
	endpoint    string
	namespace   string
	kubeconfig  string
	waitTimeout time.Duration
	staleAfter  time.Duration
	// replicaLostAfter: a replica's storage node gone this long is
	// replaced.
	replicaLostAfter time.Duration
	defaultSize      int64
	// defaultEncryption: a volume whose StorageClass names no encryption
	// gets this one.
	defaultEncryption string
	logLevel          slog.Level
	logFormat         string
	// sign runs the signer of node and storage certificates, approving
	// requests of these ServiceAccounts (NAMESPACE:NAME).
	sign                        bool
	nodeAccount, storageAccount string
	// metricsAddr serves /metrics ("": off).
	metricsAddr string
}

func newFlagSet(o *options) *flag.FlagSet {
	fs := flag.NewFlagSet("controller", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.StringVar(&o.endpoint, "endpoint", "unix:///csi/csi.sock", "CSI endpoint: unix:///path or tcp://host:port")
	fs.StringVar(&o.namespace, "namespace", os.Getenv("POD_NAMESPACE"), "namespace of the per-node publication Secrets (default $POD_NAMESPACE)")
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig (default: $KUBECONFIG, in-cluster, ~/.kube/config)")
	fs.DurationVar(&o.waitTimeout, "wait-timeout", 60*time.Second, "how long a call waits for a storage agent")
	fs.DurationVar(&o.staleAfter, "stale-after", 2*time.Minute, "a storage node not heard of for this long gets no new volumes")
	fs.DurationVar(&o.replicaLostAfter, "replica-lost-after", driver.DefaultReplicaLostAfter, "a replica whose storage node's lease has not been renewed for this long is replaced on another storage node (copied whole from the primary)")
	fs.Int64Var(&o.defaultSize, "default-size", 1<<30, "size in bytes of a volume whose request names none")
	fs.StringVar(&o.defaultEncryption, "default-encryption", "none", "encryption of a volume whose StorageClass names none: none, preferred or required")
	fs.Func("log-level", "debug, info, warn or error (default info)", func(s string) error {
		return o.logLevel.UnmarshalText([]byte(s))
	})
	fs.StringVar(&o.logFormat, "log-format", "text", "text or json")
	fs.StringVar(&o.metricsAddr, "metrics-addr", "", "serve Prometheus metrics at http://`ADDR`/metrics (CSI calls, storage nodes Ready, primaries moved, API client requests, mpnbd_build_info); empty: off")
	fs.BoolVar(&o.sign, "sign-certificates", true, "issue the node plugins' and storage agents' certificates for the storage network (signers "+nodeid.SignerNode+" and "+nodeid.SignerStorage+"; CA in the Secret "+nodeid.CASecret+" of --namespace)")
	fs.StringVar(&o.nodeAccount, "node-service-account", "", "`NAMESPACE:NAME` of the node plugin's ServiceAccount, the only one given node certificates (default --namespace:mpnbd-node)")
	fs.StringVar(&o.storageAccount, "storage-service-account", "", "`NAMESPACE:NAME` of the storage agent's ServiceAccount, the only one given storage certificates (default --namespace:mpnbd-storage-agent)")
	return fs
}

func parseArgs(args []string) (*options, error) {
	o := &options{}
	fs := newFlagSet(o)
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	switch {
	case fs.NArg() > 0:
		return nil, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	case o.namespace == "":
		return nil, errors.New("--namespace is required (or set $POD_NAMESPACE)")
	case o.logFormat != "text" && o.logFormat != "json":
		return nil, fmt.Errorf("--log-format %q (want text or json)", o.logFormat)
	case o.waitTimeout <= 0 || o.staleAfter <= 0 || o.defaultSize <= 0 || o.replicaLostAfter <= 0:
		return nil, errors.New("--wait-timeout, --stale-after, --replica-lost-after and --default-size must be positive")
	case !slices.Contains([]string{"none", "preferred", "required"}, o.defaultEncryption):
		return nil, fmt.Errorf("--default-encryption %q (want none, preferred or required)", o.defaultEncryption)
	}
	if _, _, err := driver.ParseEndpoint(o.endpoint); err != nil {
		return nil, fmt.Errorf("--endpoint: %v", err)
	}
	for _, a := range []struct {
		flag string
		v    *string
		def  string
	}{{"node-service-account", &o.nodeAccount, "mpnbd-node"}, {"storage-service-account", &o.storageAccount, "mpnbd-storage-agent"}} {
		if *a.v == "" {
			*a.v = o.namespace + ":" + a.def
		}
		ns, name, ok := strings.Cut(*a.v, ":")
		if !ok || len(validation.IsDNS1123Label(ns)) > 0 || len(validation.IsDNS1123Subdomain(name)) > 0 {
			return nil, fmt.Errorf("--%s %q: want NAMESPACE:NAME of a ServiceAccount", a.flag, *a.v)
		}
	}
	return o, nil
}

func usage() string {
	var b strings.Builder
	b.WriteString("Usage: controller [flags]\n\nThe CSI controller plugin of " + driver.DriverName + ".\n\nFlags:\n")
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
		fmt.Fprintf(stderr, "controller: %v\nRun 'controller --help' for usage.\n", err)
		return 2
	}
	log := kubelog.Setup(stderr, o.logLevel, o.logFormat)
	if err := serve(ctx, o, log); err != nil {
		log.Error("controller failed", "error", err)
		return 1
	}
	return 0
}

func serve(ctx context.Context, o *options, log *slog.Logger) error {
	cfg, err := kubeconfig.Load(o.kubeconfig)
	if err != nil {
		return err
	}
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		return err
	}
	if err := v1alpha1.AddToScheme(scheme); err != nil {
		return err
	}
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		return fmt.Errorf("API client: %w", err)
	}
	changes := driver.NewChanges()
	if err := driver.WatchChanges(ctx, cfg, scheme, changes, 30*time.Second); err != nil {
		// Without the watch every wait polls, as before.
		log.Warn("waits poll their volume every 200ms: no watch of volumes", "error", err)
		changes = nil
	}
	var metrics *driver.Metrics
	if o.metricsAddr != "" {
		reg := buildinfo.Registry("controller")
		if metrics, err = driver.NewMetrics(reg); err != nil {
			return err
		}
		// With the API client's request metrics controller-runtime
		// keeps.
		if err := driver.ServeMetrics(ctx, o.metricsAddr, buildinfo.Merge(reg, ctrlmetrics.Registry), log); err != nil {
			return fmt.Errorf("--metrics-addr: %w", err)
		}
	}
	ctl, err := driver.NewController(driver.ControllerConfig{
		Changes:          changes,
		Client:           c,
		Namespace:        o.namespace,
		Logger:           log,
		WaitTimeout:      o.waitTimeout,
		StaleAfter:       o.staleAfter,
		DefaultSizeBytes: o.defaultSize,
		// A class names its encryption or gets this one.
		DefaultEncryption: v1alpha1.Encryption(o.defaultEncryption),
	})
	if err != nil {
		return err
	}
	l, err := driver.Listen(o.endpoint)
	if err != nil {
		return err
	}
	s := driver.NewGRPCServer(log, metrics)
	csi.RegisterIdentityServer(s, &driver.Identity{
		// Ready while the API server answers and our resources exist.
		Ready: func(ctx context.Context) error {
			return c.List(ctx, &v1alpha1.NBDStorageNodeList{}, client.Limit(1))
		},
	})
	csi.RegisterControllerServer(s, ctl)
	if o.sign {
		go runSigner(ctx, cfg, scheme, o, log)
	}
	go backfill(ctx, ctl, log)
	// Replicated volumes move off a storage node that is gone; every
	// storage node and volume carries its conditions.
	events, stopEvents := kubeevents.NewRecorder(c, "mpnbd-controller", log)
	defer stopEvents()
	go driver.NewFailover(driver.FailoverConfig{Client: c, Namespace: o.namespace, Logger: log,
		ReplicaLostAfter: o.replicaLostAfter, StaleAfter: o.staleAfter, Events: events, Metrics: metrics}).Run(ctx)
	log.Info("controller serving", "endpoint", o.endpoint, "namespace", o.namespace, "api_server", cfg.Host, "version", buildinfo.Version)
	return driver.Serve(ctx, s, l, 30*time.Second)
}

// backfill gives the publications made before they carried their token's
// hash, or their node's storage addresses, those (retrying until it
// succeeds): the storage agents grant a token only by its hash and only
// from those addresses.
func backfill(ctx context.Context, ctl *driver.Controller, log *slog.Logger) {
	for delay := time.Second; ; delay = min(2*delay, time.Minute) {
		n, err := ctl.BackfillTokenHashes(ctx)
		if err == nil {
			if n > 0 {
				log.Info("publications given their token hashes", "count", n)
			}
			return
		}
		log.Error("giving publications their token hashes; retrying", "error", err, "filled", n, "retry_in", delay)
		select {
		case <-ctx.Done():
			return
		case <-time.After(delay):
		}
	}
}

// serviceAccountUser is the user name the API server gives a
// ServiceAccount's tokens.
func serviceAccountUser(nsName string) string {
	return "system:serviceaccount:" + nsName
}

// runSigner issues node and storage certificates until ctx ends. Without
// the CA (no access to its Secret yet, say) it keeps trying: volumes work
// without it, certificates wait for it.
func runSigner(ctx context.Context, cfg *rest.Config, scheme *runtime.Scheme, o *options, log *slog.Logger) {
	log = log.With("signers", []string{nodeid.SignerNode, nodeid.SignerStorage})
	c, err := client.NewWithWatch(cfg, client.Options{Scheme: scheme})
	if err != nil {
		log.Error("no certificates will be issued", "error", err)
		return
	}
	var ca *nodeid.CA
	for delay := time.Second; ; delay = min(2*delay, time.Minute) {
		if ca, err = nodeid.LoadOrCreateCA(ctx, c, o.namespace); err == nil {
			break
		}
		log.Error("no CA to issue certificates with; retrying", "error", err, "retry_in", delay)
		select {
		case <-ctx.Done():
			return
		case <-time.After(delay):
		}
	}
	log.Info("issuing certificates", "ca_expires", ca.Cert.NotAfter, "node_account", o.nodeAccount, "storage_account", o.storageAccount)
	s := nodeid.NewSigner(nodeid.SignerConfig{
		Client: c, CA: ca, Logger: log,
		NodeUser:    serviceAccountUser(o.nodeAccount),
		StorageUser: serviceAccountUser(o.storageAccount),
	})
	if err := s.Run(ctx); err != nil {
		log.Error("signer stopped", "error", err)
	}
}
