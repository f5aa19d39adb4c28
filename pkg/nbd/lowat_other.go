//go:build !linux

package nbd

import "net"

// lowatConn is a plain connection where SO_RCVLOWAT is not available.
type lowatConn struct {
	net.Conn
	stopping func() bool
}

func newLowatConn(c net.Conn) *lowatConn { return &lowatConn{Conn: c} }

func (l *lowatConn) expect(int) {}

func (l *lowatConn) disable() {}
