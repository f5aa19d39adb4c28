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
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

func probePath(local, remote netip.Addr, rate float64) (float64, error) {
	if local.Is6() != remote.Is6() {
		return 0, fmt.Errorf("mptcp: path probe from %s to %s: address families differ", local, remote)
	}
	v6 := local.Is6()
	family, proto, ipHeader := unix.AF_INET, unix.IPPROTO_ICMP, ipv4HeaderLen
	if v6 {
		family, proto, ipHeader = unix.AF_INET6, unix.IPPROTO_ICMPV6, ipv6HeaderLen
	}
	fail := func(what string, err error) (float64, error) {
		return 0, fmt.Errorf("mptcp: path probe from %s to %s: %s: %w", local, remote, what, err)
	}
	fd, err := unix.Socket(family, unix.SOCK_RAW|unix.SOCK_CLOEXEC, proto)
	if err != nil {
		return fail("ICMP socket", err)
	}
	defer unix.Close(fd)
	if err := unix.Bind(fd, sockaddrOf(local)); err != nil {
		return fail("bind", err)
	}
	// The replies of a whole probe may queue while the reader is not
	// scheduled; what the buffer drops would read as a slow path.
	if unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 8<<20) != nil {
		_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, 8<<20)
	}
	tv := unix.NsecToTimeval((20 * time.Millisecond).Nanoseconds())
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		return fail("receive timeout", err)
	}

	var idb [2]byte
	_, _ = rand.Read(idb[:])
	id := binary.BigEndian.Uint16(idb[:])
	payload := probePacket - ipHeader - icmpEchoHeaderLen
	to := sockaddrOf(remote)
	requests := newEchoRequests(v6, id, payload)
	send := func(seq uint16) error {
		err := unix.Sendto(fd, requests.at(seq), 0, to)
		if errors.Is(err, unix.ENOBUFS) || errors.Is(err, unix.EAGAIN) {
			return nil // dropped in a full queue: the path's slowness
		}
		return err
	}

	perSecond := rate / probePacket
	n := max(int(probeLength.Seconds()*perSecond), 3)
	answered := make([]bool, n+1) // by sequence number; 0 is the reachability check
	var stop atomic.Bool
	reached := make(chan struct{})
	done := make(chan struct{})
	go func() { readEchoReplies(fd, v6, id, remote, answered, &stop, reached); close(done) }()
	finish := func() { stop.Store(true); <-done }

	// The first request, sent up to three times, tells a peer that
	// answers from one that does not.
	deadline := time.After(probeReachWait)
	resend := time.NewTicker(probeReachWait / 3)
	defer resend.Stop()
	for waiting := true; waiting; {
		if err := send(0); err != nil {
			finish()
			return fail("send", err)
		}
		select {
		case <-reached:
			waiting = false
		case <-resend.C:
		case <-deadline:
			finish()
			return fail("no echo reply", fmt.Errorf("none within %v", probeReachWait))
		}
	}

	// Paced: request i leaves at start + i/perSecond; a late sender
	// moves start on rather than send more than probeBurst's worth at
	// once.
	burst := max(int(probeBurst.Seconds()*perSecond), 2)
	start := time.Now()
	began := start
	for sent := 0; sent < n; {
		due := min(int(time.Since(start).Seconds()*perSecond)+1, n)
		if due-sent > burst {
			start = start.Add(time.Duration(float64(due-sent-burst) / perSecond * float64(time.Second)))
			due = sent + burst
		}
		for ; sent < due; sent++ {
			if err := send(uint16(sent + 1)); err != nil {
				finish()
				return fail("send", err)
			}
		}
		time.Sleep(200 * time.Microsecond)
	}
	took := time.Since(began)
	time.Sleep(probeGrace)
	finish()
	if took > 2*probeLength {
		return 0, fmt.Errorf("%w: %d requests took %v, planned %v", ErrProbeStarved, n, took.Round(time.Millisecond), probeLength)
	}
	return answeredRate(answered, rate), nil
}

// readEchoReplies reads echo replies with id from remote on fd until stop,
// marks answered[seq] for each, and closes reached at the reply to
// sequence number 0.
func readEchoReplies(fd int, v6 bool, id uint16, remote netip.Addr, answered []bool, stop *atomic.Bool, reached chan<- struct{}) {
	buf := make([]byte, probePacket+64)
	for !stop.Load() {
		n, from, err := unix.Recvfrom(fd, buf, 0)
		if err != nil || addrOf(from) != remote {
			continue // the receive timeout, an interrupt, another host
		}
		msg := buf[:n]
		if !v6 && n > 0 {
			// A raw IPv4 socket hands over the IP header too.
			ihl := int(msg[0]&0x0f) * 4
			if ihl > n {
				continue
			}
			msg = msg[ihl:]
		}
		rid, ok := parseEchoReply(v6, msg)
		if !ok || rid != id {
			continue
		}
		seq := int(binary.BigEndian.Uint16(msg[6:]))
		if seq == 0 && !answered[0] {
			close(reached)
		}
		if seq < len(answered) {
			answered[seq] = true
		}
	}
}

func sockaddrOf(a netip.Addr) unix.Sockaddr {
	if a.Is4() {
		return &unix.SockaddrInet4{Addr: a.As4()}
	}
	return &unix.SockaddrInet6{Addr: a.As16()}
}

func addrOf(sa unix.Sockaddr) netip.Addr {
	switch sa := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrFrom4(sa.Addr)
	case *unix.SockaddrInet6:
		return netip.AddrFrom16(sa.Addr).Unmap()
	}
	return netip.Addr{}
}
