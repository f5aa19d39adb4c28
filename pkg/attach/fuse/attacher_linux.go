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

package fuse

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/blockdev"
	"github.com/mpnbd/mpnbd/pkg/mountinfo"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// Attacher is the FUSE transport. It is safe for concurrent use; calls for
// one volume are serialized.
type Attacher struct {
	cfg Config

	mu      sync.Mutex
	servers map[string]*serverProc // the volumes' server processes
	locks   attach.VolumeLocks
}

var _ attach.Attacher = (*Attacher)(nil)

// volume is one attached volume, served by the server process it lives
// in.
// target, dir, file, client, node and att.MPTCP do not change once it is
// stored; server, dev and closed record how far teardown got (so a failed
// detach resumes there) and are only used under the volume's lock.
type volume struct {
	target attach.Target
	opts   attach.Options
	dir    string // mount point
	file   string // the export file inside it
	path   *attach.Session
	node   *exportFile
	att    attach.Attachment

	server *fuseServer
	conn   string // the FUSE connection's name under fusectl
	dev    string
	closed bool
}

// New returns an Attacher.
func New(c Config) *Attacher {
	return &Attacher{
		cfg:     c.withDefaults(),
		servers: make(map[string]*serverProc),
	}
}

// Available tells whether this node can use the transport: it needs root,
// /dev/fuse and loop devices.
func Available() error {
	if err := blockdev.LoopAvailable(); err != nil {
		return fmt.Errorf("%w: %v", attach.ErrUnsupported, err)
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		return fmt.Errorf("%w: %v", attach.ErrUnsupported, err)
	}
	return nil
}

func (a *Attacher) lock(id string) func() { return a.locks.Lock(id) }

// stateDir returns the state directory resolved through symlinks, so
// that paths in it match what the loop driver reports as a backing file.
func (a *Attacher) stateDir() string {
	state := a.cfg.StateDir
	if r, err := filepath.EvalSymlinks(state); err == nil {
		state = r
	}
	if abs, err := filepath.Abs(state); err == nil {
		state = abs
	}
	return state
}

// paths returns a volume's mount point and file.
func (a *Attacher) paths(volumeID string) (dir, file string) {
	return volumePaths(a.stateDir(), volumeID)
}

func volumePaths(stateDir, volumeID string) (dir, file string) {
	name := volumeName(volumeID)
	dir = filepath.Join(stateDir, name)
	return dir, filepath.Join(dir, name)
}

// Attach dials the export, mounts its file and attaches a loop device,
// in a server process of the volume's own.
func (a *Attacher) Attach(ctx context.Context, t attach.Target, o attach.Options) (*attach.Attachment, error) {
	if t.VolumeID == "" {
		return nil, fmt.Errorf("%w: empty volume ID", attach.ErrInvalid)
	}
	if len(t.Addrs) == 0 {
		return nil, fmt.Errorf("%w: no server address for volume %s", attach.ErrInvalid, t.VolumeID)
	}
	unlock := a.lock(t.VolumeID)
	defer unlock()
	if err := Available(); err != nil {
		return nil, err
	}
	log := a.cfg.Logger.With("volume_id", t.VolumeID, "transport", string(attach.FUSE))
	if err := os.MkdirAll(a.cfg.StateDir, 0o700); err != nil {
		return nil, fmt.Errorf("fuse: state directory: %w", err)
	}
	// A server may serve the volume already, started by this process or
	// an earlier one; else whatever an earlier attach left (a dead mount,
	// a loop device on it) is in the way and goes.
	p, lf, err := a.claim(ctx, t.VolumeID, false, log)
	if err != nil {
		return nil, err
	}
	if p != nil {
		a.mu.Lock()
		known := a.servers[t.VolumeID]
		a.servers[t.VolumeID] = p
		a.mu.Unlock()
		if known == nil || known.pid != p.pid {
			log.Info("fuse: adopted the volume's server process", "pid", p.pid, "device", p.att.Device)
		}
		att := p.att
		return &att, nil
	}
	return a.spawn(ctx, t, o, lf, log)
}

// startVolume dials the export, mounts its file at dir and attaches a
// loop device on file. On failure it undoes what it did.
func startVolume(ctx context.Context, cfg Config, t attach.Target, o attach.Options, dir, file string, log *slog.Logger) (*volume, error) {
	dp, err := attach.OpenSession(ctx, attach.SessionConfig{Logger: log}, t, o)
	if err != nil {
		return nil, dialError(t, err)
	}
	v := &volume{target: t, opts: o, dir: dir, file: file, path: dp}
	fail := func(err error) (*volume, error) {
		if terr := teardown(v, cfg.UnmountTimeout, log); terr != nil {
			log.Error("fuse: cleaning up after a failed attach", "error", terr)
		}
		if !v.closed {
			// Nothing was acknowledged to anyone who waits for it: no
			// retry will come for the session.
			v.path.Close(cfg.UnmountTimeout)
			v.closed = true
		}
		return nil, err
	}

	multipath := dp.Multipath
	if !multipath {
		log.Warn("fuse: NBD connection runs plain TCP: MPTCP fell back")
	}
	info := dp.Info
	readOnly := o.ReadOnly || info.Flags&nbd.FlagReadOnly != 0
	node := &exportFile{
		bio:       dp.Client,
		readOnly:  readOnly,
		canZero:   info.Flags&nbd.FlagSendWriteZeroes != 0,
		openFlags: cfg.openFlags(),
		mtime:     time.Now(),
		log:       log,
	}
	node.size.Store(info.Size)
	v.node = node

	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return fail(fmt.Errorf("fuse: mount point: %w", err))
	}
	// FUSE mounts on a file too, as a file.
	if st, err := os.Lstat(dir); err != nil {
		return fail(fmt.Errorf("fuse: mount point: %w", err))
	} else if !st.IsDir() {
		return fail(fmt.Errorf("fuse: mount point %s is not a directory", dir))
	}
	srv, err := mountServer(dir, node, filepath.Base(file), cfg, log)
	if err != nil {
		return fail(fmt.Errorf("fuse: mount %s: %w", dir, err))
	}
	v.server = srv
	v.conn = connName(dir)

	bs := o.BlockSize
	if bs == 0 {
		bs = attach.DefaultBlockSize
	}
	dev, err := blockdev.AttachLoop(file, blockdev.LoopOptions{
		ReadOnly:  readOnly,
		DirectIO:  !cfg.bufferedLoop,
		BlockSize: uint32(bs),
	})
	if err != nil {
		return fail(fmt.Errorf("fuse: loop device: %w", err))
	}
	v.dev = dev
	if err := blockdev.SetQueueLimits(dev, cfg.queueLimits()); err != nil {
		log.Warn("fuse: the loop device keeps its request size and readahead", "device", dev, "error", err)
	}
	if !cfg.bufferedLoop {
		if st, err := blockdev.StatLoop(dev); err == nil && !st.DirectIO {
			log.Warn("fuse: the loop device runs without direct I/O", "device", dev)
		}
	}
	size, err := blockdev.DeviceSize(dev)
	if err != nil {
		return fail(err)
	}
	v.att = attach.Attachment{
		VolumeID:  t.VolumeID,
		Transport: attach.FUSE,
		Device:    dev,
		Size:      size,
		MPTCP:     multipath,
	}
	log.Info("fuse: attached", "device", dev, "size", size, "mptcp", multipath, "file", file)
	return v, nil
}

// mountServer mounts the file system on dir and serves it. It unmounts
// again when the mount syscall worked but the file system does not come
// up.
func mountServer(dir string, node *exportFile, name string, cfg Config, log *slog.Logger) (*fuseServer, error) {
	dev, err := mountDev(dir, "mpnbd:"+name, cfg.MaxWrite)
	if err != nil {
		return nil, err
	}
	p, err := negotiate(dev, cfg.wantedInit())
	if err == nil {
		var srv *fuseServer
		if srv, err = newFuseServer(dev, p, node, name, cfg.readers(), log); err == nil {
			srv.start()
			if err = primePoll(filepath.Join(dir, name)); err == nil {
				return srv, nil
			}
			srv.stop()
		}
	}
	// Closing the descriptor ends the connection; the mount goes too,
	// even if it takes a lazy unmount.
	dev.Close()
	if uerr := unix.Unmount(dir, 0); uerr != nil {
		_ = unix.Unmount(dir, unix.MNT_DETACH)
	}
	return nil, err
}

// primePoll polls the file once, outside the runtime's poller, so that
// the kernel learns that the file system does not implement poll (the
// server answers ENOSYS) and never asks again on this connection.
// Otherwise the first os.OpenFile of the file in this process (which
// registers it with epoll) would ask while holding the poller's epoll
// lock, which the reader waiting for that very request needs: a
// deadlock.
func primePoll(file string) error {
	fd, err := unix.Open(file, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", file, err)
	}
	defer unix.Close(fd)
	if _, err := unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}, 0); err != nil {
		return fmt.Errorf("poll %s: %w", file, err)
	}
	return nil
}

// queueLimits are the loop device's request size, the largest FUSE
// request, and its readahead, four of them. The loop driver's own request
// size (1280 KiB) exceeds what FUSE takes, which splits each request in
// two; its readahead depends on the device's past (128 to 2560 KiB), and
// one request's worth kept a buffered sequential read on four 1 Gbit/s
// paths at about half the line (two or three requests in flight cover
// the round trip).
func (c Config) queueLimits() blockdev.QueueLimits {
	kb := uint32(c.MaxWrite >> 10)
	return blockdev.QueueLimits{MaxSectorsKB: kb, ReadAheadKB: readaheadRequests * kb}
}

// readaheadRequests is the loop device's readahead in FUSE requests.
const readaheadRequests = 4

// readers is how many requests a volume's server takes at once: every
// asynchronous one the kernel may have in flight, and a few synchronous.
func (c Config) readers() int { return c.MaxBackground + 4 }

func dialError(t attach.Target, err error) error {
	if errors.Is(err, attach.ErrServerRefused) {
		return fmt.Errorf("volume %s: %w", t.VolumeID, err)
	}
	if errors.Is(err, nbd.ErrUnknownExport) || errors.Is(err, nbd.ErrAccessDenied) {
		return fmt.Errorf("%w: volume %s: %w", attach.ErrServerRefused, t.VolumeID, err)
	}
	return fmt.Errorf("fuse: connect volume %s to %v: %w", t.VolumeID, t.Addrs, err)
}

func (c Config) openFlags() uint32 {
	if c.cachedFile {
		return 0
	}
	// The loop device has its own page cache; the file's would hold every
	// block a second time. Parallel direct writes spare the inode lock.
	return fopenDirectIO | fopenParallelDirectWrites
}

// Detach removes the loop device, unmounts the file system and closes the
// connection, through the volume's server process, and waits for that
// process to exit. What a dead server process left of the volume (a
// mount, a loop device, its files) is cleaned up as well; nothing found
// is fine.
func (a *Attacher) Detach(ctx context.Context, volumeID string) error {
	if volumeID == "" {
		return fmt.Errorf("%w: empty volume ID", attach.ErrInvalid)
	}
	unlock := a.lock(volumeID)
	defer unlock()
	log := a.cfg.Logger.With("volume_id", volumeID, "transport", string(attach.FUSE))
	return a.detachServer(ctx, volumeID, log)
}

// teardown undoes whatever of an attach is in place, last step first.
// timeout bounds the waits for the loop device and the mount to let go.
func teardown(v *volume, timeout time.Duration, log *slog.Logger) error {
	if v.server != nil {
		// Every loop device on our file, not just v.dev: after an
		// autoclear the number may already belong to someone else.
		if err := retryBusy(timeout, func() error { return detachLoops(v.file, v.conn) }); err != nil {
			return err
		}
		v.dev = ""
		if err := unmount(v.server, v.dir, v.conn, timeout, log); err != nil {
			return err
		}
		v.server = nil
	}
	// Rmdir, not Remove: whatever else sits there is not ours.
	if err := unix.Rmdir(v.dir); err != nil && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.ENOTDIR) {
		log.Warn("fuse: removing mount point", "dir", v.dir, "error", err)
	}
	if !v.closed {
		if v.node != nil && !v.node.readOnly {
			// Writes nobody fsync'ed (a raw device closed without a flush),
			// and every write the session retains, become durable before
			// the connection goes. With the storage node away the detach
			// fails here, the session kept and redialing: a later try
			// (the steps above done already) flushes them. Dropped, they
			// would be lost for good should the node have lost its cache.
			ctx, cancel := context.WithTimeout(context.Background(), timeout)
			err := v.path.Drain(ctx)
			cancel()
			if err != nil {
				return fmt.Errorf("fuse: detach %s: %w", v.target.VolumeID, err)
			}
		}
		v.path.Close(timeout)
		v.closed = true
	}
	return nil
}

// detachLoops detaches every loop device on the volume's file: found by
// its path, and, where the FUSE connection conn is known, by the file's
// device and inode (a server that took the volume over from another
// mount namespace does not see the mount the loop device was set up on).
func detachLoops(file, conn string) error {
	devs, err := blockdev.FindLoopByBackingFile(file)
	if err != nil {
		return err
	}
	if devs, err = ownLoops(devs); err != nil {
		return err
	}
	if minor, perr := strconv.ParseUint(conn, 10, 32); conn != "" && perr == nil {
		more, err := blockdev.FindLoopByBackingInode(unix.Mkdev(0, uint32(minor)), fileNode)
		if err != nil {
			return err
		}
		for _, d := range more {
			if !slices.Contains(devs, d) {
				devs = append(devs, d)
			}
		}
	}
	for _, d := range devs {
		if err := blockdev.DetachLoop(d); err != nil {
			return fmt.Errorf("loop device %s: %w", d, err)
		}
	}
	return nil
}

// ownLoops keeps the loop devices whose backing file lies on a file
// system mounted in this mount namespace. The kernel names a backing file
// by its path in the mount namespace that bound it, so a loop device of
// another mount namespace (another node, where several share one host's
// kernel, as test clusters do) can show the very path of ours; it is not
// ours to detach. A device that cannot be asked (unbound meanwhile) is
// kept: detaching it is then a no-op.
func ownLoops(devs []string) ([]string, error) {
	var own []string
	for _, d := range devs {
		st, err := blockdev.StatLoop(d)
		if err != nil {
			own = append(own, d)
			continue
		}
		ok, err := mountinfo.HasDevice(int(unix.Major(st.BackingDevice)), int(unix.Minor(st.BackingDevice)))
		if err != nil {
			return nil, err
		}
		if ok {
			own = append(own, d)
		}
	}
	return own, nil
}

// retryBusy calls f until it does not fail with ErrLoopBusy or timeout
// has passed. A file system unmounted from the device a moment ago can
// keep it claimed while another mount namespace still holds a copy of the
// mount, e.g. one made by a concurrent `ip netns exec`.
func retryBusy(timeout time.Duration, f func() error) error {
	deadline := time.Now().Add(timeout)
	for {
		err := f()
		if !errors.Is(err, blockdev.ErrLoopBusy) || time.Now().After(deadline) {
			return err
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// unmount unmounts a FUSE server of ours and waits for it to stop.
//
// A mount namespace created while the file system was mounted (unshare,
// `ip netns exec`, a container) holds a copy of the mount that our umount
// does not remove; the kernel then keeps the FUSE connection, and the
// server, alive as long as that namespace lives. The file is no longer in
// use by then (the loop device let go of it), so the connection is
// aborted through fusectl.
func unmount(srv *fuseServer, dir, conn string, timeout time.Duration, log *slog.Logger) error {
	done := make(chan error, 1)
	go func() { done <- unmountRetry(srv, dir, timeout) }()
	select {
	case err := <-done:
		return err
	case <-time.After(timeout):
	}
	if m, err := isMountPoint(dir); err != nil || m {
		return <-done // still retrying a busy mount; it gives up soon
	}
	log.Warn("fuse: unmounted, but another mount namespace still holds the file system; aborting the FUSE connection", "dir", dir, "conn", conn)
	if err := abortConn(conn); err != nil {
		return fmt.Errorf("unmount %s: the FUSE connection outlives the mount and cannot be aborted: %w", dir, err)
	}
	select {
	case err := <-done:
		return err
	case <-time.After(timeout):
		return fmt.Errorf("unmount %s: the FUSE server did not stop after its connection was aborted", dir)
	}
}

// unmountRetry retries while the kernel still holds the file (a loop
// device being released).
func unmountRetry(srv *fuseServer, dir string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		err := srv.unmount(dir)
		if err == nil {
			return nil
		}
		if m, merr := isMountPoint(dir); merr == nil && !m {
			return nil // unmounted behind our back
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("unmount %s: %w", dir, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

const fusectlDir = "/sys/fs/fuse/connections"

// connName returns the name fusectl gives the FUSE connection mounted at
// dir: its anonymous device's minor number.
func connName(dir string) string {
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil || unix.Major(st.Dev) != 0 {
		return ""
	}
	return strconv.FormatUint(uint64(unix.Minor(st.Dev)), 10)
}

// abortConn aborts a FUSE connection, mounting fusectl if needed.
func abortConn(conn string) error {
	if conn == "" {
		return errors.New("unknown FUSE connection")
	}
	p := filepath.Join(fusectlDir, conn, "abort")
	if _, err := os.Stat(p); errors.Is(err, os.ErrNotExist) {
		if err := unix.Mount("fusectl", fusectlDir, "fusectl", 0, ""); err != nil && !errors.Is(err, unix.EBUSY) {
			return fmt.Errorf("mount fusectl: %w", err)
		}
	}
	return os.WriteFile(p, []byte("1"), 0)
}

// cleanup removes what an attach of the volume left on this node without
// an Attacher that knows it: loop devices on its file, the mount (whose
// server may be dead) and the mount point.
func cleanup(dir, file string, log *slog.Logger) error {
	if err := detachLoops(file, ""); err != nil {
		return err
	}
	m, err := isMountPoint(dir)
	if err != nil {
		return err
	}
	if m {
		log.Info("fuse: unmounting a stale mount", "dir", dir)
		if err := unix.Unmount(dir, 0); err != nil && !errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("unmount %s: %w", dir, err)
		}
	}
	if err := unix.Rmdir(dir); err != nil && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.ENOTDIR) {
		return fmt.Errorf("remove %s: %w", dir, err)
	}
	return nil
}

// isMountPoint reports whether dir is a mount point of this mount
// namespace (a dead FUSE mount cannot be stat'ed, so mountinfo it is).
func isMountPoint(dir string) (bool, error) {
	m, err := mountinfo.At(dir)
	return m != nil, err
}

// Health reports whether the volume's connections are up, whether they run
// MPTCP and their subflows. A volume whose server process is gone or does
// not answer is reported as not connected.
func (a *Attacher) Health(volumeID string) (attach.Health, error) {
	return a.serverHealth(volumeID)
}

func (v *volume) health() attach.Health {
	st := v.path.Relay.Stats()
	h := attach.SessionHealth(st)
	h.MPTCP = v.att.MPTCP
	var msgs []string
	if !st.Connected {
		msgs = append(msgs, h.OutageMessage())
	} else if st.Remote != nil && nbd.IsMultipathTCP(st.Remote) {
		if info, err := mptcp.GetInfo(st.Remote); err != nil {
			msgs = append(msgs, err.Error())
			h.Subflows = append(h.Subflows, 0)
		} else {
			h.Subflows = append(h.Subflows, info.TotalSubflows())
			h.Paths = attach.ConnPaths(0, st.Remote)
		}
	}
	if p := v.node.lastErr.Load(); p != nil {
		h.Connected = false
		msgs = append(msgs, (*p).Error())
	}
	if !v.att.MPTCP {
		msgs = append(msgs, "MPTCP fell back to TCP")
	}
	h.Message = strings.Join(msgs, "; ")
	return h
}

// Resize picks up a grown export: it asks the server for the export's
// size on a fresh connection, which must be at least newSize, updates the
// file and the loop device, and returns the device's new size.
func (a *Attacher) Resize(ctx context.Context, volumeID string, newSize uint64) (uint64, error) {
	unlock := a.lock(volumeID)
	defer unlock()
	return a.serverResize(ctx, volumeID, newSize)
}

// resize is Resize in the volume's server process; the caller records
// the new size in v.att.
func (v *volume) resize(ctx context.Context, cfg Config, newSize uint64) (uint64, error) {
	volumeID := v.target.VolumeID
	size, err := v.path.ProbeSize(ctx, v.target)
	if err != nil {
		return 0, dialError(v.target, err)
	}
	if size < newSize {
		return 0, fmt.Errorf("fuse: resize volume %s: %w: the export has %d bytes, less than %d", volumeID, attach.ErrTooSmall, size, newSize)
	}
	if size != v.node.size.Load() {
		v.node.size.Store(size)
		// Drop the kernel's cached attributes, then look again so the
		// inode's size, which the loop driver reads, is the new one.
		if err := v.server.invalidateAttr(); err != nil {
			return 0, fmt.Errorf("fuse: resize volume %s: invalidate attributes: %w", volumeID, err)
		}
		st, err := os.Stat(v.file)
		if err != nil {
			return 0, fmt.Errorf("fuse: resize volume %s: %w", volumeID, err)
		}
		if uint64(st.Size()) != size {
			return 0, fmt.Errorf("fuse: resize volume %s: file size %d after update, want %d", volumeID, st.Size(), size)
		}
	}
	if err := blockdev.LoopSetCapacity(v.dev); err != nil {
		return 0, fmt.Errorf("fuse: resize volume %s: %w", volumeID, err)
	}
	return blockdev.DeviceSize(v.dev)
}
