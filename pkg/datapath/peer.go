package datapath

import (
	"fmt"
	"net"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

// checkRoot refuses a peer that is not root: a handoff carries the
// devices' data path.
func checkRoot(c *net.UnixConn) error {
	uid, _, err := attach.PeerCred(c)
	if err != nil {
		return err
	}
	if uid != 0 {
		return fmt.Errorf("datapath: handover refused to uid %d", uid)
	}
	return nil
}
