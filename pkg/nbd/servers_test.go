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
	"context"
	"errors"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
)

// TestInfoServers: a client that asks is told the servers of its grant;
// one that does not ask, or whose grant names none, is told nothing; a
// list that would not read back as written is not sent (the handshake
// goes on).
func TestInfoServers(t *testing.T) {
	servers := []ServerAddrs{
		{Node: "s1", Addrs: []string{"10.0.0.1:10809", "10.0.1.1:10809"}},
		{Node: "s3", Addrs: []string{"[fd00::3]:10809"}},
	}
	var grant atomic.Pointer[Grant]
	s := newTestServer(t, &Export{Name: "vol", Backend: NewMemBackend(4096)})
	s.Resolve = func(ConnInfo, string) (Grant, error) { return *grant.Load(), nil }
	negotiate := func(ask bool) ExportInfo {
		t.Helper()
		info, err := NegotiateConnWith(context.Background(), pipeConn(t, s), "vol/t", NegotiateOptions{AskServers: ask})
		if err != nil {
			t.Fatal(err)
		}
		if info.Size != 4096 {
			t.Fatalf("size %d", info.Size)
		}
		return info
	}
	grant.Store(&Grant{Export: "vol", Servers: servers})
	if got := negotiate(true).Servers; !reflect.DeepEqual(got, servers) {
		t.Fatalf("servers %+v, want %+v", got, servers)
	}
	if got := negotiate(false).Servers; got != nil {
		t.Fatalf("servers %+v sent to a client that did not ask", got)
	}
	grant.Store(&Grant{Export: "vol"})
	if got := negotiate(true).Servers; got != nil {
		t.Fatalf("servers %+v for a grant with none", got)
	}
	grant.Store(&Grant{Export: "vol", Servers: []ServerAddrs{{Node: "s;1", Addrs: []string{"10.0.0.1:1"}}}})
	if got := negotiate(true).Servers; got != nil {
		t.Fatalf("a malformed list was sent: %+v", got)
	}
}

// TestDecodeInfoServers: what a server could send wrong is a protocol
// error, never a list with holes.
func TestDecodeInfoServers(t *testing.T) {
	for _, bad := range []string{
		"s1",                   // no addresses
		"=10.0.0.1:1",          // no node
		"s1=10.0.0.1",          // no port
		"s1=10.0.0.1:1,",       // an empty address
		"s1=10.0.0.1:1;",       // an empty entry
		"s1=10.0.0.1:1;s2=:10", // no host
		strings.Repeat("x", maxServersInfo+1),
	} {
		if got, err := decodeInfoServers([]byte(bad)); !errors.Is(err, ErrProtocol) {
			t.Errorf("%q: %+v, %v; want a protocol error", bad, got, err)
		}
	}
	got, err := decodeInfoServers([]byte("s1=10.0.0.1:1,10.0.1.1:1;s2=h:2"))
	want := []ServerAddrs{{Node: "s1", Addrs: []string{"10.0.0.1:1", "10.0.1.1:1"}}, {Node: "s2", Addrs: []string{"h:2"}}}
	if err != nil || !reflect.DeepEqual(got, want) {
		t.Fatalf("%+v, %v", got, err)
	}
	if b, err := encodeInfoServers(want); err != nil || string(b[2:]) != "s1=10.0.0.1:1,10.0.1.1:1;s2=h:2" {
		t.Fatalf("encoded %q, %v", b, err)
	}
}

// TestPrivateInfo: an information type of ours that the package does not
// know is answered by the grant's Info when a client asks, and kept by
// the client in ExportInfo.Infos; nothing when Info has no answer or the
// client did not ask.
func TestPrivateInfo(t *testing.T) {
	const typ = 0x4d7f
	s := newTestServer(t, &Export{Name: "vol", Backend: NewMemBackend(4096)})
	s.Resolve = func(ConnInfo, string) (Grant, error) {
		return Grant{Export: "vol", Info: func(t uint16) []byte {
			if t == typ {
				return []byte("answer")
			}
			return nil
		}}, nil
	}
	ask := func(types ...uint16) map[uint16][]byte {
		t.Helper()
		info, err := NegotiateConnWith(context.Background(), pipeConn(t, s), "vol/t", NegotiateOptions{AskInfos: types})
		if err != nil {
			t.Fatal(err)
		}
		return info.Infos
	}
	if got := ask(typ, typ+1); !reflect.DeepEqual(got, map[uint16][]byte{typ: []byte("answer")}) {
		t.Errorf("asked: %v", got)
	}
	if got := ask(); got != nil {
		t.Errorf("not asked: %v", got)
	}
}
