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
	"fmt"

	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/hostaddr"
	"github.com/mpnbd/mpnbd/pkg/agent"
	"github.com/mpnbd/mpnbd/pkg/kubeconfig"
	"github.com/mpnbd/mpnbd/pkg/logging/kubelog"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbdmetrics"
	"github.com/mpnbd/mpnbd/pkg/nodeid"
)

// clusterAgent is the storage agent of a --cluster run.
type clusterAgent struct {
	agent *agent.Agent
	// done receives the manager's result once it stopped.
	done chan error
	stop context.CancelFunc
}

// startAgent builds the manager and the agent serving on d.srv through
// ls, reporting addrs (the storage addresses, resolved), and starts them.
func (d *daemon) startAgent(ctx context.Context, ls *agent.Listeners, addrs []string) (*clusterAgent, error) {
	port := ls.Port()
	co := d.opts.cluster
	kubelog.Bridge(d.log)
	cfg, err := kubeconfig.Load(co.kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("kubernetes client config: %w", err)
	}
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		return nil, err
	}
	if err := v1alpha1.AddToScheme(scheme); err != nil {
		return nil, err
	}
	snapshots, err := agent.SnapshotsServed(cfg)
	if err != nil {
		return nil, err
	}
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
		Scheme: scheme,
		Cache:  agent.CacheOptions(co.nodeName, snapshots),
		// One agent per node: no leader election. Metrics are served on
		// --metrics-addr with the server's own registry.
		LeaderElection:         false,
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
	})
	if err != nil {
		return nil, fmt.Errorf("controller manager: %w", err)
	}
	acfg := agent.Config{
		NodeName:          co.nodeName,
		Snapshots:         snapshots,
		DataDir:           co.dataDir,
		Addresses:         addrs,
		Port:              int32(port),
		Topology:          co.topology,
		HeartbeatInterval: co.heartbeat,
		DrainTimeout:      d.opts.shutdownTimeout,
		SignalNICs:        co.signalNICs,
		AutoBackup:        co.autoBackup,
		OnPathEvent:       d.pathDecisions(),
		StaleLossCount:    co.staleLoss,
		Listeners:         ls,
		Exports:           d.metrics,
		OnLostWrites:      d.lostWrites,
		LeaseNamespace:    co.namespace,
		LeaseDuration:     co.leaseDuration,
		RebuildRate:       co.rebuildRate,
		Logger:            d.log,
	}
	mctx, cancel := context.WithCancel(ctx)
	if co.identity {
		// Before serving: every connection offers STARTTLS with the
		// storage certificate, refused until it is issued.
		id, err := d.startIdentity(mctx, cfg, scheme)
		if err != nil {
			cancel()
			return nil, err
		}
		d.srv.TLSConfig = id.ServerConfig()
		acfg.NodeRoots = id.Roots
		// The same certificate as a client's: the primary of a
		// replicated volume forwards to the other replicas' agents.
		acfg.PeerTLS = id.ClientConfig
	}
	a, err := agent.New(acfg, d.srv, mgr.GetClient(), mgr.GetAPIReader())
	if err != nil {
		cancel()
		return nil, err
	}
	if err := a.SetupWithManager(mgr); err != nil {
		cancel()
		return nil, err
	}
	ca := &clusterAgent{agent: a, done: make(chan error, 1), stop: cancel}
	go func() { ca.done <- mgr.Start(mctx) }()
	d.log.Info("storage agent started", "node", co.nodeName, "data_dir", co.dataDir, "namespace", co.namespace,
		"storage_addresses", addrs, "port", port, "signal_nics", co.signalNICs)
	return ca, nil
}

// startIdentity gets this storage node's certificate in the background
// and keeps it renewed until ctx ends.
func (d *daemon) startIdentity(ctx context.Context, cfg *rest.Config, scheme *runtime.Scheme) (*nodeid.Identity, error) {
	co := d.opts.cluster
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		return nil, err
	}
	id, err := nodeid.NewIdentity(nodeid.IdentityConfig{
		Client: c, Kind: nodeid.Storage, NodeName: co.nodeName, Namespace: co.namespace, Logger: d.log,
	})
	if err != nil {
		return nil, err
	}
	if d.reg != nil {
		d.reg.MustRegister(nodeid.CertCollector(nodeid.Storage, id.Leaf))
	}
	go func() {
		if err := id.Start(ctx, 0); err != nil && ctx.Err() == nil {
			d.log.Error("no storage certificate: TLS connections are refused", "error", err)
		}
	}()
	return id, nil
}

// hostAddrs is where the storage addresses' CIDRs find the host's
// addresses (tests replace it).
var hostAddrs = hostaddr.System

// pathDecisions returns what counts the slow-path watch's decisions in
// the metrics /metrics serves.
func (d *daemon) pathDecisions() func(mptcp.PathEvent) {
	if d.reg == nil {
		return nil
	}
	p := nbdmetrics.NewPathDecisions("mpnbd_server")
	d.reg.MustRegister(p)
	return p.Observe
}
