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

package mptcp

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"
)

// subflowSlots is how many subflows the first read makes room for; a
// connection with more is read again with room for all.
const subflowSlots = 8

// subflowTries bounds the reads of a connection whose subflows keep
// changing between them.
const subflowTries = 4

// GetSubflows lists the subflows of c, which must be a *net.TCPConn (or
// wrap one via a NetConn method) running MPTCP: their addresses and the
// bytes each carried. It uses MPTCP_FULL_INFO (Linux 6.5), which reads
// everything under one lock, and falls back to MPTCP_SUBFLOW_ADDRS and
// MPTCP_TCPINFO (Linux 5.16) on older kernels.
//
// The error wraps ErrNotMPTCP when c is not an MPTCP connection (or fell
// back to TCP), ErrUnsupported when the kernel has none of the options.
func GetSubflows(c net.Conn) ([]SubflowInfo, error) {
	return getSubflows(c, subflowsFD)
}

// getSubflowsLegacy is GetSubflows with the pre-6.5 options only.
func getSubflowsLegacy(c net.Conn) ([]SubflowInfo, error) {
	return getSubflows(c, legacySubflowsFD)
}

func getSubflows(c net.Conn, read func(fd uintptr) ([]SubflowInfo, error)) ([]SubflowInfo, error) {
	tc := TCPConn(c)
	if tc == nil {
		return nil, fmt.Errorf("%w: %T is not a TCP connection", ErrNotMPTCP, c)
	}
	if ok, err := tc.MultipathTCP(); err != nil || !ok {
		return nil, fmt.Errorf("%w: plain TCP or fallen back to it", ErrNotMPTCP)
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("mptcp: %w", err)
	}
	var (
		subs []SubflowInfo
		serr error
	)
	if cerr := rc.Control(func(fd uintptr) { subs, serr = read(fd) }); cerr != nil {
		return nil, fmt.Errorf("mptcp: %w", cerr)
	}
	return subs, serr
}

// subflowsFD reads fd's subflows with MPTCP_FULL_INFO, or the older
// options when the kernel lacks it.
func subflowsFD(fd uintptr) ([]SubflowInfo, error) {
	slots := subflowSlots
	var fi FullInfo
	for range subflowTries {
		var err error
		fi, err = fullInfoFD(fd, slots)
		if errors.Is(err, unix.EOPNOTSUPP) {
			return legacySubflowsFD(fd)
		}
		if err != nil {
			return nil, err
		}
		if fi.Total <= slots {
			return fi.Subflows, nil
		}
		slots = fi.Total + 2 // room for a few joining meanwhile
	}
	return fi.Subflows, nil
}

// fullInfoFD is one MPTCP_FULL_INFO read with room for slots subflows.
func fullInfoFD(fd uintptr, slots int) (FullInfo, error) {
	full := make([]byte, FullInfoSize)
	sfinfo := make([]byte, slots*SubflowInfoSize)
	tcpinfo := make([]byte, slots*TCPInfoSize)
	// The kernel writes the arrays through the pointers in full: keep
	// them where they are until it is done.
	var pin runtime.Pinner
	defer pin.Unpin()
	pin.Pin(&sfinfo[0])
	pin.Pin(&tcpinfo[0])
	ne := binary.NativeEndian
	ne.PutUint32(full[offFullSizeTCPInfoUser:], TCPInfoSize)
	ne.PutUint32(full[offFullSizeSfInfoUser:], SubflowInfoSize)
	ne.PutUint32(full[offFullSizeArraysUser:], uint32(slots))
	ne.PutUint64(full[offFullSubflowInfo:], uint64(uintptr(unsafe.Pointer(&sfinfo[0]))))
	ne.PutUint64(full[offFullTCPInfo:], uint64(uintptr(unsafe.Pointer(&tcpinfo[0]))))
	n, err := getsockoptBytes(fd, SolMPTCP, OptFullInfo, full)
	runtime.KeepAlive(sfinfo)
	runtime.KeepAlive(tcpinfo)
	if err != nil {
		return FullInfo{}, sockoptError("MPTCP_FULL_INFO", err)
	}
	return DecodeFullInfo(full[:min(int(n), len(full))], sfinfo, tcpinfo)
}

// legacySubflowsFD reads fd's subflows with MPTCP_SUBFLOW_ADDRS and
// MPTCP_TCPINFO, two reads the subflows may change between: it reads
// again until both list as many subflows, all of which fitted.
func legacySubflowsFD(fd uintptr) ([]SubflowInfo, error) {
	slots := subflowSlots
	for range subflowTries {
		addrs, na, err := subflowDataFD(fd, OptSubflowAddrs, "MPTCP_SUBFLOW_ADDRS", SubflowAddrsSize, slots)
		if err != nil {
			return nil, err
		}
		infos, nt, err := subflowDataFD(fd, OptTCPInfo, "MPTCP_TCPINFO", TCPInfoSize, slots)
		if err != nil {
			return nil, err
		}
		if na != nt || len(addrs) != na || len(infos) != nt {
			slots = max(slots, na+2, nt+2)
			continue
		}
		subs := make([]SubflowInfo, na)
		for i := range subs {
			subs[i].Local, subs[i].Remote = decodeSubflowAddrs(addrs[i])
			decodeTCPInfo(&subs[i], infos[i])
		}
		return subs, nil
	}
	return nil, fmt.Errorf("mptcp: the subflows kept changing over %d reads", subflowTries)
}

// subflowDataFD is one read of an option replying with struct
// mptcp_subflow_data and elements of size bytes, room for slots.
func subflowDataFD(fd uintptr, opt int, name string, size, slots int) ([][]byte, int, error) {
	b := make([]byte, SubflowDataSize+slots*size)
	ne := binary.NativeEndian
	ne.PutUint32(b[offSfdSizeSubflowData:], SubflowDataSize)
	ne.PutUint32(b[offSfdSizeUser:], uint32(size))
	n, err := getsockoptBytes(fd, SolMPTCP, opt, b)
	if err != nil {
		return nil, 0, sockoptError(name, err)
	}
	return DecodeSubflowData(b[:min(int(n), len(b))])
}

// sockoptError wraps a failed getsockopt of level SOL_MPTCP: ENOPROTOOPT
// is a socket that fell back to TCP (the option went to its TCP subflow),
// EOPNOTSUPP an option the kernel does not know.
func sockoptError(name string, err error) error {
	switch {
	case errors.Is(err, unix.ENOPROTOOPT):
		return fmt.Errorf("%w: getsockopt(%s): %w", ErrNotMPTCP, name, err)
	case errors.Is(err, unix.EOPNOTSUPP):
		return fmt.Errorf("%w: getsockopt(%s): %w", ErrUnsupported, name, err)
	}
	return os.NewSyscallError("getsockopt("+name+")", err)
}
