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

package agent

import (
	"log/slog"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// freeBindControl sets IP_FREEBIND (IPV6_FREEBIND) on a listening socket,
// so that it binds an address not (yet) on the host: a storage address
// whose NIC comes up after the agent started. A kernel that refuses the
// option only makes the bind need the address present.
func freeBindControl(log *slog.Logger) func(network, address string, c syscall.RawConn) error {
	return func(network, address string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			if strings.HasSuffix(network, "6") {
				serr = unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_FREEBIND, 1)
			} else {
				serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_FREEBIND, 1)
			}
		})
		if err == nil && serr != nil {
			log.Debug("IP_FREEBIND refused; the address must be present to bind it", "addr", address, "error", serr)
		}
		return err
	}
}
