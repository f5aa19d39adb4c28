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

// Package nbddev attaches exports as /dev/nbdX through the kernel's NBD
// generic-netlink family, by the kernel, relay, multiconn and tcp
// transports. Every attach sets the volume ID as backend identifier,
// destroy-on-disconnect, a dead-connection timeout and a request timeout;
// a LINK_DEAD watcher redials and hands the kernel new sockets with
// RECONFIGURE, and a fresh process re-adopts devices by their identifier.
//
// Every transport here bounds the wait on a silent storage host by the
// dead-peer bound (attach.Options.DeadPeerTimeout): the relay watches it
// itself, and the plain TCP sockets of tcp and multiconn carry it as
// TCP_USER_TIMEOUT with a keepalive (deadpeer.go), while the kernel's
// request timeout stays at least twice the bound.
//
// multiconn announces no session (the kernel cannot), so nothing fences a
// socket the kernel gave up on; what makes it safe instead is that a
// request can no longer reach the server late, after the kernel requeued
// it on another socket and newer writes followed: the socket of a silent
// path dies of TCP_USER_TIMEOUT before the kernel's request timeout
// requeues its requests, and a dead socket's unsent data is purged with
// it; the server ends its side of such a connection within the same bound
// and drops the requests it had read but not started (pkg/nbd). A
// request the server started before the path fell silent completes at
// once, long before any requeue. TestMulticonnNoLateWriteAfterSilentPath
// proves it with a path whose packets are dropped.
package nbddev

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/mpnbd/mpnbd/internal/backoff"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/fdpass"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
	"github.com/mpnbd/mpnbd/pkg/nbd/nbdnl"
	"github.com/mpnbd/mpnbd/pkg/relay"
)

// Kernel is the part of the kernel NBD client the attacher uses.
type Kernel interface {
	Connect(o nbdnl.ConnectOptions) (uint32, error)
	Disconnect(index uint32) error
	Reconfigure(index uint32, o nbdnl.ReconfigureOptions) error
	WatchLinkDead(ctx context.Context) (<-chan nbdnl.LinkDead, error)
}

// Devices is the sysfs view of NBD devices.
type Devices interface {
	WaitReady(ctx context.Context, index uint32, size uint64) error
	FindByBackend(id string) (uint32, bool, error)
}

// Config configures an Attacher.
type Config struct {
	// Mode is one of attach.Kernel, attach.Relay, attach.MultiConn, attach.TCP.
	Mode    attach.Transport
	Kernel  Kernel
	Devices Devices
	Logger  *slog.Logger
	// DialTimeout bounds one dial + negotiation; zero means 10 s.
	DialTimeout time.Duration
	// StateDir, when set, keeps a small record per attached volume so that
	// Adopt in a fresh process can re-adopt the devices.
	StateDir string
}

// Attacher attaches volumes with one transport.
type Attacher struct {
	cfg Config
	log *slog.Logger

	mu      sync.Mutex
	vols    map[string]*volume
	byIndex map[uint32]*volume
	watch   context.CancelFunc
}

type volume struct {
	target  attach.Target
	opts    attach.Options
	att     attach.Attachment
	index   uint32
	info    nbd.ExportInfo
	session nbd.SessionID
	servers attach.ServerDialer
	// life ends at detach: reconnects stop then.
	life context.Context
	end  context.CancelFunc

	// inc is the incarnation of the server last reached, if incKnown.
	inc      nbd.Incarnation
	incKnown bool

	mu           sync.Mutex
	reconnecting bool
	downSince    time.Time  // when the reconnect under way began
	conns        []net.Conn // our handles on the data sockets (for MPTCP_INFO)
	// viaMPTCP: the last connections dialed ran MPTCP (what the device
	// uses when the process has no handle on the kernel's sockets).
	viaMPTCP   bool
	relay      *relay.Relay
	local      net.Conn // the relay's end of the kernel's socket
	stopRelay  context.CancelFunc
	relayDone  chan struct{}
	reconnects int
	lastErr    error
	// fenced: the server refused the export as superseded and the
	// device was disconnected (fence.go).
	fenced bool
	// latency counts the requests of every relay the volume has had in
	// this process.
	latency *relay.Latency
}

// New returns an attacher for cfg.Mode.
func New(cfg Config) (*Attacher, error) {
	switch cfg.Mode {
	case attach.Kernel, attach.Relay, attach.MultiConn, attach.TCP:
	default:
		return nil, fmt.Errorf("%w: nbddev cannot do transport %q", attach.ErrInvalid, cfg.Mode)
	}
	if cfg.Kernel == nil || cfg.Devices == nil {
		return nil, fmt.Errorf("%w: nbddev needs a kernel client and a device view", attach.ErrInvalid)
	}
	if cfg.DialTimeout == 0 {
		cfg.DialTimeout = 10 * time.Second
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	a := &Attacher{
		cfg:     cfg,
		log:     log.With("transport", string(cfg.Mode)),
		vols:    make(map[string]*volume),
		byIndex: make(map[uint32]*volume),
	}
	// Subscribe now, from the caller's network namespace: the nbd family
	// of older kernels resolves only in the initial one.
	if err := a.startWatch(); err != nil {
		return nil, err
	}
	return a, nil
}

func (a *Attacher) usesMPTCP() bool { return a.cfg.Mode == attach.Kernel || a.cfg.Mode == attach.Relay }

func withDefaults(o attach.Options) attach.Options {
	if o.DeadConnTimeout == 0 {
		o.DeadConnTimeout = attach.DefaultDeadConnTimeout
	}
	o.DeadPeerTimeout = o.EffectiveDeadPeerTimeout()
	o.RequestTimeout = o.KernelRequestTimeout()
	if o.BlockSize == 0 {
		o.BlockSize = attach.DefaultBlockSize
	}
	return o
}

func validate(t attach.Target) error {
	switch {
	case t.VolumeID == "":
		return fmt.Errorf("%w: empty volume ID", attach.ErrInvalid)
	case t.Export == "":
		return fmt.Errorf("%w: empty export name", attach.ErrInvalid)
	case len(t.Addrs) == 0:
		return fmt.Errorf("%w: no server address", attach.ErrInvalid)
	}
	return nil
}

// Attach connects t as an NBD device. A volume this process already
// attached is returned as is; a device left by an earlier process (found by
// its backend identifier) is re-adopted with fresh sockets.
func (a *Attacher) Attach(ctx context.Context, t attach.Target, o attach.Options) (*attach.Attachment, error) {
	if err := validate(t); err != nil {
		return nil, err
	}
	if t.EncryptionRequired() && !attach.CanEncrypt(a.cfg.Mode) {
		// The kernel's NBD client speaks no TLS: only a relay, which owns
		// the connection to the server, can carry it.
		return nil, fmt.Errorf("%w: %s", attach.ErrUnsupported, attach.NoEncryption(a.cfg.Mode))
	}
	o = withDefaults(o)
	a.mu.Lock()
	if v, ok := a.vols[t.VolumeID]; ok {
		att := v.att
		a.mu.Unlock()
		return &att, nil
	}
	a.mu.Unlock()

	idx, found, err := a.cfg.Devices.FindByBackend(t.VolumeID)
	if err != nil {
		return nil, fmt.Errorf("look for an existing device of %s: %w", t.VolumeID, err)
	}
	if found {
		return a.adopt(ctx, t, o, idx)
	}
	return a.connect(ctx, t, o)
}

func (a *Attacher) newVolume(t attach.Target, o attach.Options, session nbd.SessionID) *volume {
	v := &volume{target: t, opts: o, session: session}
	v.life, v.end = context.WithCancel(context.Background())
	if o.ServersFile != "" {
		if err := v.servers.KeepIn(o.ServersFile); err != nil {
			a.log.Warn("what an earlier process learned of the storage nodes that hold the volume is lost; dialling those it was published with", "volume_id", t.VolumeID, "error", err)
		}
	}
	return v
}

// bounded reports whether the volume's I/O may fail after an outage
// (deadConnTimeout set below the hard default).
func (v *volume) bounded() bool { return v.opts.DeadConnTimeout < attach.DefaultDeadConnTimeout }

func (a *Attacher) connect(ctx context.Context, t attach.Target, o attach.Options) (_ *attach.Attachment, err error) {
	v := a.newVolume(t, o, nbd.NewSessionID())
	socks, err := a.dialAll(ctx, v)
	if err != nil {
		return nil, err
	}
	defer fdpass.Close(socks)
	defer func() {
		if err != nil {
			v.end()
			v.shutdown()
		}
	}()
	flags := nbdnl.DestroyOnDisconnect
	// One policy on every transport: a storage host silent for the
	// dead-peer bound loses its connection, which is replaced; a slow one
	// keeps it. The kernel's own request timeout is an age bound, the
	// wrong tool for that (a busy server's queue would trip it), so it
	// stays well above the dead-peer bound (attach.Options.
	// KernelRequestTimeout) and the sockets carry the bound themselves
	// (armSockets).
	timeout := v.opts.RequestTimeout
	if a.cfg.Mode == attach.Relay {
		// The relay watches the server itself (relay.Options.
		// DeadPeerTimeout) and never loses a request; a kernel timeout
		// would shut its socket down and throw away what it holds for a
		// replay. Without one the kernel only warns.
		timeout = 0
	}
	idx, err := a.cfg.Kernel.Connect(nbdnl.ConnectOptions{
		Sockets:         socks,
		Size:            v.info.Size,
		BlockSize:       o.BlockSize,
		Timeout:         timeout,
		DeadConnTimeout: o.DeadConnTimeout,
		ServerFlags:     uint64(v.info.Flags),
		ClientFlags:     flags,
		BackendID:       t.VolumeID,
	})
	if err != nil {
		if errors.Is(err, nbdnl.ErrUnsupportedSocket) {
			return nil, fmt.Errorf("%w: the kernel's nbd refuses MPTCP sockets: %v", attach.ErrUnsupported, err)
		}
		return nil, fmt.Errorf("connect nbd device: %w", err)
	}
	v.index = idx
	if err := a.cfg.Devices.WaitReady(ctx, idx, v.info.Size); err != nil {
		if derr := a.cfg.Kernel.Disconnect(idx); derr != nil {
			a.log.Error("disconnect after a failed attach", "nbd_index", idx, "error", derr)
		}
		return nil, fmt.Errorf("nbd%d not ready: %w", idx, err)
	}
	a.register(v)
	a.log.Info("volume attached", "volume_id", t.VolumeID, "nbd_index", idx, "size", v.info.Size,
		"mptcp", v.att.MPTCP, "connections", len(v.conns))
	return v.attachment(), nil
}

// adopt takes over a device an earlier process connected: it hands the
// kernel fresh sockets for the dead slots and restarts what runs in
// userspace (the relay).
func (a *Attacher) adopt(ctx context.Context, t attach.Target, o attach.Options, idx uint32) (*attach.Attachment, error) {
	v, err := a.handOver(ctx, t, o, idx)
	if errors.Is(err, errUnreachable) && !errors.Is(err, attach.ErrServerRefused) {
		// The storage node is away (an outage that outlived the last
		// process): the device is ours all the same, its I/O waits, and
		// the reconnect goes on until the node is back or the volume is
		// detached.
		v = a.newVolume(t, o, a.loadSession(t.VolumeID))
		v.index = idx
		v.reconnecting, v.downSince = true, time.Now()
		v.lastErr = err
		a.register(v)
		a.log.Warn("volume re-adopted while its storage node is unreachable; reconnecting", "volume_id", t.VolumeID, "nbd_index", idx, "error", err)
		go a.reconnect(v)
		return v.attachment(), nil
	}
	if err != nil {
		if errors.Is(err, nbdnl.ErrBackendMismatch) {
			return nil, fmt.Errorf("%w: nbd%d: %v", attach.ErrWrongVolume, idx, err)
		}
		return nil, fmt.Errorf("re-adopt nbd%d: %w", idx, err)
	}
	a.register(v)
	a.log.Info("volume re-adopted", "volume_id", t.VolumeID, "nbd_index", idx)
	return v.attachment(), nil
}

// errUnreachable marks a failure to reach the storage node (no address
// answered), as opposed to the kernel refusing the sockets.
var errUnreachable = errors.New("storage node unreachable")

// handOver dials fresh connections for t and gives them to device idx
// with RECONFIGURE and the same backend identifier. On failure everything
// it opened is closed again.
func (a *Attacher) handOver(ctx context.Context, t attach.Target, o attach.Options, idx uint32) (*volume, error) {
	v := a.newVolume(t, o, a.loadSession(t.VolumeID))
	v.index = idx
	if err := a.replaceSockets(ctx, v); err != nil {
		v.end()
		return nil, err
	}
	return v, nil
}

// replaceSockets dials fresh connections for v and gives them to its
// device with RECONFIGURE; on failure what it opened is closed again.
// The volume's old relay, if any, is stopped once the new one runs.
func (a *Attacher) replaceSockets(ctx context.Context, v *volume) error {
	v.mu.Lock()
	oldStop, oldDone, oldConns := v.stopRelay, v.relayDone, v.conns
	v.stopRelay, v.relayDone, v.relay, v.conns = nil, nil, nil, nil
	v.mu.Unlock()
	socks, err := a.dialAll(ctx, v)
	if err != nil {
		v.mu.Lock()
		v.stopRelay, v.relayDone, v.conns = oldStop, oldDone, oldConns
		v.mu.Unlock()
		return fmt.Errorf("%w: %w", errUnreachable, err)
	}
	defer fdpass.Close(socks)
	if err := a.cfg.Kernel.Reconfigure(v.index, nbdnl.ReconfigureOptions{Sockets: socks, BackendID: v.target.VolumeID}); err != nil {
		v.shutdown()
		v.mu.Lock()
		v.stopRelay, v.relayDone, v.conns = oldStop, oldDone, oldConns
		v.mu.Unlock()
		return err
	}
	if oldStop != nil {
		oldStop()
		<-oldDone
	}
	if a.cfg.Mode != attach.Relay {
		// Only the sockets the kernel took carry the device; the others
		// close unused, and the server, which saw no request on them,
		// keeps serving the connections the kernel still has.
		v.mu.Lock()
		fresh := v.conns
		keep, closing := sortTaken(fresh, oldConns, a.slots(v))
		v.conns, oldConns = keep, closing
		v.viaMPTCP = allMPTCP(fresh)
		v.mu.Unlock()
		if len(keep) == 0 {
			a.log.Info("the kernel's connections are healthy: kept them", "volume_id", v.target.VolumeID, "nbd_index", v.index)
		}
	}
	for _, c := range oldConns {
		c.Close()
	}
	return nil
}

// slots is the number of connections v's device has.
func (a *Attacher) slots(v *volume) int {
	if a.cfg.Mode == attach.MultiConn {
		return len(v.target.Addrs)
	}
	return 1
}

func (a *Attacher) register(v *volume) {
	v.att = attach.Attachment{
		VolumeID:  v.target.VolumeID,
		Transport: a.cfg.Mode,
		Device:    nbdnl.DevicePath(v.index),
		Size:      v.info.Size,
		MPTCP:     v.usesMPTCP(),
	}
	a.mu.Lock()
	a.vols[v.target.VolumeID] = v
	a.byIndex[v.index] = v
	a.mu.Unlock()
	if err := a.saveState(v); err != nil {
		a.log.Error("save state: the volume will not be re-adopted after a restart", "volume_id", v.target.VolumeID, "error", err)
	}
}

func (v *volume) attachment() *attach.Attachment {
	att := v.att
	return &att
}

// dialAll opens the data connections for the mode and returns the files to
// hand to the kernel. For relay that is the kernel's end of a socketpair;
// the relay owns the MPTCP connection.
func (a *Attacher) dialAll(ctx context.Context, v *volume) ([]*os.File, error) {
	var conns []net.Conn
	fail := func(err error) ([]*os.File, error) {
		for _, c := range conns {
			c.Close()
		}
		return nil, err
	}
	switch a.cfg.Mode {
	case attach.MultiConn:
		var err error
		conns, err = a.dialEach(ctx, v)
		if err != nil {
			return fail(err)
		}
		if len(conns) > 1 && v.info.Flags&nbd.FlagCanMultiConn == 0 {
			return fail(fmt.Errorf("%w: multiconn needs a server that allows several connections", attach.ErrUnsupported))
		}
	default:
		c, err := a.dialAny(ctx, v)
		if err != nil {
			return fail(err)
		}
		if a.cfg.Mode == attach.Relay {
			kernelEnd, relayEnd, err := relay.NewSocketPair()
			if err != nil {
				c.Close()
				return nil, err
			}
			v.info = c.Info
			v.mu.Lock()
			v.conns = []net.Conn{c.Conn}
			v.mu.Unlock()
			v.startRelay(a, relayEnd, c)
			return []*os.File{kernelEnd}, nil
		}
		conns = append(conns, c.Conn)
		v.info = c.Info
		a.noteIncarnation(v, c.Info)
	}
	v.mu.Lock()
	v.conns = conns
	v.mu.Unlock()
	a.armSockets(v, conns)

	files := make([]*os.File, 0, len(conns))
	for _, c := range conns {
		f, err := c.(*net.TCPConn).File()
		if err != nil {
			fdpass.Close(files)
			return fail(err)
		}
		files = append(files, f)
	}
	return files, nil
}

// dialEach dials every storage address at once, one connection each (the
// multiconn transport). Addresses that do not answer are left out: the
// device gets, or a reconnect offers the kernel, the connections that
// work, so a path that is down costs one connection, not the volume. A
// replicated volume's connections all go to the one server that serves
// it (its primary; the others refuse): the first connection is dialled to
// every server at once (attach.DialServers), the others to that server's
// other addresses.
func (a *Attacher) dialEach(ctx context.Context, v *volume) ([]net.Conn, error) {
	t := v.target
	servers := v.servers.For(t)
	srv := servers[0]
	// local is the node's address for the server address of path i.
	local := func(i int) string {
		if i >= 0 && i < len(t.LocalAddrs) {
			return t.LocalAddrs[i]
		}
		return ""
	}
	var conns []net.Conn
	addrs := srv.Addrs
	if len(servers) > 1 {
		dctx, cancel := context.WithTimeout(ctx, a.cfg.DialTimeout)
		first, addr, err := attach.DialServers(dctx, &v.servers, servers, func(ctx context.Context, s attach.Server, addr string) (*relay.Remote, error) {
			// No session: see below.
			return a.dialServer(ctx, v, s, addr, local(slices.Index(s.Addrs, addr)), false, -1)
		}, func(rc *relay.Remote) { rc.Close() })
		cancel()
		if err != nil {
			return nil, err
		}
		for _, s := range servers {
			if slices.Contains(s.Addrs, addr) {
				srv = s
				break
			}
		}
		conns, v.info = append(conns, first.Conn), first.Info
		addrs = slices.DeleteFunc(slices.Clone(srv.Addrs), func(x string) bool { return x == addr })
	}
	type result struct {
		c   *relay.Remote
		err error
	}
	// Once one connection is up, the others get a short grace before the
	// ones still dialing are given up: a silent path must not hold the
	// device back for the whole dial timeout.
	const grace = 2 * time.Second
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type indexed struct {
		i int
		result
	}
	ch := make(chan indexed, len(addrs))
	for i, addr := range addrs {
		go func() {
			// No session: LINK_DEAD does not say which socket died, and a
			// new socket on a live one's lane would fence it.
			c, err := a.dialServer(ctx, v, srv, addr, local(slices.Index(srv.Addrs, addr)), false, -1)
			ch <- indexed{i, result{c, err}}
		}()
	}
	res := make([]result, len(addrs))
	var timeout <-chan time.Time
	if len(conns) > 0 {
		timeout = time.After(grace)
	}
	for left := len(addrs); left > 0; left-- {
		var r indexed
		select {
		case r = <-ch:
		case <-timeout:
			cancel()
			r = <-ch
		}
		res[r.i] = r.result
		if r.err == nil && timeout == nil {
			timeout = time.After(grace)
		}
	}
	var errs []error
	for i, r := range res {
		if r.err != nil {
			errs = append(errs, r.err)
			if errors.Is(r.err, attach.ErrServerRefused) {
				// The export is refused (or the primary is one no more):
				// no address of this server will do.
				for _, c := range conns {
					c.Close()
				}
				for _, o := range res {
					if o.c != nil {
						o.c.Close()
					}
				}
				return nil, r.err
			}
			a.log.Warn("storage address unreachable: the device goes without its connection", "volume_id", t.VolumeID, "addr", addrs[i], "error", r.err)
			continue
		}
		conns = append(conns, r.c.Conn)
		v.info = r.c.Info
	}
	if len(conns) == 0 {
		return nil, errors.Join(errs...)
	}
	return conns, nil
}

// noteIncarnation records the server's incarnation and says so when it
// changed: the kernel keeps no copy of what the server acknowledged, so
// writes not yet flushed when the storage host went down are lost to
// the kernel transports (the userspace ones send them again).
func (a *Attacher) noteIncarnation(v *volume, info nbd.ExportInfo) {
	if !info.Fenced {
		return
	}
	if v.incKnown && info.Incarnation != v.inc {
		a.log.Error("the storage host restarted since the last connection: writes it acknowledged and had not flushed are lost on this transport (relay, fuse keep them)",
			"volume_id", v.target.VolumeID, "nbd_index", v.index)
	}
	v.inc, v.incKnown = info.Incarnation, true
}

// dialAny connects the volume's single data connection (kernel, relay,
// tcp) through the first of its server addresses that answers.
func (a *Attacher) dialAny(ctx context.Context, v *volume) (*relay.Remote, error) {
	ctx, cancel := context.WithTimeout(ctx, a.cfg.DialTimeout)
	defer cancel()
	c, _, err := attach.DialServers(ctx, &v.servers, v.servers.For(v.target), func(ctx context.Context, srv attach.Server, addr string) (*relay.Remote, error) {
		return a.dialServer(ctx, v, srv, addr, "", a.usesMPTCP(), 0)
	}, func(rc *relay.Remote) { rc.Close() })
	return c, err
}

// dialServer connects one data connection to server srv of the target
// and runs the handshake on it, announcing the volume's session on lane
// (none when lane < 0).
func (a *Attacher) dialServer(ctx context.Context, v *volume, srv attach.Server, addr, local string, useMPTCP bool, lane int) (*relay.Remote, error) {
	ctx, cancel := context.WithTimeout(ctx, a.cfg.DialTimeout)
	defer cancel()
	var sess *nbd.Session
	if lane >= 0 {
		sess = &nbd.Session{ID: v.session, Lane: uint32(lane), Generation: nbd.NextGeneration()}
	}
	// Asked of every server, replicated or not: a drain moves an
	// unreplicated volume to a storage node the node was not given.
	x := attach.ExportDialer{Logger: a.log.With("volume_id", v.target.VolumeID), Servers: &v.servers}
	if v.target.TLS != nil && attach.CanEncrypt(a.cfg.Mode) {
		x.TLS = v.target.TLS.ConfigFor(srv)
	}
	c, info, err := x.DialExport(ctx, addr, local, v.target.Export, useMPTCP, sess)
	if err != nil {
		return nil, err
	}
	return &relay.Remote{Conn: c, Info: info}, nil
}

func (v *volume) startRelay(a *Attacher, local net.Conn, remote *relay.Remote) {
	v.startRelayWith(a, local, remote, nil)
}

// startRelayWith starts the volume's relay; pending are bytes of the
// local side a predecessor read and did not take.
func (v *volume) startRelayWith(a *Attacher, local net.Conn, remote *relay.Remote, pending []byte) {
	ctx, cancel := context.WithCancel(context.Background())
	redial := func(ctx context.Context) (net.Conn, error) {
		c, err := a.dialAny(ctx, v)
		if err != nil {
			return nil, err
		}
		v.mu.Lock()
		v.conns = []net.Conn{c.Conn}
		v.reconnects++
		v.mu.Unlock()
		return c, nil
	}
	ro := relay.Options{Logger: a.log.With("volume_id", v.target.VolumeID), Pending: pending, DeadPeerTimeout: v.opts.DeadPeerTimeout,
		MaxBackoff: v.target.MaxBackoff()}
	if v.latency == nil {
		v.latency = relay.NewLatency()
	}
	ro.Latency = v.latency
	if v.bounded() {
		ro.FailAfter = v.opts.DeadConnTimeout
	}
	var rc net.Conn
	if remote != nil {
		rc = remote
	}
	r := relay.New(local, rc, redial, ro)
	v.relay, v.local, v.stopRelay, v.relayDone = r, local, cancel, make(chan struct{})
	done := v.relayDone
	if a.usesMPTCP() {
		go attach.KeepSubflows(ctx, r, func(ctx context.Context) (net.Conn, error) {
			c, err := a.dialAny(ctx, v)
			if err != nil {
				return nil, err
			}
			return c, nil
		}, attach.KeepConfig{Want: len(v.target.Addrs), Logger: ro.Logger})
	}
	go func() {
		defer close(done)
		if err := r.Run(ctx); err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, relay.ErrHandedOff) {
			a.log.Error("relay stopped", "volume_id", v.target.VolumeID, "error", err)
			v.mu.Lock()
			v.lastErr = err
			v.mu.Unlock()
		}
	}()
}

// shutdown stops the relay and closes our socket handles.
func (v *volume) shutdown() {
	v.mu.Lock()
	stop, done := v.stopRelay, v.relayDone
	v.stopRelay, v.relayDone, v.relay = nil, nil, nil
	v.mu.Unlock()
	if stop != nil {
		stop()
		<-done
	}
	v.mu.Lock()
	for _, c := range v.conns {
		c.Close()
	}
	v.conns = nil
	v.mu.Unlock()
}

// Detach disconnects the volume's device. Unknown volumes succeed. A
// relay first drains (drainRelay): if the storage node does not answer
// within ctx, the detach fails with attach.ErrUnflushed and the device
// stays, served, for the caller's retry.
func (a *Attacher) Detach(ctx context.Context, volumeID string) error {
	a.mu.Lock()
	v, ok := a.vols[volumeID]
	a.mu.Unlock()
	if !ok {
		idx, found, err := a.cfg.Devices.FindByBackend(volumeID)
		if err != nil || !found {
			return err
		}
		// A device from an earlier process that nobody re-adopted.
		return a.cfg.Kernel.Disconnect(idx)
	}
	v.mu.Lock()
	fenced := v.fenced
	v.mu.Unlock()
	// A fenced volume's relay has ended and dropped what it kept: the
	// volume was published again since, and nothing of it may be sent.
	resume := func() {}
	if !fenced {
		var err error
		if resume, err = a.drainRelay(ctx, v); err != nil {
			return err
		}
	}
	if err := a.cfg.Kernel.Disconnect(v.index); err != nil && !fenced {
		resume()
		return fmt.Errorf("disconnect nbd%d: %w", v.index, err)
	}
	v.end()
	v.shutdown()
	a.mu.Lock()
	delete(a.vols, volumeID)
	a.dropState(volumeID)
	delete(a.byIndex, v.index)
	a.mu.Unlock()
	a.log.Info("volume detached", "volume_id", volumeID, "nbd_index", v.index)
	return nil
}

// Health reports a volume's data path.
func (a *Attacher) Health(volumeID string) (attach.Health, error) {
	a.mu.Lock()
	v, ok := a.vols[volumeID]
	a.mu.Unlock()
	if !ok {
		return attach.Health{}, fmt.Errorf("%w: %s", attach.ErrNotAttached, volumeID)
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	// A device taken over from an earlier process may run on sockets only
	// the kernel holds: connected all the same.
	h := attach.Health{Connected: !v.reconnecting, Reconnects: v.reconnects}
	if v.reconnecting {
		h.Outage = time.Since(v.downSince)
	}
	conns := v.conns
	if v.relay != nil {
		// The relay's current connection, not one it already replaced.
		st := v.relay.Stats()
		rh := attach.SessionHealth(st)
		rh.Reconnects = v.reconnects // relay redials and device reconnects
		if v.reconnecting {
			rh.Connected, rh.Outage = false, h.Outage
		}
		h = rh
		conns = nil
		if st.Remote != nil {
			conns = []net.Conn{st.Remote}
		}
	}
	h.MPTCP = len(conns) > 0 && allMPTCP(conns)
	for _, c := range conns {
		if info, err := mptcp.GetInfo(c); err == nil {
			h.Paths = append(h.Paths, attach.ConnPaths(len(h.Subflows), c)...)
			h.Subflows = append(h.Subflows, info.TotalSubflows())
		}
	}
	if v.lastErr != nil {
		h.Message = v.lastErr.Error()
	}
	if v.relay == nil && len(conns) == 0 && !v.reconnecting {
		h.MPTCP = v.viaMPTCP
		h.Message = "connections taken over from an earlier process, held by the kernel: subflows show after the next reconnect"
	}
	if v.bounded() && h.Outage > v.opts.DeadConnTimeout {
		h.Failing = true // the kernel's dead-connection timeout, or the relay's bound
	}
	if h.Outage > 0 {
		h.Message = h.OutageMessage() + ": " + h.Message
	}
	return h, nil
}

// startWatch subscribes to LINK_DEAD once per attacher.
func (a *Attacher) startWatch() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.watch != nil {
		return nil
	}
	ctx, cancel := context.WithCancel(context.Background())
	ch, err := a.cfg.Kernel.WatchLinkDead(ctx)
	if err != nil {
		cancel()
		return fmt.Errorf("watch nbd link-dead events: %w", err)
	}
	a.watch = cancel
	go func() {
		for ev := range ch {
			a.mu.Lock()
			v := a.byIndex[ev.Index]
			a.mu.Unlock()
			if v == nil {
				continue
			}
			v.mu.Lock()
			busy := v.reconnecting
			if !busy {
				v.reconnecting, v.downSince = true, time.Now()
			}
			v.mu.Unlock()
			if !busy {
				go a.reconnect(v)
			}
		}
	}()
	return nil
}

// reconnect replaces dead connections of a device: redial, handshake,
// RECONFIGURE with the same backend identifier. The relay transport
// recovers by itself (the kernel's unix socket never dies while the relay
// lives), so LINK_DEAD there means the relay is gone.
//
// One reconnect runs per device at a time (LINK_DEAD events arriving
// meanwhile are absorbed), and it retries, with backoff, until it succeeds
// or the volume is detached: past a bounded deadConnTimeout the kernel
// fails the I/O waiting, but the device comes back when the server does.
func (a *Attacher) reconnect(v *volume) {
	defer func() {
		v.mu.Lock()
		v.reconnecting = false
		v.mu.Unlock()
	}()
	log := a.log.With("volume_id", v.target.VolumeID, "nbd_index", v.index)
	log.Warn("nbd connection dead, reconnecting")
	start := time.Now()
	pause := backoff.New(100*time.Millisecond, 5*time.Second)
	warned := false
	for attempt := 1; ; attempt++ {
		ctx, cancel := context.WithTimeout(v.life, a.cfg.DialTimeout)
		err := a.replaceSockets(ctx, v)
		cancel()
		if err == nil {
			v.mu.Lock()
			v.reconnects++
			v.lastErr = nil
			v.mu.Unlock()
			a.mu.Lock()
			if v.att.Size == 0 { // adopted while the storage node was away
				v.att.Size = v.info.Size
			}
			a.mu.Unlock()
			log.Info("nbd connection replaced", "attempts", attempt, "outage", time.Since(start))
			return
		}
		if v.life.Err() != nil {
			return
		}
		if superseded(err) {
			a.fence(v, err, log)
			return
		}
		if v.bounded() && !warned && time.Since(start) > v.opts.DeadConnTimeout {
			log.Error("the server is unreachable for longer than deadConnTimeout: I/O on the device fails until it is back", "dead_conn_timeout", v.opts.DeadConnTimeout)
			warned = true
		}
		v.mu.Lock()
		v.lastErr = err
		v.mu.Unlock()
		wait := pause.Next()
		log.Warn("reconnect failed", "error", err, "attempt", attempt, "retry_in", wait)
		if backoff.Sleep(v.life, wait) != nil {
			return
		}
	}
}

// Close stops watching; attached devices stay (they survive the process).
func (a *Attacher) Close() {
	a.mu.Lock()
	if a.watch != nil {
		a.watch()
		a.watch = nil
	}
	a.mu.Unlock()
}

// usesMPTCP reports whether the device's connections run MPTCP. Called
// with mu held or before v is shared.
func (v *volume) usesMPTCP() bool {
	if len(v.conns) == 0 {
		return v.viaMPTCP
	}
	return allMPTCP(v.conns)
}

func allMPTCP(conns []net.Conn) bool {
	for _, c := range conns {
		if !mptcp.IsMPTCP(c) {
			return false
		}
	}
	return true
}

// Resize picks up a grown export: a fresh connection learns the export's
// size, which must be at least newSize; RECONFIGURE gives it to the device.
func (a *Attacher) Resize(ctx context.Context, volumeID string, newSize uint64) (uint64, error) {
	a.mu.Lock()
	v, ok := a.vols[volumeID]
	a.mu.Unlock()
	if !ok {
		return 0, fmt.Errorf("%w: %s", attach.ErrNotAttached, volumeID)
	}
	// A connection of its own session: it must not supersede the data
	// connections.
	// It dials where the volume's own connections learned it is.
	probe := a.newVolume(v.target, v.opts, nbd.NewSessionID())
	defer probe.end()
	c, err := a.dialAny(ctx, probe)
	if err != nil {
		return 0, fmt.Errorf("resize %s: %w", volumeID, err)
	}
	c.Close()
	info := c.Info
	if info.Size < newSize {
		return 0, fmt.Errorf("resize %s: %w: the export has %d bytes, less than %d", volumeID, attach.ErrTooSmall, info.Size, newSize)
	}
	a.mu.Lock()
	cur := v.att.Size
	a.mu.Unlock()
	if info.Size != cur {
		if err := a.cfg.Kernel.Reconfigure(v.index, nbdnl.ReconfigureOptions{Size: info.Size, BackendID: volumeID}); err != nil {
			return 0, fmt.Errorf("resize nbd%d to %d bytes: %w", v.index, info.Size, err)
		}
		if err := a.cfg.Devices.WaitReady(ctx, v.index, info.Size); err != nil {
			return 0, fmt.Errorf("resize nbd%d: %w", v.index, err)
		}
		a.mu.Lock()
		v.att.Size = info.Size
		v.info.Size = info.Size
		a.mu.Unlock()
		if err := a.saveState(v); err != nil {
			a.log.Warn("save state after resize", "volume_id", volumeID, "error", err)
		}
		a.log.Info("volume resized", "volume_id", volumeID, "nbd_index", v.index, "size", info.Size)
	}
	return info.Size, nil
}
