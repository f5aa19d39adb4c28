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

package topo

import (
	"fmt"
	"net/netip"
	"strconv"
	"strings"
)

// Subflow is one established TCP subflow of an MPTCP connection, as
// listed by `ss -tni` (its "tcp-ulp-mptcp" part).
type Subflow struct {
	Local, Remote netip.AddrPort
	// Token is the MPTCP token of the connection on this host; it equals
	// mptcp.Info.Token of that connection.
	Token uint32
	// RemoteToken is the peer's token (0 for the initial subflow).
	RemoteToken       uint32
	LocalID, RemoteID uint8
	// Flags are ss's subflow flags: M/m MP_CAPABLE (remote/local), J/j
	// MP_JOIN, B/b backup, e fully established, c connected, v map valid.
	Flags string
	// Byte counters of the subflow (bytes_sent, bytes_acked,
	// bytes_received), 0 when ss did not print them.
	BytesSent, BytesAcked, BytesReceived uint64
}

// Backup reports whether either side marked the subflow as backup.
func (s Subflow) Backup() bool { return strings.ContainsAny(s.Flags, "Bb") }

// Join reports whether the subflow was created with MP_JOIN (as opposed
// to the initial MP_CAPABLE subflow).
func (s Subflow) Join() bool { return strings.ContainsAny(s.Flags, "Jj") }

// ClientSubflows lists the established MPTCP subflows in the client
// namespace.
func (t *Topology) ClientSubflows() ([]Subflow, error) {
	subs, err := Subflows(t.ClientNS)
	if err != nil || !t.ClientInCaller {
		return subs, err
	}
	// The caller's namespace holds other connections too: keep this
	// topology's.
	var own []Subflow
	for _, s := range subs {
		if t.PathOf(s.Local.Addr()) > 0 {
			own = append(own, s)
		}
	}
	return own, nil
}

// ServerSubflows lists the established MPTCP subflows in the server
// namespace.
func (t *Topology) ServerSubflows() ([]Subflow, error) { return Subflows(t.ServerNS) }

// Subflows lists the established MPTCP subflows in namespace ns using
// `ip netns exec ns ss -tniH state established`.
func Subflows(ns string) ([]Subflow, error) {
	out, err := output("ip", "netns", "exec", ns, "ss", "-tniH", "state", "established")
	if err != nil {
		return nil, err
	}
	return ParseSubflows(out)
}

// ParseSubflows parses the output of `ss -tni` (with or without -H and a
// state filter) and returns the sockets that are MPTCP subflows.
func ParseSubflows(out string) ([]Subflow, error) {
	var (
		subs    []Subflow
		cur     Subflow
		haveCur bool
	)
	for line := range strings.SplitSeq(out, "\n") {
		if strings.TrimSpace(line) == "" {
			continue
		}
		if line[0] != ' ' && line[0] != '\t' {
			// Socket line: [State] Recv-Q Send-Q Local:Port Peer:Port [Process]
			cur, haveCur = Subflow{}, false
			var addrs []netip.AddrPort
			for _, f := range strings.Fields(line) {
				if ap, err := netip.ParseAddrPort(f); err == nil {
					addrs = append(addrs, netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()))
				}
			}
			if len(addrs) >= 2 {
				cur.Local, cur.Remote, haveCur = addrs[0], addrs[1], true
			}
			continue
		}
		// Info line of the preceding socket.
		if !haveCur {
			continue
		}
		fields := strings.Fields(line)
		isMPTCP := false
		for _, f := range fields {
			if f == "tcp-ulp-mptcp" {
				isMPTCP = true
			}
			k, v, ok := strings.Cut(f, ":")
			if !ok {
				continue
			}
			var err error
			switch k {
			case "flags":
				cur.Flags = v
			case "token":
				err = parseTokens(v, &cur)
			case "bytes_sent":
				cur.BytesSent, err = strconv.ParseUint(v, 10, 64)
			case "bytes_acked":
				cur.BytesAcked, err = strconv.ParseUint(v, 10, 64)
			case "bytes_received":
				cur.BytesReceived, err = strconv.ParseUint(v, 10, 64)
			}
			if err != nil {
				return nil, fmt.Errorf("topo: parsing ss field %q: %w", f, err)
			}
		}
		if isMPTCP {
			subs = append(subs, cur)
		}
		haveCur = false
	}
	return subs, nil
}

// parseTokens parses "REMTOKEN(id:REMID)/LOCTOKEN(id:LOCID)".
func parseTokens(v string, s *Subflow) error {
	rem, loc, ok := strings.Cut(v, "/")
	if !ok {
		return fmt.Errorf("no '/'")
	}
	var err error
	if s.RemoteToken, s.RemoteID, err = parseToken(rem); err != nil {
		return err
	}
	s.Token, s.LocalID, err = parseToken(loc)
	return err
}

// parseToken parses "c2c6787c(id:4)".
func parseToken(v string) (uint32, uint8, error) {
	tok, id, ok := strings.Cut(v, "(id:")
	if !ok || !strings.HasSuffix(id, ")") {
		return 0, 0, fmt.Errorf("malformed token %q", v)
	}
	t, err := strconv.ParseUint(tok, 16, 32)
	if err != nil {
		return 0, 0, err
	}
	n, err := strconv.ParseUint(strings.TrimSuffix(id, ")"), 10, 8)
	if err != nil {
		return 0, 0, err
	}
	return uint32(t), uint8(n), nil
}
