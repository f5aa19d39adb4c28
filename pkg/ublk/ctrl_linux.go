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

package ublk

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"unsafe"

	"github.com/mpnbd/mpnbd/pkg/iouring"
	"golang.org/x/sys/unix"
)

// ControlPath is the ublk driver's control device.
const ControlPath = "/dev/ublk-control"

// ErrUnavailable: the kernel has no ublk driver (no /dev/ublk-control).
var ErrUnavailable = errors.New("ublk: no /dev/ublk-control (the ublk_drv module is not loaded, or the kernel has no ublk)")

// Available reports whether this kernel can serve ublk devices.
func Available() error {
	if _, err := os.Stat(ControlPath); err != nil {
		return fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	return nil
}

// Control sends control commands to the ublk driver. It is safe for
// concurrent use (commands go one at a time).
//
// Every command is submitted and waited for on one OS thread of its own
// (the control thread), which runs nothing else. io_uring ties a request
// to the task (thread) that submitted it; a command the driver will not
// run without blocking (ublk_drv on 6.1 runs every control command so) goes
// to an io worker of that task, started for it when the task has none. The
// request is cancelled (ECANCELED) before the driver sees it when that
// worker cannot be started (the kernel refuses to create it while a signal
// is pending on the task, and gives up after a few tries) or the task
// exits. An ordinary Go thread is a poor owner: after an interrupted wait
// the scheduler may move the waiting goroutine elsewhere and give the
// thread other goroutines (and their preemption signals), or a queue's
// goroutine that ends it. The control thread waits in the kernel or for
// the next command, and lives as long as the Control.
type Control struct {
	mu   sync.Mutex
	f    *os.File
	ring *iouring.Ring
	// cmds takes each command to the control thread; closed by Close.
	cmds chan func()
	// exited is closed when the control thread is done.
	exited chan struct{}
	// tid is the control thread's id.
	tid int
	// buf is what a command's addr points at: outside the Go heap, since
	// the kernel may read or write it after the submission returns.
	buf []byte
	// legacy: the driver predates the ioctl encoding of commands (Linux
	// before 6.3, or one without GET_FEATURES): plain command numbers.
	legacy bool
	// features are the driver's feature flags (zero when it cannot say).
	features uint64
}

// OpenControl opens the control device.
func OpenControl() (*Control, error) {
	f, err := os.OpenFile(ControlPath, os.O_RDWR, 0)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("%w: %v", ErrUnavailable, err)
		}
		return nil, fmt.Errorf("ublk: %w", err)
	}
	ring, err := iouring.New(4, iouring.SetupSQE128)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("ublk: control ring: %w", err)
	}
	buf, err := unix.Mmap(-1, 0, pageSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		_ = ring.Close() // ours, unused: nothing to lose
		f.Close()
		return nil, fmt.Errorf("ublk: %w", err)
	}
	c := &Control{f: f, ring: ring, buf: buf, cmds: make(chan func()), exited: make(chan struct{})}
	tid := make(chan int)
	go c.thread(tid)
	c.tid = <-tid
	// GET_FEATURES exists in the ioctl encoding only (6.5 and later); a
	// driver that refuses it gets the plain command numbers.
	if feat, err := c.Features(); err == nil {
		c.features = feat
	} else {
		c.legacy = true
	}
	return c, nil
}

// thread is the control thread: it runs the commands cmds brings until
// Close closes it.
func (c *Control) thread(tid chan<- int) {
	runtime.LockOSThread()
	defer close(c.exited)
	tid <- unix.Gettid()
	for cmd := range c.cmds {
		cmd()
	}
	// No command of ours is left in the kernel: the thread may serve
	// others.
	runtime.UnlockOSThread()
}

// Close releases the control device.
func (c *Control) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cmds != nil {
		close(c.cmds)
		<-c.exited
		c.cmds = nil
	}
	return errors.Join(c.ring.Close(), unix.Munmap(c.buf), c.f.Close())
}

// CommandError is a control command the driver refused (or io_uring
// cancelled before the driver saw it: ECANCELED, with Detail).
type CommandError struct {
	Cmd   string
	DevID uint32
	Errno syscall.Errno
	// Detail says more, when there is more to say.
	Detail string
}

func (e *CommandError) Error() string {
	if e.Detail != "" {
		return fmt.Sprintf("ublk: %s (device %d): %v (%s)", e.Cmd, int32(e.DevID), e.Errno, e.Detail)
	}
	return fmt.Sprintf("ublk: %s (device %d): %v", e.Cmd, int32(e.DevID), e.Errno)
}

func (e *CommandError) Unwrap() error { return e.Errno }

var cmdNames = map[uint32]string{
	cmdGetDevInfo: "GET_DEV_INFO", cmdAddDev: "ADD_DEV", cmdDelDev: "DEL_DEV", cmdStartDev: "START_DEV",
	cmdStopDev: "STOP_DEV", cmdSetParams: "SET_PARAMS", cmdGetParams: "GET_PARAMS",
	cmdStartUserRecovery: "START_USER_RECOVERY", cmdEndUserRecovery: "END_USER_RECOVERY",
	cmdGetDevInfo2: "GET_DEV_INFO2", cmdGetFeatures: "GET_FEATURES", cmdUpdateSize: "UPDATE_SIZE",
}

// command runs one control command on the control thread. in is copied
// to the command buffer first (addr and len then describe it); out, if
// not nil, receives the buffer afterwards.
func (c *Control) command(nr uint32, devID uint32, data uint64, in []byte, out []byte) (int32, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cmds == nil {
		return 0, fmt.Errorf("ublk: %s: %w", cmdNames[nr], os.ErrClosed)
	}
	var (
		res int32
		err error
	)
	done := make(chan struct{})
	c.cmds <- func() {
		defer close(done)
		res, err = c.run(nr, devID, data, in, out)
	}
	<-done
	return res, err
}

// run is command, on the control thread.
func (c *Control) run(nr uint32, devID uint32, data uint64, in []byte, out []byte) (int32, error) {
	clear(c.buf)
	n := max(len(in), len(out))
	copy(c.buf, in)
	sqe, cmd, err := c.ring.Next()
	if err != nil {
		return 0, err
	}
	sqe.Opcode = iouring.OpURingCmd
	sqe.FD = int32(c.f.Fd())
	op := ctrlOp(nr)
	if c.legacy {
		op = nr
	}
	sqe.SetCmdOp(op)
	cc := (*ctrlCmd)(unsafe.Pointer(&cmd[0]))
	*cc = ctrlCmd{devID: devID, queueID: 0xffff, data: data}
	if n > 0 {
		cc.addr = uint64(uintptr(unsafe.Pointer(&c.buf[0])))
		cc.len = uint16(n)
	}
	cqe, err := c.ring.Wait()
	if err != nil {
		return 0, err
	}
	if cqe.Res < 0 {
		e := &CommandError{Cmd: cmdNames[nr], DevID: devID, Errno: syscall.Errno(-cqe.Res)}
		if e.Errno == syscall.ECANCELED {
			e.Detail = fmt.Sprintf("io_uring cancelled it before the driver saw it; submitted by thread %d, which has %d io workers", c.tid, ioWorkers(c.tid))
		}
		return cqe.Res, e
	}
	copy(out, c.buf)
	return cqe.Res, nil
}

// ioWorkers counts the io_uring workers of thread tid (named
// iou-wrk-<tid>), -1 when /proc cannot say.
func ioWorkers(tid int) int {
	comms, err := filepath.Glob("/proc/self/task/*/comm")
	if err != nil {
		return -1
	}
	want := fmt.Sprintf("iou-wrk-%d", tid)
	n := 0
	for _, p := range comms {
		if b, err := os.ReadFile(p); err == nil && strings.TrimSpace(string(b)) == want {
			n++
		}
	}
	return n
}

func bytesOf[T any](v *T) []byte { return unsafe.Slice((*byte)(unsafe.Pointer(v)), unsafe.Sizeof(*v)) }

// Features returns the driver's feature flags (GET_FEATURES, 6.5 and
// later); older drivers answer EINVAL.
func (c *Control) Features() (uint64, error) {
	var f uint64
	if c.legacy {
		return 0, &CommandError{Cmd: "GET_FEATURES", DevID: ^uint32(0), Errno: syscall.EOPNOTSUPP}
	}
	_, err := c.command(cmdGetFeatures, ^uint32(0), 0, nil, bytesOf(&f))
	return f, err
}

func (c *Control) addDev(info *devInfo) error {
	_, err := c.command(cmdAddDev, info.devID, 0, bytesOf(info), bytesOf(info))
	return err
}

func (c *Control) devInfo(id uint32) (devInfo, error) {
	var info devInfo
	_, err := c.command(cmdGetDevInfo, id, 0, nil, bytesOf(&info))
	return info, err
}

func (c *Control) setParams(id uint32, p *params) error {
	_, err := c.command(cmdSetParams, id, 0, bytesOf(p), nil)
	return err
}

func (c *Control) simple(nr uint32, id uint32, data uint64) error {
	_, err := c.command(nr, id, data, nil, nil)
	return err
}
