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

// Package vm boots a small Linux virtual machine under qemu so that tests
// can exercise kernel features the host may lack, such as the NBD driver
// (/dev/nbdX), veth pairs and traffic shaping, on a known kernel.
//
// The guest is a kernel plus an initramfs assembled per run: a static
// busybox for the userland, the requested kernel modules, host tools with
// their shared libraries, arbitrary files, and an init script that mounts
// the pseudo file systems, brings up lo, loads the modules, runs the
// payload shell script and reports its exit status on the serial console
// before powering off. qemu runs with TCG (no KVM needed), no network
// device and no disk: networking tests build veth pairs between network
// namespaces inside the guest, and block devices come from brd, loop or
// nbd. A guest that needs a service of the host (a Kubernetes API
// server) is given a NIC whose only way out is the TCP forwards its
// Config names (HostForwards).
//
// Run boots one VM for a Config. Default provides a Config with a cached
// Debian cloud kernel fetched by hack/vm-kernel.sh; RunGoTest builds a Go
// test package statically and runs it inside the guest:
//
//	func TestAttachInVM(t *testing.T) {
//		vm.RunGoTest(t, "./pkg/nbd/nbdnl", "^TestAttach")
//	}
//
// and the guest-side test guards itself with
//
//	if os.Getenv("MPNBD_IN_VM") != "1" { t.Skip("needs the e2e VM") }
//
// The guest environment: root, PID 1 is busybox sh; / is the initramfs
// (tmpfs, counted against guest memory) with /proc, /sys, /dev
// (devtmpfs; no udev, so no /dev/disk/by-* links), /dev/pts, /dev/shm,
// /run, cgroup2, debugfs and bpffs mounted; lo is up; PATH holds the
// tools (which shadow busybox applets of the same name) and busybox. The
// kernel console runs at loglevel 3 with oops=panic, so a kernel oops
// ends the run with the oops in Result.Log.
package vm

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Config describes one VM run.
type Config struct {
	// Kernel is the path of the kernel image (bzImage/vmlinuz).
	Kernel string
	// Modules are kernel modules loaded in order before the payload runs,
	// each a host path optionally followed by module parameters, e.g.
	// "/cache/nbd.ko nbds_max=8".
	Modules []string
	// Files maps guest paths to host paths. A host directory is copied
	// recursively. File modes are preserved.
	Files map[string]string
	// Tools are host executables copied to the same path in the guest
	// together with the shared libraries they link (as ldd reports).
	// A tool takes precedence over a busybox applet of the same name.
	Tools []string
	// Env is exported to the payload.
	Env map[string]string
	// MemoryMB is the guest memory size (default 1024).
	MemoryMB int
	// CPUs is the number of virtual CPUs (default 2).
	CPUs int
	// Timeout bounds the whole run, boot included (default 5 minutes).
	Timeout time.Duration
	// Cmd is the payload, a shell script run by busybox sh as root in /,
	// with stdin from /dev/null and stdout/stderr on the console.
	Cmd string
	// KernelArgs are appended to the kernel command line.
	KernelArgs string
	// Output, if set, receives the console output as it arrives.
	Output io.Writer
	// Busybox is a static busybox binary (default: busybox from PATH).
	Busybox string
	// QEMU is the emulator binary (default: qemu-system-x86_64).
	QEMU string
	// Accel is the qemu accelerator (default: $MPNBD_VM_ACCEL or "tcg").
	Accel string
	// HostForwards carry the guest's TCP connections to ports of
	// HostAddr to addresses on the host (each connection through a socat
	// the host runs for it). With any, the guest has a NIC, eth0, at
	// GuestAddr on a network of qemu's user mode that reaches nothing
	// else; the guest kernel needs virtio_net (in Modules where it is a
	// module).
	HostForwards []HostForward
}

// A HostForward carries the guest's connections to HostAddr:Port to To
// (host:port) on the host.
type HostForward struct {
	Port int
	To   string
}

// The addresses of the guest's network when it has host forwards.
const (
	HostAddr  = "10.0.2.100"
	GuestAddr = "10.0.2.15"
)

// nicArgs are qemu's network arguments: no NIC, or one whose only way out
// is the host forwards.
func nicArgs(fwds []HostForward) ([]string, error) {
	if len(fwds) == 0 {
		return []string{"-nic", "none"}, nil
	}
	socat, err := exec.LookPath("socat")
	if err != nil {
		return nil, fmt.Errorf("vm: host forwards need socat on the host (apt-get install socat): %w", err)
	}
	spec := "user,id=host,restrict=on,ipv6=off,net=10.0.2.0/24"
	for _, f := range fwds {
		if f.Port <= 0 || f.Port > 65535 || strings.ContainsAny(f.To, ", ") {
			return nil, fmt.Errorf("vm: bad host forward %+v", f)
		}
		spec += fmt.Sprintf(",guestfwd=tcp:%s:%d-cmd:%s - TCP:%s", HostAddr, f.Port, socat, f.To)
	}
	return []string{"-netdev", spec, "-device", "virtio-net-pci,netdev=host,romfile="}, nil
}

// Result is what a VM run produced.
type Result struct {
	// ExitCode is the payload's exit status, or -1 if the guest did not
	// report one (kernel panic, timeout, setup failure).
	ExitCode int
	// Log is the whole console log, kernel messages included, with
	// carriage returns removed.
	Log string
	// Output is the part of Log that the payload printed (between the
	// start and exit markers of init), or the whole Log if the payload
	// never started.
	Output string
	// Duration is the wall time from starting qemu to its exit.
	Duration time.Duration
	// PID is the process id qemu had; the process is gone when Run
	// returns.
	PID int
	// Started reports whether the payload began (init's start marker).
	Started bool
}

// ErrTimeout is reported (wrapped, together with the context's error)
// when the run did not finish within Config.Timeout or the context.
var ErrTimeout = errors.New("vm: timed out")

// ExitError reports a payload that exited with a non-zero status.
type ExitError struct {
	Code int
}

func (e *ExitError) Error() string {
	return fmt.Sprintf("vm: payload exited with status %d", e.Code)
}

const (
	markerStart = "MPNBD-VM-START-"
	markerExit  = "MPNBD-VM-EXIT-"
	markerError = "MPNBD-VM-SETUP-ERROR-"

	defaultMemoryMB = 1024
	defaultCPUs     = 2
	defaultTimeout  = 5 * time.Minute
	// exitGrace is how long qemu may take to power off after the guest
	// reported its exit status before it is killed.
	exitGrace = 5 * time.Second
)

// Run builds the initramfs for cfg in a temporary directory, boots qemu
// and waits for the payload to finish. It returns a nil error only if the
// payload reported exit status 0; a non-zero status is an *ExitError, a
// run that exceeded cfg.Timeout or ctx wraps ErrTimeout, and a guest that
// ended without reporting a status is another error. Result.Log holds the
// console log in every case. qemu is killed before Run returns.
//
// A kernel that panics while it boots, before the payload began (seen
// under TCG now and then, in code of the kernel's own: nothing of ours
// ran yet), is booted again, up to bootAttempts times.
func Run(ctx context.Context, cfg Config) (Result, error) {
	for attempt := 1; ; attempt++ {
		res, err := runOnce(ctx, cfg)
		if err == nil || res.Started || attempt >= bootAttempts || ctx.Err() != nil || !strings.Contains(res.Log, "Kernel panic") {
			return res, err
		}
		if cfg.Output != nil {
			fmt.Fprintf(cfg.Output, "vm: the kernel panicked while booting, before the payload began (%s); booting again\n", lastLines(res.Log, 1))
		}
	}
}

// bootAttempts bounds the boots of one Run whose kernel panics before the
// payload begins.
const bootAttempts = 3

func runOnce(ctx context.Context, cfg Config) (Result, error) {
	res := Result{ExitCode: -1}
	if cfg.Kernel == "" {
		return res, errors.New("vm: Config.Kernel is empty")
	}
	if cfg.MemoryMB <= 0 {
		cfg.MemoryMB = defaultMemoryMB
	}
	if cfg.CPUs <= 0 {
		cfg.CPUs = defaultCPUs
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = defaultTimeout
	}
	if cfg.QEMU == "" {
		cfg.QEMU = "qemu-system-x86_64"
	}
	if cfg.Accel == "" {
		cfg.Accel = os.Getenv("MPNBD_VM_ACCEL")
	}
	if cfg.Accel == "" {
		cfg.Accel = "tcg"
	}
	qemu, err := exec.LookPath(cfg.QEMU)
	if err != nil {
		return res, fmt.Errorf("vm: %w", err)
	}

	dir, err := os.MkdirTemp("", "mpnbd-vm-*")
	if err != nil {
		return res, fmt.Errorf("vm: %w", err)
	}
	defer os.RemoveAll(dir)

	nonce, err := newNonce()
	if err != nil {
		return res, err
	}
	initrd := filepath.Join(dir, "initrd.cpio")
	if err := buildInitramfs(initrd, &cfg, nonce); err != nil {
		return res, err
	}

	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()

	cmdline := "console=ttyS0 quiet loglevel=3 panic=-1 oops=panic mitigations=off"
	if cfg.KernelArgs != "" {
		cmdline += " " + cfg.KernelArgs
	}
	nic, err := nicArgs(cfg.HostForwards)
	if err != nil {
		return res, err
	}
	args := []string{
		"-nodefaults", "-no-user-config", "-no-reboot",
		"-accel", cfg.Accel,
		"-cpu", "max",
		"-m", strconv.Itoa(cfg.MemoryMB),
		"-smp", strconv.Itoa(cfg.CPUs),
		"-display", "none",
		"-serial", "stdio",
	}
	args = append(args, nic...)
	args = append(args,
		"-kernel", cfg.Kernel,
		"-initrd", initrd,
		"-append", cmdline,
	)
	cmd := exec.Command(qemu, args...)
	con := newConsole(nonce, cfg.Output)
	var stderr bytes.Buffer
	cmd.Stdout = con
	cmd.Stderr = &stderr
	cmd.WaitDelay = 5 * time.Second
	setProcAttr(cmd)

	start := time.Now()
	if err := cmd.Start(); err != nil {
		return res, fmt.Errorf("vm: start qemu: %w", err)
	}
	res.PID = cmd.Process.Pid
	waitc := make(chan error, 1)
	go func() { waitc <- cmd.Wait() }()

	var (
		waitErr  error
		timedOut bool
		grace    <-chan time.Time
		exited   = con.exited
	)
loop:
	for {
		select {
		case waitErr = <-waitc:
			break loop
		case <-exited:
			// The payload is done; give qemu a moment to power off.
			t := time.NewTimer(exitGrace)
			defer t.Stop()
			grace, exited = t.C, nil
		case <-grace:
			_ = cmd.Process.Kill()
			waitErr = <-waitc
			break loop
		case <-ctx.Done():
			timedOut = true
			_ = cmd.Process.Kill()
			waitErr = <-waitc
			break loop
		}
	}
	res.Duration = time.Since(start)
	con.flush()
	res.Log, res.Output = con.logs()
	res.Started = con.started()
	code, reported, setupErr := con.status()

	switch {
	case reported:
		res.ExitCode = code
		if code != 0 {
			return res, &ExitError{Code: code}
		}
		return res, nil
	case setupErr != "":
		return res, fmt.Errorf("vm: guest setup failed: %s", setupErr)
	case timedOut:
		return res, fmt.Errorf("%w after %v: %w", ErrTimeout, res.Duration.Round(time.Millisecond), ctx.Err())
	}
	msg := "vm: guest ended without reporting an exit status"
	if waitErr != nil {
		msg += " (qemu: " + waitErr.Error() + ")"
	}
	if s := strings.TrimSpace(stderr.String()); s != "" {
		msg += ": " + s
	}
	if tail := lastLines(res.Log, 5); tail != "" {
		msg += "; console ends with:\n" + tail
	}
	return res, errors.New(msg)
}

// started reports whether the payload's start marker arrived.
func (c *console) started() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.startOff >= 0
}

func newNonce() (string, error) {
	b := make([]byte, 8)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("vm: %w", err)
	}
	return hex.EncodeToString(b), nil
}

// console collects the serial output of qemu and watches it for the
// markers the guest's init prints.
type console struct {
	nonce  string
	out    io.Writer
	exited chan struct{} // closed when the exit marker arrives

	mu        sync.Mutex
	partial   []byte
	log       strings.Builder
	startOff  int // offset in log after the start marker, -1 if none
	endOff    int // offset in log of the exit marker line, -1 if none
	code      int
	reported  bool
	setupErr  string
	closeOnce sync.Once
}

func newConsole(nonce string, out io.Writer) *console {
	return &console{nonce: nonce, out: out, exited: make(chan struct{}), startOff: -1, endOff: -1}
}

func (c *console) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.out != nil {
		_, _ = c.out.Write(p)
	}
	c.partial = append(c.partial, p...)
	for {
		i := bytes.IndexByte(c.partial, '\n')
		if i < 0 {
			break
		}
		c.line(string(c.partial[:i]))
		c.partial = c.partial[i+1:]
	}
	return len(p), nil
}

// flush processes an unterminated last line.
func (c *console) flush() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.partial) > 0 {
		c.line(string(c.partial))
		c.partial = nil
	}
}

func (c *console) line(l string) {
	l = strings.ReplaceAll(l, "\r", "")
	off := c.log.Len()
	c.log.WriteString(l)
	c.log.WriteByte('\n')
	// Kernel messages may share a line with payload output, so the
	// markers are searched anywhere in the line.
	if i := strings.Index(l, markerStart+c.nonce); i >= 0 && c.startOff < 0 {
		c.startOff = c.log.Len()
		return
	}
	if i := strings.Index(l, markerError+c.nonce+":"); i >= 0 && c.setupErr == "" {
		c.setupErr = strings.TrimSpace(l[i+len(markerError+c.nonce+":"):])
		return
	}
	if i := strings.Index(l, markerExit+c.nonce+"="); i >= 0 && !c.reported {
		rest := l[i+len(markerExit+c.nonce+"="):]
		j := 0
		for j < len(rest) && rest[j] >= '0' && rest[j] <= '9' {
			j++
		}
		if code, err := strconv.Atoi(rest[:j]); err == nil {
			c.code, c.reported = code, true
			c.endOff = off + i
			c.closeOnce.Do(func() { close(c.exited) })
		}
	}
}

func (c *console) logs() (log, output string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	log = c.log.String()
	if c.startOff < 0 {
		return log, log
	}
	end := len(log)
	if c.endOff >= c.startOff {
		end = c.endOff
	}
	return log, log[c.startOff:end]
}

func (c *console) status() (code int, reported bool, setupErr string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.code, c.reported, c.setupErr
}

// lastLines returns the last n non-empty lines of s.
func lastLines(s string, n int) string {
	var lines []string
	sc := bufio.NewScanner(strings.NewReader(s))
	sc.Buffer(make([]byte, 0, 64*1024), 1<<20)
	for sc.Scan() {
		if strings.TrimSpace(sc.Text()) == "" {
			continue
		}
		lines = append(lines, sc.Text())
		if len(lines) > n {
			lines = lines[1:]
		}
	}
	return strings.Join(lines, "\n")
}
