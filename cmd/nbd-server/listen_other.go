//go:build !linux

package main

import "net"

// listenerMPTCP reports whether l's socket is an MPTCP socket; only Linux
// has MPTCP sockets.
func listenerMPTCP(net.Listener) (bool, error) { return false, nil }
