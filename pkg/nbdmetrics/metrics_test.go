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

package nbdmetrics

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
	"github.com/mpnbd/mpnbd/pkg/replica"
)

func newObserver(t *testing.T) (*Observer, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	o, err := New(reg)
	if err != nil {
		t.Fatal(err)
	}
	return o, reg
}

// value returns the value of the series of name whose labels include
// want, and whether there is one.
func value(t *testing.T, reg prometheus.Gatherer, name string, want map[string]string) (float64, bool) {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			got := map[string]string{}
			for _, lp := range m.GetLabel() {
				got[lp.GetName()] = lp.GetValue()
			}
			for k, v := range want {
				if got[k] != v {
					continue next
				}
			}
			switch {
			case m.Counter != nil:
				return m.Counter.GetValue(), true
			case m.Gauge != nil:
				return m.Gauge.GetValue(), true
			case m.Histogram != nil:
				return float64(m.Histogram.GetSampleCount()), true
			}
		}
	}
	return 0, false
}

func series(t *testing.T, reg prometheus.Gatherer, name string) []*dto.Metric {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()
		}
	}
	return nil
}

func TestRequestCounters(t *testing.T) {
	o, reg := newObserver(t)
	o.ExportAdded("idle")
	o.Request("disk", nbd.CmdRead, 4096, 80*time.Microsecond, 0)
	o.Request("disk", nbd.CmdRead, 512, 2*time.Millisecond, 0)
	o.Request("disk", nbd.CmdWrite, 65536, 3*time.Second, 0)
	o.Request("disk", nbd.CmdWrite, 0, time.Millisecond, nbd.ENOSPC)
	o.Request("disk", nbd.CmdRead, 0, time.Millisecond, nbd.EINVAL)
	o.Request("disk", nbd.CmdFlush, 0, 20*time.Second, 0)
	o.Request("disk", nbd.CmdTrim, 0, time.Millisecond, nbd.EPERM)
	o.Request("other", nbd.CmdWriteZeroes, 0, time.Millisecond, 0)

	const want = `
# HELP mpnbd_server_read_bytes_total Bytes read from the export and sent to clients (successful NBD_CMD_READ payloads).
# TYPE mpnbd_server_read_bytes_total counter
mpnbd_server_read_bytes_total{export="disk"} 4608
mpnbd_server_read_bytes_total{export="idle"} 0
# HELP mpnbd_server_written_bytes_total Bytes received from clients and written to the export (successful NBD_CMD_WRITE payloads).
# TYPE mpnbd_server_written_bytes_total counter
mpnbd_server_written_bytes_total{export="disk"} 65536
mpnbd_server_written_bytes_total{export="idle"} 0
# HELP mpnbd_server_requests_total Requests handled, by export and command, whether they succeeded or not.
# TYPE mpnbd_server_requests_total counter
mpnbd_server_requests_total{cmd="flush",export="disk"} 1
mpnbd_server_requests_total{cmd="read",export="disk"} 3
mpnbd_server_requests_total{cmd="trim",export="disk"} 1
mpnbd_server_requests_total{cmd="write",export="disk"} 2
mpnbd_server_requests_total{cmd="write_zeroes",export="other"} 1
# HELP mpnbd_server_request_errors_total Requests answered with an error, by export, command and NBD error value.
# TYPE mpnbd_server_request_errors_total counter
mpnbd_server_request_errors_total{cmd="read",errno="EINVAL",export="disk"} 1
mpnbd_server_request_errors_total{cmd="trim",errno="EPERM",export="disk"} 1
mpnbd_server_request_errors_total{cmd="write",errno="ENOSPC",export="disk"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want),
		"mpnbd_server_read_bytes_total", "mpnbd_server_written_bytes_total",
		"mpnbd_server_requests_total", "mpnbd_server_request_errors_total"); err != nil {
		t.Fatal(err)
	}

	// The latency histogram: one series per export and command, with the
	// samples in the right buckets (le is inclusive, +Inf catches 20 s).
	o2, _ := newObserver(t)
	o2.Request("disk", nbd.CmdFlush, 0, 20*time.Second, 0)
	const wantHist = `
# HELP mpnbd_server_request_duration_seconds Time from a request being read to its reply being written, by export and command.
# TYPE mpnbd_server_request_duration_seconds histogram
mpnbd_server_request_duration_seconds_bucket{cmd="flush",export="disk",le="5e-05"} 0
mpnbd_server_request_duration_seconds_bucket{cmd="flush",export="disk",le="0.0001"} 0
mpnbd_server_request_duration_seconds_bucket{cmd="flush",export="disk",le="0.00025"} 0
mpnbd_server_request_duration_seconds_bucket{cmd="flush",export="disk",le="0.0005"} 0
mpnbd_server_request_duration_seconds_bucket{cmd="flush",export="disk",le="0.001"} 0
mpnbd_server_request_duration_seconds_bucket{cmd="flush",export="disk",le="0.0025"} 0
mpnbd_server_request_duration_seconds_bucket{cmd="flush",export="disk",le="0.005"} 0
mpnbd_server_request_duration_seconds_bucket{cmd="flush",export="disk",le="0.01"} 0
mpnbd_server_request_duration_seconds_bucket{cmd="flush",export="disk",le="0.025"} 0
mpnbd_server_request_duration_seconds_bucket{cmd="flush",export="disk",le="0.05"} 0
mpnbd_server_request_duration_seconds_bucket{cmd="flush",export="disk",le="0.1"} 0
mpnbd_server_request_duration_seconds_bucket{cmd="flush",export="disk",le="0.25"} 0
mpnbd_server_request_duration_seconds_bucket{cmd="flush",export="disk",le="0.5"} 0
mpnbd_server_request_duration_seconds_bucket{cmd="flush",export="disk",le="1"} 0
mpnbd_server_request_duration_seconds_bucket{cmd="flush",export="disk",le="2.5"} 0
mpnbd_server_request_duration_seconds_bucket{cmd="flush",export="disk",le="5"} 0
mpnbd_server_request_duration_seconds_bucket{cmd="flush",export="disk",le="10"} 0
mpnbd_server_request_duration_seconds_bucket{cmd="flush",export="disk",le="+Inf"} 1
mpnbd_server_request_duration_seconds_sum{cmd="flush",export="disk"} 20
mpnbd_server_request_duration_seconds_count{cmd="flush",export="disk"} 1
`
	if err := testutil.CollectAndCompare(o2.duration, strings.NewReader(wantHist)); err != nil {
		t.Fatal(err)
	}
	if n := testutil.CollectAndCount(o.duration); n != 5 {
		t.Fatalf("%d latency series, want 5 (one per export and command)", n)
	}
	for _, tc := range []struct {
		cmd  string
		le   float64
		want uint64
	}{
		{"read", 50e-6, 0}, {"read", 100e-6, 1}, {"read", 2.5e-3, 3},
		{"write", 1e-3, 1}, {"write", 2.5, 1}, {"write", 5, 2},
	} {
		got := bucket(t, reg, "disk", tc.cmd, tc.le)
		if got != tc.want {
			t.Errorf("%s le=%g: %d samples, want %d", tc.cmd, tc.le, got, tc.want)
		}
	}
}

func bucket(t *testing.T, reg prometheus.Gatherer, export, cmd string, le float64) uint64 {
	t.Helper()
	for _, m := range series(t, reg, "mpnbd_server_request_duration_seconds") {
		labels := map[string]string{}
		for _, lp := range m.GetLabel() {
			labels[lp.GetName()] = lp.GetValue()
		}
		if labels["export"] != export || labels["cmd"] != cmd {
			continue
		}
		for _, b := range m.GetHistogram().GetBucket() {
			if b.GetUpperBound() == le {
				return b.GetCumulativeCount()
			}
		}
		t.Fatalf("no bucket le=%g", le)
	}
	t.Fatalf("no histogram for %s/%s", export, cmd)
	return 0
}

func TestBuckets(t *testing.T) {
	if LatencyBuckets[0] != 50e-6 || LatencyBuckets[len(LatencyBuckets)-1] != 10 {
		t.Fatalf("buckets %v do not span 50µs..10s", LatencyBuckets)
	}
	for i := 1; i < len(LatencyBuckets); i++ {
		if LatencyBuckets[i] <= LatencyBuckets[i-1] {
			t.Fatalf("buckets not increasing at %d: %v", i, LatencyBuckets)
		}
	}
}

func TestConnectionSeries(t *testing.T) {
	o, reg := newObserver(t)
	a1, b1 := net.Pipe()
	a2, b2 := net.Pipe()
	defer func() { a1.Close(); b1.Close(); a2.Close(); b2.Close() }()
	c1 := nbd.ConnInfo{Conn: a1, RemoteAddr: &net.TCPAddr{IP: net.IPv4(10, 0, 0, 1), Port: 40001}}
	c2 := nbd.ConnInfo{Conn: a2, RemoteAddr: &net.TCPAddr{IP: net.IPv4(10, 0, 0, 2), Port: 40002}}

	o.ConnOpened(c1, "disk")
	o.ConnOpened(c2, "disk")
	// Pretend the second one is MPTCP with two joined subflows.
	o.live.mu.Lock()
	o.live.conns[a2].mptcp = true
	o.live.mu.Unlock()
	o.live.getInfo = func(c net.Conn) (mptcp.Info, error) {
		if c != a2 {
			t.Errorf("MPTCP_INFO read from a plain TCP connection")
		}
		return mptcp.Info{Subflows: 2}, nil
	}

	const want = `
# HELP mpnbd_server_connections Connections currently in the transmission phase, by export.
# TYPE mpnbd_server_connections gauge
mpnbd_server_connections{export="disk"} 2
# HELP mpnbd_server_connections_accepted_total Connections that completed negotiation and attached to the export.
# TYPE mpnbd_server_connections_accepted_total counter
mpnbd_server_connections_accepted_total{export="disk"} 2
# HELP mpnbd_server_connection_mptcp 1 if the open connection is carried by Multipath TCP, 0 for plain TCP (or a fallback to it).
# TYPE mpnbd_server_connection_mptcp gauge
mpnbd_server_connection_mptcp{export="disk",remote="10.0.0.1:40001"} 0
mpnbd_server_connection_mptcp{export="disk",remote="10.0.0.2:40002"} 1
# HELP mpnbd_server_connection_mptcp_subflows Additional MPTCP subflows (joined with MP_JOIN, not counting the initial one) of the open connection, from MPTCP_INFO.
# TYPE mpnbd_server_connection_mptcp_subflows gauge
mpnbd_server_connection_mptcp_subflows{export="disk",remote="10.0.0.2:40002"} 2
`
	names := []string{"mpnbd_server_connections", "mpnbd_server_connections_accepted_total",
		"mpnbd_server_connection_mptcp", "mpnbd_server_connection_mptcp_subflows"}
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), names...); err != nil {
		t.Fatal(err)
	}

	// A fallback seen at scrape time turns the gauge to 0 and drops subflows.
	o.live.getInfo = func(net.Conn) (mptcp.Info, error) {
		return mptcp.Info{}, fmt.Errorf("%w: fell back", mptcp.ErrNotMPTCP)
	}
	if v, ok := value(t, reg, "mpnbd_server_connection_mptcp", map[string]string{"remote": "10.0.0.2:40002"}); !ok || v != 0 {
		t.Fatalf("after fallback: mptcp gauge = %v (present %v), want 0", v, ok)
	}
	if n := len(series(t, reg, "mpnbd_server_connection_mptcp_subflows")); n != 0 {
		t.Fatalf("after fallback: %d subflow series, want none", n)
	}
	// Any other error (socket closing) keeps the open-time value.
	o.live.getInfo = func(net.Conn) (mptcp.Info, error) { return mptcp.Info{}, errors.New("bad file descriptor") }
	if v, _ := value(t, reg, "mpnbd_server_connection_mptcp", map[string]string{"remote": "10.0.0.2:40002"}); v != 1 {
		t.Fatalf("on getsockopt error: mptcp gauge = %v, want 1", v)
	}

	// Closed connections take their series with them.
	o.ConnClosed(c1, "disk")
	o.ConnClosed(c2, "disk")
	const after = `
# HELP mpnbd_server_connections Connections currently in the transmission phase, by export.
# TYPE mpnbd_server_connections gauge
mpnbd_server_connections{export="disk"} 0
# HELP mpnbd_server_connections_accepted_total Connections that completed negotiation and attached to the export.
# TYPE mpnbd_server_connections_accepted_total counter
mpnbd_server_connections_accepted_total{export="disk"} 2
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(after), names...); err != nil {
		t.Fatal(err)
	}
}

func TestDuplicateRemoteIsOneSeries(t *testing.T) {
	o, reg := newObserver(t)
	remote := &net.TCPAddr{IP: net.IPv4(10, 0, 0, 1), Port: 40001}
	a1, b1 := net.Pipe()
	a2, b2 := net.Pipe()
	defer func() { a1.Close(); b1.Close(); a2.Close(); b2.Close() }()
	o.ConnOpened(nbd.ConnInfo{Conn: a1, RemoteAddr: remote}, "disk")
	o.ConnOpened(nbd.ConnInfo{Conn: a2, RemoteAddr: remote}, "disk")
	// Gather fails on duplicate series, and series() fails the test then.
	if n := len(series(t, reg, "mpnbd_server_connection_mptcp")); n != 1 {
		t.Fatalf("%d series, want 1", n)
	}
}

func TestExportLifecycle(t *testing.T) {
	o, reg := newObserver(t)
	o.ExportAdded("a")
	o.ExportAdded("b")
	o.Request("a", nbd.CmdWrite, 100, time.Millisecond, 0)
	o.Request("a", nbd.CmdWrite, 0, time.Millisecond, nbd.EIO)
	o.Request("b", nbd.CmdRead, 7, time.Millisecond, 0)
	o.ExportRemoved("a")
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if lp.GetName() == "export" && lp.GetValue() == "a" {
					t.Errorf("%s still has a series for the removed export", mf.GetName())
				}
			}
		}
	}
	if v, ok := value(t, reg, "mpnbd_server_read_bytes_total", map[string]string{"export": "b"}); !ok || v != 7 {
		t.Fatalf("export b read bytes = %v (present %v), want 7", v, ok)
	}
}

// TestCapacity: the storage node's capacity shows from the agent's first
// report on, and not before (a standalone server has no agent).
func TestCapacity(t *testing.T) {
	o, reg := newObserver(t)
	for _, name := range []string{"mpnbd_server_capacity_bytes", "mpnbd_server_available_bytes"} {
		if s := series(t, reg, name); len(s) != 0 {
			t.Errorf("%s before any report: %v", name, s)
		}
	}
	o.Capacity(100<<30, 40<<30)
	o.Capacity(100<<30, 30<<30)
	if err := testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP mpnbd_server_available_bytes Bytes new volumes may take if every volume filled up: the filesystem's free space less what the sparse backing files may still allocate (NBDStorageNode status.availableBytes).
# TYPE mpnbd_server_available_bytes gauge
mpnbd_server_available_bytes 3.221225472e+10
# HELP mpnbd_server_capacity_bytes Size of the filesystem holding the volumes' backing files, as the storage agent last measured it (NBDStorageNode status.capacityBytes).
# TYPE mpnbd_server_capacity_bytes gauge
mpnbd_server_capacity_bytes 1.073741824e+11
`), "mpnbd_server_capacity_bytes", "mpnbd_server_available_bytes"); err != nil {
		t.Fatal(err)
	}
}

// TestReplicas: a replicated volume's replicas show as in sync or not,
// with what each lacks and its rebuild's progress, and go with the
// export.
func TestReplicas(t *testing.T) {
	o, reg := newObserver(t)
	o.ExportAdded("vr")
	o.Replicas("vr", []replica.ReplicaState{{Name: "s2", State: "InSync"}, {Name: "s3", State: "Rebuilding", Lacking: 8 << 20, Copied: 2 << 20, Total: 8 << 20}})
	o.Replicas("vr", []replica.ReplicaState{{Name: "s2", State: "Out", Lacking: 1 << 20}, {Name: "s3", State: "Rebuilding", Lacking: 8 << 20, Copied: 4 << 20, Total: 8 << 20}})
	for _, tc := range []struct {
		name, replica string
		want          float64
	}{
		{"mpnbd_server_replica_in_sync", "s2", 0},
		{"mpnbd_server_replica_in_sync", "s3", 0},
		{"mpnbd_server_replica_lacking_bytes", "s2", 1 << 20},
		{"mpnbd_server_replica_lacking_bytes", "s3", 8 << 20},
		{"mpnbd_server_replica_rebuild_copied_bytes", "s3", 4 << 20},
		{"mpnbd_server_replica_rebuild_copied_bytes", "s2", 0},
	} {
		if v, ok := value(t, reg, tc.name, map[string]string{"export": "vr", "replica": tc.replica}); !ok || v != tc.want {
			t.Errorf("%s{replica=%s} = %v (present %v), want %v", tc.name, tc.replica, v, ok, tc.want)
		}
	}
	o.Replicas("vr", []replica.ReplicaState{{Name: "s2", State: "InSync"}})
	if v, ok := value(t, reg, "mpnbd_server_replica_in_sync", map[string]string{"export": "vr", "replica": "s2"}); !ok || v != 1 {
		t.Errorf("s2 back in sync: %v (present %v)", v, ok)
	}
	o.ExportRemoved("vr")
	for _, name := range []string{"mpnbd_server_replica_in_sync", "mpnbd_server_replica_lacking_bytes", "mpnbd_server_replica_rebuild_copied_bytes"} {
		if s := series(t, reg, name); len(s) != 0 {
			t.Errorf("%s after the export went: %v", name, s)
		}
	}
}

func TestRegisterTwice(t *testing.T) {
	reg := prometheus.NewRegistry()
	if _, err := New(reg); err != nil {
		t.Fatal(err)
	}
	if _, err := New(reg); err == nil {
		t.Fatal("second registration on the same registry succeeded")
	}
}

// TestServer runs a real nbd.Server on 127.0.0.1 (over MPTCP when the
// kernel allows it) and checks the metrics a client's traffic produces.
func TestServer(t *testing.T) {
	o, reg := newObserver(t)
	useMPTCP := true
	if err := mptcp.Available(); err != nil {
		t.Logf("MPTCP unavailable, the MPTCP checks are skipped: %v", err)
		useMPTCP = false
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	l, err := mptcp.Listen(ctx, "tcp", "127.0.0.1:0", useMPTCP)
	if err != nil {
		t.Fatal(err)
	}
	srv := &nbd.Server{Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Observer: o}
	const size = 1 << 20
	if err := srv.AddExport(&nbd.Export{Name: "disk", Backend: nbd.NewMemBackend(size)}); err != nil {
		t.Fatal(err)
	}
	o.ExportAdded("disk")
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	defer func() {
		sctx, scancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer scancel()
		srv.Shutdown(sctx)
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	}()

	cl, err := nbd.Dial(ctx, nbd.DialOptions{Addr: l.Addr().String(), Export: "disk", MPTCP: useMPTCP, Conns: 2,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte("mpnbd!"), 10000) // 60000 bytes
	if _, err := cl.WriteAt(data, 4096); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(data))
	if _, err := cl.ReadAt(got, 4096); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data) {
		t.Fatal("read back different data")
	}
	if err := cl.Flush(); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.ReadAt(make([]byte, 10), size); err == nil {
		t.Fatal("read past the end succeeded")
	}

	// The server records a request after writing its reply, so the client
	// can be a little ahead of the metrics: wait for them to settle.
	exp := map[string]string{"export": "disk"}
	check := func(name string, labels map[string]string, want float64) {
		t.Helper()
		l := map[string]string{}
		for k, v := range exp {
			l[k] = v
		}
		for k, v := range labels {
			l[k] = v
		}
		deadline := time.Now().Add(5 * time.Second)
		for {
			v, ok := value(t, reg, name, l)
			if ok && v == want {
				return
			}
			if time.Now().After(deadline) {
				t.Errorf("%s%v = %v (present %v), want %v", name, l, v, ok, want)
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	check("mpnbd_server_written_bytes_total", nil, float64(len(data)))
	check("mpnbd_server_read_bytes_total", nil, float64(len(data)))
	check("mpnbd_server_requests_total", map[string]string{"cmd": "read"}, 2)
	check("mpnbd_server_requests_total", map[string]string{"cmd": "flush"}, 1)
	check("mpnbd_server_request_errors_total", map[string]string{"cmd": "read", "errno": "EINVAL"}, 1)
	check("mpnbd_server_request_duration_seconds", map[string]string{"cmd": "write"}, 1)
	check("mpnbd_server_connections", nil, 2)
	check("mpnbd_server_connections_accepted_total", nil, 2)

	conns := series(t, reg, "mpnbd_server_connection_mptcp")
	if len(conns) != 2 {
		t.Fatalf("%d connection_mptcp series, want 2", len(conns))
	}
	locals := map[string]bool{}
	for _, c := range cl.Conns() {
		locals[c.LocalAddr().String()] = true
	}
	for _, m := range conns {
		var remote string
		for _, lp := range m.GetLabel() {
			if lp.GetName() == "remote" {
				remote = lp.GetValue()
			}
		}
		if !locals[remote] {
			t.Errorf("remote label %q is none of the client's addresses %v", remote, locals)
		}
		want := 0.0
		if useMPTCP {
			want = 1
		}
		if m.GetGauge().GetValue() != want {
			t.Errorf("connection_mptcp{remote=%q} = %v, want %v", remote, m.GetGauge().GetValue(), want)
		}
	}
	subflows := series(t, reg, "mpnbd_server_connection_mptcp_subflows")
	if useMPTCP {
		if len(subflows) != 2 {
			t.Errorf("%d subflow series, want 2", len(subflows))
		}
		for _, c := range cl.Conns() {
			info, err := mptcp.GetInfo(c)
			if err != nil {
				t.Fatalf("client side MPTCP_INFO: %v", err)
			}
			check("mpnbd_server_connection_mptcp_subflows", map[string]string{"remote": c.LocalAddr().String()}, float64(info.Subflows))
			t.Logf("MPTCP connection %s: %d additional subflows", c.LocalAddr(), info.Subflows)
		}
	} else if len(subflows) != 0 {
		t.Errorf("%d subflow series on plain TCP, want none", len(subflows))
	}

	// Closing the client removes the per-connection series.
	cl.Close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		v, _ := value(t, reg, "mpnbd_server_connections", exp)
		if v == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("connections gauge stuck at %v after the client closed", v)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if n := len(series(t, reg, "mpnbd_server_connection_mptcp")); n != 0 {
		t.Fatalf("%d per-connection series after close, want none", n)
	}
}

// TestRefusals runs a real nbd.Server with small limits on 127.0.0.1 (over
// MPTCP when the kernel allows it): refusals are counted by reason, with
// no export name in any label, and the connection gauges go back to zero.
func TestRefusals(t *testing.T) {
	o, reg := newObserver(t)
	for _, r := range nbd.RefusalReasons {
		if v, ok := value(t, reg, "mpnbd_server_refused_connections_total", map[string]string{"reason": r}); !ok || v != 0 {
			t.Errorf("refused_connections_total{reason=%q} before any refusal: %v, %v; want a zero series", r, v, ok)
		}
	}
	useMPTCP := mptcp.Available() == nil
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	l, err := mptcp.Listen(ctx, "tcp", "127.0.0.1:0", useMPTCP)
	if err != nil {
		t.Fatal(err)
	}
	srv := &nbd.Server{
		Logger:   slog.New(slog.NewTextHandler(io.Discard, nil)),
		Observer: o,
		Limits:   nbd.Limits{MaxHandshakesPerSource: 2, MaxConnsPerExport: 1, HandshakeTimeout: -1},
	}
	const secret = "vol/s3cr3t-token"
	if err := srv.AddExport(&nbd.Export{Name: secret, Backend: nbd.NewMemBackend(1 << 20)}); err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	defer func() {
		sctx, scancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer scancel()
		srv.Shutdown(sctx)
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	}()
	waitValue := func(name string, labels map[string]string, want float64) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			v, _ := value(t, reg, name, labels)
			if v == want {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s%v = %v after 10s, want %v", name, labels, v, want)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	d := mptcp.Dialer(useMPTCP)
	var idle []net.Conn
	for range 3 {
		c, err := d.DialContext(ctx, "tcp", l.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		idle = append(idle, c)
		if len(idle) == 2 {
			waitValue("mpnbd_server_handshakes", nil, 2)
		}
	}
	waitValue("mpnbd_server_refused_connections_total", map[string]string{"reason": nbd.RefusedHandshakesPerSource}, 1)
	waitValue("mpnbd_server_client_connections", nil, 2)
	for _, c := range idle {
		c.Close()
	}
	waitValue("mpnbd_server_handshakes", nil, 0)

	cl, err := nbd.Dial(ctx, nbd.DialOptions{Addr: l.Addr().String(), Export: secret, MPTCP: useMPTCP,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := nbd.Dial(ctx, nbd.DialOptions{Addr: l.Addr().String(), Export: secret, MPTCP: useMPTCP,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}); !errors.Is(err, nbd.ErrAccessDenied) {
		t.Fatalf("second connection to a full export: %v, want NBD_REP_ERR_POLICY", err)
	}
	waitValue("mpnbd_server_refused_connections_total", map[string]string{"reason": nbd.RefusedPerExport}, 1)
	cl.Close()
	waitValue("mpnbd_server_client_connections", nil, 0)
	waitValue("mpnbd_server_handshakes", nil, 0)

	for _, m := range series(t, reg, "mpnbd_server_refused_connections_total") {
		for _, lp := range m.GetLabel() {
			if lp.GetName() != "reason" || strings.Contains(lp.GetValue(), "s3cr3t") {
				t.Errorf("refused_connections_total has label %s=%q", lp.GetName(), lp.GetValue())
			}
		}
	}
}

// TestStrayJoinMetric: the storage agent's closes for stray subflows are
// counted per export, and go with the export.
func TestStrayJoinMetric(t *testing.T) {
	reg := prometheus.NewRegistry()
	o, err := New(reg)
	if err != nil {
		t.Fatal(err)
	}
	o.ExportAdded("vol")
	o.StrayJoin("vol")
	o.StrayJoin("vol")
	if v, ok := value(t, reg, "mpnbd_server_stray_subflow_connections_total", map[string]string{"export": "vol"}); !ok || v != 2 {
		t.Fatalf("stray_subflow_connections_total = %v, %v; want 2", v, ok)
	}
	o.ExportRemoved("vol")
	if _, ok := value(t, reg, "mpnbd_server_stray_subflow_connections_total", map[string]string{"export": "vol"}); ok {
		t.Fatal("the series outlived its export")
	}
}
