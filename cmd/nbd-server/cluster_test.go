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

package main

import (
	"bytes"
	"context"
	"net/netip"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/hostaddr"
	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/agent"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
)

func TestParseArgsCluster(t *testing.T) {
	t.Setenv("NODE_NAME", "node-from-env")
	t.Setenv("POD_NAMESPACE", "ns-from-env")
	o, err := parseArgs([]string{"--cluster", "--storage-address", "10.0.0.1,10.0.1.1", "--storage-address", "fd00::1,10.77.1.0/24"})
	if err != nil {
		t.Fatal(err)
	}
	want := &clusterOptions{
		nodeName:  "node-from-env",
		dataDir:   defaultDataDir,
		namespace: "ns-from-env",
		addresses: hostaddr.List{Flag: "--storage-address", Entries: []hostaddr.Entry{
			{Addr: netip.MustParseAddr("10.0.0.1")}, {Addr: netip.MustParseAddr("10.0.1.1")},
			{Addr: netip.MustParseAddr("fd00::1")}, {Prefix: netip.MustParsePrefix("10.77.1.0/24")},
		}},
		topology:   map[string]string{access.TopologyKey: access.DefaultTopology},
		heartbeat:  defaultHeartbeat,
		autoBackup: true,
		staleLoss:  mptcp.DefaultStaleLossCount,
		identity:   true,
		port:       10809,

		leaseDuration: agent.DefaultLeaseDuration,
	}
	if !reflect.DeepEqual(o.cluster, want) {
		t.Fatalf("cluster options = %+v, want %+v", o.cluster, want)
	}
	if !o.noList || len(o.exports) != 0 || !reflect.DeepEqual(o.listen, []string{defaultListen}) {
		t.Fatalf("options = %+v", o)
	}

	o, err = parseArgs([]string{"--cluster", "--node-name", "n1", "--namespace", "mpnbd",
		"--storage-address", "192.168.1.5", "--data-dir", "/srv/vols", "--signal-nic", "eth1,10.7.0.0/16",
		"--signal-nic", "eth2", "--topology", "topology.kubernetes.io/zone=a,rack=r1", "--heartbeat", "3s",
		"--auto-backup=false", "--mptcp-stale-loss-count", "0", "--kubeconfig", "/etc/kube.conf", "--listen", ":10810", "--tcp", "--identity=false",
		"--lease-duration", "10s", "--rebuild-rate", "50"})
	if err != nil {
		t.Fatal(err)
	}
	want = &clusterOptions{
		nodeName:   "n1",
		dataDir:    "/srv/vols",
		namespace:  "mpnbd",
		addresses:  hostaddr.List{Flag: "--storage-address", Entries: []hostaddr.Entry{{Addr: netip.MustParseAddr("192.168.1.5")}}},
		signalNICs: []mptcp.NICSpec{"eth1", "10.7.0.0/16", "eth2"},
		topology:   map[string]string{"topology.kubernetes.io/zone": "a", "rack": "r1"},
		heartbeat:  3 * time.Second,
		kubeconfig: "/etc/kube.conf",
		port:       10810,

		leaseDuration: 10 * time.Second,
		rebuildRate:   50 << 20,
	}
	if !reflect.DeepEqual(o.cluster, want) {
		t.Fatalf("cluster options = %+v, want %+v", o.cluster, want)
	}
	if !o.tcp || !reflect.DeepEqual(o.listen, []string{":10810"}) {
		t.Fatalf("options = %+v", o)
	}

	// The handshakes kept for published nodes: half of --max-handshakes
	// unless given; 0 keeps none.
	for _, tc := range []struct {
		args []string
		want int
	}{
		{nil, 0},
		{[]string{"--reserved-handshakes", "100"}, 100},
		{[]string{"--reserved-handshakes", "0"}, -1},
		{[]string{"--max-handshakes", "0", "--reserved-handshakes", "5000"}, 5000},
	} {
		o, err := parseArgs(append([]string{"--cluster", "--node-name", "n1", "--namespace", "ns", "--storage-address", "10.0.0.1"}, tc.args...))
		if err != nil {
			t.Fatalf("%q: %v", tc.args, err)
		}
		if o.limits.ReservedHandshakes != tc.want {
			t.Errorf("%q: Limits.ReservedHandshakes %d, want %d", tc.args, o.limits.ReservedHandshakes, tc.want)
		}
	}

	// Standalone runs stay as they were.
	if o, err := parseArgs([]string{"--export", "d=/x"}); err != nil || o.cluster != nil {
		t.Fatalf("standalone: %+v, %v", o, err)
	}
}

func TestParseArgsClusterErrors(t *testing.T) {
	t.Setenv("NODE_NAME", "")
	t.Setenv("POD_NAMESPACE", "")
	cfg := writeFile(t, "c.json", `{"exports": []}`)
	ok := []string{"--cluster", "--node-name", "n1", "--namespace", "ns", "--storage-address", "10.0.0.1"}
	with := func(extra ...string) []string { return append(append([]string(nil), ok...), extra...) }
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"no node name", []string{"--cluster", "--namespace", "ns", "--storage-address", "10.0.0.1"}, "--node-name"},
		{"short lease", with("--lease-duration", "2s"), "--lease-duration"},
		{"negative rebuild rate", with("--rebuild-rate", "-1"), "--rebuild-rate"},
		{"no namespace", []string{"--cluster", "--node-name", "n1", "--storage-address", "10.0.0.1"}, "--namespace"},
		{"no storage address", []string{"--cluster", "--node-name", "n1", "--namespace", "ns"}, "--storage-address"},
		{"empty storage address", []string{"--cluster", "--node-name", "n1", "--namespace", "ns", "--storage-address", ","}, "--storage-address"},
		{"storage address with port", with("--storage-address", "10.0.0.2:10809"), `invalid --storage-address "10.0.0.2:10809": want an IP address without a port, or a CIDR`},
		{"storage address an interface", with("--storage-address", "eth1"), `invalid --storage-address "eth1"`},
		{"bad storage CIDR", with("--storage-address", "10.77.1.0/33"), `invalid --storage-address "10.77.1.0/33"`},
		{"storage address twice", with("--storage-address", "10.0.0.1"), "--storage-address 10.0.0.1 is given twice"},
		{"storage CIDR twice", with("--storage-address", "10.77.1.0/24,10.77.1.0/24"), "--storage-address 10.77.1.0/24 is given twice"},
		{"bad node name", with("--node-name", "Node_1"), `invalid --node-name "Node_1"`},
		{"bad signal nic", with("--signal-nic", "10.0.0.0/99"), `invalid --signal-nic "10.0.0.0/99"`},
		{"bad topology", with("--topology", "zone"), `topology "zone"`},
		{"bad topology value", with("--topology", "zone=a b"), `topology value "a b"`},
		{"bad heartbeat", with("--heartbeat", "0s"), "invalid --heartbeat 0s"},
		{"negative stale loss count", with("--mptcp-stale-loss-count", "-1"), "invalid --mptcp-stale-loss-count -1"},
		{"export in cluster mode", with("--export", "a=/a"), "--export cannot be combined with --cluster"},
		{"config in cluster mode", with("--config", cfg), "--config cannot be combined with --cluster"},
		{"cluster flag without cluster", []string{"--export", "a=/a", "--node-name", "n1"}, "--node-name needs --cluster"},
		{"address without cluster", []string{"--export", "a=/a", "--storage-address", "10.0.0.1"}, "--storage-address needs --cluster"},
		{"identity without cluster", []string{"--export", "a=/a", "--identity"}, "--identity needs --cluster"},
		{"listen on a host in cluster mode", with("--listen", "0.0.0.0:10809"), "in cluster mode --listen gives only the port (:10809"},
		{"two listen addresses in cluster mode", with("--listen", ":10809", "--listen", ":10810"), "one --listen address"},
		{"negative reserved handshakes", with("--reserved-handshakes", "-1"), "invalid --reserved-handshakes -1"},
		{"more reserved than handshakes", with("--max-handshakes", "10", "--reserved-handshakes", "11"), "--reserved-handshakes 11 is more than --max-handshakes 10"},
		{"reserved handshakes without cluster", []string{"--export", "a=/a", "--reserved-handshakes", "3"}, "--reserved-handshakes needs --cluster"},
		{"tls files in cluster mode", with("--tls", "on", "--tls-cert", "c.pem", "--tls-key", "k.pem"), "--tls cannot be combined with --cluster"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o, err := parseArgs(tc.args)
			if err == nil {
				t.Fatalf("parsed as %+v (cluster %+v), want an error", o, o.cluster)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q, want it to contain %q", err, tc.want)
			}
		})
	}
}

func TestRunClusterUsage(t *testing.T) {
	t.Setenv("NODE_NAME", "")
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), []string{"--help"}, &stdout, &stderr); code != 0 {
		t.Fatalf("--help: exit %d", code)
	}
	for _, want := range []string{"--cluster", "--node-name NAME", "--storage-address IP|CIDR[,...]", "--signal-nic NIC[,NIC...]",
		"--topology KEY=VALUE[,KEY=VALUE...]", "--heartbeat DURATION", "--reserved-handshakes N", "--kubeconfig FILE", "--data-dir DIR", "--identity",
		defaultDataDir, "$NODE_NAME", "$POD_NAMESPACE", "/readyz"} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("help text lacks %q", want)
		}
	}
	stdout.Reset()
	if code := run(context.Background(), []string{"--cluster", "--storage-address", "10.0.0.1"}, &stdout, &stderr); code != exitUsage {
		t.Fatalf("missing node name: exit %d, want %d", code, exitUsage)
	}
	if !strings.Contains(stderr.String(), "--node-name") {
		t.Fatalf("stderr %q does not name --node-name", stderr.String())
	}
}

// fakeHost is an AddrSource standing for the host's addresses.
type fakeHost []mptcp.Interface

func (f fakeHost) Interfaces() ([]mptcp.Interface, error) { return f, nil }

// TestRunClusterStorageCIDR: a --storage-address CIDR holding no address
// of the host stops the agent at start, the log naming it.
func TestRunClusterStorageCIDR(t *testing.T) {
	old := hostAddrs
	t.Cleanup(func() { hostAddrs = old })
	hostAddrs = fakeHost{{Index: 2, Name: "eth1", Addrs: []netip.Addr{netip.MustParseAddr("10.77.1.5")}}}
	var stdout, stderr bytes.Buffer
	args := []string{"--cluster", "--node-name", "n1", "--namespace", "ns", "--data-dir", filepath.Join(t.TempDir(), "vols"),
		"--metrics-addr", "", "--listen", ":0", "--storage-address", "10.77.1.0/24,10.77.4.0/24"}
	if code := run(context.Background(), args, &stdout, &stderr); code != exitFailure {
		t.Fatalf("exit %d, want %d; stderr:\n%s", code, exitFailure, stderr.String())
	}
	if want := "--storage-address 10.77.4.0/24: no address of this host is in it"; !strings.Contains(stderr.String(), want) {
		t.Fatalf("stderr %q does not say %q", stderr.String(), want)
	}
}
