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
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"testing"
	"time"
)

// pair listens on 127.0.0.1 (MPTCP or not), dials it (MPTCP or not) and
// returns both ends after a small echo exchange.
func pair(t *testing.T, listenMPTCP, dialMPTCP bool) (client, server net.Conn) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ln, err := Listen(ctx, "tcp4", "127.0.0.1:0", listenMPTCP)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()

	type res struct {
		c   net.Conn
		err error
	}
	acc := make(chan res, 1)
	go func() {
		c, err := ln.Accept()
		acc <- res{c, err}
	}()
	client, err = Dialer(dialMPTCP).DialContext(ctx, "tcp4", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	r := <-acc
	if r.err != nil {
		t.Fatal(r.err)
	}
	server = r.c
	t.Cleanup(func() { server.Close() })

	// Exchange some data so the MPTCP handshake has fully completed on
	// both sides (the server learns the client's key from the first
	// data packet's DSS/MP_CAPABLE option).
	msg := []byte("hello over mptcp")
	if _, err := client.Write(msg); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(server, buf); err != nil {
		t.Fatal(err)
	}
	if _, err := server.Write(buf); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(client, buf); err != nil {
		t.Fatal(err)
	}
	return client, server
}

func requireMPTCP(t *testing.T) {
	t.Helper()
	if err := Available(); err != nil {
		t.Skipf("skipping: MPTCP unavailable: %v", err)
	}
}

func TestLoopbackMPTCP(t *testing.T) {
	requireMPTCP(t)
	client, server := pair(t, true, true)

	for name, c := range map[string]net.Conn{"client": client, "server": server} {
		if !IsMPTCP(c) {
			t.Errorf("%s: IsMPTCP = false", name)
		}
		info, err := GetInfo(c)
		if err != nil {
			t.Fatalf("%s: GetInfo: %v", name, err)
		}
		t.Logf("%s: %+v", name, info)
		if info.Size < InfoSizeMin {
			t.Errorf("%s: Size = %d", name, info.Size)
		}
		if info.Fallback() {
			t.Errorf("%s: fallback flag set", name)
		}
		if info.Token == 0 {
			t.Errorf("%s: zero token", name)
		}
		// Only the initial subflow: no additional ones on loopback.
		if info.Subflows != 0 {
			t.Errorf("%s: Subflows = %d, want 0 additional", name, info.Subflows)
		}
		if info.HasSubflowsTotal() && info.SubflowsTotal != 1 {
			t.Errorf("%s: SubflowsTotal = %d, want 1", name, info.SubflowsTotal)
		}
		if info.HasCounters() && info.BytesSent == 0 && info.BytesReceived == 0 {
			t.Errorf("%s: no bytes counted", name)
		}
	}
	ci, _ := GetInfo(client)
	si, _ := GetInfo(server)
	if ci.HasCounters() {
		if ci.BytesSent != 16 || si.BytesReceived != 16 || si.BytesSent != 16 || ci.BytesReceived != 16 {
			t.Errorf("byte counters: client sent %d recv %d, server sent %d recv %d (want 16 each)",
				ci.BytesSent, ci.BytesReceived, si.BytesSent, si.BytesReceived)
		}
	}
}

// TestWrappedConn checks that NetConn-style wrappers are followed.
func TestWrappedConn(t *testing.T) {
	requireMPTCP(t)
	client, _ := pair(t, true, true)
	wrapped := tls.Client(client, &tls.Config{InsecureSkipVerify: true}) // never handshakes
	if !IsMPTCP(wrapped) {
		t.Error("IsMPTCP(tls.Client(mptcp conn)) = false")
	}
	if _, err := GetInfo(wrapped); err != nil {
		t.Errorf("GetInfo(wrapped): %v", err)
	}
}

func TestPlainTCP(t *testing.T) {
	client, server := pair(t, false, false)
	for name, c := range map[string]net.Conn{"client": client, "server": server} {
		if IsMPTCP(c) {
			t.Errorf("%s: IsMPTCP = true for plain TCP", name)
		}
		_, err := GetInfo(c)
		if !errors.Is(err, ErrNotMPTCP) {
			t.Errorf("%s: GetInfo err = %v, want ErrNotMPTCP", name, err)
		}
	}
}

// TestFallback dials with MPTCP to a plain TCP listener: the client socket
// is IPPROTO_MPTCP but falls back to TCP, which must be reported.
func TestFallback(t *testing.T) {
	requireMPTCP(t)
	client, server := pair(t, false, true)
	if IsMPTCP(client) {
		t.Error("client: IsMPTCP = true after fallback")
	}
	if _, err := GetInfo(client); !errors.Is(err, ErrNotMPTCP) {
		t.Errorf("client: GetInfo err = %v, want ErrNotMPTCP", err)
	} else {
		t.Logf("fallback client: %v", err)
	}
	if IsMPTCP(server) {
		t.Error("server: IsMPTCP = true for plain TCP listener")
	}
}

func TestNotTCP(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	if IsMPTCP(a) {
		t.Error("IsMPTCP(pipe) = true")
	}
	if _, err := GetInfo(a); !errors.Is(err, ErrNotMPTCP) {
		t.Errorf("GetInfo(pipe) err = %v", err)
	}
	if IsMPTCP(nil) {
		t.Error("IsMPTCP(nil) = true")
	}
}

// TestLoopbackSubflows reads the single subflow of a loopback connection
// with MPTCP_FULL_INFO and with the older options.
func TestLoopbackSubflows(t *testing.T) {
	requireMPTCP(t)
	client, server := pair(t, true, true)
	for _, read := range []struct {
		name string
		fn   func(net.Conn) ([]SubflowInfo, error)
	}{{"full-info", GetSubflows}, {"legacy", getSubflowsLegacy}} {
		for name, c := range map[string]net.Conn{"client": client, "server": server} {
			subs, err := read.fn(c)
			if err != nil {
				t.Fatalf("%s %s: %v", read.name, name, err)
			}
			t.Logf("%s %s: %+v", read.name, name, subs)
			if len(subs) != 1 {
				t.Fatalf("%s %s: %d subflows, want 1", read.name, name, len(subs))
			}
			s := subs[0]
			local := c.LocalAddr().(*net.TCPAddr).AddrPort()
			remote := c.RemoteAddr().(*net.TCPAddr).AddrPort()
			if s.Local != local || s.Remote != remote {
				t.Errorf("%s %s: %s -> %s, want %s -> %s", read.name, name, s.Local, s.Remote, local, remote)
			}
			// The pair exchanged 16 bytes each way.
			if s.BytesSent < 16 || s.BytesAcked < 16 || s.BytesReceived < 16 {
				t.Errorf("%s %s: counters %+v, want at least 16 each", read.name, name, s)
			}
			if s.State != 1 {
				t.Errorf("%s %s: TCP state %d, want 1 (established)", read.name, name, s.State)
			}
		}
	}
}

func TestSubflowsNotMPTCP(t *testing.T) {
	client, _ := pair(t, false, false)
	if _, err := GetSubflows(client); !errors.Is(err, ErrNotMPTCP) {
		t.Errorf("plain TCP: %v", err)
	}
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	if _, err := GetSubflows(a); !errors.Is(err, ErrNotMPTCP) {
		t.Errorf("pipe: %v", err)
	}
	if err := Available(); err != nil {
		return
	}
	fell, _ := pair(t, false, true)
	if _, err := GetSubflows(fell); !errors.Is(err, ErrNotMPTCP) {
		t.Errorf("fallen back to TCP: %v", err)
	}
}
