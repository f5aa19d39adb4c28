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

// Package attach turns an NBD export into a block device on this node, by
// one of several transports:
//
//   - kernel:    the MPTCP socket itself is handed to the kernel's NBD driver
//     (only on kernels whose nbd accepts MPTCP sockets);
//   - relay:     the kernel gets one end of an AF_UNIX socketpair and a
//     userspace relay moves NBD frames to and from the MPTCP connection,
//     redialling and replaying in-flight requests when it breaks;
//   - multiconn: N plain TCP connections, one per local storage NIC;
//   - tcp:       one plain TCP connection (the baseline);
//   - fuse:      no nbd driver at all: the pipelined userspace client serves
//     the export as a file through FUSE and a loop device sits on top.
//
// auto picks kernel, then relay, then fuse, by what the node supports.
package attach

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"time"

	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nodeid"
	"github.com/mpnbd/mpnbd/pkg/relay"
)

// Transport names a way of attaching.
type Transport string

const (
	Auto      Transport = "auto"
	Kernel    Transport = "kernel"
	Relay     Transport = "relay"
	MultiConn Transport = "multiconn"
	TCP       Transport = "tcp"
	FUSE      Transport = "fuse"
	Ublk      Transport = "ublk"
)

// Transports lists every valid value, auto first.
var Transports = []Transport{Auto, Kernel, Ublk, Relay, MultiConn, TCP, FUSE}

// ParseTransport validates a transport name.
func ParseTransport(s string) (Transport, error) {
	if s == "" {
		return Auto, nil
	}
	for _, t := range Transports {
		if string(t) == s {
			return t, nil
		}
	}
	return "", fmt.Errorf("%w: transport %q (want one of auto, kernel, ublk, relay, multiconn, tcp, fuse)", ErrInvalid, s)
}

// Defaults for every attach; documented in docs/transports.md.
const (
	// DefaultDeadConnTimeout is how long I/O waits for a dead connection to
	// be replaced before it fails: in effect forever (a hard mount). I/O
	// waits while the storage node is unreachable and resumes, with no
	// error, when it is back; the reconnects go on until the volume is
	// detached. The StorageClass parameter deadConnTimeout bounds it for
	// those who prefer an I/O error.
	DefaultDeadConnTimeout = 10 * 365 * 24 * time.Hour
	// DefaultRequestTimeout is the kernel's per-request timeout: a request
	// unanswered this long marks its connection dead, which triggers a
	// reconnect and requeues the request (it does not fail it). It is an
	// age bound, so it stays long (a busy server's queue must not trip
	// it); a dead socket's requests wait for it all the same, so it also
	// bounds how long they stall after the dead-peer bound ended their
	// socket.
	DefaultRequestTimeout = 30 * time.Second
	DefaultBlockSize      = 4096
	// DefaultDeadPeerTimeout bounds how long a data connection waits on a
	// silent storage host (one that lost power sends no reset) before it
	// is replaced: requests waiting, nothing received and no
	// acknowledgement from the host's kernel for this long. Userspace
	// sessions watch it themselves (relay.Options.DeadPeerTimeout); the
	// plain TCP sockets handed to the kernel get it as TCP_USER_TIMEOUT
	// with a keepalive (mptcp.ArmDeadPeer). The StorageClass parameter
	// deadPeerTimeout changes it. It stays below the request timeout, so
	// that a kernel socket dies, dropping what it had not sent, before
	// the kernel requeues its requests elsewhere.
	DefaultDeadPeerTimeout = relay.DefaultDeadPeerTimeout
)

// KernelRequestTimeout is the request timeout given to the kernel for
// o: RequestTimeout (default DefaultRequestTimeout), raised to at least
// twice the dead-peer bound so that a socket the bound ends is dead
// before the kernel times its requests out and requeues them.
func (o Options) KernelRequestTimeout() time.Duration {
	rt := o.RequestTimeout
	if rt <= 0 {
		rt = DefaultRequestTimeout
	}
	return max(rt, 2*o.EffectiveDeadPeerTimeout())
}

// EffectiveDeadPeerTimeout is the dead-peer bound of o: DeadPeerTimeout
// when set; else the default, lowered to half of an explicit
// RequestTimeout (a class asking for a short request timeout asks for
// quick failover, and the bound must stay below it), never below
// relay.MinDeadPeerTimeout.
func (o Options) EffectiveDeadPeerTimeout() time.Duration {
	switch {
	case o.DeadPeerTimeout > 0:
		return max(o.DeadPeerTimeout, relay.MinDeadPeerTimeout)
	case o.RequestTimeout > 0:
		return max(min(DefaultDeadPeerTimeout, o.RequestTimeout/2), relay.MinDeadPeerTimeout)
	}
	return DefaultDeadPeerTimeout
}

// Target says what to attach.
type Target struct {
	// VolumeID becomes the kernel's BACKEND_IDENTIFIER, so a device can be
	// found again after a restart and never reattached to another volume.
	VolumeID string
	// Export is the NBD export name (it may carry a per-node secret).
	Export string
	// Addrs are the server's addresses (host:port). The first is dialled
	// with MPTCP; multiconn uses one per path, paired with LocalAddrs.
	Addrs []string
	// LocalAddrs are the node's storage addresses, for multiconn.
	LocalAddrs []string
	// TLS, when set, makes every connection upgrade to TLS before the
	// export is chosen. Only the transports that own their connections
	// (relay, ublk, fuse) can (CanEncrypt); the others refuse such a
	// target with ErrUnsupported, or connect in plaintext when the TLS
	// is Optional.
	TLS *TargetTLS `json:",omitempty"`
	// Replicas are the other storage nodes that hold a replicated
	// volume. One of them takes over when the primary (Addrs) is gone;
	// until then they refuse the node. The transports whose session
	// redials (relay, fuse, ublk, and the kernel ones with one
	// connection) dial every server at once and keep the one that
	// serves the export; multiconn dials the primary's alone.
	Replicas []Server `json:",omitempty"`
}

// ReplicatedMaxBackoff bounds the pause between a replicated volume's
// dials: a failover is decided within seconds, and the new primary must
// not wait for a session that backed off as long as an unreplicated
// volume's may (the replicas refuse a node at once, so that dialing them
// each second costs little).
const ReplicatedMaxBackoff = time.Second

// MaxBackoff is the longest pause between the target's dials: for a
// replicated volume ReplicatedMaxBackoff, else zero (the relay's
// default).
func (t Target) MaxBackoff() time.Duration {
	if len(t.Replicas) > 0 {
		return ReplicatedMaxBackoff
	}
	return 0
}

// Server is one storage node that may serve a target.
type Server struct {
	// StorageNode names it (its certificate names it, over TLS).
	StorageNode string
	// Addrs are its addresses (host:port).
	Addrs []string
}

// Servers lists the storage nodes that may serve the target: its own
// (Addrs, named by TLS.StorageNode when set) first, then its Replicas.
func (t Target) Servers() []Server {
	own := Server{Addrs: t.Addrs}
	if t.TLS != nil {
		own.StorageNode = t.TLS.StorageNode
	}
	return append([]Server{own}, t.Replicas...)
}

// CanEncrypt reports whether transport t can carry a volume's
// connections over TLS: those whose connections the kernel's NBD client
// holds cannot.
func CanEncrypt(t Transport) bool {
	return t == Relay || t == Ublk || t == FUSE
}

// EncryptionRequired reports whether the target's connections must run
// TLS.
func (t Target) EncryptionRequired() bool { return t.TLS != nil && !t.TLS.Optional }

// TargetTLS is how a target's connections authenticate over TLS.
type TargetTLS struct {
	// StorageNode is the node the server's certificate must name.
	StorageNode string
	// IdentityDir holds the node's certificate and the CA bundle (as
	// nodeid.Identity keeps them).
	IdentityDir string
	// Optional lets a transport that cannot encrypt connect in
	// plaintext (the volume's encryption is preferred, not required).
	Optional bool `json:",omitempty"`
}

// Config is the TLS configuration of the target's connections.
func (t *TargetTLS) Config() *tls.Config {
	return nodeid.FileClientTLS(t.IdentityDir, t.StorageNode)
}

// ConfigFor is the TLS configuration of a connection to server s: its
// certificate must name s.StorageNode (the target's own node when s does
// not name one).
func (t *TargetTLS) ConfigFor(s Server) *tls.Config {
	if s.StorageNode == "" || s.StorageNode == t.StorageNode {
		return t.Config()
	}
	return nodeid.FileClientTLS(t.IdentityDir, s.StorageNode)
}

// Options tune an attach. Zero values mean the defaults above.
type Options struct {
	// DeadConnTimeout bounds how long I/O waits for the server; see
	// DefaultDeadConnTimeout.
	DeadConnTimeout time.Duration
	RequestTimeout  time.Duration
	// DeadPeerTimeout is how long a data connection may wait with nothing
	// from the storage host before it counts as dead and is replaced; see
	// DefaultDeadPeerTimeout.
	DeadPeerTimeout time.Duration `json:",omitempty"`
	BlockSize       uint64
	ReadOnly        bool
	// ServersFile, when set, is where the volume's session keeps the
	// storage nodes its servers last named as holding it
	// (ServerDialer.KeepIn), for whichever process serves the volume
	// next. The Manager sets it (KeepServersIn).
	ServersFile string `json:",omitempty"`
}

// Attachment is an attached volume.
type Attachment struct {
	VolumeID  string
	Transport Transport
	// Device is the block device path (/dev/nbdN or /dev/loopN).
	Device string
	Size   uint64
	// MPTCP reports whether the data path runs over MPTCP.
	MPTCP bool
	// Choice says how the manager came to Transport; nil unless this
	// call attached the volume (a repeated attach, an adopted volume).
	Choice *Choice
}

// Choice is how a volume's transport was chosen, for the node plugin to
// tell the user.
type Choice struct {
	// Requested is what the volume asked for: auto, or the transport its
	// StorageClass names.
	Requested Transport
	// Skipped are the transports auto passed over before this one, in
	// order, each with its reason: refused now, or refused by an earlier
	// attach on this node.
	Skipped []Fallback
	// Missing are the transports auto prefers to this one that the node
	// does not have (no nbd driver, no ublk, or left out by --transports).
	Missing []Transport
}

// Health is a volume's data-path state, for volume stats and conditions.
type Health struct {
	Connected bool
	MPTCP     bool
	// Subflows is the number of MPTCP subflows (including the first) of
	// each connection; empty when unknown.
	Subflows []int
	// Paths are the MPTCP subflows of every connection, each with its
	// addresses and the bytes it carried; empty when unknown (no MPTCP,
	// or a kernel that does not list subflows).
	Paths []PathStats `json:"paths,omitempty"`
	// Reconnects counts redials since the attach; Replaced the working
	// connections swapped for ones with more MPTCP subflows
	// (KeepSubflows).
	Reconnects int
	Replaced   int `json:"replaced,omitempty"`
	// Outage is how long the volume has been waiting for its storage node
	// (zero while connected): I/O waits meanwhile.
	Outage time.Duration
	// Replayed counts requests sent again after reconnects; Resent the
	// acknowledged writes sent again to a server that may have lost them;
	// Retained the acknowledged writes no completed FLUSH covers yet. Only
	// the userspace transports keep these.
	Replayed, Resent, Retained int
	// InFlight counts the requests the node's block layer sent and the
	// session has not answered yet; InFlightBytes what they hold (the
	// userspace transports).
	InFlight      int `json:"inFlight,omitempty"`
	InFlightBytes int `json:"inFlightBytes,omitempty"`
	// Requests counts the requests the session answered, by command: how
	// long each took, from the node's block layer sending it to its
	// answer (outages included), and how it ended (the userspace
	// transports; since the process serving the volume started).
	Requests []relay.RequestStats `json:"requests,omitempty"`
	// Failing: the outage outlasted the volume's bounded wait
	// (deadConnTimeout), so I/O fails until the storage node is back.
	Failing bool
	Message string
}

// PathStats is the traffic of one MPTCP subflow of a volume's connection:
// the path it takes, from a local address of this node to one of the
// storage node's, and the bytes it carried. The counters are the
// subflow's own: they start at zero when the subflow (or its connection)
// is replaced.
type PathStats struct {
	// Connection is the connection's index in Health.Subflows.
	Connection int            `json:"connection"`
	Local      netip.AddrPort `json:"local"`
	Remote     netip.AddrPort `json:"remote"`
	// SentBytes counts the bytes sent, retransmissions included;
	// ReceivedBytes the bytes received.
	SentBytes     uint64 `json:"sentBytes"`
	ReceivedBytes uint64 `json:"receivedBytes"`
	// RetransBytes counts the bytes sent again; RTT is the smoothed
	// round-trip time; DeliveryRate the kernel's latest estimate of the
	// bytes per second reaching the storage node. Zero when unknown (a
	// datapath of an earlier release does not send them).
	RetransBytes uint64        `json:"retransBytes,omitempty"`
	RTT          time.Duration `json:"rtt,omitempty"`
	DeliveryRate uint64        `json:"deliveryRate,omitempty"`
}

// ConnPaths is the subflows of c, a volume's connection number conn, as
// PathStats; nil when c does not run MPTCP or they cannot be read.
func ConnPaths(conn int, c net.Conn) []PathStats {
	subs, err := mptcp.GetSubflows(c)
	if err != nil {
		return nil
	}
	paths := make([]PathStats, 0, len(subs))
	for _, s := range subs {
		paths = append(paths, PathStats{Connection: conn, Local: s.Local, Remote: s.Remote,
			SentBytes: s.BytesSent, ReceivedBytes: s.BytesReceived,
			RetransBytes: s.BytesRetrans, RTT: s.RTT, DeliveryRate: s.DeliveryRate})
	}
	return paths
}

// SessionHealth is the health of a data path that runs through a relay
// (the NBD session of the userspace transports); MPTCP, Subflows and
// Message are the caller's to add.
func SessionHealth(st relay.Stats) Health {
	h := Health{Connected: st.Connected, Reconnects: st.Reconnects, Replaced: st.Replaced, Replayed: st.Replayed, Resent: st.RetainedReplays,
		Retained: st.Retained, Failing: st.Failing, InFlight: st.InFlight, InFlightBytes: st.InFlightBytes,
		Requests: st.Latency.Requests()}
	if !st.DownSince.IsZero() {
		h.Outage = time.Since(st.DownSince)
	}
	return h
}

// OutageMessage says what a volume waiting for its storage node does
// meanwhile.
func (h Health) OutageMessage() string {
	if h.Failing {
		return fmt.Sprintf("storage node unreachable for %v, longer than deadConnTimeout: I/O fails until it is back", h.Outage.Round(time.Second))
	}
	return fmt.Sprintf("waiting for the storage node for %v", h.Outage.Round(time.Second))
}

// Attacher is one transport.
type Attacher interface {
	// Attach connects the target and returns the block device. It is
	// idempotent: a volume already attached is returned as is. On failure
	// nothing is left behind (no device, socket or relay).
	Attach(ctx context.Context, t Target, o Options) (*Attachment, error)
	// Detach disconnects a volume and removes its device. Detaching a
	// volume that is not attached succeeds.
	Detach(ctx context.Context, volumeID string) error
	// Health reports the data path of an attached volume.
	Health(volumeID string) (Health, error)
	// Resize picks up a grown export: it asks the server for the
	// export's size on a fresh connection, which must be at least
	// newSize, resizes the device to it and returns the device's size.
	Resize(ctx context.Context, volumeID string, newSize uint64) (uint64, error)
}

// Adopter is a transport that can take over, in a new process, the
// volumes an earlier process attached.
type Adopter interface {
	Adopt(ctx context.Context) ([]*Attachment, error)
}

// Sentinel errors, mapped to gRPC codes at the CSI boundary.
var (
	ErrInvalid       = errors.New("attach: invalid argument")
	ErrNotAttached   = errors.New("attach: volume not attached")
	ErrUnsupported   = errors.New("attach: transport not supported on this node")
	ErrWrongVolume   = errors.New("attach: device belongs to another volume")
	ErrServerRefused = errors.New("attach: server refused the export")
	// ErrTooSmall: Resize found the export smaller than requested (the
	// storage node has not grown it yet).
	ErrTooSmall = errors.New("attach: export smaller than requested")
	// ErrUnflushed: writes the volume's data path acknowledged are not
	// durable on the storage node yet (it does not answer), so the volume
	// is not detached: detaching would drop them. The session keeps them
	// and keeps redialing; a later detach succeeds once they are flushed.
	ErrUnflushed = errors.New("attach: acknowledged writes are not durable yet")
)
