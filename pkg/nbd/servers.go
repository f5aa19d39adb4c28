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

package nbd

import (
	"fmt"
	"net"
	"strings"
)

// InfoServers is an information type of ours: the storage nodes that
// hold the export now (a replicated volume's replicas, the serving one
// included), so that a client learns of a replica that was added after it
// was given its list and can reach it when it takes over. A client asks
// for it in the GO request's list of information types; a server that
// knows of no such list (or does not know the type) sends nothing, as the
// protocol lets a server do with any information type it is asked for.
//
//	S: reply NBD_REP_INFO, data: InfoServers (u16), then text:
//	   <node>=<host:port>[,<host:port>...][;<node>=...]
//
// The number is far from the protocol's own (0-3 today).
const InfoServers uint16 = 0x4d50

// ServerAddrs is one storage node that holds an export, and where it
// serves.
type ServerAddrs struct {
	Node  string
	Addrs []string
}

// maxServersInfo bounds the text, as the protocol bounds its strings.
const maxServersInfo = 4096

func encodeInfoServers(servers []ServerAddrs) ([]byte, error) {
	parts := make([]string, 0, len(servers))
	for _, s := range servers {
		if err := checkServer(s); err != nil {
			return nil, err
		}
		parts = append(parts, s.Node+"="+strings.Join(s.Addrs, ","))
	}
	text := strings.Join(parts, ";")
	if len(text) > maxServersInfo {
		return nil, fmt.Errorf("the list of %d servers is %d bytes, more than %d", len(servers), len(text), maxServersInfo)
	}
	return encodeInfoString(InfoServers, text), nil
}

func decodeInfoServers(b []byte) ([]ServerAddrs, error) {
	if len(b) > maxServersInfo {
		return nil, fmt.Errorf("%w: servers info of %d bytes", ErrProtocol, len(b))
	}
	if len(b) == 0 {
		return nil, nil
	}
	var out []ServerAddrs
	for _, part := range strings.Split(string(b), ";") {
		node, list, _ := strings.Cut(part, "=")
		s := ServerAddrs{Node: node}
		if list != "" {
			s.Addrs = strings.Split(list, ",")
		}
		if err := checkServer(s); err != nil {
			return nil, fmt.Errorf("%w: servers info: %w", ErrProtocol, err)
		}
		out = append(out, s)
	}
	return out, nil
}

// checkServer refuses what would not read back as written.
func checkServer(s ServerAddrs) error {
	if s.Node == "" || strings.ContainsAny(s.Node, "=;,") {
		return fmt.Errorf("storage node name %q", s.Node)
	}
	if len(s.Addrs) == 0 {
		return fmt.Errorf("storage node %s: no address", s.Node)
	}
	for _, a := range s.Addrs {
		if host, port, err := net.SplitHostPort(a); err != nil || host == "" || port == "" || strings.ContainsAny(a, ";,") {
			return fmt.Errorf("storage node %s: %q is not host:port", s.Node, a)
		}
	}
	return nil
}
