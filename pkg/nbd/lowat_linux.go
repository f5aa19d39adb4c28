package nbd

import (
	"net"
	"syscall"

	"golang.org/x/sys/unix"
)

// lowatConn raises SO_RCVLOWAT while a large write payload is expected, so
// the reader wakes once per big chunk instead of once per segment. The
// mark never exceeds the bytes still expected (a higher mark would wait
// for data that is not coming).
type lowatConn struct {
	net.Conn
	rc     syscall.RawConn
	want   int // bytes of payload still expected
	cur    int // current SO_RCVLOWAT
	broken bool
}

const maxLowat = 256 << 10

func newLowatConn(c net.Conn) *lowatConn {
	l := &lowatConn{Conn: c, cur: 1}
	if IsMultipathTCP(c) {
		// MPTCP accepts the option, but its receive window does not grow
		// to cover the mark the way TCP's does: a reader can wait for
		// bytes the sender is not allowed to send (seen with qemu-img).
		l.broken = true
		return l
	}
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
	n, err := l.Conn.Read(p)
	l.want = max(l.want-n, 0)
	return n, err
}

func (l *lowatConn) disable() { l.broken = true }
