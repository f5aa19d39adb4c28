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

package interop

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/syncbuf"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// toolTimeout bounds every external command, so a peer that hangs fails
// the test instead of eating the whole package timeout.
const toolTimeout = 45 * time.Second

// debianPackage names the package that ships each tool, for skip messages.
var debianPackage = map[string]string{
	"nbdinfo":    "libnbd-bin",
	"nbdcopy":    "libnbd-bin",
	"qemu-img":   "qemu-utils",
	"fio":        "fio",
	"nbdkit":     "nbdkit",
	"nbd-server": "nbd-server",
	"mptcpize":   "mptcpize",
}

// needTools skips the test when one of the tools is not on PATH.
func needTools(t *testing.T, tools ...string) {
	t.Helper()
	for _, name := range tools {
		if _, err := exec.LookPath(name); err != nil {
			t.Skipf("skipping: %s not found on PATH (Debian package %s): %v", name, debianPackage[name], err)
		}
	}
}

// needMPTCP skips the test unless mptcpize is installed and the kernel
// really carries a loopback connection over MPTCP (rather than silently
// falling back to TCP).
func needMPTCP(t *testing.T) {
	t.Helper()
	needTools(t, "mptcpize")
	if reason := mptcpUnavailable(); reason != "" {
		t.Skipf("skipping: %s", reason)
	}
}

var mptcpProbe = sync.OnceValue(func() string {
	var lc net.ListenConfig
	lc.SetMultipathTCP(true)
	l, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		return fmt.Sprintf("cannot listen with MPTCP: %v", err)
	}
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			close(accepted)
			return
		}
		accepted <- c
	}()
	d := net.Dialer{Timeout: 5 * time.Second}
	d.SetMultipathTCP(true)
	c, err := d.Dial("tcp", l.Addr().String())
	if err != nil {
		return fmt.Sprintf("cannot dial with MPTCP: %v", err)
	}
	defer c.Close()
	s, ok := <-accepted
	if !ok {
		return "MPTCP listener accept failed"
	}
	defer s.Close()
	if !nbd.IsMultipathTCP(c) || !nbd.IsMultipathTCP(s) {
		return "kernel falls back to plain TCP for MPTCP sockets (CONFIG_MPTCP off or net.mptcp.enabled=0)"
	}
	return ""
})

func mptcpUnavailable() string { return mptcpProbe() }

// cmdResult is the outcome of one external command.
type cmdResult struct {
	Stdout, Stderr string
	ExitCode       int
	Err            error
	Elapsed        time.Duration
}

// runCmd runs a command to completion (bounded by toolTimeout) and
// returns what it printed and how it exited; it never fails the test.
func runCmd(t *testing.T, name string, args ...string) cmdResult {
	t.Helper()
	return runCmdEnv(t, nil, name, args...)
}

// runCmdEnv is runCmd with extra environment variables.
func runCmdEnv(t *testing.T, env []string, name string, args ...string) cmdResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), toolTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = append(append(os.Environ(), "LC_ALL=C"), env...)
	cmd.WaitDelay = 5 * time.Second
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	err := cmd.Run()
	r := cmdResult{Stdout: stdout.String(), Stderr: stderr.String(), Err: err, Elapsed: time.Since(start)}
	r.ExitCode = cmd.ProcessState.ExitCode()
	if ctx.Err() != nil {
		r.Err = fmt.Errorf("timed out after %v: %w", toolTimeout, err)
	}
	t.Logf("$ %s %s  (exit %d, %v)", name, strings.Join(args, " "), r.ExitCode, r.Elapsed.Round(time.Millisecond))
	return r
}

// mustRun runs a command and fails the test unless it exits 0 with an
// empty stderr: the tools used here are silent on success, so anything on
// stderr is a complaint from the peer.
func mustRun(t *testing.T, name string, args ...string) string {
	t.Helper()
	r := runCmd(t, name, args...)
	if r.Err != nil || r.ExitCode != 0 {
		t.Fatalf("%s failed (exit %d): %v\nstdout:\n%s\nstderr:\n%s", name, r.ExitCode, r.Err, r.Stdout, r.Stderr)
	}
	if strings.TrimSpace(r.Stderr) != "" {
		t.Fatalf("%s exited 0 but complained on stderr:\n%s\nstdout:\n%s", name, r.Stderr, r.Stdout)
	}
	return r.Stdout
}

// logTap is a slog handler that keeps every record of the server (shown
// when the test fails) and remembers those at Warn or above, which an
// interoperating peer must never cause.
type logTap struct {
	inner slog.Handler
	sink  *logSink
}

type logSink struct {
	mu    sync.Mutex
	buf   bytes.Buffer
	warns []string
}

func (s *logSink) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.buf.Write(p)
}

func (s *logSink) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.buf.String()
}

func (s *logSink) warnings() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.warns...)
}

func newLogTap() (*slog.Logger, *logSink) {
	sink := &logSink{}
	h := slog.NewTextHandler(sink, &slog.HandlerOptions{Level: slog.LevelDebug})
	return slog.New(&logTap{inner: h, sink: sink}), sink
}

func (h *logTap) Enabled(ctx context.Context, l slog.Level) bool { return h.inner.Enabled(ctx, l) }

func (h *logTap) Handle(ctx context.Context, r slog.Record) error {
	if r.Level >= slog.LevelWarn {
		var b strings.Builder
		b.WriteString(r.Message)
		r.Attrs(func(a slog.Attr) bool {
			fmt.Fprintf(&b, " %s=%v", a.Key, a.Value)
			return true
		})
		h.sink.mu.Lock()
		h.sink.warns = append(h.sink.warns, b.String())
		h.sink.mu.Unlock()
	}
	return h.inner.Handle(ctx, r)
}

func (h *logTap) WithAttrs(as []slog.Attr) slog.Handler {
	return &logTap{inner: h.inner.WithAttrs(as), sink: h.sink}
}

func (h *logTap) WithGroup(name string) slog.Handler {
	return &logTap{inner: h.inner.WithGroup(name), sink: h.sink}
}

// exportSpec describes one export of a test server.
type exportSpec struct {
	Name     string
	Size     int64
	ReadOnly bool
	// Fill, when set, is written to the backing file before it is served.
	Fill []byte
}

// testServer is our NBD server running in-process on 127.0.0.1.
type testServer struct {
	Srv     *nbd.Server
	Addr    string // host:port
	Dir     string
	Paths   map[string]string // export name -> backing file
	Exports map[string]*nbd.Export
	obs     *recorder

	mu    sync.Mutex
	conns map[net.Conn]bool     // every connection that asked for an export -> carried by MPTCP
	tls   []tls.ConnectionState // of every connection that asked for an export over TLS
}

type serverOptions struct {
	MPTCP       bool
	DisableList bool
	// Deny names exports that Authorize refuses.
	Deny []string
	// TLS offers STARTTLS; TLSRequired makes every connection upgrade.
	TLS         *tls.Config
	TLSRequired bool
}

// startServer serves the exports on a fresh 127.0.0.1:0 listener (MPTCP
// when asked) and shuts everything down when the test ends, failing it if
// the server logged a warning or answered a request with an error.
func startServer(t *testing.T, opt serverOptions, specs ...exportSpec) *testServer {
	t.Helper()
	logger, sink := newLogTap()
	ts := &testServer{
		Dir:     t.TempDir(),
		Paths:   map[string]string{},
		Exports: map[string]*nbd.Export{},
		obs:     &recorder{},
		conns:   map[net.Conn]bool{},
	}
	ts.Srv = &nbd.Server{
		Logger:      logger,
		DisableList: opt.DisableList,
		Observer:    ts.obs,
		TLSConfig:   opt.TLS,
		TLSRequired: opt.TLSRequired,
		Authorize: func(c nbd.ConnInfo, export string) error {
			ts.mu.Lock()
			ts.conns[c.Conn] = nbd.IsMultipathTCP(c.Conn)
			if c.TLS != nil {
				ts.tls = append(ts.tls, *c.TLS)
			}
			ts.mu.Unlock()
			for _, d := range opt.Deny {
				if d == export {
					return errors.New("denied by test policy")
				}
			}
			return nil
		},
	}
	for _, s := range specs {
		path := filepath.Join(ts.Dir, s.Name+".img")
		if s.ReadOnly || s.Fill != nil {
			writeFile(t, path, s.Fill, s.Size)
		}
		b, err := nbd.OpenFile(path, s.Size, !s.ReadOnly, s.ReadOnly)
		if err != nil {
			t.Fatalf("open backend %s: %v", path, err)
		}
		t.Cleanup(func() { b.Close() })
		e := &nbd.Export{Name: s.Name, Backend: b, ReadOnly: s.ReadOnly}
		if err := ts.Srv.AddExport(e); err != nil {
			t.Fatal(err)
		}
		ts.Paths[s.Name] = path
		ts.Exports[s.Name] = e
	}

	var lc net.ListenConfig
	lc.SetMultipathTCP(opt.MPTCP)
	l, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	ts.Addr = l.Addr().String()
	served := make(chan error, 1)
	go func() { served <- ts.Srv.Serve(l) }()

	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := ts.Srv.Shutdown(ctx); err != nil {
			t.Errorf("server shutdown: %v", err)
		}
		if err := <-served; err != nil {
			t.Errorf("Serve returned %v", err)
		}
		for _, w := range sink.warnings() {
			t.Errorf("server logged a warning: %s", w)
		}
		for _, e := range ts.obs.errors() {
			t.Errorf("server answered a request with an error: %s", e)
		}
		t.Logf("server requests: %s", ts.obs.summary())
		if t.Failed() {
			t.Logf("server log:\n%s", sink.String())
		}
	})
	return ts
}

// URI is the NBD URI of an export.
func (ts *testServer) URI(export string) string {
	return "nbd://" + ts.Addr + "/" + export
}

// tlsStates returns the TLS states of the connections that asked for an
// export so far and forgets them.
func (ts *testServer) tlsStates() []tls.ConnectionState {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	s := ts.tls
	ts.tls = nil
	return s
}

// Port is the TCP port the server listens on.
func (ts *testServer) Port() string {
	_, p, _ := net.SplitHostPort(ts.Addr)
	return p
}

// connModes returns how many connections asked for an export, and how many
// of those were carried by MPTCP.
func (ts *testServer) connModes() (total, mptcp int) {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	for _, mp := range ts.conns {
		total++
		if mp {
			mptcp++
		}
	}
	return total, mptcp
}

// checkTransport fails the test unless every connection the server saw
// used the expected transport.
func (ts *testServer) checkTransport(t *testing.T, wantMPTCP bool) {
	t.Helper()
	total, mp := ts.connModes()
	if total == 0 {
		t.Fatalf("server saw no connection asking for an export")
	}
	if wantMPTCP && mp != total {
		t.Fatalf("%d of %d connections used MPTCP; want all (is the peer really wrapped by mptcpize?)", mp, total)
	}
	if !wantMPTCP && mp != 0 {
		t.Fatalf("%d of %d connections used MPTCP on a plain TCP listener", mp, total)
	}
	t.Logf("%d connections, %d over MPTCP", total, mp)
}

// recorder is an nbd.Observer that counts requests per command and keeps
// every error reply.
type recorder struct {
	mu     sync.Mutex
	counts map[string]int
	bytes  map[string]int64
	errs   []string
	opened int
}

func (r *recorder) ConnOpened(nbd.ConnInfo, string) {
	r.mu.Lock()
	r.opened++
	r.mu.Unlock()
}

func (r *recorder) ConnClosed(nbd.ConnInfo, string) {}

func (r *recorder) Request(export string, cmd uint16, n int, _ time.Duration, errno uint32) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.counts == nil {
		r.counts, r.bytes = map[string]int{}, map[string]int64{}
	}
	name := nbd.CmdName(cmd)
	r.counts[name]++
	r.bytes[name] += int64(n)
	if errno != 0 && len(r.errs) < 20 {
		r.errs = append(r.errs, fmt.Sprintf("export %s: %s -> %s", export, name, nbd.ErrnoName(errno)))
	}
}

func (r *recorder) errors() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.errs...)
}

func (r *recorder) count(cmd uint16) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.counts[nbd.CmdName(cmd)]
}

func (r *recorder) transmissions() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.opened
}

func (r *recorder) summary() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var parts []string
	for _, c := range []uint16{nbd.CmdRead, nbd.CmdWrite, nbd.CmdFlush, nbd.CmdTrim, nbd.CmdWriteZeroes, nbd.CmdCache, nbd.CmdBlockStatus} {
		name := nbd.CmdName(c)
		if n := r.counts[name]; n > 0 {
			parts = append(parts, fmt.Sprintf("%s=%d/%dB", name, n, r.bytes[name]))
		}
	}
	parts = append(parts, fmt.Sprintf("conns=%d", r.opened))
	return strings.Join(parts, " ")
}

// writeFile creates path with data followed by zeroes up to size (sparse).
func writeFile(t *testing.T, path string, data []byte, size int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Write(data); err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(max(size, int64(len(data)))); err != nil {
		t.Fatal(err)
	}
}

// randomBytes returns n pseudo-random bytes from a seeded generator.
func randomBytes(seed uint64, n int) []byte {
	var s [32]byte
	for i := range s {
		s[i] = byte(seed >> (8 * (i % 8)))
	}
	s[31] ^= 0x5a
	b := make([]byte, n)
	rand.NewChaCha8(s).Read(b)
	return b
}

// region is a byte range [Off, Off+Len).
type region struct{ Off, Len int64 }

// makeImage returns random content of size bytes in which the given
// regions are zero, and writes it to path leaving the zero regions as
// holes, so tools that look for sparseness see them.
func makeImage(t *testing.T, path string, seed uint64, size int64, holes ...region) []byte {
	t.Helper()
	data := randomBytes(seed, int(size))
	for _, h := range holes {
		clear(data[h.Off : h.Off+h.Len])
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	var off int64
	for _, h := range append(holes, region{Off: size}) {
		if h.Off > off {
			if _, err := f.WriteAt(data[off:h.Off], off); err != nil {
				t.Fatal(err)
			}
		}
		off = h.Off + h.Len
	}
	return data
}

func sum(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

func fileSum(t *testing.T, path string) string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

func readFile(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// firstDiff describes where two byte slices first differ.
func firstDiff(a, b []byte) string {
	if len(a) != len(b) {
		return fmt.Sprintf("lengths %d and %d", len(a), len(b))
	}
	for i := range a {
		if a[i] != b[i] {
			j := i
			for j < len(a) && a[j] != b[j] {
				j++
			}
			return fmt.Sprintf("first difference at byte %d (%#x): %#02x vs %#02x, differing run of %d bytes", i, i, a[i], b[i], j-i)
		}
	}
	return "equal"
}

// freePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// daemon is a long-running peer process (an NBD server) started by a test.
// When the test ends, any line of its output that mentions an error fails
// the test unless the test announced it with expectErrors.
type daemon struct {
	cmd    *exec.Cmd
	out    *syncbuf.Buffer
	exited chan struct{}
	err    error

	mu       sync.Mutex
	expected []string
}

// expectErrors declares error messages the test provokes on purpose.
func (d *daemon) expectErrors(substrings ...string) {
	d.mu.Lock()
	d.expected = append(d.expected, substrings...)
	d.mu.Unlock()
}

// unexpectedErrors returns the output lines that report an error the test
// did not announce.
func (d *daemon) unexpectedErrors() []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	var bad []string
lines:
	for _, l := range strings.Split(d.out.String(), "\n") {
		if !strings.Contains(strings.ToLower(l), "error") {
			continue
		}
		for _, e := range d.expected {
			if strings.Contains(l, e) {
				continue lines
			}
		}
		bad = append(bad, l)
	}
	return bad
}

// startDaemon starts a process in its own process group; it is killed
// (group and all) when the test ends.
func startDaemon(t *testing.T, name string, args ...string) *daemon {
	t.Helper()
	d := &daemon{out: &syncbuf.Buffer{}, exited: make(chan struct{})}
	d.cmd = exec.Command(name, args...)
	d.cmd.Env = append(os.Environ(), "LC_ALL=C")
	d.cmd.Stdout, d.cmd.Stderr = d.out, d.out
	d.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := d.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	t.Logf("started %s (pid %d): %s", name, d.cmd.Process.Pid, strings.Join(args, " "))
	go func() {
		d.err = d.cmd.Wait()
		close(d.exited)
	}()
	t.Cleanup(func() {
		pgid := d.cmd.Process.Pid
		syscall.Kill(-pgid, syscall.SIGTERM)
		select {
		case <-d.exited:
		case <-time.After(5 * time.Second):
			syscall.Kill(-pgid, syscall.SIGKILL)
			<-d.exited
		}
		if out := strings.TrimSpace(d.out.String()); out != "" {
			t.Logf("%s output:\n%s", name, out)
		}
		for _, l := range d.unexpectedErrors() {
			t.Errorf("%s reported an error: %s", name, l)
		}
	})
	return d
}

// waitListening dials network/addr until an NBD server greets, giving up
// after 10 s or as soon as alive reports that the server process is gone.
// A listener that answers with something else than the NBD greeting (the
// port was taken by another program) is an error too.
func waitListening(network, addr string, alive func() error) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		if err := alive(); err != nil {
			return err
		}
		c, err := net.DialTimeout(network, addr, time.Second)
		if err == nil {
			// Take the greeting before hanging up, which also keeps the
			// server from logging a failed write.
			c.SetReadDeadline(time.Now().Add(2 * time.Second))
			hello := make([]byte, 18)
			_, err := io.ReadFull(c, hello)
			c.Close()
			if err != nil || string(hello[:8]) != "NBDMAGIC" {
				return fmt.Errorf("%s %s accepts but does not greet like an NBD server (%q, %v)", network, addr, hello, err)
			}
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("nothing listening on %s %s after 10s: %v", network, addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// alive reports an error once the daemon has exited.
func (d *daemon) alive() error {
	select {
	case <-d.exited:
		return fmt.Errorf("exited (%v) before listening:\n%s", d.err, d.out.String())
	default:
		return nil
	}
}

// waitPidFile waits for a daemonized process to write its pid file and
// returns the pid.
func waitPidFile(t *testing.T, path string) int {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, err := os.ReadFile(path)
		if err == nil {
			if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && pid > 0 {
				return pid
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("pid file %s not written after 10s", path)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// dialClient dials our NBD client and closes it when the test ends.
func dialClient(t *testing.T, o nbd.DialOptions) *nbd.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if o.Logger == nil {
		o.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	cl, err := nbd.Dial(ctx, o)
	if err != nil {
		t.Fatalf("dial %s %s export %q: %v", o.Network, o.Addr, o.Export, err)
	}
	t.Cleanup(func() { cl.Close() })
	return cl
}
