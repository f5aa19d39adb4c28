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
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"github.com/mpnbd/mpnbd/pkg/iouring"
	"golang.org/x/sys/unix"
)

// Handler does a device's I/O. Its methods are called concurrently, one
// call per request in flight; an error fails that request (EIO).
type Handler interface {
	ReadAt(p []byte, off int64) error
	// WriteAt with fua set must be durable when it returns.
	WriteAt(p []byte, off int64, fua bool) error
	Flush() error
	Trim(off, n int64) error
	// WriteZeroes with noUnmap set must allocate the range.
	WriteZeroes(off, n int64, noUnmap bool) error
}

// Keeper is a Handler that can keep a write's buffer instead of copying
// its data (a session that holds acknowledged writes until a flush covers
// them). A queue of a device served by a Keeper serves its requests from
// buffers of the Keeper's, and hands over the buffer of every write that
// fills at least half of it, taking a new one for the tag's next requests.
type Keeper interface {
	Handler
	// Buffer returns a buffer of n bytes, not necessarily zeroed.
	Buffer(n int) *[]byte
	// KeepWrite is WriteAt of the first n bytes of *buf; the handler
	// takes buf, whatever the outcome: the queue never touches it again.
	KeepWrite(buf *[]byte, n int, off int64, fua bool) error
}

// Starter is a Handler that can start reads and writes without waiting
// for them: a queue's thread then starts every request of a batch itself
// and pushes them out together, with no goroutine and no wake-up per
// request.
type Starter interface {
	Handler
	// StartIO starts a read into p (write false) or a write of p at off.
	// kept, for a write, is p's buffer, which the handler takes (see
	// Keeper), or nil. done is called once with the outcome, from any
	// goroutine, and must be quick. StartIO returns false, having started
	// and taken nothing, for a request it cannot start so: the queue then
	// serves it through the Handler.
	StartIO(write bool, p []byte, kept *[]byte, off int64, fua bool, done func(error)) bool
	// Push sends out what StartIO started.
	Push()
}

// Config describes a new device.
type Config struct {
	// Size of the device in bytes (a multiple of the logical block).
	Size uint64
	// LogicalBlockShift is log2 of the logical block size (9 to 12);
	// zero means 9 (512 bytes).
	LogicalBlockShift uint8
	// Queues and Depth: hardware queues and requests in flight per queue
	// (zero: 1 queue of 64).
	Queues, Depth int
	// MaxIO is the largest request in bytes (zero: 1 MiB, what a direct
	// 1 MiB write or read is in one bio; the driver may round it down).
	MaxIO int
	// ReadOnly makes the block device read-only; Discard and WriteZeroes
	// advertise those operations (the handler must do them).
	ReadOnly, Discard, WriteZeroes bool
	Logger                         *slog.Logger
}

func (c *Config) defaults() {
	if c.LogicalBlockShift == 0 {
		c.LogicalBlockShift = 9
	}
	if c.Queues <= 0 {
		c.Queues = 1
	}
	if c.Depth <= 0 {
		c.Depth = 64
	}
	if c.MaxIO <= 0 {
		c.MaxIO = 1 << 20
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// Device is a ublk device served by this process.
type Device struct {
	ID     uint32
	ctrl   *Control
	char   *os.File
	h      Handler
	log    *slog.Logger
	queues []*queue
	wg     sync.WaitGroup
	// done is closed once every queue has stopped serving.
	done chan struct{}
	// ioctlEncode: the device takes its I/O commands in the ioctl
	// encoding (it was made with UBLK_F_CMD_IOCTL_ENCODE).
	ioctlEncode bool
}

// BlockPath is the device's block device.
func (d *Device) BlockPath() string { return BlockPath(d.ID) }

// BlockPath is the block device of ublk device id.
func BlockPath(id uint32) string { return fmt.Sprintf("/dev/ublkb%d", id) }

func charPath(id uint32) string { return fmt.Sprintf("/dev/ublkc%d", id) }

// Create adds a device, serves it with h and starts it: its block device
// exists when Create returns. The device uses user recovery: if this
// process dies, the kernel keeps the device and holds (and later reissues)
// its I/O until another process takes it over with Recover.
func Create(ctx context.Context, ctrl *Control, cfg Config, h Handler) (*Device, error) {
	cfg.defaults()
	info := devInfo{
		nrHWQueues:    uint16(cfg.Queues),
		queueDepth:    uint16(cfg.Depth),
		maxIOBufBytes: uint32(cfg.MaxIO),
		devID:         ^uint32(0),
		flags:         FlagUserRecovery | FlagUserRecoveryReissue,
	}
	if !ctrl.legacy {
		info.flags |= FlagCmdIoctlEncode
	}
	if err := ctrl.addDev(&info); err != nil {
		return nil, err
	}
	id := info.devID
	fail := func(err error) (*Device, error) {
		if derr := ctrl.simple(cmdDelDev, id, 0); derr != nil {
			cfg.Logger.Error("ublk: delete a device after a failed create", "dev_id", id, "error", derr)
		}
		return nil, err
	}
	// The driver may have lowered the buffer size it takes.
	sectors := min(uint32(cfg.MaxIO), info.maxIOBufBytes) >> 9
	p := params{types: paramTypeBasic}
	p.len = uint32(unsafe.Sizeof(p))
	attrs := uint32(attrVolatileCache | attrFUA)
	if cfg.ReadOnly {
		attrs |= attrReadOnly
	}
	p.basic = paramBasic{
		attrs:           attrs,
		logicalBSShift:  cfg.LogicalBlockShift,
		physicalBSShift: 12,
		ioOptShift:      12,
		ioMinShift:      cfg.LogicalBlockShift,
		maxSectors:      sectors,
		devSectors:      cfg.Size >> 9,
	}
	if cfg.Discard || cfg.WriteZeroes {
		p.types |= paramTypeDiscard
		p.discard = paramDiscard{discardGranularity: 4096, maxDiscardSegments: 1}
		if cfg.Discard {
			p.discard.maxDiscardSectors = ^uint32(0) >> 9
		}
		if cfg.WriteZeroes {
			p.discard.maxWriteZeroesSectors = ^uint32(0) >> 9
		}
	}
	if err := ctrl.setParams(id, &p); err != nil {
		return fail(err)
	}
	d, err := serve(ctx, ctrl, id, info, h, cfg.Logger)
	if err != nil {
		return fail(err)
	}
	if err := ctrl.simple(cmdStartDev, id, uint64(os.Getpid())); err != nil {
		d.stopQueues()
		return fail(err)
	}
	return d, nil
}

// Recover takes over device id, left by a process that died, and serves
// it with h: the I/O the kernel held goes to h.
func Recover(ctx context.Context, ctrl *Control, id uint32, h Handler, log *slog.Logger) (*Device, error) {
	if log == nil {
		log = slog.Default()
	}
	info, err := ctrl.devInfo(id)
	if err != nil {
		return nil, err
	}
	if err := ctrl.simple(cmdStartUserRecovery, id, 0); err != nil {
		return nil, err
	}
	d, err := serve(ctx, ctrl, id, info, h, log)
	if err != nil {
		return nil, err
	}
	if err := ctrl.simple(cmdEndUserRecovery, id, uint64(os.Getpid())); err != nil {
		d.stopQueues()
		return nil, err
	}
	return d, nil
}

// UpdateSize changes the size of device id (UBLK_F_UPDATE_SIZE: Linux
// 6.14 and later; Features says whether the driver has it).
func (c *Control) UpdateSize(id uint32, size uint64) error {
	return c.simple(cmdUpdateSize, id, size>>9)
}

// Server returns the pid of the process that serves device id (0 when
// none has started it).
func (c *Control) Server(id uint32) (int, error) {
	info, err := c.devInfo(id)
	return int(info.ublksrvPID), err
}

// State reports the state of device id (StateLive, StateQuiesced, ...).
func (c *Control) State(id uint32) (int, error) {
	info, err := c.devInfo(id)
	return int(info.state), err
}

// serve opens the device's char device and starts its queues; it returns
// once every queue has asked the driver for its first requests.
func serve(ctx context.Context, ctrl *Control, id uint32, info devInfo, h Handler, log *slog.Logger) (*Device, error) {
	char, err := openChar(ctx, id)
	if err != nil {
		return nil, err
	}
	d := &Device{ID: id, ctrl: ctrl, char: char, h: h, log: log.With("ublk_dev", id), done: make(chan struct{}),
		ioctlEncode: info.flags&FlagCmdIoctlEncode != 0}
	ready := make(chan error, info.nrHWQueues)
	for q := 0; q < int(info.nrHWQueues); q++ {
		qu := &queue{dev: d, id: uint16(q), depth: int(info.queueDepth), maxIO: int(info.maxIOBufBytes), released: make(chan struct{})}
		d.queues = append(d.queues, qu)
		d.wg.Add(1)
		go func() {
			defer d.wg.Done()
			qu.run(ready)
		}()
	}
	var errs []error
	for range d.queues {
		if err := <-ready; err != nil {
			errs = append(errs, err)
		}
	}
	go func() {
		d.wg.Wait()
		for _, q := range d.queues {
			<-q.released
		}
		char.Close()
		close(d.done)
	}()
	if err := errors.Join(errs...); err != nil {
		d.stopQueues()
		return nil, err
	}
	return d, nil
}

// openChar opens /dev/ublkcN, waiting for it to appear.
func openChar(ctx context.Context, id uint32) (*os.File, error) {
	deadline := time.Now().Add(10 * time.Second)
	for {
		f, err := os.OpenFile(charPath(id), os.O_RDWR, 0)
		if err == nil {
			return f, nil
		}
		if !errors.Is(err, os.ErrNotExist) || time.Now().After(deadline) {
			return nil, fmt.Errorf("ublk: %w", err)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// stopQueues ends serving without going through the driver: closing the
// rings makes the driver treat the queues as dead.
func (d *Device) stopQueues() {
	for _, q := range d.queues {
		q.stop()
	}
	<-d.done
}

// Done is closed when the device stopped serving (Delete, or the driver
// aborted the queues).
func (d *Device) Done() <-chan struct{} { return d.done }

// Delete stops and removes the device; the block device goes away.
func (d *Device) Delete() error {
	err := d.ctrl.simple(cmdStopDev, d.ID, 0)
	select {
	case <-d.done:
	case <-time.After(30 * time.Second):
		d.log.Error("ublk: queues still serving 30s after STOP_DEV; closing their rings")
		d.stopQueues()
	}
	if derr := d.ctrl.simple(cmdDelDev, d.ID, 0); derr != nil && err == nil {
		err = derr
	}
	return err
}

// Abandon stops serving and leaves the device to a Recover (as a crash
// would, but without exiting the process).
func (d *Device) Abandon() { d.stopQueues() }

// Remove stops and deletes device id whoever served it.
func (c *Control) Remove(id uint32) error {
	err := c.simple(cmdStopDev, id, 0)
	if derr := c.simple(cmdDelDev, id, 0); derr != nil && !errors.Is(derr, syscall.ENODEV) {
		return derr
	}
	if errors.Is(err, syscall.ENODEV) {
		return nil
	}
	return err
}

// queue serves one hardware queue: a thread of its own (the driver takes
// commands for a queue only from the task that fetched its first
// requests) with a ring, the shared descriptors and one buffer per tag.
type queue struct {
	dev   *Device
	id    uint16
	depth int
	maxIO int

	ring  *iouring.Ring
	descs []byte
	// bufs holds every tag's buffer, unless the handler is a Keeper:
	// then kept[tag] is the tag's buffer, replaced whenever the handler
	// kept it.
	bufs  []byte
	kept  []*[]byte
	keep  Keeper
	start Starter
	efd   int
	ebuf  [8]byte // the eventfd's counter is read into it

	mu      sync.Mutex
	done    []completion
	stopped bool
	// handlers counts requests in their handler: the eventfd and the
	// buffers they use outlive the queue's thread until the last is done.
	handlers  sync.WaitGroup
	efdClosed bool
	// released is closed once the queue's ring and descriptors are
	// released (after its thread exited).
	released chan struct{}
}

type completion struct {
	tag    uint16
	result int32
}

const eventTag = 1 << 63

func (q *queue) stop() {
	q.mu.Lock()
	q.stopped = true
	q.mu.Unlock()
	q.wake()
}

func (q *queue) wake() {
	var one [8]byte
	one[0] = 1
	q.mu.Lock()
	if !q.efdClosed && q.efd > 0 {
		// Adding 1 to an open eventfd cannot fail (near the counter's
		// limit, the write blocks until the thread reads).
		_, _ = unix.Write(q.efd, one[:])
	}
	q.mu.Unlock()
}

func (q *queue) run(ready chan<- error) {
	// The thread is the queue's: it never goes back to the scheduler's
	// pool (it ends with this goroutine), and the queue's ring closes
	// only once it is gone.
	runtime.LockOSThread()
	if unix.Gettid() == unix.Getpid() {
		// The process's first thread, which the runtime never lets exit:
		// serve from another. While this goroutine holds the first
		// thread, the new one runs on some other.
		done := make(chan struct{})
		go func() {
			defer close(done)
			q.run(ready)
		}()
		<-done
		runtime.UnlockOSThread()
		return
	}
	defer q.releaseOnceExited(unix.Gettid())
	if err := q.setup(); err != nil {
		ready <- err
		return
	}
	for tag := 0; tag < q.depth; tag++ {
		if err := q.command(ioFetchReq, uint16(tag), 0); err != nil {
			ready <- err
			return
		}
	}
	if err := q.armEvent(); err != nil {
		ready <- err
		return
	}
	if _, err := q.ring.Submit(0); err != nil {
		ready <- fmt.Errorf("ublk: queue %d: submit the first fetches: %w", q.id, err)
		return
	}
	ready <- nil
	q.loop()
}

func (q *queue) setup() error {
	var err error
	// Every tag has a command outstanding, plus the eventfd read, plus
	// room for commits submitted together.
	if q.ring, err = iouring.New(uint32(2*q.depth+2), iouring.SetupSQE128); err != nil {
		return fmt.Errorf("ublk: queue %d: %w", q.id, err)
	}
	if q.descs, err = unix.Mmap(int(q.dev.char.Fd()), descOffset(int(q.id)), descAreaSize(q.depth), unix.PROT_READ, unix.MAP_SHARED|unix.MAP_POPULATE); err != nil {
		return fmt.Errorf("ublk: queue %d: map descriptors: %w", q.id, err)
	}
	q.start, _ = q.dev.h.(Starter)
	if k, ok := q.dev.h.(Keeper); ok {
		q.keep = k
		q.kept = make([]*[]byte, q.depth)
		for tag := range q.kept {
			q.kept[tag] = k.Buffer(q.maxIO)
		}
	} else if q.bufs, err = unix.Mmap(-1, 0, q.depth*q.maxIO, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE|unix.MAP_NORESERVE); err != nil {
		return fmt.Errorf("ublk: queue %d: buffers: %w", q.id, err)
	}
	if q.efd, err = unix.Eventfd(0, unix.EFD_CLOEXEC); err != nil {
		return fmt.Errorf("ublk: queue %d: eventfd: %w", q.id, err)
	}
	return nil
}

// releaseOnceExited releases the queue once its thread tid has exited.
// The order matters when the queue stops on a live device (Abandon): the
// driver may have queued a request to the thread as a task-work item
// before it cancels the thread's commands. An exiting thread runs such an
// item by requeueing the request, as in a crash; a live one (the ring
// closed under it) would take the request for the server, after the
// cancellation aborted the server's requests, and nothing would ever end
// it: the device could not quiesce for a successor (seen on 6.12).
func (q *queue) releaseOnceExited(tid int) {
	go func() {
		defer close(q.released)
		task := fmt.Sprintf("/proc/self/task/%d", tid)
		deadline := time.Now().Add(5 * time.Second)
		for {
			if _, err := os.Stat(task); errors.Is(err, os.ErrNotExist) {
				break
			}
			if time.Now().After(deadline) {
				q.dev.log.Warn("ublk: the queue's thread has not exited; closing its ring anyway", "queue", q.id, "tid", tid)
				break
			}
			time.Sleep(time.Millisecond)
		}
		q.release()
	}()
}

func (q *queue) release() {
	if q.ring != nil {
		q.ring.Close()
	}
	if q.descs != nil {
		_ = unix.Munmap(q.descs) // ours: it cannot fail
	}
	// A request still in its handler writes to its buffer and wakes the
	// eventfd: both go once the last handler is done.
	go func() {
		q.handlers.Wait()
		q.mu.Lock()
		q.efdClosed = true
		if q.efd > 0 {
			unix.Close(q.efd)
		}
		q.mu.Unlock()
		if q.bufs != nil {
			_ = unix.Munmap(q.bufs) // ours: it cannot fail
		}
	}()
}

// buf is tag's buffer. The queue's thread reads it when it hands the
// buffer to the driver, a handler when it serves the tag's request: the
// two never overlap (a tag's request is in its handler only between its
// fetch and its commit).
func (q *queue) buf(tag uint16) []byte {
	if q.kept != nil {
		return (*q.kept[tag])[:q.maxIO]
	}
	return q.bufs[int(tag)*q.maxIO : int(tag+1)*q.maxIO]
}

// command queues FETCH_REQ or COMMIT_AND_FETCH_REQ for tag (submitted with
// the next Submit).
func (q *queue) command(nr uint32, tag uint16, result int32) error {
	sqe, cmd, err := q.ring.Next()
	if err != nil {
		if _, serr := q.ring.Submit(0); serr != nil {
			return serr
		}
		if sqe, cmd, err = q.ring.Next(); err != nil {
			return err
		}
	}
	sqe.Opcode = iouring.OpURingCmd
	sqe.FD = int32(q.dev.char.Fd())
	op := nr
	if q.dev.ioctlEncode {
		op = ioOp(nr)
	}
	sqe.SetCmdOp(op)
	sqe.UserData = uint64(tag)
	c := (*ioCmd)(unsafe.Pointer(&cmd[0]))
	*c = ioCmd{qID: q.id, tag: tag, result: result, addr: uint64(uintptr(unsafe.Pointer(&q.buf(tag)[0])))}
	return nil
}

func (q *queue) armEvent() error {
	sqe, _, err := q.ring.Next()
	if err != nil {
		return err
	}
	sqe.Opcode = iouring.OpRead
	sqe.FD = int32(q.efd)
	sqe.Addr = uint64(uintptr(unsafe.Pointer(&q.ebuf[0])))
	sqe.Len = 8
	sqe.UserData = eventTag
	return nil
}

// loop handles completions until every tag's command was aborted (the
// device stopped) or the queue is stopped.
func (q *queue) loop() {
	live := q.depth // tags with a command outstanding in the driver
	// started: requests StartIO took that are not pushed out yet; they go
	// when no completion is left to handle, before the thread sleeps.
	started := false
	defer func() {
		if started {
			q.start.Push()
		}
	}()
	for {
		c, ok := q.ring.Peek()
		if ok {
			q.ring.Seen()
		} else {
			if started {
				q.start.Push()
				started = false
			}
			var err error
			if c, err = q.ring.Wait(); err != nil {
				q.dev.log.Error("ublk: queue ring failed", "queue", q.id, "error", err)
				return
			}
		}
		if c.UserData == eventTag {
			q.mu.Lock()
			done, stopped := q.done, q.stopped
			q.done = nil
			q.mu.Unlock()
			if stopped {
				return
			}
			for _, d := range done {
				if err := q.command(ioCommitAndFetchRq, d.tag, d.result); err != nil {
					q.dev.log.Error("ublk: commit", "queue", q.id, "tag", d.tag, "error", err)
					return
				}
				live++
			}
			// The commits and the eventfd's read go with the next wait
			// (one system call for both), or at once if the ring fills.
			if err := q.armEvent(); err != nil {
				return
			}
			continue
		}
		live--
		tag := uint16(c.UserData)
		if c.Res != ioResOK {
			// Aborted (the device stops) or refused: no refetch.
			if c.Res != ioResAbort {
				q.dev.log.Warn("ublk: command failed", "queue", q.id, "tag", tag, "result", c.Res)
			}
			if live == 0 {
				return
			}
			continue
		}
		desc := *(*ioDesc)(unsafe.Pointer(&q.descs[int(tag)*int(unsafe.Sizeof(ioDesc{}))]))
		if q.startIO(tag, desc) {
			started = true
			continue
		}
		q.handlers.Add(1)
		go q.handle(tag, desc)
	}
}

// startIO starts a read or write through the Starter, if the handler is
// one and takes it; it reports whether it did.
func (q *queue) startIO(tag uint16, d ioDesc) bool {
	op := d.opFlags & 0xff
	if q.start == nil || (op != opRead && op != opWrite) {
		return false
	}
	off := int64(d.startSector) << 9
	n := int64(d.nrSectors) << 9
	write := op == opWrite
	p := q.buf(tag)[:n]
	var kept *[]byte
	if write && q.keep != nil && 2*n >= int64(q.maxIO) {
		kept = q.kept[tag]
	}
	q.handlers.Add(1)
	done := func(err error) {
		res := int32(n)
		if err != nil {
			q.dev.log.Warn("ublk: request failed", "op", op, "offset", off, "length", n, "error", err)
			res = -int32(syscall.EIO)
		}
		q.complete(tag, res)
	}
	if !q.start.StartIO(write, p, kept, off, d.opFlags&ioFlagFUA != 0, done) {
		q.handlers.Done()
		return false
	}
	if kept != nil {
		// Taken: the tag's next requests land in a new buffer (set
		// before this thread commits the tag, which only it does).
		q.kept[tag] = q.keep.Buffer(q.maxIO)
	}
	return true
}

// handle runs one request through the handler and hands the result to
// the queue's thread.
func (q *queue) handle(tag uint16, d ioDesc) {
	off := int64(d.startSector) << 9
	n := int64(d.nrSectors) << 9
	var err error
	var res int32
	switch d.opFlags & 0xff {
	case opRead:
		err = q.dev.h.ReadAt(q.buf(tag)[:n], off)
		res = int32(n)
	case opWrite:
		fua := d.opFlags&ioFlagFUA != 0
		if q.keep != nil && 2*n >= int64(q.maxIO) {
			// The handler keeps this buffer; the tag's next requests
			// land in a new one.
			b := q.kept[tag]
			q.kept[tag] = q.keep.Buffer(q.maxIO)
			err = q.keep.KeepWrite(b, int(n), off, fua)
		} else {
			err = q.dev.h.WriteAt(q.buf(tag)[:n], off, fua)
		}
		res = int32(n)
	case opFlush:
		err = q.dev.h.Flush()
	case opDiscard:
		err = q.dev.h.Trim(off, n)
	case opWriteZeroes:
		err = q.dev.h.WriteZeroes(off, n, d.opFlags&ioFlagNoUnmap != 0)
	default:
		res = -int32(syscall.EOPNOTSUPP)
	}
	if err != nil {
		q.dev.log.Warn("ublk: request failed", "op", d.opFlags&0xff, "offset", off, "length", n, "error", err)
		res = -int32(syscall.EIO)
	}
	q.complete(tag, res)
}

// complete hands tag's result to the queue's thread, which commits it.
// One wake for every batch: the thread takes all that is done when it
// wakes, so a completion that finds others waiting need not wake it.
func (q *queue) complete(tag uint16, res int32) {
	q.mu.Lock()
	first := len(q.done) == 0
	q.done = append(q.done, completion{tag, res})
	q.mu.Unlock()
	if first {
		q.wake()
	}
	q.handlers.Done()
}
