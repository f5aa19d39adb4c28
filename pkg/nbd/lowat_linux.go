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

package nbd

import (
	"errors"
	"net"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// lowatConn raises SO_RCVLOWAT while a large write payload is expected, so
// the reader wakes once per big chunk instead of once per segment (over
// MPTCP each read also sends the subflows window updates: the server's CPU
// per GB written fell by a third). The mark never exceeds the bytes still
// expected (a higher mark would wait for data that is not coming), and a
// read never waits for it longer than stallGuard: a socket whose receive
// window closes below the mark (MPTCP, whose readiness check has no
// memory-pressure escape, was seen to stall a qemu-img write this way)
// would otherwise never wake the reader.
type lowatConn struct {
	net.Conn
	rc     syscall.RawConn
	want   int // bytes of payload still expected
	cur    int // current SO_RCVLOWAT
	broken bool
	// stalls counts reads that waited stallGuard for the mark; at
	// maxStalls the connection reads without one.
	stalls int
	// stopping reports that the connection is being drained: its read
	// deadline, which the guard moves, must then stay in the past.
	stopping func() bool
}

const (
	maxLowat   = 1 << 20
	stallGuard = 50 * time.Millisecond
	maxStalls  = 4
)

func newLowatConn(c net.Conn) *lowatConn {
	l := &lowatConn{Conn: c, cur: 1, stopping: func() bool { return false }}
	if sc, ok := c.(syscall.Conn); ok {
		if rc, err := sc.SyscallConn(); err == nil {
			l.rc = rc
		}
	}
	return l
}

func (l *lowatConn) expect(n int) {
	l.want = n
	if n == 0 {
		l.set(1)
	}
}

func (l *lowatConn) set(v int) {
	if l.rc == nil || l.broken || v == l.cur {
		return
	}
	var serr error
	if err := l.rc.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVLOWAT, v)
	}); err != nil || serr != nil {
		// Not supported on this socket: fall back to plain reads.
		l.broken = true
		return
	}
	l.cur = v
}

func (l *lowatConn) Read(p []byte) (int, error) {
	if l.want >= 64<<10 {
		l.set(min(l.want, len(p), maxLowat))
	} else {
		l.set(1)
	}
	if l.cur <= 1 {
		n, err := l.Conn.Read(p)
		l.want = max(l.want-n, 0)
		return n, err
	}
	_ = l.SetReadDeadline(time.Now().Add(stallGuard))
	n, err := l.Conn.Read(p)
	l.restoreDeadline()
	if n == 0 && errors.Is(err, os.ErrDeadlineExceeded) && !l.stopping() {
		// The mark was not reached in time: the rest of this payload
		// is read without one, and after maxStalls all of them.
		l.stalls++
		l.want = 0
		l.set(1)
		if l.stalls >= maxStalls {
			l.broken = true
		}
		n, err = l.Conn.Read(p)
	}
	l.want = max(l.want-n, 0)
	return n, err
}

// restoreDeadline undoes the guard's read deadline: none, or one in the
// past while the connection is drained.
func (l *lowatConn) restoreDeadline() {
	var d time.Time
	if l.stopping() {
		d = time.Now()
	}
	_ = l.SetReadDeadline(d)
}

func (l *lowatConn) disable() { l.broken = true }
