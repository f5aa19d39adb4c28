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

// Package mptcp contains small helpers around Multipath TCP sockets:
// creating listeners and dialers that request MPTCP, telling whether a
// connection really runs MPTCP (rather than having fallen back to plain
// TCP) and reading the kernel's per-connection MPTCP_INFO counters.
//
// Listen and Dialer are portable: on systems without MPTCP support (or on
// Linux with net.mptcp.enabled=0) the Go runtime silently uses plain TCP,
// which IsMPTCP then reports. GetInfo and Available are only implemented
// on Linux; elsewhere they return an error wrapping ErrUnsupported.
package mptcp

import (
	"context"
	"errors"
	"net"
)

var (
	// ErrUnsupported is returned by functions that need kernel MPTCP
	// support on platforms (or kernels) that lack it.
	ErrUnsupported = errors.New("mptcp: not supported")

	// ErrNotMPTCP is returned by GetInfo when the connection is not an
	// MPTCP connection: a plain TCP socket, or an MPTCP socket that fell
	// back to TCP.
	ErrNotMPTCP = errors.New("mptcp: connection is not using MPTCP")
)

// Listen returns a stream listener on network/addr. With mptcp=true the
// listener asks for Multipath TCP (net.ListenConfig.SetMultipathTCP);
// whether an accepted connection really uses it is reported by IsMPTCP.
func Listen(ctx context.Context, network, addr string, mptcp bool) (net.Listener, error) {
	var lc net.ListenConfig
	lc.SetMultipathTCP(mptcp)
	return lc.Listen(ctx, network, addr)
}

// Dialer returns a new *net.Dialer whose multipath setting is mptcp.
func Dialer(mptcp bool) *net.Dialer {
	d := &net.Dialer{}
	d.SetMultipathTCP(mptcp)
	return d
}

// netConner is implemented by wrappers such as *tls.Conn that expose the
// underlying connection.
type netConner interface {
	NetConn() net.Conn
}

// TCPConn unwraps c (following NetConn methods) down to a *net.TCPConn.
// It returns nil when there is none.
func TCPConn(c net.Conn) *net.TCPConn {
	// Bound the unwrapping so a wrapper returning itself cannot loop.
	for range 16 {
		switch v := c.(type) {
		case nil:
			return nil
		case *net.TCPConn:
			return v
		case netConner:
			next := v.NetConn()
			if next == c {
				return nil
			}
			c = next
		default:
			return nil
		}
	}
	return nil
}

// IsMPTCP reports whether c is (or wraps) a TCP connection that is really
// using Multipath TCP, i.e. was created as an MPTCP socket and has not
// fallen back to plain TCP.
func IsMPTCP(c net.Conn) bool {
	tc := TCPConn(c)
	if tc == nil {
		return false
	}
	ok, err := tc.MultipathTCP()
	return err == nil && ok
}
