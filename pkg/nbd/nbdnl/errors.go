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

package nbdnl

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
)

// Errors that the Client tells apart. Each error returned for a kernel
// failure also wraps the kernel's errno, so errors.Is(err, unix.EINVAL) (or
// os.ErrPermission for EPERM) works next to these.
var (
	// ErrFamilyNotFound: the "nbd" generic netlink family cannot be
	// resolved, because the nbd driver is not loaded or because the caller
	// is outside the initial network namespace on a kernel before 6.4.
	ErrFamilyNotFound = errors.New(`generic netlink family "nbd" not found`)

	// ErrBusy: CONNECT named a device that is already configured (EBUSY),
	// or that another CONNECT is creating at the same moment (EEXIST).
	ErrBusy = errors.New("nbd device busy")

	// ErrNotFound: no device has the index (DISCONNECT, RECONFIGURE,
	// STATUS), or, for RECONFIGURE, the device exists but is not connected.
	ErrNotFound = errors.New("no such nbd device")

	// ErrBackendMismatch: RECONFIGURE was refused because the backend
	// identifier differs from (or lacks) the one the device was connected
	// with.
	ErrBackendMismatch = errors.New("nbd backend identifier does not match")

	// ErrUnsupportedSocket: the kernel refused a socket because of its type;
	// kernels with "nbd: restrict sockets to TCP and UDP" accept only TCP and
	// UNIX stream sockets, and so refuse MPTCP.
	//
	// The kernel reports this as a bare EINVAL and says why only in its log,
	// which the client cannot read. The rule used: an EINVAL answer to
	// CONNECT or RECONFIGURE whose sockets include one with SO_PROTOCOL ==
	// IPPROTO_MPTCP is ErrUnsupportedSocket, once the other EINVAL causes
	// the client can check are ruled out (no socket, several sockets without
	// NBD_FLAG_CAN_MULTI_CONN, a bad block size, and for RECONFIGURE a
	// missing device or a backend mismatch).
	ErrUnsupportedSocket = errors.New("socket type not supported by the kernel nbd driver (needs TCP or UNIX stream)")
)

// errnoOf returns the errno the kernel answered with, or 0.
func errnoOf(err error) syscall.Errno {
	var errno syscall.Errno
	if errors.As(err, &errno) {
		return errno
	}
	return 0
}

// opError builds the error of a failed command: what was done, the sentinel
// that classifies it (if any) and the underlying error carrying the errno.
func opError(op string, kind, err error) error {
	if kind == nil {
		return fmt.Errorf("nbdnl: %s: %w", op, err)
	}
	return fmt.Errorf("nbdnl: %s: %w: %w", op, kind, err)
}

// familyNotFound explains a failed lookup of the family: a loaded driver
// whose family cannot be seen means the caller is in another network
// namespace than the one the family is registered for.
func familyNotFound(sysRoot string, err error) error {
	if sysRoot == "" {
		sysRoot = defaultSysRoot
	}
	if _, serr := os.Stat(filepath.Join(sysRoot, "module", "nbd")); serr == nil {
		return fmt.Errorf("nbdnl: %w: the nbd driver is loaded but its family is not visible here; "+
			"kernels before 6.4 serve it only in the initial network namespace "+
			"(run in the host network namespace): %w", ErrFamilyNotFound, err)
	}
	return fmt.Errorf("nbdnl: %w: the nbd driver is not loaded (modprobe nbd): %w", ErrFamilyNotFound, err)
}
