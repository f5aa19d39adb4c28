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
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/attach/fuse"
	"github.com/mpnbd/mpnbd/pkg/datapath"
	"github.com/mpnbd/mpnbd/pkg/driver"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// TestMain: the test binary is also a volume's FUSE server process, as
// the node executable is.
func TestMain(m *testing.M) {
	if fuse.ServeRequested() {
		os.Exit(fuse.ServeMain())
	}
	os.Exit(m.Run())
}

func TestParseArgs(t *testing.T) {
	o, err := parseArgs([]string{"--node-id", "n1", "--transports", "fuse,relay", "--topology", "zone=a,rack=r1",
		"--storage-nic", "eth1,10.0.0.0/24", "--storage-address", "10.0.0.2", "--storage-address", "10.77.1.0/24,fd00:77::/64"})
	if err != nil {
		t.Fatal(err)
	}
	if o.nodeID != "n1" || len(o.transports) != 2 || o.transports[0] != attach.FUSE || o.topology["rack"] != "r1" ||
		len(o.storageNICs) != 2 || o.staleLoss != mptcp.DefaultStaleLossCount {
		t.Fatalf("parsed %+v", o)
	}
	if got := fmt.Sprint(o.storageAddrs.Entries); got != "[10.0.0.2 10.77.1.0/24 fd00:77::/64]" || o.storageAddrs.Flag != "--storage-address" {
		t.Fatalf("storage addresses %s (flag %q)", got, o.storageAddrs.Flag)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{}, "--node-id"},
		{[]string{"--node-id", "n", "--transports", "auto"}, "auto"},
		{[]string{"--node-id", "n", "--transports", "nfs"}, "nfs"},
		{[]string{"--node-id", "n", "--storage-address", "eth0"}, `invalid --storage-address "eth0": want an IP address without a port, or a CIDR`},
		{[]string{"--node-id", "n", "--storage-address", "10.77.1.0/33"}, `invalid --storage-address "10.77.1.0/33"`},
		{[]string{"--node-id", "n", "--storage-address", "10.0.0.2", "--storage-address", "10.0.0.2"}, "--storage-address 10.0.0.2 is given twice"},
		{[]string{"--node-id", "n", "--topology", "zone"}, "zone"},
		{[]string{"--node-id", "n", "--endpoint", "csi.sock"}, "--endpoint"},
		{[]string{"--node-id", "n", "--datapath-socket", "a", "--serve-datapath", "b"}, "--serve-datapath"},
		{[]string{"--node-id", "n", "--generation", "seven"}, "seven"},
		{[]string{"--node-id", "n", "--mptcp-stale-loss-count", "-2"}, "--mptcp-stale-loss-count -2"},
	} {
		t.Setenv("NODE_NAME", "")
		if _, err := parseArgs(c.args); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("parseArgs(%q) = %v, want an error naming %s", c.args, err, c.want)
		}
	}
}

// fakeHost is an AddrSource standing for the host's addresses.
type fakeHost struct {
	ifs []mptcp.Interface
	err error
}

func (f fakeHost) Interfaces() ([]mptcp.Interface, error) { return f.ifs, f.err }

// storageHost has two storage NICs on the subnets 10.77.1.0/24 and
// 10.77.2.0/24, and a management address.
var storageHost = fakeHost{ifs: []mptcp.Interface{
	{Index: 1, Name: "lo", Addrs: []netip.Addr{netip.MustParseAddr("127.0.0.1")}},
	{Index: 2, Name: "eth0", Addrs: []netip.Addr{netip.MustParseAddr("192.168.0.10"), netip.MustParseAddr("fe80::1")}},
	{Index: 3, Name: "eth1", Addrs: []netip.Addr{netip.MustParseAddr("10.77.1.5"), netip.MustParseAddr("fd00:77::5")}},
	{Index: 4, Name: "eth2", Addrs: []netip.Addr{netip.MustParseAddr("10.77.2.5")}},
}}

// TestStorageAddresses: the addresses published on the Node, CIDRs
// resolved on the host's addresses.
func TestStorageAddresses(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{nil, "[192.168.0.10 10.77.1.5 fd00:77::5 10.77.2.5]"},
		{[]string{"--storage-address", "10.0.0.9"}, "[10.0.0.9]"},
		{[]string{"--storage-address", "10.77.2.0/24,10.77.1.0/24"}, "[10.77.2.5 10.77.1.5]"},
		{[]string{"--storage-address", "10.77.0.0/16", "--storage-address", "10.77.2.5,fd00:77::/64"}, "[10.77.1.5 10.77.2.5 fd00:77::5]"},
	} {
		o, err := parseArgs(append([]string{"--node-id", "n"}, c.args...))
		if err != nil {
			t.Fatal(err)
		}
		got, err := storageAddresses(o, storageHost)
		if err != nil || fmt.Sprint(got) != c.want {
			t.Errorf("storage addresses of %q: %q, %v; want %s", c.args, got, err, c.want)
		}
	}

	o, err := parseArgs([]string{"--node-id", "n", "--storage-address", "10.77.1.0/24,10.77.4.0/24"})
	if err != nil {
		t.Fatal(err)
	}
	if got, err := storageAddresses(o, storageHost); err == nil ||
		!strings.Contains(err.Error(), "--storage-address 10.77.4.0/24: no address of this host is in it") {
		t.Errorf("storage addresses with a CIDR holding none of the host's: %q, %v", got, err)
	}
	failing := errors.New("no netlink")
	if _, err := storageAddresses(&options{}, fakeHost{err: failing}); !errors.Is(err, failing) {
		t.Errorf("storage addresses of a host whose addresses cannot be listed: %v", err)
	}
}

// TestRunStorageCIDRWithoutAddress: the plugin stops at start on a
// --storage-address CIDR that holds none of the host's addresses, and
// says which.
func TestRunStorageCIDRWithoutAddress(t *testing.T) {
	old := hostAddrs
	t.Cleanup(func() { hostAddrs = old })
	hostAddrs = storageHost
	var stdout, stderr bytes.Buffer
	args := []string{"--node-id", "n", "--state-dir", t.TempDir(), "--endpoint", "unix://" + filepath.Join(t.TempDir(), "csi.sock"),
		"--storage-address", "10.77.4.0/24"}
	if code := run(context.Background(), args, &stdout, &stderr); code != 1 {
		t.Fatalf("exit %d, want 1; stderr:\n%s", code, stderr.String())
	}
	if want := "--storage-address 10.77.4.0/24: no address of this host is in it"; !strings.Contains(stderr.String(), want) {
		t.Fatalf("stderr %q does not say %q", stderr.String(), want)
	}
}

// TestServeMetricsBracketedAddress: --metrics-addr takes the chart's
// [$(HTTP_ADDRESS)]:PORT, the brackets around an IPv4 address too, and
// serves there only.
func TestServeMetricsBracketedAddress(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(l.Addr().String())
	l.Close()
	addr := "[127.0.0.1]:" + port
	o, err := parseArgs([]string{"--node-id", "n", "--metrics-addr", addr})
	if err != nil || o.metricsAddr != addr {
		t.Fatalf("parseArgs(--metrics-addr %s): %+v, %v", addr, o, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	up := prometheus.NewGauge(prometheus.GaugeOpts{Name: "test_up"})
	up.Set(1)
	reg := prometheus.NewRegistry()
	reg.MustRegister(up)
	if err := driver.ServeMetrics(ctx, addr, reg, slog.New(slog.NewTextHandler(io.Discard, nil))); err != nil {
		t.Fatal(err)
	}
	resp, err := http.Get("http://127.0.0.1:" + port + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), "test_up 1") {
		t.Errorf("/metrics on %s: %s\n%.300s", addr, resp.Status, b)
	}
	// Bound to 127.0.0.1 only: another loopback address does not answer.
	if c, err := net.DialTimeout("tcp", "127.0.0.2:"+port, time.Second); err == nil {
		c.Close()
		t.Errorf("%s answers on 127.0.0.2", addr)
	}
}

// A pod without the generation label gets an empty value: unknown.
func TestParseGeneration(t *testing.T) {
	for arg, want := range map[string]int64{"--generation=": 0, "--generation=12": 12} {
		o, err := parseArgs([]string{"--node-id", "n", arg})
		if err != nil || o.generation != want {
			t.Errorf("parseArgs(%s): generation %v, %v; want %d", arg, o, err, want)
		}
	}
}

func TestRunUsage(t *testing.T) {
	var out, errb bytes.Buffer
	if code := run(context.Background(), []string{"--help"}, &out, &errb); code != 0 || !strings.Contains(out.String(), "-storage-nic") {
		t.Fatalf("--help: code %d, output %q", code, out.String())
	}
}

// TestRunServesCSIAndMetrics runs the plugin (fuse transport) until it is
// stopped: the CSI socket answers and /metrics is served.
func TestRunServesCSIAndMetrics(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the node plugin needs root")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skipf("no fuse transport here: %v", err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	dir := t.TempDir()
	sock := filepath.Join(dir, "csi.sock")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	var stderr bytes.Buffer
	go func() {
		done <- run(ctx, []string{"--node-id", "n1", "--endpoint", "unix://" + sock, "--state-dir", dir,
			"--transports", "fuse", "--metrics-addr", addr}, io.Discard, &stderr)
	}()
	var body string
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get("http://" + addr + "/metrics")
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				body = string(b)
				break
			}
		}
		if time.Now().After(deadline) {
			cancel()
			t.Fatalf("no metrics at %s: %v\n%s", addr, err, stderr.String())
		}
		time.Sleep(100 * time.Millisecond)
	}
	if !strings.Contains(body, "process_cpu_seconds_total") {
		t.Errorf("metrics without the process collector:\n%.500s", body)
	}
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	info, err := csi.NewNodeClient(conn).NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	if err != nil || info.GetNodeId() != "n1" {
		t.Fatalf("NodeGetInfo = %v, %v", info, err)
	}
	cancel()
	if code := <-done; code != 0 {
		t.Fatalf("run returned %d:\n%s", code, stderr.String())
	}
}

// TestDatapathComponent runs the datapath component and a plugin that
// drives it over the socket: a fuse volume attached through the component
// keeps serving its device while the plugin stops and starts again, and
// the restarted plugin reports it healthy.
func TestDatapathComponent(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the datapath component needs root")
	}
	if err := fuse.Available(); err != nil {
		t.Skipf("no fuse transport here: %v", err)
	}
	backend := nbd.NewMemBackend(16 << 20)
	srv := &nbd.Server{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	if err := srv.AddExport(&nbd.Export{Name: "vol", Backend: backend}); err != nil {
		t.Fatal(err)
	}
	nl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(nl)
	t.Cleanup(func() { srv.Shutdown(context.Background()) })

	dir := t.TempDir()
	dpSock := filepath.Join(dir, "datapath.sock")
	dpCtx, dpStop := context.WithCancel(context.Background())
	dpDone := make(chan int, 1)
	var dpErr bytes.Buffer
	go func() {
		dpDone <- run(dpCtx, []string{"--node-id", "n1", "--serve-datapath", dpSock, "--state-dir", filepath.Join(dir, "dp"),
			"--transports", "fuse"}, io.Discard, &dpErr)
	}()
	dp := &datapath.Client{Path: dpSock}
	deadline := time.Now().Add(30 * time.Second)
	for len(dp.Available()) == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the datapath component did not come up:\n%s", dpErr.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	tg := attach.Target{VolumeID: "pv-dp", Export: "vol", Addrs: []string{nl.Addr().String()}}
	att, err := dp.Attach(context.Background(), attach.FUSE, tg, attach.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := dp.Detach(context.Background(), tg.VolumeID); err != nil {
			t.Errorf("detach: %v", err)
		}
		dpStop()
		<-dpDone
	})

	plugin := func() (context.CancelFunc, chan int, string) {
		sock := filepath.Join(dir, "csi.sock")
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan int, 1)
		go func() {
			done <- run(ctx, []string{"--node-id", "n1", "--endpoint", "unix://" + sock, "--state-dir", filepath.Join(dir, "plugin"),
				"--datapath-socket", dpSock}, io.Discard, io.Discard)
		}()
		return cancel, done, sock
	}
	ready := func(sock string) {
		t.Helper()
		conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		deadline := time.Now().Add(30 * time.Second)
		for {
			info, err := csi.NewNodeClient(conn).NodeGetInfo(context.Background(), &csi.NodeGetInfoRequest{})
			if err == nil && info.GetNodeId() == "n1" {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("plugin not answering: %v", err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	stop, done, sock := plugin()
	ready(sock)
	want := bytes.Repeat([]byte{0x6d}, 1<<20)
	f, err := os.OpenFile(att.Device, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(want, 0); err != nil {
		t.Fatal(err)
	}
	stop()
	if code := <-done; code != 0 {
		t.Fatalf("plugin exited %d", code)
	}
	// The plugin is gone; the device is served all the same.
	if err := f.Sync(); err != nil {
		t.Fatalf("fsync with the plugin stopped: %v", err)
	}
	got := make([]byte, len(want))
	if _, err := backend.ReadAt(got, 0); err != nil {
		t.Fatalf("read the backend: %v", err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("the write did not reach the server with the plugin stopped")
	}
	stop, done, sock = plugin()
	defer func() { stop(); <-done }()
	ready(sock)
	if tr, h, err := dp.Health(tg.VolumeID); err != nil || tr != attach.FUSE || !h.Connected {
		t.Fatalf("health through the component after the plugin's restart: %s %+v %v", tr, h, err)
	}
}

// TestGuardOnlyWhereIOIsServed: the process that serves the volumes' I/O
// (a node plugin running its own data path, or the datapath component)
// is kept in memory and from the OOM killer; a node plugin whose data
// path is the datapath component's is not.
func TestGuardOnlyWhereIOIsServed(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the node plugin needs root")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skipf("no fuse transport here: %v", err)
	}
	var calls atomic.Int32
	saved := guardAgainstReclaim
	guardAgainstReclaim = func() error { calls.Add(1); return nil }
	t.Cleanup(func() { guardAgainstReclaim = saved })
	dir := t.TempDir()
	for i, c := range []struct {
		role string
		args []string
		want int32
	}{
		{"a node plugin whose data path is the datapath component's", []string{"--datapath-socket", filepath.Join(dir, "datapath.sock")}, 0},
		{"a node plugin running its own data path", []string{"--transports", "fuse"}, 1},
		{"the datapath component", []string{"--serve-datapath", filepath.Join(dir, "served.sock"), "--transports", "fuse"}, 1},
	} {
		calls.Store(0)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan int, 1)
		var stderr bytes.Buffer
		args := append([]string{"--node-id", "n1", "--state-dir", filepath.Join(dir, strconv.Itoa(i))}, c.args...)
		sock := filepath.Join(dir, strconv.Itoa(i)+".sock")
		if c.args[0] == "--serve-datapath" {
			sock = c.args[1]
		} else {
			args = append(args, "--endpoint", "unix://"+sock)
		}
		go func() { done <- run(ctx, args, io.Discard, &stderr) }()
		// Up once its socket answers: the guard, if any, came before.
		deadline := time.Now().Add(30 * time.Second)
		for {
			if conn, err := net.Dial("unix", sock); err == nil {
				conn.Close()
				break
			}
			if time.Now().After(deadline) {
				cancel()
				t.Fatalf("%s: not serving at %s:\n%s", c.role, sock, stderr.String())
			}
			time.Sleep(50 * time.Millisecond)
		}
		cancel()
		if code := <-done; code != 0 {
			t.Fatalf("%s: run returned %d:\n%s", c.role, code, stderr.String())
		}
		if n := calls.Load(); n != c.want {
			t.Errorf("%s: guarded against memory reclaim %d times, want %d", c.role, n, c.want)
		}
	}
}
