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

// Package agent is the storage agent's side of the cluster: it keeps the
// backing stores and exports of the NBDVolumes placed on its node in step
// with their specs, enforces the publications (access.NodeExport names,
// per-node tokens, source addresses, read-only) on the NBD server, and
// reports the node's capacity in an NBDStorageNode.
//
// The controller talks to it only through the API objects: it creates an
// NBDVolume, grows spec.sizeBytes, edits spec.publications or deletes the
// object, then waits for status.observedGeneration to reach the object's
// generation. The agent reports a generation only once everything in that
// spec is in effect.
package agent

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
	"github.com/mpnbd/mpnbd/pkg/nodeid"
	"github.com/mpnbd/mpnbd/pkg/replica"
)

// Defaults for Config fields left zero.
const (
	DefaultHeartbeatInterval = 10 * time.Second
	DefaultDrainTimeout      = 30 * time.Second
)

// NBDVolume conditions the agent keeps: Ready (the volume is served) and
// Grown (the backing store has the spec's size; False with the reason
// when it could not grow, while the volume keeps serving its old size).
const (
	ConditionReady = "Ready"
	ConditionGrown = "Grown"
	// ConditionDeletionBlocked is True while a deleted volume stays
	// because it is in use: published (reason InUse), or, its export
	// closed, with connections to it still open (ConnectionsOpen).
	ConditionDeletionBlocked = "DeletionBlocked"
)

// storageNodeField is the NBDVolume field the agent's cache selects on
// (declared selectable in the CRD).
const storageNodeField = "spec.storageNode"

// ExportObserver is told when exports come and go and, at every
// capacity report, how much room the node has (metrics).
type ExportObserver interface {
	ExportAdded(name string)
	ExportRemoved(name string)
	// Capacity gets what the NBDStorageNode reports: the data directory's
	// filesystem size and what new volumes may still take.
	Capacity(capacityBytes, availableBytes int64)
	// StrayJoin counts a connection closed because a subflow joined it
	// from outside its node's published storage addresses.
	StrayJoin(name string)
}

// ReplicaObserver, when the Config's ExportObserver implements it too, is
// told where the replicas of each replicated volume this node is the
// primary of stand, at every report of them (metrics).
type ReplicaObserver interface {
	Replicas(volume string, states []replica.ReplicaState)
}

// Config configures an Agent.
type Config struct {
	// NodeName is this storage node; only NBDVolumes whose
	// spec.storageNode equals it are served.
	NodeName string
	// DataDir holds one sparse file <volume>.img per volume.
	DataDir string
	// Addresses are the node's storage IP addresses, reported in the
	// volumes' status.export and in the NBDStorageNode.
	Addresses []string
	// Port is the NBD server's port.
	Port int32
	// Topology labels are reported in the NBDStorageNode.
	Topology map[string]string
	// HeartbeatInterval is how often the NBDStorageNode is refreshed;
	// zero means DefaultHeartbeatInterval.
	HeartbeatInterval time.Duration
	// DrainTimeout bounds draining a removed export or revoked connections;
	// zero means DefaultDrainTimeout.
	DrainTimeout time.Duration
	// SignalNICs, when not empty, are the storage NICs (interface names or
	// CIDRs) that get MPTCP "signal" endpoints, kept while the agent runs.
	// Empty leaves the host's endpoints alone.
	SignalNICs []mptcp.NICSpec
	// AutoBackup flags backup the signal endpoint of a path much slower
	// than the others for the reads it carries, and clears the flag once
	// it recovers (mptcp.SlowPaths).
	AutoBackup bool
	// OnPathEvent, when set, hears of the slow-path watch's decisions
	// (mptcp.SlowPathPolicy.OnEvent): the metrics. The agent records
	// them as Events on its NBDStorageNode besides (pathEvents).
	OnPathEvent func(mptcp.PathEvent)
	// StaleLossCount is the least net.mptcp.stale_loss_cnt kept with the
	// signal endpoints (0: left alone; see mptcp.DefaultStaleLossCount).
	StaleLossCount int
	// Listeners, when set, are the NBD server's listeners: the port is
	// opened on each address of SignalNICs before its endpoint is
	// announced, and closed when the address leaves (Listeners.Follow).
	// Without it the port must already listen there.
	Listeners *Listeners
	// Snapshots turns the NBDSnapshot reconciler on (SnapshotsServed);
	// the cache must then come from CacheOptions(node, true).
	Snapshots bool
	// Exports, when set, is told about added and removed exports and the
	// measured capacity.
	Exports ExportObserver
	// OnLostWrites, when set, is called when a volume's final sync failed
	// as its export closed: acknowledged writes may be lost and no client
	// is connected to be told (the server then changes its incarnation).
	OnLostWrites func(volume string)
	// NodeRoots, when set, returns the CA that issues node certificates:
	// a TLS connection presenting one is the node it names (see resolve).
	// The server's TLS configuration must ask for and verify them
	// (nodeid.Identity.ServerConfig).
	NodeRoots func() *x509.CertPool
	// PeerTLS, when set, is the TLS configuration with which the primary
	// of a replicated volume dials the other replicas' agents on storage
	// node (nodeid.Identity.ClientConfig of the agent's storage
	// certificate). Without it replicated volumes are not served.
	PeerTLS func(storageNode string) *tls.Config
	// RebuildRate bounds a replica's rebuild, in bytes per second (zero:
	// as fast as the replica takes it).
	RebuildRate float64
	// LeaseNamespace, when set, is where the agent keeps the storage
	// node's Lease (v1alpha1.StorageLeaseName), by which the controller
	// fails replicated volumes over from a node that is gone (lease.go).
	LeaseNamespace string
	// LeaseDuration is the lease's duration; zero means
	// DefaultLeaseDuration.
	LeaseDuration time.Duration
	// Logger receives structured logs; nil means slog.Default().
	Logger *slog.Logger
}

// Agent reconciles the NBDVolumes of one storage node onto an nbd.Server.
type Agent struct {
	cfg    Config
	log    *slog.Logger
	srv    *nbd.Server
	client client.Client
	// reader reads uncached (its own NBDStorageNode, which it may get
	// but not list or watch).
	reader client.Reader

	mu   sync.RWMutex
	vols map[string]*volume
	// ledgers: what each volume held as a replica knows of its
	// primary's unsettled forwards (ledgerFor), under mu.
	ledgers map[string]*replica.Ledger
	// roomMu makes a check of free space and the allocation it admits
	// one step among the concurrent reconciles.
	roomMu sync.Mutex

	// capacityKick asks the heartbeat for a report now.
	capacityKick chan struct{}
	// mgrCache is waited for before the first capacity report.
	mgrCache cache.Cache
	// replicas caches the volumes of which this node holds a replica
	// (replica.go); nil when it holds none.
	replicas cache.Cache
	started  atomic.Bool
	// leaseRenewed is when the lease was last renewed (UnixNano; 0:
	// never).
	leaseRenewed atomic.Int64
	// nodeUID is the UID of the NBDStorageNode as last reported
	// (types.UID), for the Events on it.
	nodeUID atomic.Value
}

// ledgerFor returns the settle-mark ledger of volume name, held as a
// replica of size bytes: made on first use and kept while the process
// lives (a replica promoted keeps what its ledger knows of the reign
// before).
func (a *Agent) ledgerFor(name string, size int64) *replica.Ledger {
	a.mu.Lock()
	defer a.mu.Unlock()
	l := a.ledgers[name]
	if l == nil {
		if a.ledgers == nil {
			a.ledgers = map[string]*replica.Ledger{}
		}
		l = replica.NewLedger(size)
		a.ledgers[name] = l
	}
	l.SetSize(size)
	return l
}

// volumeWorkers is how many volumes the agent reconciles at once.
const volumeWorkers = 4

// volume is what the agent holds for one NBDVolume.
type volume struct {
	name    string
	backend *nbd.FileBackend // nil until the file is open
	// grants by node ID: who may open the export, as last applied.
	grants map[string]grant
	// generation is the NBDVolume's metadata.generation whose
	// publications grants are.
	generation int64
	// asReplica: held as a replica of another node's primary
	// (replica.go), which alone may open it, as record says.
	asReplica bool
	record    *replicaRecord
	// replicated: served as the primary of a replicated volume
	// (primary.go), through its Mirror.
	replicated *replicated
}

// grant is one applied publication.
type grant struct {
	nodeID    string
	tokenHash string // TokenHash of the node's token; "" for certificate grants
	addrs     []netip.Addr
	limited   bool // the publication lists addresses (maybe none valid)
	readOnly  bool
	epoch     int64 // the publication's epoch; 0 for one made before epochs
}

func (g grant) equal(o grant) bool {
	return g.nodeID == o.nodeID && g.tokenHash == o.tokenHash && g.limited == o.limited &&
		g.readOnly == o.readOnly && g.epoch == o.epoch && slices.Equal(g.addrs, o.addrs)
}

// New returns an agent serving on srv. It installs srv.Resolve (only
// access.NodeExport names of current publications are served) and sets
// srv.DisableList. k8sClient should be the manager's (cached) client;
// apiReader an uncached reader (mgr.GetAPIReader()).
func New(c Config, srv *nbd.Server, k8sClient client.Client, apiReader client.Reader) (*Agent, error) {
	switch {
	case c.NodeName == "":
		return nil, errors.New("agent: no node name")
	case c.DataDir == "":
		return nil, errors.New("agent: no data directory")
	case len(c.Addresses) == 0:
		return nil, errors.New("agent: no storage addresses")
	case c.Port <= 0 || c.Port > 65535:
		return nil, fmt.Errorf("agent: invalid port %d", c.Port)
	case srv == nil || k8sClient == nil || apiReader == nil:
		return nil, errors.New("agent: a server, a client and an API reader are needed")
	}
	for _, a := range c.Addresses {
		if _, err := netip.ParseAddr(a); err != nil {
			return nil, fmt.Errorf("agent: storage address %q: %w", a, err)
		}
	}
	if c.HeartbeatInterval <= 0 {
		c.HeartbeatInterval = DefaultHeartbeatInterval
	}
	if c.DrainTimeout <= 0 {
		c.DrainTimeout = DefaultDrainTimeout
	}
	if c.LeaseDuration <= 0 {
		c.LeaseDuration = DefaultLeaseDuration
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if err := os.MkdirAll(c.DataDir, 0o700); err != nil {
		return nil, fmt.Errorf("agent: data directory: %w", err)
	}
	a := &Agent{
		cfg:          c,
		log:          c.Logger.With("node", c.NodeName),
		srv:          srv,
		client:       k8sClient,
		reader:       apiReader,
		vols:         make(map[string]*volume),
		capacityKick: make(chan struct{}, 1),
	}
	srv.Resolve = a.resolve
	srv.DisableList = true
	// The handshake slots Limits.ReservedHandshakes keeps are for the
	// published nodes; none is published before the first reconcile.
	srv.SetKnownSources(nil)
	return a, nil
}

// CacheOptions returns the manager cache options the agent needs: only the
// NBDVolumes (and, with snapshots, the NBDSnapshots) of node are cached
// and watched.
func CacheOptions(node string, snapshots bool) cache.Options {
	o := cache.Options{
		ByObject: map[client.Object]cache.ByObject{
			&v1alpha1.NBDVolume{}: {Field: fields.OneTermEqualSelector(storageNodeField, node)},
		},
	}
	if snapshots {
		o.ByObject[&v1alpha1.NBDSnapshot{}] = cache.ByObject{Field: fields.OneTermEqualSelector(storageNodeField, node)}
	}
	return o
}

// SnapshotsServed reports whether the API server serves NBDSnapshots: a
// cluster upgraded without the CRD does not, and the agent then takes no
// snapshots (Config.Snapshots) but serves its volumes all the same.
func SnapshotsServed(cfg *rest.Config) (bool, error) {
	dc, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		return false, err
	}
	list, err := dc.ServerResourcesForGroupVersion(v1alpha1.GroupVersion.String())
	if apierrors.IsNotFound(err) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("discovering %s: %w", v1alpha1.GroupVersion, err)
	}
	for _, r := range list.APIResources {
		if r.Name == "nbdsnapshots" {
			return true, nil
		}
	}
	return false, nil
}

// Started reports whether the manager's cache synced and the agent made
// its first capacity report attempt (for readiness).
func (a *Agent) Started() bool { return a.started.Load() }

// errUnpublished is what a refused connection is told in the logs; the
// client only sees ERR_POLICY.
var errUnpublished = errors.New("no current publication with this token")

// resolve is the nbd.Server's Resolve hook. A node opens a volume in one
// of two ways (access.ExportName):
//
//   - with a token: served when token is that of a current publication of
//     the volume; over TLS the node certificate must name the node the
//     token was issued to;
//   - by the volume's name alone, over TLS with a node certificate: served
//     when the volume is published to the node the certificate names.
//
// Either way the connection must come from one of the publication's
// addresses (if it lists any), and present the publication's epoch: an
// older one is refused as superseded (nbd.ErrSuperseded, which ends the
// node's data path), and so is the epoch of a publication withdrawn since
// (older than the generation whose publications are applied). Everything
// else is refused, for the node to dial again.
func (a *Agent) resolve(c nbd.ConnInfo, name string) (nbd.Grant, error) {
	vol, token, epoch, ok := access.ParseExport(name)
	if !ok {
		return nbd.Grant{}, errors.New("export name is not <volume>[/<token>][@<epoch>]")
	}
	a.mu.RLock()
	defer a.mu.RUnlock()
	v, ok := a.vols[vol]
	if !ok || v.backend == nil {
		return nbd.Grant{}, fmt.Errorf("volume %q: %w", vol, nbd.ErrUnknownExport)
	}
	if v.asReplica {
		// Opened by the volume's primary alone (replica.go).
		return a.resolveReplica(c, v, token, epoch)
	}
	if why := a.servesAsPrimary(v); why != "" {
		// Refused for now: the node dials the volume's other replicas.
		return nbd.Grant{}, fmt.Errorf("volume %q is not served here now: %s", vol, why)
	}
	peer, err := a.peerNode(c)
	if err != nil {
		return nbd.Grant{}, err
	}
	withToken := token != ""
	if !withToken && peer == "" {
		return nbd.Grant{}, errors.New("export name has no token and the connection has no node certificate")
	}
	for _, g := range v.grants {
		switch {
		case withToken && !access.TokenMatches(g.tokenHash, token):
			continue
		case withToken && peer != "" && g.nodeID != peer:
			return nbd.Grant{}, fmt.Errorf("the token was issued to node %s; the certificate names node %s", g.nodeID, peer)
		case !withToken && g.nodeID != peer:
			continue
		}
		if g.limited && !slices.Contains(g.addrs, remoteIP(c)) {
			return nbd.Grant{}, fmt.Errorf("node %s: connection from %v, not one of its storage addresses", g.nodeID, c.RemoteAddr)
		}
		switch {
		case epoch < g.epoch:
			return nbd.Grant{}, fmt.Errorf("node %s: the connection is of publication epoch %d, replaced by epoch %d: %w",
				g.nodeID, epoch, g.epoch, nbd.ErrSuperseded)
		case epoch > g.epoch:
			// The publication that the node was given is not applied
			// here yet: the node dials again.
			return nbd.Grant{}, fmt.Errorf("node %s: the connection is of publication epoch %d, newer than the one applied here (%d)",
				g.nodeID, epoch, g.epoch)
		}
		grant := nbd.Grant{Export: vol, ReadOnly: g.readOnly, Tag: g.nodeID, RequireTLS: g.tokenHash == ""}
		if v.replicated != nil {
			grant.Servers = v.replicated.servers
		}
		return grant, nil
	}
	if epoch > 0 && epoch < v.generation {
		// A publication's epoch is the volume's generation when it was
		// made, and the publications applied here are those of a later
		// generation, which no longer holds it: it was withdrawn (the
		// node fenced and force-detached, the volume published elsewhere
		// since). The session presenting it is refused for good, so that
		// it fails its I/O instead of waiting, and redialing, forever.
		return nbd.Grant{}, fmt.Errorf("volume %q: the connection is of publication epoch %d, withdrawn by generation %d: %w",
			vol, epoch, v.generation, nbd.ErrSuperseded)
	}
	if !withToken {
		return nbd.Grant{}, fmt.Errorf("volume %q is not published to node %s", vol, peer)
	}
	return nbd.Grant{}, errUnpublished
}

// peerNode is the node a TLS connection's certificate names ("" for a
// connection without TLS, or when node certificates are not in use).
func (a *Agent) peerNode(c nbd.ConnInfo) (string, error) {
	if c.TLS == nil || a.cfg.NodeRoots == nil || len(c.TLS.PeerCertificates) == 0 {
		return "", nil
	}
	node, err := nodeid.PeerNode(c.TLS, a.cfg.NodeRoots())
	if err != nil {
		return "", fmt.Errorf("the client's certificate: %w", err)
	}
	return node, nil
}

// remoteIP is the connection's peer address, or the zero Addr.
func remoteIP(c nbd.ConnInfo) netip.Addr {
	if c.RemoteAddr == nil {
		return netip.Addr{}
	}
	ap, err := netip.ParseAddrPort(c.RemoteAddr.String())
	if err != nil {
		return netip.Addr{}
	}
	return ap.Addr().Unmap()
}

// kickCapacity asks for a capacity report soon (never blocks).
func (a *Agent) kickCapacity() {
	select {
	case a.capacityKick <- struct{}{}:
	default:
	}
}

// Close stops serving every volume: exports are drained (up to the drain
// timeout) and removed, and backing files flushed and closed. The files
// and the API objects stay, for the next start.
func (a *Agent) Close() error {
	a.mu.Lock()
	vols := make([]*volume, 0, len(a.vols))
	for _, v := range a.vols {
		vols = append(vols, v)
	}
	a.vols = make(map[string]*volume)
	a.mu.Unlock()
	var errs []error
	for _, v := range vols {
		errs = append(errs, a.closeVolume(v))
	}
	return errors.Join(errs...)
}

// closeVolume removes v's export and closes its backend.
func (a *Agent) closeVolume(v *volume) error {
	if v.backend == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), a.cfg.DrainTimeout)
	defer cancel()
	var err error
	switch rerr := a.srv.RemoveExport(ctx, v.name); {
	case errors.Is(rerr, nbd.ErrUnknownExport):
	case rerr != nil:
		// The server closed the connections hard and waited for their
		// handlers: the backend is no longer in use.
		a.log.Warn("export connections did not drain in time and were closed", "volume_id", v.name, "error", rerr)
		fallthrough
	default:
		if a.cfg.Exports != nil {
			a.cfg.Exports.ExportRemoved(v.name)
		}
	}
	if serr := v.backend.Sync(); serr != nil {
		err = errors.Join(err, fmt.Errorf("volume %s: flush: %w", v.name, serr))
		if a.cfg.OnLostWrites != nil {
			a.cfg.OnLostWrites(v.name)
		}
	}
	closeFile := v.backend.Close
	if r := v.replicated; r != nil {
		closeFile = func() error { return closeReplicated(r) }
		v.replicated = nil
	}
	if cerr := closeFile(); cerr != nil {
		err = errors.Join(err, fmt.Errorf("volume %s: close: %w", v.name, cerr))
	}
	v.backend = nil
	return err
}
