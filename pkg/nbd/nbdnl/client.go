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

package nbdnl

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/bits"
	"os"
	"runtime"
	"slices"
	"syscall"
	"time"

	"github.com/mdlayher/genetlink"
	"github.com/mdlayher/netlink"
)

// DefaultBlockSize is the block size Connect uses when none is given.
const DefaultBlockSize = 4096

// A Client talks to the kernel's NBD generic netlink family. Its methods may
// be called from several goroutines.
type Client struct {
	c      *genetlink.Conn
	family genetlink.Family

	// dialWatch opens the connection WatchLinkDead listens on.
	dialWatch func() (*genetlink.Conn, error)
	// sys is read to tell the causes of an EINVAL answer apart.
	sys Sysfs
}

// Dial opens a generic netlink socket and resolves the "nbd" family. It
// fails with an error wrapping ErrFamilyNotFound when the driver is not
// loaded or the family is not visible from the caller's network namespace.
func Dial() (*Client, error) {
	c, err := genetlink.Dial(nil)
	if err != nil {
		return nil, fmt.Errorf("nbdnl: dial generic netlink: %w", err)
	}
	cl, err := newClient(c)
	if err != nil {
		_ = c.Close()
		return nil, err
	}
	cl.dialWatch = func() (*genetlink.Conn, error) { return genetlink.Dial(nil) }
	return cl, nil
}

// newClient resolves the family on c and wraps c in a Client.
func newClient(c *genetlink.Conn) (*Client, error) {
	f, err := c.GetFamily(familyName)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, familyNotFound(defaultSysRoot, err)
		}
		return nil, fmt.Errorf("nbdnl: get family %q: %w", familyName, err)
	}
	return &Client{
		c:      c,
		family: f,
		dialWatch: func() (*genetlink.Conn, error) {
			return nil, errors.New("nbdnl: no connection for watching link-dead events")
		},
	}, nil
}

// Close closes the netlink socket. Devices stay as they are.
func (c *Client) Close() error {
	return c.c.Close()
}

// ConnectOptions configures Connect. Zero values of the optional fields are
// not sent, so the kernel's defaults apply.
type ConnectOptions struct {
	// Index selects /dev/nbd<Index>; the device is created if missing. Nil
	// lets the kernel pick the first unconfigured device, or create one.
	Index *uint32

	// Sockets are connected sockets that finished the NBD handshake, one per
	// connection. The kernel takes its own reference to each; the caller
	// may close its files once Connect returns. More than one needs
	// NBD_FLAG_CAN_MULTI_CONN in ServerFlags.
	Sockets []*os.File

	// Size is the export size in bytes; always sent.
	Size uint64
	// BlockSize is the logical block size: a power of two, at least 512 and
	// at most the kernel's limit (the page size on older kernels). 0 means
	// DefaultBlockSize.
	BlockSize uint64

	// Timeout is the I/O timeout, rounded up to whole seconds. 0 is not
	// sent and the kernel's default applies.
	Timeout time.Duration
	// DeadConnTimeout is how long I/O waits for Reconfigure to replace a
	// dead connection before failing, rounded up to whole seconds. 0 is not
	// sent: I/O on a device without a live connection fails at once.
	DeadConnTimeout time.Duration

	// ServerFlags are the NBD transmission flags the server announced
	// (nbd.Flag*, widened to 64 bits). 0 is not sent.
	ServerFlags uint64
	// ClientFlags are NBD_CFLAG_* bits. 0 is not sent.
	ClientFlags ClientFlags

	// BackendID is stored as NBD_ATTR_BACKEND_IDENTIFIER and shows in
	// /sys/block/nbdN/backend; Reconfigure then has to repeat it. "" is not
	// sent.
	BackendID string
}

// Connect configures a device with o and starts it. It returns the device's
// index (/dev/nbd<index>).
//
// Errors: ErrBusy when the device is in use, ErrUnsupportedSocket when the
// kernel refuses an MPTCP socket (see its doc for the rule), otherwise the
// kernel's errno (EPERM without CAP_SYS_ADMIN, EINVAL, EBADF, ENOTSOCK...).
func (c *Client) Connect(o ConnectOptions) (uint32, error) {
	op := "connect"
	if o.Index != nil {
		op = fmt.Sprintf("connect nbd%d", *o.Index)
	}
	if err := o.validate(); err != nil {
		return 0, opError(op, nil, err)
	}
	fds, err := socketFDs(o.Sockets)
	if err != nil {
		return 0, opError(op, nil, err)
	}
	bs := o.BlockSize
	if bs == 0 {
		bs = DefaultBlockSize
	}

	ae := netlink.NewAttributeEncoder()
	if o.Index != nil {
		ae.Uint32(attrIndex, *o.Index)
	}
	ae.Uint64(attrSizeBytes, o.Size)
	ae.Uint64(attrBlockSizeBytes, bs)
	if o.Timeout > 0 {
		ae.Uint64(attrTimeout, seconds(o.Timeout))
	}
	if o.ServerFlags != 0 {
		ae.Uint64(attrServerFlags, o.ServerFlags)
	}
	if o.ClientFlags != 0 {
		ae.Uint64(attrClientFlags, uint64(o.ClientFlags))
	}
	ae.Nested(attrSockets, encodeSockets(fds))
	if o.DeadConnTimeout > 0 {
		ae.Uint64(attrDeadConnTimeout, seconds(o.DeadConnTimeout))
	}
	if o.BackendID != "" {
		ae.String(attrBackendIdentifier, o.BackendID)
	}

	// CONNECT answers with a message of its own (or an error), so no ACK is
	// asked for: it would arrive as a second datagram after the reply.
	msgs, err := c.execute(cmdConnect, ae, netlink.Request)
	runtime.KeepAlive(o.Sockets)
	if err != nil {
		return 0, opError(op, c.classifyConnect(o, err), err)
	}
	for _, m := range msgs {
		if index, err := decodeIndex(m.Data); err == nil {
			return index, nil
		}
	}
	return 0, opError(op, nil, errors.New("reply carries no device index"))
}

func (o *ConnectOptions) validate() error {
	if len(o.Sockets) == 0 {
		return fmt.Errorf("no socket: %w", syscall.EINVAL)
	}
	if len(o.Sockets) > 1 && o.ServerFlags&flagCanMultiConn == 0 {
		return fmt.Errorf("%d sockets but the server flags lack NBD_FLAG_CAN_MULTI_CONN: %w",
			len(o.Sockets), syscall.EINVAL)
	}
	if bs := o.BlockSize; bs != 0 && (bs < 512 || bits.OnesCount64(bs) != 1) {
		return fmt.Errorf("block size %d is not a power of two of at least 512: %w", bs, syscall.EINVAL)
	}
	if o.Timeout < 0 || o.DeadConnTimeout < 0 {
		return fmt.Errorf("negative timeout: %w", syscall.EINVAL)
	}
	return nil
}

func (c *Client) classifyConnect(o ConnectOptions, err error) error {
	switch errnoOf(err) {
	case syscall.EBUSY, syscall.EEXIST:
		return ErrBusy
	case syscall.EINVAL:
		if anyMPTCP(o.Sockets) {
			return ErrUnsupportedSocket
		}
	}
	return nil
}

// Disconnect disconnects device index: the kernel sends NBD_CMD_DISC on every
// connection and shuts the sockets down. A device that exists but is not
// connected is left alone without error. ErrNotFound (wrapping EINVAL) when
// no device has the index.
func (c *Client) Disconnect(index uint32) error {
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(attrIndex, index)
	if _, err := c.execute(cmdDisconnect, ae, netlink.Request|netlink.Acknowledge); err != nil {
		var kind error
		if errnoOf(err) == syscall.EINVAL {
			// The index is always sent, so EINVAL means no device has it
			// (or it is being removed right now).
			kind = ErrNotFound
		}
		return opError(fmt.Sprintf("disconnect nbd%d", index), kind, err)
	}
	return nil
}

// ReconfigureOptions configures Reconfigure. Nil and zero fields are not
// sent and leave the device as it is.
type ReconfigureOptions struct {
	// Sockets replace dead connections, one dead slot each. The kernel
	// silently ignores sockets once no slot is dead.
	Sockets []*os.File
	// Size, when not 0, resizes the device to Size bytes.
	Size uint64
	// Timeout and DeadConnTimeout, when set, replace the device's values
	// (rounded up to whole seconds; 0 turns the timeout off).
	Timeout         *time.Duration
	DeadConnTimeout *time.Duration
	// ClientFlags, when set, replaces all client flags: a bit not set is
	// cleared.
	ClientFlags *ClientFlags
	// BackendID must repeat the identifier the device was connected with,
	// if it was connected with one.
	BackendID string
}

// Reconfigure changes a connected device; mostly it hands the kernel new
// sockets for connections that died (see WatchLinkDead).
//
// Errors: ErrNotFound when no device has the index or it is not connected,
// ErrBackendMismatch when BackendID is not the device's, ErrUnsupportedSocket
// when the kernel refuses an MPTCP socket, otherwise the kernel's errno.
// After an EINVAL the client asks STATUS and reads
// /sys/block/nbd<index>/backend to tell these apart.
func (c *Client) Reconfigure(index uint32, o ReconfigureOptions) error {
	op := fmt.Sprintf("reconfigure nbd%d", index)
	if (o.Timeout != nil && *o.Timeout < 0) || (o.DeadConnTimeout != nil && *o.DeadConnTimeout < 0) {
		return opError(op, nil, fmt.Errorf("negative timeout: %w", syscall.EINVAL))
	}
	fds, err := socketFDs(o.Sockets)
	if err != nil {
		return opError(op, nil, err)
	}

	ae := netlink.NewAttributeEncoder()
	ae.Uint32(attrIndex, index)
	if o.Size != 0 {
		ae.Uint64(attrSizeBytes, o.Size)
	}
	if o.Timeout != nil {
		ae.Uint64(attrTimeout, seconds(*o.Timeout))
	}
	if o.ClientFlags != nil {
		ae.Uint64(attrClientFlags, uint64(*o.ClientFlags))
	}
	if len(fds) > 0 {
		ae.Nested(attrSockets, encodeSockets(fds))
	}
	if o.DeadConnTimeout != nil {
		ae.Uint64(attrDeadConnTimeout, seconds(*o.DeadConnTimeout))
	}
	if o.BackendID != "" {
		ae.String(attrBackendIdentifier, o.BackendID)
	}

	_, err = c.execute(cmdReconfigure, ae, netlink.Request|netlink.Acknowledge)
	runtime.KeepAlive(o.Sockets)
	if err != nil {
		return opError(op, c.classifyReconfigure(index, o, err), err)
	}
	return nil
}

// classifyReconfigure names the cause of a failed RECONFIGURE. The kernel
// answers EINVAL for a missing or unconfigured device, a backend mismatch,
// and a refused socket alike; they are checked in the kernel's order.
func (c *Client) classifyReconfigure(index uint32, o ReconfigureOptions, err error) error {
	if errnoOf(err) != syscall.EINVAL {
		return nil
	}
	if st, serr := c.Status(index); errors.Is(serr, ErrNotFound) || (serr == nil && !st.Connected) {
		return ErrNotFound
	}
	if backend, berr := c.sys.Backend(index); berr == nil {
		if backend != "" && backend != o.BackendID {
			return ErrBackendMismatch
		}
	} else if o.BackendID != "" && !anyMPTCP(o.Sockets) {
		// The identifier cannot be read back; a refused identifier is the
		// likely cause.
		return ErrBackendMismatch
	}
	if anyMPTCP(o.Sockets) {
		return ErrUnsupportedSocket
	}
	return nil
}

// Status reports device index. ErrNotFound when no device has the index.
func (c *Client) Status(index uint32) (DeviceStatus, error) {
	op := fmt.Sprintf("status nbd%d", index)
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(attrIndex, index)
	devs, err := c.status(ae)
	if err != nil {
		return DeviceStatus{}, opError(op, nil, err)
	}
	// The kernel reads the index as an int and lists every device for -1,
	// so pick the entry rather than trusting the list's length.
	for _, d := range devs {
		if d.Index == index {
			return d, nil
		}
	}
	return DeviceStatus{}, fmt.Errorf("nbdnl: %s: %w", op, ErrNotFound)
}

// StatusAll reports every nbd device, ordered by index.
func (c *Client) StatusAll() ([]DeviceStatus, error) {
	devs, err := c.status(netlink.NewAttributeEncoder())
	if err != nil {
		return nil, opError("status", nil, err)
	}
	slices.SortFunc(devs, func(a, b DeviceStatus) int { return cmp.Compare(a.Index, b.Index) })
	return devs, nil
}

func (c *Client) status(ae *netlink.AttributeEncoder) ([]DeviceStatus, error) {
	msgs, err := c.execute(cmdStatus, ae, netlink.Request)
	if err != nil {
		return nil, err
	}
	var devs []DeviceStatus
	for _, m := range msgs {
		d, err := decodeStatus(m.Data)
		if err != nil {
			return nil, err
		}
		devs = append(devs, d...)
	}
	return devs, nil
}

// WatchLinkDead reports NBD_CMD_LINK_DEAD events until ctx ends, then closes
// the channel. It listens on a connection of its own, joined to the
// "nbd_mc_group" multicast group. The kernel sends these events to the
// initial network namespace only. Events that arrive while the receiver
// lags behind may be dropped by the kernel; callers that must not miss a
// dead link should also poll Status.
func (c *Client) WatchLinkDead(ctx context.Context) (<-chan LinkDead, error) {
	var group uint32
	found := false
	for _, g := range c.family.Groups {
		if g.Name == mcastGroup {
			group, found = g.ID, true
		}
	}
	if !found {
		return nil, fmt.Errorf("nbdnl: watch link-dead: family has no multicast group %q", mcastGroup)
	}
	wc, err := c.dialWatch()
	if err != nil {
		return nil, fmt.Errorf("nbdnl: watch link-dead: %w", err)
	}
	if err := wc.JoinGroup(group); err != nil {
		_ = wc.Close()
		return nil, fmt.Errorf("nbdnl: watch link-dead: join group %q: %w", mcastGroup, err)
	}

	ch := make(chan LinkDead, 16)
	stop := context.AfterFunc(ctx, func() { _ = wc.Close() })
	go func() {
		defer close(ch)
		defer func() {
			if stop() {
				_ = wc.Close()
			}
		}()
		for {
			msgs, _, err := wc.Receive()
			if err != nil {
				if ctx.Err() == nil && errors.Is(err, syscall.ENOBUFS) {
					continue // the socket overflowed; events were lost
				}
				return
			}
			for _, m := range msgs {
				if m.Header.Command != cmdLinkDead {
					continue
				}
				ev, err := decodeLinkDead(m.Data)
				if err != nil {
					continue
				}
				select {
				case ch <- ev:
				case <-ctx.Done():
					return
				}
			}
		}
	}()
	return ch, nil
}

func (c *Client) execute(cmd uint8, ae *netlink.AttributeEncoder, flags netlink.HeaderFlags) ([]genetlink.Message, error) {
	b, err := ae.Encode()
	if err != nil {
		return nil, err
	}
	return c.c.Execute(genetlink.Message{
		Header: genetlink.Header{Command: cmd, Version: familyVersion},
		Data:   b,
	}, c.family.ID, flags)
}

// encodeSockets encodes NBD_ATTR_SOCKETS' content: one NBD_SOCK_ITEM holding
// an NBD_SOCK_FD per socket.
func encodeSockets(fds []uint32) func(*netlink.AttributeEncoder) error {
	return func(ae *netlink.AttributeEncoder) error {
		for _, fd := range fds {
			ae.Nested(attrSockItem, func(iae *netlink.AttributeEncoder) error {
				iae.Uint32(attrSockFD, fd)
				return nil
			})
		}
		return nil
	}
}

// socketFDs returns the descriptors of files without switching them to
// blocking mode, as (*os.File).Fd would.
func socketFDs(files []*os.File) ([]uint32, error) {
	fds := make([]uint32, 0, len(files))
	for i, f := range files {
		if f == nil {
			return nil, fmt.Errorf("socket %d is nil: %w", i, syscall.EBADF)
		}
		rc, err := f.SyscallConn()
		if err != nil {
			return nil, fmt.Errorf("socket %d: %w", i, err)
		}
		var fd uintptr
		if err := rc.Control(func(d uintptr) { fd = d }); err != nil {
			return nil, fmt.Errorf("socket %d: %w", i, err)
		}
		fds = append(fds, uint32(fd))
	}
	return fds, nil
}

// anyMPTCP reports whether one of files is a multipath TCP socket.
func anyMPTCP(files []*os.File) bool {
	for _, f := range files {
		if f == nil {
			continue
		}
		if p, err := socketProtocol(f); err == nil && p == ipprotoMPTCP {
			return true
		}
	}
	return false
}

// seconds rounds d up to whole seconds.
func seconds(d time.Duration) uint64 {
	if d <= 0 {
		return 0
	}
	return uint64((d + time.Second - 1) / time.Second)
}
