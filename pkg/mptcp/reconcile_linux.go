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
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"slices"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"
)

// SystemAddrs is the AddrSource of a network namespace, read through a
// route netlink socket. Like a PM, it stays bound to the namespace it was
// created in, whichever goroutine uses it.
type SystemAddrs struct {
	c *netlink.Conn
}

var _ AddrSource = (*SystemAddrs)(nil)

// DialAddrs returns the AddrSource of the calling thread's network
// namespace.
func DialAddrs() (*SystemAddrs, error) {
	c, err := netlink.Dial(unix.NETLINK_ROUTE, nil)
	if err != nil {
		return nil, fmt.Errorf("mptcp: dial route netlink: %w", err)
	}
	return &SystemAddrs{c: c}, nil
}

// Close releases the netlink socket.
func (s *SystemAddrs) Close() error { return s.c.Close() }

// Interfaces lists the interfaces with their addresses (RTM_GETLINK and
// RTM_GETADDR dumps). Addresses still in duplicate address detection
// (tentative) or that failed it are left out: they cannot carry subflows
// yet; the kernel announces the end of detection as an address change.
func (s *SystemAddrs) Interfaces() ([]Interface, error) {
	links, err := s.c.Execute(netlink.Message{
		Header: netlink.Header{Type: unix.RTM_GETLINK, Flags: netlink.Request | netlink.Dump},
		Data:   make([]byte, unix.SizeofIfInfomsg),
	})
	if err != nil {
		return nil, fmt.Errorf("mptcp: listing interfaces: %w", err)
	}
	byIndex := map[int]*Interface{}
	var order []int
	for _, m := range links {
		if m.Header.Type != unix.RTM_NEWLINK {
			continue
		}
		idx, name, err := parseLinkMsg(m.Data)
		if err != nil {
			return nil, fmt.Errorf("mptcp: listing interfaces: %w", err)
		}
		if _, dup := byIndex[idx]; !dup {
			order = append(order, idx)
		}
		byIndex[idx] = &Interface{Index: idx, Name: name}
	}

	addrs, err := s.c.Execute(netlink.Message{
		Header: netlink.Header{Type: unix.RTM_GETADDR, Flags: netlink.Request | netlink.Dump},
		Data:   make([]byte, unix.SizeofIfAddrmsg),
	})
	if err != nil {
		return nil, fmt.Errorf("mptcp: listing addresses: %w", err)
	}
	for _, m := range addrs {
		if m.Header.Type != unix.RTM_NEWADDR {
			continue
		}
		idx, a, ok, err := parseAddrMsg(m.Data)
		if err != nil {
			return nil, fmt.Errorf("mptcp: listing addresses: %w", err)
		}
		if ifc := byIndex[idx]; ok && ifc != nil {
			ifc.Addrs = append(ifc.Addrs, a)
		}
	}

	slices.Sort(order)
	ifs := make([]Interface, 0, len(order))
	for _, idx := range order {
		ifs = append(ifs, *byIndex[idx])
	}
	return ifs, nil
}

// parseLinkMsg returns the index and name of an RTM_NEWLINK message body
// (struct ifinfomsg and attributes).
func parseLinkMsg(b []byte) (int, string, error) {
	if len(b) < unix.SizeofIfInfomsg {
		return 0, "", fmt.Errorf("link message of %d bytes", len(b))
	}
	idx := int(int32(binary.NativeEndian.Uint32(b[4:8])))
	ad, err := netlink.NewAttributeDecoder(b[unix.SizeofIfInfomsg:])
	if err != nil {
		return 0, "", err
	}
	var name string
	for ad.Next() {
		if ad.Type() == unix.IFLA_IFNAME {
			name = ad.String()
		}
	}
	if err := ad.Err(); err != nil {
		return 0, "", err
	}
	if name == "" {
		return 0, "", fmt.Errorf("link %d without a name", idx)
	}
	return idx, name, nil
}

// parseAddrMsg returns the interface index and address of an RTM_NEWADDR
// message body (struct ifaddrmsg and attributes); ok is false for an
// address that is not usable yet (tentative or failed duplicate
// detection) or of another family.
func parseAddrMsg(b []byte) (idx int, a netip.Addr, ok bool, err error) {
	if len(b) < unix.SizeofIfAddrmsg {
		return 0, netip.Addr{}, false, fmt.Errorf("address message of %d bytes", len(b))
	}
	family := b[0]
	flags := uint32(b[2])
	idx = int(binary.NativeEndian.Uint32(b[4:8]))
	ad, err := netlink.NewAttributeDecoder(b[unix.SizeofIfAddrmsg:])
	if err != nil {
		return 0, netip.Addr{}, false, err
	}
	var local, address []byte
	for ad.Next() {
		switch ad.Type() {
		case unix.IFA_LOCAL:
			local = ad.Bytes()
		case unix.IFA_ADDRESS:
			address = ad.Bytes()
		case unix.IFA_FLAGS:
			flags = ad.Uint32()
		}
	}
	if err := ad.Err(); err != nil {
		return 0, netip.Addr{}, false, err
	}
	// IFA_LOCAL is the local address where it differs from IFA_ADDRESS
	// (the peer of a point-to-point link).
	raw := local
	if raw == nil {
		raw = address
	}
	switch {
	case family == unix.AF_INET && len(raw) == 4:
		a = netip.AddrFrom4([4]byte(raw))
	case family == unix.AF_INET6 && len(raw) == 16:
		a = netip.AddrFrom16([16]byte(raw))
	case family != unix.AF_INET && family != unix.AF_INET6:
		return idx, netip.Addr{}, false, nil
	default:
		return 0, netip.Addr{}, false, fmt.Errorf("family %d address of %d bytes", family, len(raw))
	}
	if flags&(unix.IFA_F_TENTATIVE|unix.IFA_F_DADFAILED) != 0 {
		return idx, a, false, nil
	}
	return idx, a, true, nil
}

// AddrChanges subscribes to the link and address changes (IPv4 and IPv6)
// of the calling thread's network namespace and returns a channel that
// receives a value after changes, coalesced: one pending value stands for
// any number of changes. The channel is closed when ctx is done or the
// subscription fails. Pass it as WatchOptions.Changes.
func AddrChanges(ctx context.Context) (<-chan struct{}, error) {
	groups := uint32(1<<(unix.RTNLGRP_LINK-1) | 1<<(unix.RTNLGRP_IPV4_IFADDR-1) | 1<<(unix.RTNLGRP_IPV6_IFADDR-1))
	c, err := netlink.Dial(unix.NETLINK_ROUTE, &netlink.Config{Groups: groups})
	if err != nil {
		return nil, fmt.Errorf("mptcp: subscribe to address changes: %w", err)
	}
	ch := make(chan struct{}, 1)
	stop := make(chan struct{})
	go func() {
		select {
		case <-ctx.Done():
		case <-stop:
		}
		c.Close()
	}()
	go func() {
		defer close(ch)
		defer close(stop)
		for {
			_, err := c.Receive()
			if err != nil && ctx.Err() == nil && errors.Is(err, unix.ENOBUFS) {
				// Notifications were lost: a run is due anyway.
				err = nil
			}
			if err != nil {
				return
			}
			select {
			case ch <- struct{}{}:
			default:
			}
		}
	}()
	return ch, nil
}
