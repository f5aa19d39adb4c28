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

package fuse

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/mpnbd/mpnbd/pkg/fdpass"
	"golang.org/x/sys/unix"
)

// Node IDs of the file system. They are fixed, and file handles carry
// nothing, so that whoever holds the /dev/fuse descriptor and the INIT
// parameters can answer every request: no table of nodes or open files
// lives in the serving process.
const (
	rootNode = 1
	fileNode = 2
)

// attrTTL is how long, in seconds, the kernel may keep names and
// attributes: the file only changes by Resize, which tells it.
const attrTTL = 3600

// initTimeout bounds the wait for the kernel's INIT after the mount.
const initTimeout = 10 * time.Second

// fuseServer answers the kernel's requests on one FUSE connection for a
// root directory holding the export file. Several readers each take one
// request per read(2) and answer it with one write before they read the
// next, so stop can leave the connection at a request boundary with no
// request taken and unanswered: the kernel queues what comes meanwhile
// for whoever reads the descriptor next, in this process or another.
type fuseServer struct {
	dev     *os.File // /dev/fuse, non-blocking, in the runtime's poller
	fd      int
	params  initParams
	file    *exportFile
	name    string // the file's name in the root
	ents    []dirent
	readers int
	log     *slog.Logger

	mu       sync.Mutex // serializes start and stop
	running  bool
	stopping atomic.Bool
	wg       sync.WaitGroup
	gone     chan struct{} // closed once the kernel ended the connection
	goneOnce sync.Once
}

// newFuseServer returns a server for the connection dev, whose INIT
// negotiated p; it does not read dev until start. dev must be
// non-blocking and pollable, so that stop can interrupt a read.
func newFuseServer(dev *os.File, p initParams, file *exportFile, name string, readers int, log *slog.Logger) (*fuseServer, error) {
	if err := dev.SetReadDeadline(time.Time{}); err != nil {
		return nil, fmt.Errorf("fuse: /dev/fuse is not pollable: %w", err)
	}
	fd, err := fdpass.RawFd(dev)
	if err != nil {
		return nil, err
	}
	return &fuseServer{
		dev:     dev,
		fd:      fd,
		params:  p,
		file:    file,
		name:    name,
		readers: max(readers, 1),
		log:     log,
		gone:    make(chan struct{}),
		ents: []dirent{
			{Ino: rootNode, Type: direntTypeDir, Name: "."},
			{Ino: rootNode, Type: direntTypeDir, Name: ".."},
			{Ino: fileNode, Type: direntTypeReg, Name: name},
		},
	}, nil
}

// mountDev opens /dev/fuse and mounts a FUSE file system on dir served
// through it. The descriptor is non-blocking and goes into the runtime's
// poller (os.NewFile) only once mounted: until then the device belongs
// to no connection, and polling it would never wake up.
func mountDev(dir, fsName string, maxRead int) (*os.File, error) {
	fd, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: "/dev/fuse", Err: err}
	}
	data := fmt.Sprintf("fd=%d,rootmode=40000,user_id=0,group_id=0,allow_other,max_read=%d", fd, maxRead)
	if err := unix.Mount(fsName, dir, "fuse.mpnbd", unix.MS_NOSUID|unix.MS_NODEV, data); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("mount: %w", err)
	}
	return os.NewFile(uintptr(fd), "/dev/fuse"), nil
}

// negotiate answers the kernel's INIT on a freshly mounted connection.
func negotiate(dev *os.File, want initParams) (initParams, error) {
	buf := make([]byte, 8192)
	if err := dev.SetReadDeadline(time.Now().Add(initTimeout)); err != nil {
		return initParams{}, fmt.Errorf("/dev/fuse is not pollable: %w", err)
	}
	// dev polls (checked just above): clearing the deadline cannot fail
	// but on a closed file.
	defer func() { _ = dev.SetReadDeadline(time.Time{}) }()
	n, err := dev.Read(buf)
	if err != nil {
		return initParams{}, fmt.Errorf("waiting for INIT: %w", err)
	}
	req, err := parseRequest(buf[:n])
	if err != nil {
		return initParams{}, err
	}
	if req.hdr.Opcode != fuseInit {
		return initParams{}, fmt.Errorf("first request has opcode %d, not INIT", req.hdr.Opcode)
	}
	in, err := decodeInit(req.arg)
	if err != nil {
		return initParams{}, err
	}
	fd, err := fdpass.RawFd(dev)
	if err != nil {
		return initParams{}, err
	}
	if in.Major != protoMajor || in.Minor < protoMinMinor {
		// The mount fails either way: the error says why.
		_ = writeReply(fd, req.hdr.Unique, int32(unix.EPROTO))
		return initParams{}, fmt.Errorf("kernel speaks FUSE %d.%d, need %d.%d or later", in.Major, in.Minor, protoMajor, protoMinMinor)
	}
	p := want
	p.Minor = min(in.Minor, protoMinor)
	p.Flags = want.Flags & in.Flags
	p.MaxReadahead = in.MaxReadahead
	if err := writeReply(fd, req.hdr.Unique, 0, encodeInitOut(p)); err != nil {
		return initParams{}, fmt.Errorf("answering INIT: %w", err)
	}
	return p, nil
}

// wantedInit is what we ask the kernel for.
func (c Config) wantedInit() initParams {
	flags := uint32(initAsyncRead | initBigWrites | initParallelDirops | initMaxPages | initAsyncDIO)
	if c.syncDIO {
		flags &^= initAsyncDIO // the loop driver's direct I/O becomes synchronous
	}
	return initParams{Flags: flags, MaxWrite: uint32(c.MaxWrite), MaxBackground: uint16(min(c.MaxBackground, 65535))}
}

// writeReply sends one reply, header and payload in one writev.
func writeReply(fd int, unique uint64, errno int32, payload ...[]byte) error {
	var hdr [outHeaderSize]byte
	n := outHeaderSize
	if errno == 0 {
		for _, p := range payload {
			n += len(p)
		}
	} else {
		payload = nil
	}
	putOutHeader(hdr[:], n, errno, unique)
	iov := append(make([][]byte, 0, 1+len(payload)), hdr[:])
	iov = append(iov, payload...)
	for {
		_, err := unix.Writev(fd, iov)
		if err == unix.EINTR {
			continue
		}
		return err
	}
}

// start lets the readers take requests.
func (s *fuseServer) start() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.running {
		return
	}
	s.stopping.Store(false)
	// dev polls (newFuseServer checked): this fails only once it is
	// closed, which the readers see.
	_ = s.dev.SetReadDeadline(time.Time{})
	s.running = true
	for range s.readers {
		s.wg.Add(1)
		go s.reader()
	}
}

// stop returns once no reader reads anymore and every request read has
// been answered.
func (s *fuseServer) stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.running {
		return
	}
	s.stopping.Store(true)
	// A deadline in the past wakes the readers waiting in the poller;
	// the others see stopping once they have answered. It fails only on
	// a closed file, whose reads fail too.
	_ = s.dev.SetReadDeadline(time.Unix(1, 0))
	s.wg.Wait()
	s.running = false
}

// done is closed once the kernel ended the connection (unmounted or
// aborted).
func (s *fuseServer) done() <-chan struct{} { return s.gone }

func (s *fuseServer) markGone() { s.goneOnce.Do(func() { close(s.gone) }) }

// unmount unmounts dir and, if the server runs, waits until the kernel
// ended the connection; then it closes the descriptor.
func (s *fuseServer) unmount(dir string) error {
	if err := unix.Unmount(dir, 0); err != nil {
		return err
	}
	s.mu.Lock()
	running := s.running
	s.mu.Unlock()
	if running {
		<-s.gone
		s.stop()
	}
	return s.dev.Close()
}

func (s *fuseServer) reader() {
	defer s.wg.Done()
	buf := make([]byte, max(8192, inHeaderSize+writeInSize+int(s.params.MaxWrite)))
	for !s.stopping.Load() {
		n, err := s.dev.Read(buf)
		if err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
			// The poller reports the end of the connection as an error
			// event (os.File says "not pollable"); read(2) tells what
			// it is.
			n, err = unix.Read(s.fd, buf)
			if errors.Is(err, unix.EAGAIN) {
				time.Sleep(time.Millisecond) // spurious: try again
				continue
			}
		}
		if err != nil {
			switch {
			case errors.Is(err, os.ErrDeadlineExceeded), errors.Is(err, unix.ENOENT), errors.Is(err, unix.EINTR):
				// ENOENT: the request was interrupted before we got it.
				continue
			case errors.Is(err, unix.ENODEV):
			default:
				s.log.Error("fuse: reading /dev/fuse", "error", err)
			}
			s.markGone()
			return
		}
		if n == 0 {
			s.markGone()
			return
		}
		s.serve(buf, n)
	}
}

// serve answers the request in buf[:n]; it may reuse buf for the reply.
func (s *fuseServer) serve(buf []byte, n int) {
	req, err := parseRequest(buf[:n])
	if err != nil {
		s.log.Warn("fuse: dropping a request", "error", err)
		if n >= inHeaderSize {
			s.reply(req.hdr.Unique, int32(unix.EIO))
		}
		return
	}
	h := req.hdr
	switch h.Opcode {
	case fuseForget, fuseBatchForget, fuseInterrupt:
		// Node IDs are fixed, and requests are short: nothing to do and
		// no reply.
		return
	case fuseRead:
		if h.NodeID != fileNode {
			s.reply(h.Unique, nodeErr(h.NodeID))
			return
		}
		in, err := decodeRead(req.arg)
		if err != nil || uint64(in.Size) > uint64(len(buf)-outHeaderSize) {
			s.reply(h.Unique, int32(unix.EINVAL))
			return
		}
		// The arguments are decoded: the data goes where the request was.
		got, errno := s.file.read(buf[outHeaderSize:outHeaderSize+int(in.Size)], in.Offset)
		if errno != 0 {
			s.reply(h.Unique, int32(errno))
			return
		}
		putOutHeader(buf, outHeaderSize+got, 0, h.Unique)
		s.send(buf[:outHeaderSize+got])
		return
	}
	errno, out := s.handle(req)
	s.reply(h.Unique, errno, out...)
}

// nodeErr is the error for a request about a node that is not the file.
func nodeErr(id uint64) int32 {
	if id == rootNode {
		return int32(unix.EISDIR)
	}
	return int32(unix.ENOENT)
}

// handle answers every request but READ and those without a reply.
func (s *fuseServer) handle(req request) (int32, [][]byte) {
	h := req.hdr
	isFile, isRoot := h.NodeID == fileNode, h.NodeID == rootNode
	errOut := func(err error) (int32, [][]byte) { return int32(errnoOf(err)), nil }
	switch h.Opcode {
	case fuseLookup:
		name, err := decodeName(req.arg)
		if err != nil {
			return errOut(err)
		}
		if !isRoot {
			return int32(unix.ENOTDIR), nil
		}
		if name != s.name {
			return int32(unix.ENOENT), nil
		}
		return 0, [][]byte{encodeEntryOut(s.file.attr(), attrTTL)}
	case fuseGetattr:
		switch {
		case isRoot:
			return 0, [][]byte{encodeAttrOut(s.rootAttr(), attrTTL)}
		case isFile:
			return 0, [][]byte{encodeAttrOut(s.file.attr(), attrTTL)}
		}
		return int32(unix.ENOENT), nil
	case fuseSetattr:
		in, err := decodeSetattr(req.arg)
		if err != nil {
			return errOut(err)
		}
		switch {
		case isRoot:
			return 0, [][]byte{encodeAttrOut(s.rootAttr(), attrTTL)}
		case isFile:
			if e := s.file.setattr(in.Valid&fattrSize != 0, in.Size); e != 0 {
				return int32(e), nil
			}
			return 0, [][]byte{encodeAttrOut(s.file.attr(), attrTTL)}
		}
		return int32(unix.ENOENT), nil
	case fuseOpendir:
		if !isRoot {
			return int32(unix.ENOTDIR), nil
		}
		return 0, [][]byte{encodeOpenOut(0)}
	case fuseReaddir:
		if !isRoot {
			return int32(unix.ENOTDIR), nil
		}
		in, err := decodeRead(req.arg)
		if err != nil {
			return errOut(err)
		}
		return 0, [][]byte{encodeDirents(s.ents, in.Offset, in.Size)}
	case fuseReleasedir, fuseRelease, fuseDestroy:
		return 0, nil
	case fuseStatfs:
		return 0, [][]byte{encodeStatfsOut(s.file.size.Load()/pageSize, pageSize)}
	}
	switch h.Opcode {
	case fuseOpen, fuseWrite, fuseFlush, fuseFsync, fuseFallocate:
		if !isFile {
			return nodeErr(h.NodeID), nil
		}
	default:
		// INIT once the connection runs, and what the file system does
		// not do.
		return int32(unix.ENOSYS), nil
	}
	switch h.Opcode {
	case fuseOpen:
		flags, err := decodeOpen(req.arg)
		if err != nil {
			return errOut(err)
		}
		of, e := s.file.open(flags)
		if e != 0 {
			return int32(e), nil
		}
		return 0, [][]byte{encodeOpenOut(of)}
	case fuseWrite:
		in, err := decodeWrite(req.arg)
		if err != nil {
			return errOut(err)
		}
		n, e := s.file.write(in.Data, in.Offset)
		if e != 0 {
			return int32(e), nil
		}
		return 0, [][]byte{encodeWriteOut(n)}
	case fuseFlush:
		return 0, nil // close(2); durability is fsync's business
	case fuseFsync:
		if len(req.arg) < fsyncInSize {
			return errOut(errMalformed)
		}
		return int32(s.file.fsync()), nil
	case fuseFallocate:
		in, err := decodeFallocate(req.arg)
		if err != nil {
			return errOut(err)
		}
		return int32(s.file.allocate(in.Offset, in.Length, in.Mode)), nil
	}
	return int32(unix.ENOSYS), nil
}

func errnoOf(err error) syscall.Errno {
	if errors.Is(err, errMalformed) {
		return unix.EINVAL
	}
	return unix.EIO
}

func (s *fuseServer) rootAttr() attr {
	return attr{Ino: rootNode, Mode: unix.S_IFDIR | 0o755, Nlink: 2, Blksize: pageSize,
		Time: s.file.attrTime(), TimeNsec: s.file.attrTimeNsec()}
}

func (s *fuseServer) reply(unique uint64, errno int32, payload ...[]byte) {
	s.check(writeReply(s.fd, unique, errno, payload...))
}

func (s *fuseServer) send(b []byte) {
	for {
		_, err := unix.Write(s.fd, b)
		if err == unix.EINTR {
			continue
		}
		s.check(err)
		return
	}
}

func (s *fuseServer) check(err error) {
	switch {
	case err == nil, errors.Is(err, unix.ENOENT):
		// ENOENT: the request was interrupted or aborted meanwhile.
	case errors.Is(err, unix.ENODEV):
		s.markGone()
	default:
		s.log.Error("fuse: writing a reply", "error", err)
	}
}

// invalidateAttr drops the kernel's cached attributes of the file, so
// that it asks for its size again.
func (s *fuseServer) invalidateAttr() error {
	_, err := unix.Write(s.fd, encodeNotifyInvalInode(fileNode, -1, 0))
	if errors.Is(err, unix.ENOENT) {
		return nil // not cached
	}
	return err
}
