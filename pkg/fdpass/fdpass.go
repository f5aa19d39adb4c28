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

// Package fdpass passes open files between processes over unix stream
// sockets: the files travel as SCM_RIGHTS attached to the first bytes of
// a message, and arrive as new descriptors of the same open files.
//
// Send and Recv move bytes, the caller framing them; SendJSON and
// RecvJSON move one JSON value in a frame of its own: its length (4
// bytes, big-endian, at most MaxFrame), then the JSON, the files attached
// to the length. Nothing received is left open on an error: the files of
// a message that is refused are closed.
package fdpass

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"time"

	"golang.org/x/sys/unix"
)

// MaxFrame is the largest JSON message SendJSON sends and RecvJSON
// accepts.
const MaxFrame = 16 << 20

// Errors of a message refused. The files that came with it are closed.
var (
	// ErrTooManyFiles: the message carries more files than the receiver
	// takes.
	ErrTooManyFiles = errors.New("fdpass: more files than expected")
	// ErrTruncated: the kernel cut the control message short (MSG_CTRUNC),
	// dropping files that did not fit.
	ErrTruncated = errors.New("fdpass: control message truncated")
	// ErrTooLarge: a frame longer than MaxFrame.
	ErrTooLarge = errors.New("fdpass: message too large")
)

// Send writes b on c, files attached to its first bytes, and returns once
// all of b is written. The descriptors go as they are: unlike f.Fd, Send
// leaves the files non-blocking if they are. A non-zero deadline is set
// as c's write deadline first.
func Send(c *net.UnixConn, b []byte, files []*os.File, deadline time.Time) error {
	if len(b) == 0 && len(files) > 0 {
		return errors.New("fdpass: files need at least one byte to travel with")
	}
	var oob []byte
	if len(files) > 0 {
		fds := make([]int, len(files))
		for i, f := range files {
			fd, err := RawFd(f)
			if err != nil {
				return fmt.Errorf("fdpass: file %d (%s): %w", i, f.Name(), err)
			}
			fds[i] = fd
		}
		oob = unix.UnixRights(fds...)
	}
	if !deadline.IsZero() {
		c.SetWriteDeadline(deadline)
	}
	n, _, err := c.WriteMsgUnix(b, oob, nil)
	runtime.KeepAlive(files)
	if err == nil && n < len(b) {
		_, err = c.Write(b[n:])
	}
	return err
}

// Recv reads from c into p once, as Read does, and returns the number of
// bytes read and the files that came with them. It takes at most
// maxFiles files: a message with more (ErrTooManyFiles), or one whose
// control message the kernel truncated (ErrTruncated), is an error, and
// whatever files came are closed. A non-zero deadline is set as c's read
// deadline first.
func Recv(c *net.UnixConn, p []byte, maxFiles int, deadline time.Time) (int, []*os.File, error) {
	if !deadline.IsZero() {
		c.SetReadDeadline(deadline)
	}
	var oob []byte
	if maxFiles > 0 {
		oob = make([]byte, unix.CmsgSpace(maxFiles*4))
	}
	n, oobn, flags, _, err := c.ReadMsgUnix(p, oob)
	files, ferr := parseRights(oob[:oobn])
	switch {
	case ferr != nil:
	case flags&unix.MSG_CTRUNC != 0:
		ferr = fmt.Errorf("%w: room for %d files, %d received and closed", ErrTruncated, maxFiles, len(files))
	case len(files) > maxFiles:
		ferr = fmt.Errorf("%w: %d, at most %d", ErrTooManyFiles, len(files), maxFiles)
	}
	if ferr != nil {
		err = ferr
	}
	if err != nil {
		Close(files)
		return n, nil, err
	}
	return n, files, nil
}

// SendJSON writes v as a JSON frame on c, files attached. A non-zero
// deadline is set as c's write deadline first.
func SendJSON(c *net.UnixConn, v any, files []*os.File, deadline time.Time) error {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("fdpass: %w", err)
	}
	if len(b) > MaxFrame {
		return fmt.Errorf("%w: %d bytes", ErrTooLarge, len(b))
	}
	frame := binary.BigEndian.AppendUint32(make([]byte, 0, 4+len(b)), uint32(len(b)))
	return Send(c, append(frame, b...), files, deadline)
}

// RecvJSON reads a JSON frame from c into v and returns the files that
// came with it, at most maxFiles (see Recv). A non-zero deadline is set as
// c's read deadline first: it bounds the whole frame.
func RecvJSON(c *net.UnixConn, v any, maxFiles int, deadline time.Time) ([]*os.File, error) {
	var hdr [4]byte
	n, files, err := Recv(c, hdr[:], maxFiles, deadline)
	if err != nil {
		return nil, err
	}
	if _, err := io.ReadFull(c, hdr[n:]); err != nil {
		Close(files)
		return nil, fmt.Errorf("fdpass: message length: %w", unexpectedEOF(err))
	}
	size := binary.BigEndian.Uint32(hdr[:])
	if size > MaxFrame {
		Close(files)
		return nil, fmt.Errorf("%w: %d bytes", ErrTooLarge, size)
	}
	b := make([]byte, size)
	if _, err := io.ReadFull(c, b); err != nil {
		Close(files)
		return nil, fmt.Errorf("fdpass: message of %d bytes: %w", size, unexpectedEOF(err))
	}
	if err := json.Unmarshal(b, v); err != nil {
		Close(files)
		return nil, fmt.Errorf("fdpass: message: %w", err)
	}
	return files, nil
}

// Close closes files.
func Close(files []*os.File) {
	for _, f := range files {
		f.Close()
	}
}

// unexpectedEOF is err of a read that ended a message before its end.
func unexpectedEOF(err error) error {
	if errors.Is(err, io.EOF) {
		return io.ErrUnexpectedEOF
	}
	return err
}

// parseRights returns the files of the SCM_RIGHTS messages in oob,
// close-on-exec; other control messages are ignored.
func parseRights(oob []byte) ([]*os.File, error) {
	if len(oob) == 0 {
		return nil, nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, fmt.Errorf("fdpass: control message: %w", err)
	}
	var files []*os.File
	for _, m := range msgs {
		if m.Header.Level != unix.SOL_SOCKET || m.Header.Type != unix.SCM_RIGHTS {
			continue
		}
		fds, err := unix.ParseUnixRights(&m)
		if err != nil {
			Close(files)
			return nil, fmt.Errorf("fdpass: control message: %w", err)
		}
		for _, fd := range fds {
			unix.CloseOnExec(fd)
			files = append(files, os.NewFile(uintptr(fd), "fdpass"))
		}
	}
	return files, nil
}

// RawFd is f's descriptor, without what f.Fd does besides: make it
// blocking (a descriptor whose reads another goroutine must be able to
// interrupt, such as /dev/fuse, must stay in the poller).
func RawFd(f *os.File) (int, error) {
	raw, err := f.SyscallConn()
	if err != nil {
		return -1, err
	}
	fd := -1
	if err := raw.Control(func(u uintptr) { fd = int(u) }); err != nil {
		return -1, err
	}
	return fd, nil
}
