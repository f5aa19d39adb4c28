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

// Package hostaddr reads the addresses a flag gives for this host, such
// as --storage-address: each entry is an IP address, taken as it is, or
// a CIDR prefix standing for every global unicast address of the host
// (its network namespace) inside it, found when the program starts. A
// DaemonSet thus gives every node its own addresses on shared storage
// subnets with one argument.
package hostaddr

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

// Entry is one entry of a List: an IP address (Addr valid) or a CIDR
// prefix (Prefix valid).
type Entry struct {
	Addr   netip.Addr
	Prefix netip.Prefix
}

// String is the entry as given (a prefix keeps its host bits).
func (e Entry) String() string {
	if e.Prefix.IsValid() {
		return e.Prefix.String()
	}
	return e.Addr.String()
}

// List is the entries of a flag, in the order given.
type List struct {
	// Flag names the entries in errors ("--storage-address").
	Flag    string
	Entries []Entry
}

// Parse returns the List of entries, each an IP address (without a zone
// or a port) or a CIDR prefix; flag names them in errors. Blank entries
// are skipped. An entry given twice is an error.
func Parse(flag string, entries []string) (List, error) {
	l := List{Flag: flag}
	err := l.Add(entries...)
	return l, err
}

// Add parses entries as Parse does and appends them to l.
func (l *List) Add(entries ...string) error {
	for _, s := range entries {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		var e Entry
		if strings.Contains(s, "/") {
			p, err := netip.ParsePrefix(s)
			if err != nil {
				return fmt.Errorf("invalid %s %q: want an IP address without a port, or a CIDR", l.Flag, s)
			}
			e.Prefix = p
		} else {
			a, err := netip.ParseAddr(s)
			if err != nil || a.Zone() != "" {
				return fmt.Errorf("invalid %s %q: want an IP address without a port, or a CIDR", l.Flag, s)
			}
			e.Addr = a.Unmap()
		}
		if slices.ContainsFunc(l.Entries, func(o Entry) bool { return o.String() == e.String() }) {
			return fmt.Errorf("%s %s is given twice", l.Flag, e)
		}
		l.Entries = append(l.Entries, e)
	}
	return nil
}

// HasPrefix reports whether an entry is a CIDR prefix, which only the
// host's addresses resolve.
func (l List) HasPrefix() bool {
	return slices.ContainsFunc(l.Entries, func(e Entry) bool { return e.Prefix.IsValid() })
}

// Resolve returns the addresses l stands for: the entries in the order
// given, an IP address as it is (whether the host has it or not), a CIDR
// prefix as the global unicast addresses of src inside it, in the
// interfaces' order (by index). An address given more than once (in a
// prefix and literally, or in two prefixes) is returned once, where it
// first comes. A prefix without any address of src is an error naming
// it. src is asked only when an entry is a prefix.
func (l List) Resolve(src mptcp.AddrSource) ([]netip.Addr, error) {
	var host []netip.Addr
	if l.HasPrefix() {
		var err error
		if host, err = Global(src); err != nil {
			return nil, fmt.Errorf("%s: %w", l.Flag, err)
		}
	}
	var out []netip.Addr
	add := func(a netip.Addr) {
		if !slices.Contains(out, a) {
			out = append(out, a)
		}
	}
	for _, e := range l.Entries {
		if !e.Prefix.IsValid() {
			add(e.Addr)
			continue
		}
		n := 0
		for _, a := range host {
			if e.Prefix.Contains(a) {
				add(a)
				n++
			}
		}
		if n == 0 {
			return nil, fmt.Errorf("%s %s: no address of this host is in it", l.Flag, e)
		}
	}
	return out, nil
}

// Global returns every global unicast address of src (IPv4-mapped ones
// as IPv4), interfaces by index, each interface's in the order src gives
// them, each address once.
func Global(src mptcp.AddrSource) ([]netip.Addr, error) {
	ifs, err := src.Interfaces()
	if err != nil {
		return nil, fmt.Errorf("listing the host's addresses: %w", err)
	}
	ifs = slices.Clone(ifs)
	slices.SortStableFunc(ifs, func(a, b mptcp.Interface) int { return cmp.Compare(a.Index, b.Index) })
	var out []netip.Addr
	for _, ifc := range ifs {
		for _, a := range ifc.Addrs {
			if a = a.Unmap(); a.IsGlobalUnicast() && !slices.Contains(out, a) {
				out = append(out, a)
			}
		}
	}
	return out, nil
}

// Strings returns addrs as text.
func Strings(addrs []netip.Addr) []string {
	out := make([]string, len(addrs))
	for i, a := range addrs {
		out[i] = a.String()
	}
	return out
}

// System is the AddrSource of this process's network namespace (that of
// the calling thread), read at each call (mptcp.DialAddrs).
var System mptcp.AddrSource = system{}

type system struct{}

func (system) Interfaces() ([]mptcp.Interface, error) {
	s, err := mptcp.DialAddrs()
	if err != nil {
		return nil, err
	}
	defer s.Close()
	return s.Interfaces()
}
