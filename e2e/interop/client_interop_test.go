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
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// peerServer is a running third-party NBD server exporting one file.
type peerServer struct {
	Network, Addr string
	URI           string // for libnbd tools
	Path          string // backing file
	Size          int64
	// Daemon is the peer process when the test owns its output (nbdkit);
	// nil for nbd-server, which logs to syslog.
	Daemon *daemon
}

// expectErrors declares peer error messages the test provokes on purpose.
func (ps *peerServer) expectErrors(substrings ...string) {
	if ps.Daemon != nil {
		ps.Daemon.expectErrors(substrings...)
	}
}

// startNbdkit runs nbdkit's file plugin on a sparse file of size bytes,
// on a UNIX socket or on 127.0.0.1 TCP (wrapped by mptcpize when mptcp),
// with optional filters and their parameters.
func startNbdkit(t *testing.T, network string, mptcp bool, size int64, filters, params []string) *peerServer {
	t.Helper()
	dir := t.TempDir()
	ps := &peerServer{Network: network, Path: filepath.Join(dir, "disk.img"), Size: size}
	writeFile(t, ps.Path, nil, size)
	// A port picked in advance can be taken by someone else before nbdkit
	// binds it: try a few.
	for attempt := 1; ; attempt++ {
		args := []string{"-f", "--exit-with-parent"}
		switch network {
		case "unix":
			ps.Addr = filepath.Join(dir, "nbdkit.sock")
			ps.URI = "nbd+unix:///?socket=" + ps.Addr
			args = append(args, "-U", ps.Addr)
		case "tcp":
			port := strconv.Itoa(freePort(t))
			ps.Addr = net.JoinHostPort("127.0.0.1", port)
			ps.URI = "nbd://" + ps.Addr
			args = append(args, "-i", "127.0.0.1", "-p", port)
		default:
			t.Fatalf("network %q", network)
		}
		for _, f := range filters {
			args = append(args, "--filter="+f)
		}
		args = append(args, "file", "file="+ps.Path)
		args = append(args, params...)
		name, argv := peer(mptcp, "nbdkit", args...)
		d := startDaemon(t, name, argv...)
		err := waitListening(network, ps.Addr, d.alive)
		if err == nil {
			ps.Daemon = d
			return ps
		}
		// A failed attempt is not a peer error to report.
		d.expectErrors("")
		if attempt == 3 || network == "unix" {
			t.Fatalf("nbdkit: %v", err)
		}
		t.Logf("nbdkit attempt %d: %v", attempt, err)
	}
}

// nbdServerConfig is a minimal nbd-server configuration: one newstyle
// export by name, on 127.0.0.1 only.
const nbdServerConfig = `[generic]
listenaddr = 127.0.0.1
port = %d

[%s]
exportname = %s
flush = true
fua = true
trim = true
`

// startNbdServer runs Debian's nbd-server with a generated configuration.
// nbd-server daemonizes (without -d it forks a child per client, which a
// multi-connection client needs), so it is tracked by its pid file.
func startNbdServer(t *testing.T, export string, size int64) *peerServer {
	t.Helper()
	dir := t.TempDir()
	ps := &peerServer{Network: "tcp", Path: filepath.Join(dir, "disk.img"), Size: size}
	writeFile(t, ps.Path, nil, size)
	for attempt := 1; ; attempt++ {
		port := freePort(t)
		ps.Addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
		ps.URI = "nbd://" + ps.Addr + "/" + export
		cfg := filepath.Join(dir, "config")
		if err := os.WriteFile(cfg, fmt.Appendf(nil, nbdServerConfig, port, export, ps.Path), 0o600); err != nil {
			t.Fatal(err)
		}
		pidFile := filepath.Join(dir, "nbd-server.pid")
		os.Remove(pidFile)
		r := runCmd(t, "nbd-server", "-C", cfg, "-p", pidFile)
		if r.ExitCode != 0 || r.Err != nil {
			if attempt < 3 {
				t.Logf("nbd-server attempt %d failed (exit %d): %s", attempt, r.ExitCode, r.Stderr)
				continue
			}
			t.Fatalf("nbd-server failed to start (exit %d): %v\n%s%s", r.ExitCode, r.Err, r.Stdout, r.Stderr)
		}
		// The daemon writes its pid file before it binds the port, and
		// exits if that fails.
		pid := waitPidFile(t, pidFile)
		t.Logf("nbd-server daemon pid %d", pid)
		t.Cleanup(func() { stopPid(t, pid) })
		err := waitListening("tcp", ps.Addr, func() error {
			if syscall.Kill(pid, 0) != nil || isZombie(pid) {
				return fmt.Errorf("nbd-server (pid %d) exited before listening on %s; its log went to syslog", pid, ps.Addr)
			}
			return nil
		})
		if err == nil {
			return ps
		}
		if attempt == 3 {
			t.Fatalf("nbd-server: %v", err)
		}
		t.Logf("nbd-server attempt %d: %v", attempt, err)
	}
}

// isZombie reports whether pid has exited but was not reaped (a daemon
// that outlived its parent and whose new parent does not reap).
func isZombie(pid int) bool {
	state, _, err := attach.ProcStat(pid)
	return err == nil && state == 'Z'
}

// stopPid terminates a daemon started by a test and waits until it is gone.
func stopPid(t *testing.T, pid int) {
	if err := syscall.Kill(pid, syscall.SIGTERM); err != nil {
		return
	}
	deadline := time.Now().Add(5 * time.Second)
	for syscall.Kill(pid, 0) == nil && !isZombie(pid) {
		if time.Now().After(deadline) {
			t.Logf("pid %d ignored SIGTERM for 5s; killing it", pid)
			syscall.Kill(pid, syscall.SIGKILL)
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// image tracks what an export must contain.
type image struct {
	mu   sync.Mutex
	want []byte
}

func (im *image) set(off int64, p []byte) {
	im.mu.Lock()
	copy(im.want[off:], p)
	im.mu.Unlock()
}

func (im *image) zero(off, n int64) {
	im.mu.Lock()
	clear(im.want[off : off+n])
	im.mu.Unlock()
}

// exerciseClient drives our client against a real server: concurrent
// pipelined writes (aligned, unaligned, FUA), flush, trim, write-zeroes,
// an out-of-range request that must come back as an error reply without
// breaking the connection, then a full read-back compared by checksum with
// both the expected image and the server's backing file.
func exerciseClient(t *testing.T, cl *nbd.Client, ps *peerServer, seed uint64) {
	t.Helper()
	size := ps.Size
	if cl.Size() != size {
		t.Fatalf("client sees size %d, server exports %d", cl.Size(), size)
	}
	im := &image{want: readFile(t, ps.Path)}
	if int64(len(im.want)) != size {
		t.Fatalf("backing file is %d bytes, want %d", len(im.want), size)
	}

	// Concurrent writes of 1 MiB - 1 KiB at unaligned offsets, eight at a
	// time, covering most of the export.
	const chunk = 1 << 20
	var wg sync.WaitGroup
	errs := make(chan error, size/chunk)
	for i := int64(0); i < size/chunk; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			off := i*chunk + 333
			p := randomBytes(seed+uint64(i), chunk-1024)
			var flags uint16
			if i%5 == 0 {
				flags = nbd.CmdFlagFUA
			}
			if _, err := cl.WriteAtFlags(p, off, flags); err != nil {
				errs <- fmt.Errorf("write %d bytes at %d (flags %#x): %w", len(p), off, flags, err)
				return
			}
			im.set(off, p)
		}()
		if i%8 == 7 {
			wg.Wait()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}

	// Tiny writes straddling a sector and a page boundary, and the very
	// last byte of the export.
	for _, w := range []struct{ off, n int64 }{{511, 2}, {4095, 3}, {size - 1, 1}} {
		p := randomBytes(seed^uint64(w.off), int(w.n))
		if _, err := cl.WriteAt(p, w.off); err != nil {
			t.Fatalf("write %d bytes at %d: %v", w.n, w.off, err)
		}
		im.set(w.off, p)
	}
	if err := cl.Flush(); err != nil {
		t.Fatalf("flush: %v", err)
	}
	compareFile(t, ps.Path, im.want, "after writes and flush")

	flags := cl.Info().Flags
	if flags&nbd.FlagSendTrim != 0 {
		// Both peers punch a hole, so the range reads back as zeroes (the
		// protocol itself leaves trimmed content unspecified).
		const off, n = 2 << 20, 1 << 20
		if err := cl.Trim(off, n); err != nil {
			t.Fatalf("trim %d+%d: %v", off, n, err)
		}
		im.zero(off, n)
	} else {
		t.Logf("server does not announce trim (flags %#04x)", flags)
	}
	if flags&nbd.FlagSendWriteZeroes != 0 {
		for _, z := range []struct {
			off, n int64
			noHole bool
		}{{5<<20 + 100, 70000, false}, {7 << 20, 64 << 10, true}} {
			if err := cl.WriteZeroes(z.off, z.n, z.noHole); err != nil {
				t.Fatalf("write zeroes %d+%d (no hole %v): %v", z.off, z.n, z.noHole, err)
			}
			im.zero(z.off, z.n)
		}
	} else {
		t.Logf("server does not announce write zeroes (flags %#04x)", flags)
	}
	if err := cl.Flush(); err != nil {
		t.Fatalf("flush: %v", err)
	}

	// A read crossing the end of the export: the server must refuse it
	// with an error reply, and the connection must stay in step.
	ps.expectErrors("out of range")
	var nerr *nbd.Error
	_, err := cl.ReadAt(make([]byte, 4096), size-1024)
	if !errors.As(err, &nerr) || nerr.Cmd != nbd.CmdRead || nerr.Errno == 0 {
		t.Fatalf("read past the end: got %v, want an *nbd.Error reply for the read", err)
	}
	t.Logf("read past the end refused with %v", err)
	_, err = cl.WriteAt(make([]byte, 4096), size-1024)
	if !errors.As(err, &nerr) || nerr.Cmd != nbd.CmdWrite || nerr.Errno == 0 {
		t.Fatalf("write past the end: got %v, want an *nbd.Error reply for the write", err)
	}
	t.Logf("write past the end refused with %v", err)

	// Read everything back, in parallel 1 MiB requests.
	got := make([]byte, size)
	errs = make(chan error, size/chunk+1)
	for off := int64(0); off < size; off += chunk {
		wg.Add(1)
		go func() {
			defer wg.Done()
			n := min(chunk, size-off)
			if _, err := cl.ReadAt(got[off:off+n], off); err != nil {
				errs <- fmt.Errorf("read %d bytes at %d: %w", n, off, err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if sum(got) != sum(im.want) {
		t.Fatalf("read back through our client differs from what was written: %s", firstDiff(got, im.want))
	}
	compareFile(t, ps.Path, im.want, "at the end")
}

// compareFile checks the server's backing file byte for byte.
func compareFile(t *testing.T, path string, want []byte, when string) {
	t.Helper()
	if got := readFile(t, path); !bytes.Equal(got, want) {
		t.Fatalf("backing file %s: sha256 %s, want %s (%s)", when, sum(got), sum(want), firstDiff(got, want))
	}
}

// crossCheckInfo compares what our client learned in negotiation with what
// libnbd's nbdinfo reports for the same server.
func crossCheckInfo(t *testing.T, cl *nbd.Client, uri string) {
	t.Helper()
	if _, err := exec.LookPath("nbdinfo"); err != nil {
		t.Logf("nbdinfo not installed; skipping the cross-check of export flags")
		return
	}
	out := parseNbdinfo(t, mustRun(t, "nbdinfo", "--no-content", "--json", uri))
	if len(out.Exports) != 1 {
		t.Fatalf("nbdinfo reported %d exports", len(out.Exports))
	}
	e := out.Exports[0]
	info := cl.Info()
	check := func(field string, p *bool, bit uint16) {
		t.Helper()
		if p == nil {
			t.Errorf("nbdinfo did not report %s", field)
		} else if *p != (info.Flags&bit != 0) {
			t.Errorf("%s: nbdinfo says %v, our client parsed flags %#04x", field, *p, info.Flags)
		}
	}
	if e.Size == nil || uint64(*e.Size) != info.Size {
		t.Errorf("size: nbdinfo says %v, our client %d", deref(e.Size), info.Size)
	}
	check("is_read_only", e.IsReadOnly, nbd.FlagReadOnly)
	check("can_flush", e.CanFlush, nbd.FlagSendFlush)
	check("can_fua", e.CanFUA, nbd.FlagSendFUA)
	check("can_trim", e.CanTrim, nbd.FlagSendTrim)
	check("can_zero", e.CanZero, nbd.FlagSendWriteZeroes)
	check("can_multi_conn", e.CanMultiConn, nbd.FlagCanMultiConn)
	// can_df is not compared: servers announce NBD_FLAG_SEND_DF only to
	// clients that negotiated structured replies, which libnbd does and
	// our client does not.
	check("is_rotational", e.IsRotational, nbd.FlagRotational)
	if e.BlockMax != nil && info.MaxBlock != 0 && uint32(*e.BlockMax) != info.MaxBlock {
		t.Errorf("maximum block size: nbdinfo says %d, our client %d", *e.BlockMax, info.MaxBlock)
	}
}

// verifyMultiConn writes through a multi-connection client (requests are
// spread over all its connections), flushes once, and checks the data
// through a separate single-connection client and in the backing file.
func verifyMultiConn(t *testing.T, o nbd.DialOptions, ps *peerServer, seed uint64) {
	t.Helper()
	o.Conns = 4
	cl := dialClient(t, o)
	if n := len(cl.Conns()); n != 4 {
		t.Fatalf("multi-conn client has %d connections, want 4", n)
	}
	want := readFile(t, ps.Path)
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for i := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			off := int64(i) * (ps.Size / 16)
			p := randomBytes(seed+uint64(i), 256<<10+i)
			if _, err := cl.WriteAt(p, off); err != nil {
				errs <- err
				return
			}
			copy(want[off:], p)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("multi-conn write: %v", err)
	}
	// With NBD_FLAG_CAN_MULTI_CONN one flush, on any connection, covers
	// the writes completed on all of them.
	if err := cl.Flush(); err != nil {
		t.Fatalf("flush: %v", err)
	}
	o.Conns = 1
	other := dialClient(t, o)
	got := make([]byte, ps.Size)
	if _, err := other.ReadAt(got, 0); err != nil {
		t.Fatalf("read through a second client: %v", err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("second client reads different data: %s", firstDiff(got, want))
	}
	compareFile(t, ps.Path, want, "after multi-conn writes")
}

// TestClientNbdkit runs our client against nbdkit's file plugin over a
// UNIX socket and over TCP, with one and with four connections.
func TestClientNbdkit(t *testing.T) {
	needTools(t, "nbdkit")
	for i, network := range []string{"unix", "tcp"} {
		t.Run(network, func(t *testing.T) {
			ps := startNbdkit(t, network, false, 16<<20, nil, nil)
			o := nbd.DialOptions{Network: network, Addr: ps.Addr}
			cl := dialClient(t, o)
			want := nbd.FlagHasFlags | nbd.FlagSendFlush | nbd.FlagSendFUA | nbd.FlagSendTrim | nbd.FlagSendWriteZeroes | nbd.FlagCanMultiConn
			if f := cl.Info().Flags; f&want != want || f&nbd.FlagReadOnly != 0 {
				t.Fatalf("nbdkit file plugin flags %#04x, want %#04x set and not read-only", f, want)
			}
			crossCheckInfo(t, cl, ps.URI)
			exerciseClient(t, cl, ps, uint64(1000*(i+1)))
			verifyMultiConn(t, o, ps, uint64(5000*(i+1)))
			sessionUnfenced(t, o)
		})
	}
}

// TestClientNbdkitNoMultiConn checks that a server that does not announce
// NBD_FLAG_CAN_MULTI_CONN gets one connection only.
func TestClientNbdkitNoMultiConn(t *testing.T) {
	needTools(t, "nbdkit")
	ps := startNbdkit(t, "unix", false, 4<<20, []string{"multi-conn"}, []string{"multi-conn-mode=disable"})
	o := nbd.DialOptions{Network: "unix", Addr: ps.Addr}
	cl := dialClient(t, o)
	if f := cl.Info().Flags; f&nbd.FlagCanMultiConn != 0 {
		t.Fatalf("flags %#04x announce multi-conn despite multi-conn-mode=disable", f)
	}
	crossCheckInfo(t, cl, ps.URI)
	o.Conns = 2
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cl2, err := nbd.Dial(ctx, o)
	if err == nil {
		cl2.Close()
		t.Fatalf("Dial with 2 connections succeeded on a server without multi-conn")
	}
	if !errors.Is(err, nbd.ErrUnsupported) {
		t.Fatalf("Dial with 2 connections: %v, want nbd.ErrUnsupported", err)
	}
	// The single-connection client still works.
	p := randomBytes(77, 64<<10)
	if _, err := cl.WriteAt(p, 4096); err != nil {
		t.Fatal(err)
	}
	if err := cl.Flush(); err != nil {
		t.Fatal(err)
	}
	want := make([]byte, ps.Size)
	copy(want[4096:], p)
	compareFile(t, ps.Path, want, "after a write")
}

// sessionUnfenced checks that a client announcing a session (our option,
// unknown to other servers) still negotiates and does I/O, unfenced.
func sessionUnfenced(t *testing.T, o nbd.DialOptions) {
	t.Helper()
	id := nbd.NewSessionID()
	o.Session = &id
	cl := dialClient(t, o)
	if info := cl.Info(); info.Fenced || info.Incarnation != (nbd.Incarnation{}) {
		t.Fatalf("a server without the session option reported fencing: %+v", info)
	}
	p := randomBytes(91, 8192)
	if _, err := cl.WriteAt(p, 0); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(p))
	if _, err := cl.ReadAt(got, 0); err != nil || !bytes.Equal(got, p) {
		t.Fatalf("read back after a session handshake: %v, equal %v", err, bytes.Equal(got, p))
	}
}

// TestClientNbdServer runs our client against Debian's nbd-server.
func TestClientNbdServer(t *testing.T) {
	needTools(t, "nbd-server")
	ps := startNbdServer(t, "disk", 16<<20)
	o := nbd.DialOptions{Network: "tcp", Addr: ps.Addr, Export: "disk"}
	cl := dialClient(t, o)
	info := cl.Info()
	t.Logf("nbd-server export: size %d flags %#04x block sizes %d/%d/%d", info.Size, info.Flags, info.MinBlock, info.PrefBlock, info.MaxBlock)
	want := nbd.FlagHasFlags | nbd.FlagSendFlush | nbd.FlagSendFUA | nbd.FlagSendTrim
	if info.Flags&want != want || info.Flags&nbd.FlagReadOnly != 0 {
		t.Fatalf("nbd-server flags %#04x, want %#04x set (flush, fua, trim are enabled in its config) and not read-only", info.Flags, want)
	}
	exerciseClient(t, cl, ps, 3000)
	sessionUnfenced(t, o)

	if info.Flags&nbd.FlagCanMultiConn != 0 {
		verifyMultiConn(t, o, ps, 7000)
	} else {
		o.Conns = 2
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		cl2, err := nbd.Dial(ctx, o)
		if err == nil {
			cl2.Close()
		}
		if !errors.Is(err, nbd.ErrUnsupported) {
			t.Fatalf("nbd-server does not announce multi-conn; Dial with 2 connections: %v, want nbd.ErrUnsupported", err)
		}
	}

	// An unknown export name is refused during negotiation.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := nbd.Dial(ctx, nbd.DialOptions{Addr: ps.Addr, Export: "nosuch"})
	if !errors.Is(err, nbd.ErrUnknownExport) {
		t.Fatalf("Dial of an unknown export: %v, want nbd.ErrUnknownExport", err)
	}
}

// TestClientNbdkitMPTCP runs our client with MPTCP against nbdkit wrapped
// by mptcpize: every connection must really be carried by MPTCP. A plain
// nbdkit is the control: there the same client must report the fallback.
func TestClientNbdkitMPTCP(t *testing.T) {
	needTools(t, "nbdkit")
	needMPTCP(t)
	t.Run("mptcpize", func(t *testing.T) {
		ps := startNbdkit(t, "tcp", true, 16<<20, nil, nil)
		o := nbd.DialOptions{Addr: ps.Addr, MPTCP: true, Conns: 2}
		cl := dialClient(t, o)
		for i, mp := range cl.MultipathTCP() {
			if !mp {
				t.Fatalf("connection %d to nbdkit under mptcpize is not carried by MPTCP", i)
			}
		}
		exerciseClient(t, cl, ps, 9000)
	})
	t.Run("plain-tcp-control", func(t *testing.T) {
		ps := startNbdkit(t, "tcp", false, 1<<20, nil, nil)
		cl := dialClient(t, nbd.DialOptions{Addr: ps.Addr, MPTCP: true})
		if mp := cl.MultipathTCP(); len(mp) != 1 || mp[0] {
			t.Fatalf("MultipathTCP() = %v against a plain TCP nbdkit, want [false]", mp)
		}
		p := randomBytes(11, 4096)
		if _, err := cl.WriteAt(p, 0); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, 4096)
		if _, err := cl.ReadAt(got, 0); err != nil || !bytes.Equal(got, p) {
			t.Fatalf("read back after fallback: err %v, equal %v", err, bytes.Equal(got, p))
		}
	})
}
