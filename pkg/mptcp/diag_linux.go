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

//go:build linux

package mptcp

import (
	"fmt"

	"github.com/mdlayher/netlink"
)

// SocketDiag reads the TCP sockets of the network namespace it was opened
// in.
type SocketDiag struct{ c *netlink.Conn }

// DialSocketDiag opens the socket diagnostics of the calling thread's
// network namespace; the handle stays bound to it.
func DialSocketDiag() (*SocketDiag, error) {
	c, err := netlink.Dial(netlinkSockDiag, nil)
	if err != nil {
		return nil, fmt.Errorf("mptcp: dial socket diagnostics: %w", err)
	}
	return &SocketDiag{c: c}, nil
}

// Close releases the netlink socket.
func (d *SocketDiag) Close() error { return d.c.Close() }

// Established lists the namespace's established TCP sockets, IPv4 and
// IPv6, MPTCP subflows marked as such.
func (d *SocketDiag) Established() ([]TCPSocket, error) {
	var out []TCPSocket
	for _, family := range []uint8{afInet, afInet6} {
		msgs, err := d.c.Execute(netlink.Message{
			Header: netlink.Header{Type: sockDiagByFamily, Flags: netlink.Request | netlink.Dump},
			Data:   diagRequest(family),
		})
		if err != nil {
			return nil, fmt.Errorf("mptcp: socket diagnostics dump: %w", err)
		}
		for _, m := range msgs {
			s, err := decodeDiagMsg(m.Data)
			if err != nil {
				return nil, err
			}
			out = append(out, s)
		}
	}
	return out, nil
}
