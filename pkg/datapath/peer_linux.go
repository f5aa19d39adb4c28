package datapath

import (
	"fmt"
	"net"

	"golang.org/x/sys/unix"
)

// checkRoot refuses a peer that is not root: a handoff carries the
// devices' data path.
func checkRoot(c *net.UnixConn) error {
	raw, err := c.SyscallConn()
	if err != nil {
		return err
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return err
	}
	if cerr != nil {
		return cerr
	}
	if cred.Uid != 0 {
		return fmt.Errorf("datapath: handover refused to uid %d", cred.Uid)
	}
	return nil
}
