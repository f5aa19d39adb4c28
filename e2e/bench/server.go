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

//go:build linux

package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/pki"
	"github.com/mpnbd/mpnbd/internal/testenv/topo"
)

// ExportName is the export every server offers.
const ExportName = "bench"

// ExportSize is the size of the backing file of every export.
const ExportSize = 2 << 30

// serverProc is a running NBD server inside the server namespace.
type serverProc struct {
	name string
	// pid is the process whose CPU time (with its descendants') is
	// measured: the server itself, since `ip netns exec` and
	// `mptcpize run` exec it in place, or nbd-server's daemon.
	pid  int
	cmd  *exec.Cmd     // nil for the nbd-server daemon
	done chan struct{} // closed when cmd has exited
	file string        // backing file
	dir  string        // private directory (nbd-server config, pid file)
	log  *tailBuffer
}

// tailBuffer keeps the last few KiB written to it.
type tailBuffer struct {
	mu  sync.Mutex
	buf []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf = append(t.buf, p...)
	if n := len(t.buf); n > 8<<10 {
		t.buf = append([]byte(nil), t.buf[n-(8<<10):]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	if t == nil {
		return ""
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	return strings.TrimSpace(string(t.buf))
}

// serverEnv is what starting a server needs.
type serverEnv struct {
	topo      *topo.Topology
	mptcp     bool
	port      int
	serverBin string // our nbd-server binary
	// candidateBin is the nbd-server of ours-b.
	candidateBin string
	tmpDir       string // tmpfs directory for the backing files
	tag          string // makes file names unique per benchmark
	// pkiDir holds the CA, server and client certificates of ours-tls
	// (pki's GnuTLS layout; the server certificate names the server's
	// address).
	pkiDir string
}

func (e *serverEnv) addr() string {
	return e.topo.ServerAddr(1).String() + ":" + strconv.Itoa(e.port)
}

// inServerNS returns the argv that runs argv in the server namespace,
// wrapped by mptcpize for third-party servers on MPTCP networks.
func inNS(ns string, wrap bool, argv ...string) []string {
	out := []string{"ip", "netns", "exec", ns}
	if wrap {
		out = append(out, "mptcpize", "run")
	}
	return append(out, argv...)
}

// startServer starts server name with a fresh export file, allocated in
// full, and waits until it listens.
func startServer(ctx context.Context, e *serverEnv, name string) (_ *serverProc, err error) {
	s := &serverProc{name: name, log: &tailBuffer{}}
	s.file = filepath.Join(e.tmpDir, leftoverMarker(e.tag)+name+".img")
	defer func() {
		if err != nil {
			err = errors.Join(err, s.stop())
		}
	}()
	if err := createExport(s.file, ExportSize, ExportSize); err != nil {
		return s, err
	}
	host, port := e.topo.ServerAddr(1).String(), strconv.Itoa(e.port)
	var argv []string
	switch name {
	case ServerOurs, ServerOursB, ServerOursTLS:
		bin := e.serverBin
		if name == ServerOursB {
			if bin = e.candidateBin; bin == "" {
				return s, errors.New("server ours-b needs a second build of nbd-server (--bin-b)")
			}
		}
		argv = inNS(e.topo.ServerNS, false, bin,
			"--listen", e.addr(),
			"--export", fmt.Sprintf("%s=%s,size=%d", ExportName, s.file, ExportSize),
			"--metrics-addr", "", "--log-level", "warn", "--shutdown-timeout", "2s")
		if !e.mptcp {
			argv = append(argv, "--tcp")
		}
		if name == ServerOursTLS {
			argv = append(argv, "--tls", "require", "--tls-cert", filepath.Join(e.pkiDir, pki.ServerCert),
				"--tls-key", filepath.Join(e.pkiDir, pki.ServerKey), "--tls-ca", filepath.Join(e.pkiDir, pki.CACert))
		}
	case ServerNbdkit:
		argv = inNS(e.topo.ServerNS, e.mptcp, "nbdkit", "-f", "--exit-with-parent",
			"-i", host, "-p", port, "file", "file="+s.file)
	case ServerNbdServer:
		return s, startNbdServer(ctx, e, s)
	default:
		return s, fmt.Errorf("unknown server %q", name)
	}
	return s, s.start(ctx, e, argv)
}

// start runs argv as the server's process, killed with the benchmark, and
// waits until it listens.
func (s *serverProc) start(ctx context.Context, e *serverEnv, argv []string) error {
	s.cmd = exec.Command(argv[0], argv[1:]...)
	s.cmd.Stdout, s.cmd.Stderr = s.log, s.log
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := s.cmd.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", s.name, err)
	}
	s.pid = s.cmd.Process.Pid
	s.done = make(chan struct{})
	go func() {
		_ = s.cmd.Wait() // how it ended is in its log
		close(s.done)
	}()
	return waitListening(ctx, e, s)
}

// nbdServerConfig is the generated configuration of Debian's nbd-server.
const nbdServerConfig = `[generic]
listenaddr = %s
port = %d

[%s]
exportname = %s
`

// startNbdServer runs Debian's nbd-server. Its foreground mode (-d)
// serves a single connection and then exits, and fio's nbd engine opens
// more than one, so it runs as the usual daemon (one child process per
// connection) tracked by its pid file.
func startNbdServer(ctx context.Context, e *serverEnv, s *serverProc) error {
	dir, err := os.MkdirTemp("", leftoverMarker(e.tag)+"nbd-server-")
	if err != nil {
		return err
	}
	s.dir = dir
	cfg := filepath.Join(dir, "config")
	pidFile := filepath.Join(dir, "pid")
	conf := fmt.Sprintf(nbdServerConfig, e.topo.ServerAddr(1), e.port, ExportName, s.file)
	if err := os.WriteFile(cfg, []byte(conf), 0o600); err != nil {
		return err
	}
	argv := inNS(e.topo.ServerNS, e.mptcp, "nbd-server", "-C", cfg, "-p", pidFile)
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = s.log, s.log
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("nbd-server: %w: %s", err, s.log)
	}
	// The daemon writes its pid file before it binds the port.
	deadline := time.Now().Add(5 * time.Second)
	for {
		b, err := os.ReadFile(pidFile)
		if err == nil {
			if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && pid > 0 {
				s.pid = pid
				break
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("nbd-server wrote no pid file %s", pidFile)
		}
		time.Sleep(20 * time.Millisecond)
	}
	return waitListening(ctx, e, s)
}

// createExport makes the backing file path of size bytes with its first
// alloc bytes written (zeros). A tmpfs page's first write can cost a
// virtual machine several CPU seconds per GB (the hypervisor backs guest
// memory when it is first touched; fallocate alone does not touch it),
// which a sparse export would charge to the write runs and the server's
// CPU: the runs measure the server, not the host's page allocation.
func createExport(path string, size, alloc int64) error {
	os.Remove(path)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	err = f.Truncate(size)
	zeros := make([]byte, 1<<20)
	for off := int64(0); err == nil && off < alloc; off += int64(len(zeros)) {
		_, err = f.WriteAt(zeros[:min(int64(len(zeros)), alloc-off)], off)
	}
	if err != nil {
		f.Close()
		return fmt.Errorf("creating the export %s: %w", path, err)
	}
	return f.Close()
}

// alive reports whether the server process still runs.
func (s *serverProc) alive() bool {
	if s.pid <= 0 {
		return false
	}
	if s.done != nil {
		select {
		case <-s.done:
			return false
		default:
			return true
		}
	}
	st, err := ReadProcStat(s.pid)
	return err == nil && st.State != 'Z' && st.State != 'X'
}

// waitListening waits until something listens on the server's port in
// the server namespace.
func waitListening(ctx context.Context, e *serverEnv, s *serverProc) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		out, err := topo.Exec(e.topo.ServerNS, "ss", "-Hltn", "sport = :"+strconv.Itoa(e.port)).Output()
		if err == nil && len(bytes.TrimSpace(out)) > 0 {
			return nil
		}
		if !s.alive() {
			return fmt.Errorf("%s exited before listening: %s", s.name, s.log)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s does not listen on port %d after 10s: %s", s.name, e.port, s.log)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// settle waits (up to a second) until the server has no child processes
// left, i.e. nbd-server's per-connection children have exited, so CPU
// samples taken afterwards are complete.
func (s *serverProc) settle() {
	if s.cmd != nil {
		time.Sleep(100 * time.Millisecond)
		return
	}
	deadline := time.Now().Add(time.Second)
	for time.Now().Before(deadline) && len(Descendants(allProcs(), s.pid)) > 0 {
		time.Sleep(20 * time.Millisecond)
	}
}

// stop terminates the server and removes its files. It is safe to call
// more than once.
func (s *serverProc) stop() error {
	var errs []error
	if s.cmd != nil && s.cmd.Process != nil && s.done != nil {
		// Signals fail only for processes that are gone already.
		_ = s.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-s.done:
		case <-time.After(5 * time.Second):
			_ = syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL)
			<-s.done
			errs = append(errs, fmt.Errorf("%s ignored SIGTERM for 5s; killed", s.name))
		}
	} else if s.cmd == nil && s.pid > 0 {
		// nbd-server's daemon and its per-connection children.
		kids := Descendants(allProcs(), s.pid)
		_ = syscall.Kill(s.pid, syscall.SIGTERM)
		for _, k := range kids {
			_ = syscall.Kill(k.PID, syscall.SIGTERM)
		}
		deadline := time.Now().Add(5 * time.Second)
		for s.alive() && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		if s.alive() {
			_ = syscall.Kill(s.pid, syscall.SIGKILL)
			errs = append(errs, fmt.Errorf("%s ignored SIGTERM for 5s; killed", s.name))
		}
		for _, k := range kids {
			// Only if the pid was not reused in the meantime.
			if st, err := ReadProcStat(k.PID); err == nil && st.Comm == k.Comm {
				_ = syscall.Kill(k.PID, syscall.SIGKILL)
			}
		}
	}
	s.pid = 0
	if s.file != "" {
		if err := os.Remove(s.file); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	if s.dir != "" {
		os.RemoveAll(s.dir)
	}
	return errors.Join(errs...)
}

// leftoverMarker starts the names of every file and directory a benchmark
// with topology name tag creates, so that a later run can recognise the
// leftovers of one that was killed.
func leftoverMarker(tag string) string { return "mpnbd-bench-" + tag + "-" }

// cleanLeftovers kills the servers and removes the files of an earlier
// benchmark with the same tag that could not clean up (SIGKILL): our
// server and nbdkit die with the benchmark, but nbd-server's daemon does
// not.
func cleanLeftovers(tag, tmpDir string) []string {
	var done []string
	marker := []byte(leftoverMarker(tag))
	for _, p := range allProcs() {
		if p.PID == os.Getpid() {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(p.PID), "cmdline"))
		if err == nil && bytes.Contains(cmdline, marker) {
			if syscall.Kill(p.PID, syscall.SIGKILL) == nil {
				done = append(done, fmt.Sprintf("killed %s (pid %d)", p.Comm, p.PID))
			}
		}
	}
	for _, pattern := range []string{filepath.Join(tmpDir, leftoverMarker(tag)+"*"), filepath.Join(os.TempDir(), leftoverMarker(tag)+"*")} {
		matches, _ := filepath.Glob(pattern)
		for _, m := range matches {
			if os.RemoveAll(m) == nil {
				done = append(done, "removed "+m)
			}
		}
	}
	return done
}
