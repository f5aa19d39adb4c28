// Package nbddev attaches exports as /dev/nbdX through the kernel's NBD
// generic-netlink family, by the kernel, relay, multiconn and tcp
// transports. Every attach sets the volume ID as backend identifier,
// destroy-on-disconnect, a dead-connection timeout and a request timeout;
// a LINK_DEAD watcher redials and hands the kernel new sockets with
// RECONFIGURE, and a fresh process re-adopts devices by their identifier.
package nbddev

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"time"

	"github.com/mpnbd/mpnbd/pkg/attach"
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
	// DialContext dials with d; nil means d.DialContext. Tests use it to
	// dial from another network namespace.
	DialContext func(ctx context.Context, d *net.Dialer, network, addr string) (net.Conn, error)
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
	target attach.Target
	opts   attach.Options
	att    attach.Attachment
	index  uint32
	info   nbd.ExportInfo

	mu         sync.Mutex
	conns      []net.Conn // our handles on the data sockets (for MPTCP_INFO)
	relay      *relay.Relay
	stopRelay  context.CancelFunc
	relayDone  chan struct{}
	reconnects int
	lastErr    error
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
	if cfg.DialContext == nil {
		cfg.DialContext = func(ctx context.Context, d *net.Dialer, network, addr string) (net.Conn, error) {
			return d.DialContext(ctx, network, addr)
		}
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
	if o.RequestTimeout == 0 {
		o.RequestTimeout = attach.DefaultRequestTimeout
	}
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

func (a *Attacher) connect(ctx context.Context, t attach.Target, o attach.Options) (_ *attach.Attachment, err error) {
	v := &volume{target: t, opts: o}
	socks, err := a.dialAll(ctx, v)
	if err != nil {
		return nil, err
	}
	defer closeFiles(socks)
	defer func() {
		if err != nil {
			v.shutdown()
		}
	}()
	flags := nbdnl.DestroyOnDisconnect
	idx, err := a.cfg.Kernel.Connect(nbdnl.ConnectOptions{
		Sockets:         socks,
		Size:            v.info.Size,
		BlockSize:       o.BlockSize,
		Timeout:         o.RequestTimeout,
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

// handOver dials fresh connections for t and gives them to device idx
// with RECONFIGURE and the same backend identifier. On failure everything
// it opened is closed again.
func (a *Attacher) handOver(ctx context.Context, t attach.Target, o attach.Options, idx uint32) (*volume, error) {
	v := &volume{target: t, opts: o, index: idx}
	socks, err := a.dialAll(ctx, v)
	if err != nil {
		return nil, err
	}
	defer closeFiles(socks)
	if err := a.cfg.Kernel.Reconfigure(idx, nbdnl.ReconfigureOptions{Sockets: socks, BackendID: t.VolumeID}); err != nil {
		v.shutdown()
		return nil, err
	}
	return v, nil
}

func (a *Attacher) register(v *volume) {
	v.att = attach.Attachment{
		VolumeID:  v.target.VolumeID,
		Transport: a.cfg.Mode,
		Device:    nbdnl.DevicePath(v.index),
		Size:      v.info.Size,
		MPTCP:     len(v.conns) > 0 && allMPTCP(v.conns),
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
	t := v.target
	var conns []net.Conn
	fail := func(err error) ([]*os.File, error) {
		for _, c := range conns {
			c.Close()
		}
		return nil, err
	}
	switch a.cfg.Mode {
	case attach.MultiConn:
		for i, addr := range t.Addrs {
			local := ""
			if i < len(t.LocalAddrs) {
				local = t.LocalAddrs[i]
			}
			c, info, err := a.dial(ctx, t, addr, local, false)
			if err != nil {
				return fail(err)
			}
			conns = append(conns, c)
			v.info = info
		}
		if len(conns) > 1 && v.info.Flags&nbd.FlagCanMultiConn == 0 {
			return fail(fmt.Errorf("%w: multiconn needs a server that allows several connections", attach.ErrUnsupported))
		}
	default:
		c, info, err := a.dial(ctx, t, t.Addrs[0], "", a.usesMPTCP())
		if err != nil {
			return fail(err)
		}
		conns = append(conns, c)
		v.info = info
	}
	v.conns = conns

	if a.cfg.Mode == attach.Relay {
		kernelEnd, relayEnd, err := relay.NewSocketPair()
		if err != nil {
			return fail(err)
		}
		v.startRelay(a, relayEnd, conns[0])
		return []*os.File{kernelEnd}, nil
	}
	files := make([]*os.File, 0, len(conns))
	for _, c := range conns {
		f, err := c.(*net.TCPConn).File()
		if err != nil {
			closeFiles(files)
			return fail(err)
		}
		files = append(files, f)
	}
	return files, nil
}

// dial connects one data connection and runs the handshake on it.
func (a *Attacher) dial(ctx context.Context, t attach.Target, addr, local string, useMPTCP bool) (net.Conn, nbd.ExportInfo, error) {
	ctx, cancel := context.WithTimeout(ctx, a.cfg.DialTimeout)
	defer cancel()
	d := mptcp.Dialer(useMPTCP)
	if local != "" {
		la, err := net.ResolveTCPAddr("tcp", net.JoinHostPort(local, "0"))
		if err != nil {
			return nil, nbd.ExportInfo{}, fmt.Errorf("%w: local address %q: %v", attach.ErrInvalid, local, err)
		}
		d.LocalAddr = la
	}
	c, err := a.cfg.DialContext(ctx, d, "tcp", addr)
	if err != nil {
		return nil, nbd.ExportInfo{}, fmt.Errorf("dial %s: %w", addr, err)
	}
	if useMPTCP && !mptcp.IsMPTCP(c) {
		a.log.Warn("MPTCP requested but the connection fell back to TCP", "volume_id", t.VolumeID, "remote", addr)
	}
	info, err := nbd.NegotiateConn(ctx, c, t.Export)
	if err != nil {
		c.Close()
		if errors.Is(err, nbd.ErrUnknownExport) || errors.Is(err, nbd.ErrAccessDenied) {
			return nil, nbd.ExportInfo{}, fmt.Errorf("%w: %v", attach.ErrServerRefused, err)
		}
		return nil, nbd.ExportInfo{}, fmt.Errorf("handshake with %s: %w", addr, err)
	}
	return c, info, nil
}

func (v *volume) startRelay(a *Attacher, local, remote net.Conn) {
	ctx, cancel := context.WithCancel(context.Background())
	redial := func(ctx context.Context) (net.Conn, error) {
		c, _, err := a.dial(ctx, v.target, v.target.Addrs[0], "", true)
		if err == nil {
			v.mu.Lock()
			v.conns = []net.Conn{c}
			v.reconnects++
			v.mu.Unlock()
		}
		return c, err
	}
	r := relay.New(local, remote, redial, relay.Options{Logger: a.log.With("volume_id", v.target.VolumeID)})
	v.relay, v.stopRelay, v.relayDone = r, cancel, make(chan struct{})
	go func() {
		defer close(v.relayDone)
		if err := r.Run(ctx); err != nil && !errors.Is(err, context.Canceled) {
			a.log.Error("relay stopped", "volume_id", v.target.VolumeID, "error", err)
			v.mu.Lock()
			v.lastErr = err
			v.mu.Unlock()
		}
	}()
}

// shutdown stops the relay and closes our socket handles.
func (v *volume) shutdown() {
	if v.stopRelay != nil {
		v.stopRelay()
		<-v.relayDone
	}
	v.mu.Lock()
	for _, c := range v.conns {
		c.Close()
	}
	v.conns = nil
	v.mu.Unlock()
}

// Detach disconnects the volume's device. Unknown volumes succeed.
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
	if err := a.cfg.Kernel.Disconnect(v.index); err != nil {
		return fmt.Errorf("disconnect nbd%d: %w", v.index, err)
	}
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
	h := attach.Health{Connected: len(v.conns) > 0, Reconnects: v.reconnects}
	if v.relay != nil {
		st := v.relay.Stats()
		h.Connected = st.Connected
	}
	h.MPTCP = len(v.conns) > 0 && allMPTCP(v.conns)
	for _, c := range v.conns {
		if info, err := mptcp.GetInfo(c); err == nil {
			h.Subflows = append(h.Subflows, info.TotalSubflows())
		}
	}
	if v.lastErr != nil {
		h.Message = v.lastErr.Error()
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
			go a.reconnect(v)
		}
	}()
	return nil
}

// reconnect replaces dead connections of a device: redial, handshake,
// RECONFIGURE with the same backend identifier. The relay transport
// recovers by itself (the kernel's unix socket never dies while the relay
// lives), so LINK_DEAD there means the relay is gone.
func (a *Attacher) reconnect(v *volume) {
	log := a.log.With("volume_id", v.target.VolumeID, "nbd_index", v.index)
	log.Warn("nbd connection dead, reconnecting")
	backoff := 100 * time.Millisecond
	deadline := time.Now().Add(v.opts.DeadConnTimeout)
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), a.cfg.DialTimeout)
		nv, err := a.handOver(ctx, v.target, v.opts, v.index)
		cancel()
		if err == nil {
			v.mu.Lock()
			old := v.conns
			v.conns = nv.conns
			v.reconnects++
			if nv.relay != nil {
				v.relay, v.stopRelay, v.relayDone = nv.relay, nv.stopRelay, nv.relayDone
			}
			v.mu.Unlock()
			for _, c := range old {
				c.Close()
			}
			log.Info("nbd connection replaced")
			return
		}
		log.Warn("reconnect failed", "error", err, "retry_in", backoff)
		time.Sleep(backoff)
		backoff = min(2*backoff, 5*time.Second)
	}
	log.Error("gave up reconnecting: I/O on the device will fail")
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

func allMPTCP(conns []net.Conn) bool {
	for _, c := range conns {
		if !mptcp.IsMPTCP(c) {
			return false
		}
	}
	return true
}

func closeFiles(fs []*os.File) {
	for _, f := range fs {
		f.Close()
	}
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
	c, info, err := a.dial(ctx, v.target, v.target.Addrs[0], "", a.usesMPTCP())
	if err != nil {
		return 0, fmt.Errorf("resize %s: %w", volumeID, err)
	}
	c.Close()
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
