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

//go:build unix

package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"

	"github.com/mpnbd/mpnbd/pkg/buildinfo"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// logSink collects the JSON log records that run writes.
type logSink struct {
	mu    sync.Mutex
	buf   []byte
	lines []string
	recs  []map[string]any
}

func (s *logSink) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.buf = append(s.buf, p...)
	for {
		i := bytes.IndexByte(s.buf, '\n')
		if i < 0 {
			break
		}
		line := string(s.buf[:i])
		s.buf = s.buf[i+1:]
		s.lines = append(s.lines, line)
		var rec map[string]any
		if json.Unmarshal([]byte(line), &rec) == nil {
			s.recs = append(s.recs, rec)
		}
	}
	return len(p), nil
}

func (s *logSink) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return strings.Join(s.lines, "\n") + string(s.buf)
}

// find returns the records with message msg.
func (s *logSink) find(msg string) []map[string]any {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []map[string]any
	for _, r := range s.recs {
		if r["msg"] == msg {
			out = append(out, r)
		}
	}
	return out
}

// wait returns the n-th (1-based) record with message msg.
func (s *logSink) wait(t *testing.T, msg string, n int) map[string]any {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		if recs := s.find(msg); len(recs) >= n {
			return recs[n-1]
		}
		if time.Now().After(deadline) {
			t.Fatalf("no log record %q (#%d) in time; log:\n%s", msg, n, s)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

type running struct {
	log         *logSink
	stdout      *bytes.Buffer
	cancel      context.CancelFunc
	done        chan int
	addr        string // first NBD listener
	metricsAddr string
}

// start runs the command in-process with args and waits until it is ready.
func start(t *testing.T, args ...string) *running {
	t.Helper()
	r := &running{log: &logSink{}, stdout: &bytes.Buffer{}, done: make(chan int, 1)}
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel = cancel
	go func() { r.done <- run(ctx, args, r.stdout, r.log) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-r.done:
		case <-time.After(30 * time.Second):
			t.Errorf("run did not return")
		}
		if t.Failed() {
			t.Logf("server log:\n%s", r.log)
		}
	})
	deadline := time.Now().Add(15 * time.Second)
	for {
		if recs := r.log.find("ready"); len(recs) > 0 {
			listen := recs[0]["listen"].([]any)
			r.addr = listen[0].(string)
			r.metricsAddr, _ = recs[0]["metrics_addr"].(string)
			return r
		}
		select {
		case code := <-r.done:
			r.done <- code
			t.Fatalf("run exited with %d before it was ready; log:\n%s", code, r.log)
		case <-time.After(5 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("not ready in time; log:\n%s", r.log)
		}
	}
}

// stop cancels the run and returns its exit code.
func (r *running) stop(t *testing.T) int {
	t.Helper()
	r.cancel()
	select {
	case code := <-r.done:
		r.done <- code
		return code
	case <-time.After(30 * time.Second):
		t.Fatalf("run did not return after cancel")
		return -1
	}
}

// scrape fetches /metrics and returns the samples by series name with
// labels, as printed (e.g. `m{export="disk"}`).
func (r *running) scrape(t *testing.T) map[string]float64 {
	t.Helper()
	resp, err := http.Get("http://" + r.metricsAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/metrics: %s", resp.Status)
	}
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			t.Fatalf("bad sample line %q", line)
		}
		out[line[:i]] = v
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func dial(t *testing.T, addr, export string, useMPTCP bool) (*nbd.Client, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cl, err := nbd.Dial(ctx, nbd.DialOptions{Addr: addr, Export: export, MPTCP: useMPTCP, Logger: quiet()})
	if err == nil {
		t.Cleanup(func() { cl.Close() })
	}
	return cl, err
}

func randBytes(n int) []byte {
	b := make([]byte, n)
	rand.Read(b)
	return b
}

// TestMetricsBracketedAddress: the server serves /healthz and /metrics on
// a bracketed IPv4 address, as the chart's [$(HTTP_ADDRESS)]:PORT gives it.
func TestMetricsBracketedAddress(t *testing.T) {
	img := filepath.Join(t.TempDir(), "disk.img")
	r := start(t, "--listen", "127.0.0.1:0", "--export", "d="+img+",size=1M,create",
		"--metrics-addr", "[127.0.0.1]:0", "--log-format", "json")
	if !strings.HasPrefix(r.metricsAddr, "127.0.0.1:") {
		t.Fatalf("metrics on %q, want 127.0.0.1", r.metricsAddr)
	}
	for _, path := range []string{"/healthz", "/metrics"} {
		resp, err := http.Get("http://" + r.metricsAddr + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Errorf("%s: %s", path, resp.Status)
		}
	}
}

func TestEndToEnd(t *testing.T) {
	useMPTCP := mptcp.Available() == nil
	if !useMPTCP {
		t.Logf("MPTCP unavailable, the MPTCP checks are skipped: %v", mptcp.Available())
	}
	img := filepath.Join(t.TempDir(), "disk.img")
	const size = 8 << 20
	r := start(t,
		"--listen", "127.0.0.1:0",
		"--export", "disk="+img+",size=8M,create,desc=e2e disk",
		"--metrics-addr", "127.0.0.1:0",
		"--log-format", "json", "--log-level", "debug")

	// The file was made sparse with the requested size.
	st, err := os.Stat(img)
	if err != nil {
		t.Fatal(err)
	}
	if st.Size() != size {
		t.Fatalf("created file has %d bytes, want %d", st.Size(), size)
	}
	if blocks := st.Sys().(*syscall.Stat_t).Blocks; blocks*512 >= size {
		t.Errorf("created file is not sparse: %d blocks allocated", blocks)
	}
	lst := r.log.wait(t, "listening", 1)
	if lst["mptcp"] != useMPTCP {
		t.Errorf("listener logged mptcp=%v, want %v", lst["mptcp"], useMPTCP)
	}

	resp, err := http.Get("http://" + r.metricsAddr + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || string(body) != "ok\n" {
		t.Fatalf("/healthz: %s %q", resp.Status, body)
	}

	const (
		written = `mpnbd_server_written_bytes_total{export="disk"}`
		read    = `mpnbd_server_read_bytes_total{export="disk"}`
	)
	before := r.scrape(t)
	if v, ok := before[written]; !ok || v != 0 {
		t.Fatalf("before any I/O: %s = %v (present %v)", written, v, ok)
	}
	if _, ok := before["go_goroutines"]; !ok {
		t.Error("no Go runtime metrics")
	}
	if _, ok := before["process_open_fds"]; !ok {
		t.Error("no process metrics")
	}

	cl, err := dial(t, r.addr, "disk", useMPTCP)
	if err != nil {
		t.Fatal(err)
	}
	if info := cl.Info(); info.Size != size || info.Description != "e2e disk" || info.Flags&nbd.FlagReadOnly != 0 {
		t.Fatalf("export info %+v", info)
	}
	data1 := randBytes(1<<20 + 123)
	data2 := randBytes(3000)
	off1, off2 := int64(4096), int64(size-3000)
	if _, err := cl.WriteAt(data1, off1); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.WriteAt(data2, off2); err != nil {
		t.Fatal(err)
	}
	got1 := make([]byte, len(data1))
	got2 := make([]byte, len(data2))
	if _, err := cl.ReadAt(got1, off1); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.ReadAt(got2, off2); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got1, data1) || !bytes.Equal(got2, data2) {
		t.Fatal("read back different data")
	}
	if err := cl.Flush(); err != nil {
		t.Fatal(err)
	}
	// A write past the end fails and moves no byte counter.
	if _, err := cl.WriteAt([]byte("x"), size); err == nil {
		t.Fatal("write past the end succeeded")
	}

	moved := float64(len(data1) + len(data2))
	remote := cl.Conns()[0].LocalAddr().String()
	mptcpGauge := 0.0
	if useMPTCP {
		mptcpGauge = 1
	}
	want := map[string]float64{
		written: moved,
		read:    moved,
		`mpnbd_server_requests_total{cmd="write",export="disk"}`:                      3,
		`mpnbd_server_requests_total{cmd="read",export="disk"}`:                       2,
		`mpnbd_server_requests_total{cmd="flush",export="disk"}`:                      1,
		`mpnbd_server_request_errors_total{cmd="write",errno="ENOSPC",export="disk"}`: 1,
		`mpnbd_server_request_duration_seconds_count{cmd="write",export="disk"}`:      3,
		`mpnbd_server_connections{export="disk"}`:                                     1,
		`mpnbd_server_connections_accepted_total{export="disk"}`:                      1,
		`mpnbd_server_connection_mptcp{export="disk",remote="` + remote + `"}`:        mptcpGauge,
	}
	// The server records a request after writing its reply, so the client
	// can be a little ahead of the metrics: wait for them to settle.
	var after map[string]float64
	for deadline := time.Now().Add(5 * time.Second); ; {
		after = r.scrape(t)
		var wrong []string
		for name, w := range want {
			if v, ok := after[name]; !ok || v != w {
				wrong = append(wrong, fmt.Sprintf("%s = %v (present %v), want %v", name, v, ok, w))
			}
		}
		if len(wrong) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("metrics after the I/O:\n%s", strings.Join(wrong, "\n"))
		}
		time.Sleep(10 * time.Millisecond)
	}
	if useMPTCP {
		name := `mpnbd_server_connection_mptcp_subflows{export="disk",remote="` + remote + `"}`
		if _, ok := after[name]; !ok {
			t.Errorf("no %s", name)
		}
	}

	// Stop with the client still connected: it is drained, the data
	// flushed, and run returns 0.
	if code := r.stop(t); code != 0 {
		t.Fatalf("exit code %d, want 0", code)
	}
	if err := cl.Flush(); err == nil {
		t.Error("the connection still works after shutdown")
	}
	if stopped := r.log.wait(t, "stopped", 1); stopped["exit_code"] != 0.0 {
		t.Errorf("stopped record %v", stopped)
	}
	if r.stdout.Len() != 0 {
		t.Errorf("stdout: %q", r.stdout)
	}
	f, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	if len(f) != size || !bytes.Equal(f[off1:off1+int64(len(data1))], data1) || !bytes.Equal(f[off2:], data2) {
		t.Fatal("the file does not hold the data written")
	}
	if !bytes.Equal(f[:off1], make([]byte, off1)) {
		t.Fatal("bytes never written are not zero")
	}
}

func writeJSON(t *testing.T, path string, v any) {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	// Write and rename, as config management tools do.
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

type jsonExport struct {
	Name     string `json:"name"`
	Path     string `json:"path"`
	Size     string `json:"size,omitempty"`
	Create   bool   `json:"create,omitempty"`
	ReadOnly bool   `json:"readonly,omitempty"`
}

func TestReloadOnSIGHUP(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "config.json")
	pa, pb, pc, pf := filepath.Join(dir, "a.img"), filepath.Join(dir, "b.img"), filepath.Join(dir, "c.img"), filepath.Join(dir, "f.img")
	writeJSON(t, cfg, map[string]any{
		"listen":           []string{"127.0.0.1:0"},
		"log_format":       "json",
		"shutdown_timeout": "5s",
		"exports": []jsonExport{
			{Name: "a", Path: pa, Size: "1M", Create: true},
			{Name: "b", Path: pb, Size: "1M", Create: true},
		},
	})
	r := start(t, "--config", cfg, "--tcp", "--metrics-addr", "127.0.0.1:0", "--export", "f="+pf+",size=1M,create")
	if lst := r.log.wait(t, "listening", 1); lst["mptcp"] != false {
		t.Errorf("--tcp listener logged mptcp=%v", lst["mptcp"])
	}

	ca, err := dial(t, r.addr, "a", false)
	if err != nil {
		t.Fatal(err)
	}
	data := randBytes(64 << 10)
	if _, err := ca.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := dial(t, r.addr, "b", false); err != nil {
		t.Fatal(err)
	}

	// Drop a, make b read-only, add c; f comes from a flag and stays.
	writeJSON(t, cfg, map[string]any{
		"listen":     []string{"127.0.0.1:0"},
		"log_format": "json",
		"exports": []jsonExport{
			{Name: "b", Path: pb, ReadOnly: true},
			{Name: "c", Path: pc, Size: "2M", Create: true},
		},
	})
	if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	rec := r.log.wait(t, "config reloaded", 1)
	for k, want := range map[string]float64{"exports": 3, "added": 2, "removed": 2, "failed": 0} {
		if rec[k] != want {
			t.Errorf("reload record %s = %v, want %v", k, rec[k], want)
		}
	}

	// a's connection was drained and a is gone; its data is on disk.
	if err := ca.Flush(); err == nil {
		t.Error("connection to the removed export still works")
	}
	if _, err := dial(t, r.addr, "a", false); !errors.Is(err, nbd.ErrUnknownExport) {
		t.Errorf("dial removed export: %v, want ErrUnknownExport", err)
	}
	onDisk, err := os.ReadFile(pa)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(onDisk[:len(data)], data) {
		t.Error("data written to the removed export is not in its file")
	}
	// b is now read-only.
	cb, err := dial(t, r.addr, "b", false)
	if err != nil {
		t.Fatal(err)
	}
	if cb.Info().Flags&nbd.FlagReadOnly == 0 {
		t.Error("b is not read-only after reload")
	}
	var nerr *nbd.Error
	if _, err := cb.WriteAt([]byte("x"), 0); !errors.As(err, &nerr) || nerr.Errno != nbd.EPERM {
		t.Errorf("write to read-only b: %v, want EPERM", err)
	}
	// c is new, f still there.
	cc, err := dial(t, r.addr, "c", false)
	if err != nil {
		t.Fatal(err)
	}
	if cc.Size() != 2<<20 {
		t.Errorf("c has size %d", cc.Size())
	}
	if _, err := dial(t, r.addr, "f", false); err != nil {
		t.Error(err)
	}
	m := r.scrape(t)
	for name := range m {
		if strings.Contains(name, `export="a"`) {
			t.Errorf("series of the removed export remain: %s", name)
		}
	}
	if _, ok := m[`mpnbd_server_written_bytes_total{export="c"}`]; !ok {
		t.Error("no series for the added export")
	}
	info := `mpnbd_build_info{component="nbd-server",go_version="` + runtime.Version() + `",revision="` + buildinfo.Revision() + `",version="` + buildinfo.Version + `"}`
	if m[info] != 1 {
		t.Errorf("no %s 1", info)
	}

	// A broken config is refused and changes nothing.
	if err := os.WriteFile(cfg, []byte(`{"exports": [`), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	if rec := r.log.wait(t, "reload failed; keeping the current exports", 1); !strings.Contains(fmt.Sprint(rec["error"]), cfg) {
		t.Errorf("reload error does not name the file: %v", rec["error"])
	}
	if _, err := dial(t, r.addr, "c", false); err != nil {
		t.Errorf("after a failed reload: %v", err)
	}

	if code := r.stop(t); code != 0 {
		t.Fatalf("exit code %d", code)
	}
}

func TestRunUsage(t *testing.T) {
	var stdout, stderr bytes.Buffer
	if code := run(context.Background(), []string{"--help"}, &stdout, &stderr); code != 0 {
		t.Fatalf("--help: exit %d", code)
	}
	for _, want := range []string{"--listen ADDR", "--export NAME=PATH[,OPTIONS]", "--config FILE", "--tcp",
		"--metrics-addr", "--log-format", "--no-list", `"exports": [`, "size=SIZE", "SIGHUP"} {
		if !strings.Contains(stdout.String(), want) {
			t.Errorf("help text lacks %q", want)
		}
	}

	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--export", "d=/x,size=10Q"}, `invalid size "10Q"`},
		{[]string{"--export", "d=/x", "--log-format", "yaml"}, `invalid log format "yaml"`},
		{[]string{"--frobnicate"}, "unknown flag --frobnicate"},
	} {
		stdout.Reset()
		stderr.Reset()
		if code := run(context.Background(), tc.args, &stdout, &stderr); code != 2 {
			t.Errorf("%v: exit %d, want 2", tc.args, code)
		}
		if !strings.Contains(stderr.String(), tc.want) || !strings.Contains(stderr.String(), "--help") {
			t.Errorf("%v: stderr %q, want %q and a hint", tc.args, stderr.String(), tc.want)
		}
		if stdout.Len() != 0 {
			t.Errorf("%v: stdout %q", tc.args, stdout.String())
		}
	}
}

func TestRunStartFailures(t *testing.T) {
	dir := t.TempDir()
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	existing := filepath.Join(dir, "existing.img")
	if err := os.WriteFile(existing, make([]byte, 4096), 0o600); err != nil {
		t.Fatal(err)
	}
	empty := filepath.Join(dir, "empty.img")
	if err := os.WriteFile(empty, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(dir, "missing.img")
	small := filepath.Join(dir, "small.img")
	if err := os.WriteFile(small, make([]byte, 4096), 0o400); err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"missing file", []string{"--export", "d=" + missing}, missing + " does not exist (add the create option"},
		{"missing read-only file", []string{"--export", "d=" + missing + ",readonly"}, missing + " does not exist"},
		{"directory", []string{"--export", "d=" + dir}, dir + " is not a regular file or block device"},
		{"empty file", []string{"--export", "d=" + empty}, empty + " is empty"},
		{"read-only file smaller than size", []string{"--export", "d=" + small + ",readonly,size=1M"}, "larger than the read-only file"},
		{"address in use", []string{"--export", "d=" + existing, "--listen", busy.Addr().String()}, "address already in use"},
		{"metrics address in use", []string{"--export", "d=" + existing, "--listen", "127.0.0.1:0", "--metrics-addr", busy.Addr().String()}, "address already in use"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			code := run(ctx, tc.args, &stdout, &stderr)
			if code != 1 {
				t.Fatalf("exit %d, want 1; stderr:\n%s", code, stderr.String())
			}
			if !strings.Contains(stderr.String(), tc.want) {
				t.Fatalf("stderr does not contain %q:\n%s", tc.want, stderr.String())
			}
		})
	}
	if _, err := os.Stat(missing); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a missing file was created without the create option: %v", err)
	}
}

// TestFailedFinalSyncChangesIncarnation: an export's final sync fails as
// it closes (the backend's writeback error consumed, no client connected
// to be told): the server must announce a new incarnation, now and after
// a restart, so that sessions send again what they retain.
func TestFailedFinalSyncChangesIncarnation(t *testing.T) {
	dir := t.TempDir()
	b, err := nbd.OpenFile(filepath.Join(dir, "x.img"), 1<<20, true, false)
	if err != nil {
		t.Fatal(err)
	}
	d := &daemon{log: quiet(), srv: &nbd.Server{}, incarnations: nbd.IncarnationStore{Path: filepath.Join(dir, incarnationFile)}}
	before, err := d.incarnations.Current()
	if err != nil {
		t.Skipf("no boot ID here: %v", err)
	}
	d.srv.Incarnation = before
	// Closed under the backend: its final sync fails, as a writeback
	// error makes it.
	b.Close()
	if d.closeBackend("x", &openExport{cfg: ExportConfig{Name: "x"}, backend: b}) {
		t.Fatal("closing an export whose sync failed reported success")
	}
	if d.srv.Incarnation == before {
		t.Fatal("the server announces the same incarnation after an export lost acknowledged writes")
	}
	next, err := (nbd.IncarnationStore{Path: d.incarnations.Path}).Current()
	if err != nil || next != d.srv.Incarnation {
		t.Fatalf("the next start would announce %x (%v), not the changed %x", next, err, d.srv.Incarnation)
	}
}

// TestClusterMetricsGather: the storage agent's registry and
// controller-runtime's (which holds its own Go runtime and process
// collectors in this binary) gather together without a clash.
func TestClusterMetricsGather(t *testing.T) {
	if _, err := (prometheus.Gatherers{buildinfo.Registry("storage-agent"), ctrlmetrics.Registry}).Gather(); err == nil {
		t.Log("controller-runtime's registry holds no Go collector here: the merge is not needed")
	}
	mfs, err := buildinfo.Merge(buildinfo.Registry("storage-agent"), ctrlmetrics.Registry).Gather()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, mf := range mfs {
		if mf.GetName() == "go_goroutines" {
			n++
		}
	}
	if n != 1 {
		t.Errorf("go_goroutines gathered %d times", n)
	}
}
