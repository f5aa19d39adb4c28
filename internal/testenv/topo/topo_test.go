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
	"net/netip"
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"
)

func TestPlan(t *testing.T) {
	cfg := Asymmetric("ab")
	cfg.Paths[3].Backup = true
	topo, err := Plan(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if topo.ClientNS != "ab-cli" || topo.ServerNS != "ab-srv" || topo.JoinPort != DefaultJoinPort {
		t.Errorf("names: %+v", topo)
	}
	want := []Path{
		{"ab-c1", "ab-s1", netip.MustParseAddr("10.77.1.1"), netip.MustParseAddr("10.77.1.2"), 1000, false},
		{"ab-c2", "ab-s2", netip.MustParseAddr("10.77.2.1"), netip.MustParseAddr("10.77.2.2"), 1000, false},
		{"ab-c3", "ab-s3", netip.MustParseAddr("10.77.3.1"), netip.MustParseAddr("10.77.3.2"), 1000, false},
		{"ab-c4", "ab-s4", netip.MustParseAddr("10.77.4.1"), netip.MustParseAddr("10.77.4.2"), 100, true},
	}
	if !reflect.DeepEqual(topo.Paths, want) {
		t.Errorf("paths:\n got %+v\nwant %+v", topo.Paths, want)
	}
	if a := topo.ServerAddr(2); a != netip.MustParseAddr("10.77.2.2") {
		t.Errorf("ServerAddr(2) = %v", a)
	}
	if p := topo.PathOf(netip.MustParseAddr("10.77.3.1")); p != 3 {
		t.Errorf("PathOf = %d", p)
	}
	if p := topo.PathOf(netip.MustParseAddr("::ffff:10.77.4.2")); p != 4 {
		t.Errorf("PathOf(mapped) = %d", p)
	}
	if p := topo.PathOf(netip.MustParseAddr("10.78.1.1")); p != 0 {
		t.Errorf("PathOf(outside) = %d", p)
	}
	if r := topo.LineRateMBps(); r != 387.5 {
		t.Errorf("LineRateMBps = %v", r)
	}
	env := topo.Env()
	for _, kv := range []string{"CLIENT_NS=ab-cli", "SERVER_ADDR1=10.77.1.2", "RATE_MBIT4=100", "BACKUP4=1", "PATHS=4", "JOIN_PORT=10900"} {
		if !slices.Contains(env, kv) {
			t.Errorf("Env lacks %q: %q", kv, env)
		}
	}
}

func TestPlanOptions(t *testing.T) {
	cfg := Uniform("x", 2, 0)
	cfg.Subnet = "192.168"
	cfg.JoinPort = -1
	topo, err := Plan(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if topo.JoinPort != 0 {
		t.Errorf("JoinPort = %d, want 0 (none)", topo.JoinPort)
	}
	if topo.Paths[1].ClientAddr != netip.MustParseAddr("192.168.2.1") || topo.Paths[1].RateMbit != DefaultRateMbit {
		t.Errorf("path 2: %+v", topo.Paths[1])
	}
	if d := Default4("d"); len(d.Paths) != 4 || d.Paths[0].RateMbit != 1000 {
		t.Errorf("Default4: %+v", d)
	}
}

func TestPlanInvalid(t *testing.T) {
	for name, cfg := range map[string]Config{
		"empty name":  Default4(""),
		"bad char":    Default4("a b"),
		"dot":         Default4("a.b"),
		"too long":    Default4("abcdefghijkl"), // "abcdefghijkl-cli" is 16 chars
		"no paths":    {Name: "x"},
		"bad subnet":  {Name: "x", Paths: []PathConfig{{}}, Subnet: "10.77.1"},
		"v6 subnet":   {Name: "x", Paths: []PathConfig{{}}, Subnet: "fe80::"},
		"neg rate":    {Name: "x", Paths: []PathConfig{{RateMbit: -1}}},
		"join port":   {Name: "x", Paths: []PathConfig{{}}, JoinPort: 70000},
		"255 paths":   Uniform("x", 255, 1),
		"long ifname": Uniform("abcdefghijk", 100, 1), // "abcdefghijk-c100"
	} {
		if _, err := Plan(cfg); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
	if _, err := Plan(Default4("abcdefghijk")); err != nil {
		t.Errorf("11-character name rejected: %v", err)
	}
}

func TestUniqueName(t *testing.T) {
	a, b := UniqueName("mp"), UniqueName("mp")
	if a == b || len(a) != 6 || !strings.HasPrefix(a, "mp") {
		t.Errorf("UniqueName: %q %q", a, b)
	}
	if _, err := Plan(Default4(a)); err != nil {
		t.Error(err)
	}
}

func TestTBFArgs(t *testing.T) {
	got := strings.Join(TBFArgs(1000), " ")
	if want := "tbf rate 1000mbit burst 262144 latency 10ms"; got != want {
		t.Errorf("1000: %q, want %q", got, want)
	}
	got = strings.Join(TBFArgs(100), " ")
	if want := "tbf rate 100mbit burst 262144 latency 10ms"; got != want {
		t.Errorf("100: %q, want %q", got, want)
	}
	// Above 1 Gbit/s the bucket grows with the rate (2 ms worth).
	got = strings.Join(TBFArgs(10000), " ")
	if want := "tbf rate 10000mbit burst 2500000 latency 10ms"; got != want {
		t.Errorf("10000: %q, want %q", got, want)
	}
}

func TestStrayLinks(t *testing.T) {
	out := `1: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536 qdisc noqueue state UNKNOWN mode DEFAULT
7: ab-c1@if6: <BROADCAST,MULTICAST> mtu 1500 qdisc noop state DOWN mode DEFAULT
8: ab-s1@ab-c1: <BROADCAST,MULTICAST> mtu 1500 qdisc noop state DOWN mode DEFAULT
9: ab-cx: <BROADCAST> mtu 1500
10: abc-c1: <BROADCAST> mtu 1500
11: ab-c12: <BROADCAST> mtu 1500
`
	got := strayLinks(out, "ab")
	want := []string{"ab-c1", "ab-s1", "ab-c12"}
	if !slices.Equal(got, want) {
		t.Errorf("strayLinks = %q, want %q", got, want)
	}
}

func TestParseSubflows(t *testing.T) {
	b, err := os.ReadFile("testdata/ss_client_backup.txt")
	if err != nil {
		t.Fatal(err)
	}
	subs, err := ParseSubflows(string(b))
	if err != nil {
		t.Fatal(err)
	}
	// The sample holds two MPTCP connections (tokens 6889419f and
	// fd26ee15) with 4 subflows each; path 4 was announced as backup.
	if len(subs) != 8 {
		t.Fatalf("got %d subflows, want 8: %+v", len(subs), subs)
	}
	byToken := map[uint32][]Subflow{}
	for _, s := range subs {
		byToken[s.Token] = append(byToken[s.Token], s)
	}
	for _, tok := range []uint32{0x6889419f, 0xfd26ee15} {
		conn := byToken[tok]
		if len(conn) != 4 {
			t.Errorf("token %x: %d subflows", tok, len(conn))
			continue
		}
		var paths []int
		for _, s := range conn {
			l, r := s.Local.Addr().As4(), s.Remote.Addr().As4()
			if l[2] != r[2] {
				t.Errorf("subflow crosses paths: %v -> %v", s.Local, s.Remote)
			}
			paths = append(paths, int(l[2]))
			initial := s.Remote.Port() == 5300
			if initial == s.Join() {
				t.Errorf("%v -> %v: flags %q", s.Local, s.Remote, s.Flags)
			}
			if s.Backup() != (l[2] == 4) {
				t.Errorf("%v: backup=%v flags %q", s.Local, s.Backup(), s.Flags)
			}
			if s.Join() && (s.RemoteToken == 0 || s.RemoteID != l[2]) {
				t.Errorf("%v: remote token %x id %d", s.Local, s.RemoteToken, s.RemoteID)
			}
		}
		slices.Sort(paths)
		if !slices.Equal(paths, []int{1, 2, 3, 4}) {
			t.Errorf("token %x: paths %v", tok, paths)
		}
	}
	// The busy data connection's initial subflow.
	var found bool
	for _, s := range subs {
		if s.Local == netip.MustParseAddrPort("10.77.1.1:50778") {
			found = true
			if s.Token != 0x6889419f || s.RemoteToken != 0 || s.Flags != "Mmec" || s.BytesSent != 235441149 || s.BytesAcked != 235320638 {
				t.Errorf("initial subflow: %+v", s)
			}
		}
	}
	if !found {
		t.Error("10.77.1.1:50778 not found")
	}

	b, err = os.ReadFile("testdata/ss_server_backup.txt")
	if err != nil {
		t.Fatal(err)
	}
	subs, err = ParseSubflows(string(b))
	if err != nil {
		t.Fatal(err)
	}
	if len(subs) != 8 {
		t.Errorf("server: got %d subflows, want 8", len(subs))
	}
}

func TestParseSubflowsIgnoresPlainTCP(t *testing.T) {
	out := "ESTAB 0 0 10.0.0.1:22 10.0.0.2:5555\n\t cubic wscale:7,7 rto:204 bytes_sent:100\n" +
		"ESTAB 0 0 [::ffff:10.77.1.1]:4000 [::ffff:10.77.1.2]:10809\n\t cubic bytes_acked:5 tcp-ulp-mptcp flags:Mmec token:0000(id:0)/abcd(id:0) seq:1 sfseq:1 ssnoff:1 maplen:0\n"
	subs, err := ParseSubflows(out)
	if err != nil {
		t.Fatal(err)
	}
	if len(subs) != 1 {
		t.Fatalf("got %+v", subs)
	}
	s := subs[0]
	if s.Local != netip.MustParseAddrPort("10.77.1.1:4000") || s.Token != 0xabcd || s.BytesAcked != 5 {
		t.Errorf("got %+v", s)
	}
	if _, err := ParseSubflows("0 0 1.1.1.1:1 2.2.2.2:2\n\t tcp-ulp-mptcp token:zz(id:0)/1(id:0)\n"); err == nil {
		t.Error("bad token accepted")
	}
}
