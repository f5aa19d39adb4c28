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

package nbd

import (
	"bytes"
	"crypto/rand"
	"crypto/tls"
	"io"
	"net"
	"sync/atomic"
	"testing"
	"time"
)

// countingConn counts the writes that reach the socket.
type countingConn struct {
	net.Conn
	writes atomic.Int64
}

func (c *countingConn) Write(p []byte) (int, error) {
	c.writes.Add(1)
	return c.Conn.Write(p)
}

// tlsPair is a TLS connection over loopback TCP, both ends made by
// tlsOver, the server's socket writes counted; no handshake yet.
func tlsPair(t *testing.T) (srv, cli *tls.Conn, counted *countingConn) {
	t.Helper()
	p := newTestPKI(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			close(accepted)
			return
		}
		accepted <- c
	}()
	raw, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	srvRaw, ok := <-accepted
	if !ok {
		t.Fatal("accept failed")
	}
	counted = &countingConn{Conn: srvRaw}
	srv = tlsOver(counted, p.server, true)
	cli = tlsOver(raw, p.client, false)
	t.Cleanup(func() { srv.Close(); cli.Close() })
	return srv, cli, counted
}

// TestTLSTransportBatches: a megabyte written inside Batched reaches the
// socket in a few writes of whole records (crypto/tls alone makes one per
// 16 KiB record), and arrives intact; outside Batched every record is its
// own write; a batch larger than the transport's buffer still arrives in
// order.
func TestTLSTransportBatches(t *testing.T) {
	srv, cli, counted := tlsPair(t)
	hs := make(chan error, 1)
	go func() { hs <- cli.Handshake() }()
	if err := srv.Handshake(); err != nil {
		t.Fatal(err)
	}
	if err := <-hs; err != nil {
		t.Fatal(err)
	}

	data := make([]byte, 1<<20)
	if _, err := rand.Read(data); err != nil {
		t.Fatal(err)
	}
	got := make(chan []byte, 1)
	read := func(n int) {
		b := make([]byte, n)
		if _, err := io.ReadFull(cli, b); err != nil {
			t.Error(err)
		}
		got <- b
	}
	for _, tc := range []struct {
		name     string
		batched  bool
		maxCalls int64
		minCalls int64
	}{
		{"batched", true, int64(len(data)/tlsIOSize) + 2, 1},
		{"unbatched", false, 1 << 20, int64(len(data) / (tlsRecord + 256))},
	} {
		go read(2 * len(data))
		before := counted.writes.Load()
		write := func() error {
			// Two writes: a batch spans them, and the second
			// overflows the buffer more than once.
			if _, err := srv.Write(data); err != nil {
				return err
			}
			_, err := srv.Write(data)
			return err
		}
		var err error
		if tc.batched {
			err = Batched(srv, write)
		} else {
			err = write()
		}
		if err != nil {
			t.Fatal(err)
		}
		b := <-got
		if !bytes.Equal(b[:len(data)], data) || !bytes.Equal(b[len(data):], data) {
			t.Fatalf("%s: the data arrived changed", tc.name)
		}
		calls := counted.writes.Load() - before
		t.Logf("%s: 2 MiB in %d socket writes", tc.name, calls)
		if calls > tc.maxCalls*2 || calls < tc.minCalls {
			t.Errorf("%s: 2 MiB in %d socket writes, want %d to %d", tc.name, calls, tc.minCalls, tc.maxCalls*2)
		}
	}
}

// TestTLSBatchedBeforeHandshake: a batch that starts the handshake does
// not hold the handshake's own messages back (it would wait forever for
// the answer to them).
func TestTLSBatchedBeforeHandshake(t *testing.T) {
	srv, cli, _ := tlsPair(t)
	data := make([]byte, 64<<10)
	got := make(chan error, 1)
	go func() {
		b := make([]byte, len(data))
		_, err := io.ReadFull(cli, b)
		got <- err
	}()
	wrote := make(chan error, 1)
	go func() {
		wrote <- Batched(srv, func() error {
			_, err := srv.Write(data)
			return err
		})
	}()
	for _, ch := range []chan error{wrote, got} {
		select {
		case err := <-ch:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("a batched write before the handshake: still waiting after 10 s")
		}
	}
}
