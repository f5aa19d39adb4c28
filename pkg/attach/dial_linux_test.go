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

package attach

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// TestDialExportRetriesMPTCPFallback: a server that answers without MPTCP
// makes every MPTCP connection fall back to TCP; DialExport closes such
// a connection and dials again, mptcpAttempts times, then keeps the last
// one (a volume on a network without MPTCP still attaches). An MPTCP
// server takes one connection.
func TestDialExportRetriesMPTCPFallback(t *testing.T) {
	if err := mptcp.Available(); err != nil {
		t.Skipf("skipping: MPTCP unavailable: %v", err)
	}
	for _, c := range []struct {
		name      string
		serverMP  bool
		wantConns int64
		wantMP    bool
	}{
		{"plain TCP server", false, mptcpAttempts, false},
		{"MPTCP server", true, 1, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			srv := &nbd.Server{Logger: slog.New(slog.DiscardHandler)}
			if err := srv.AddExport(&nbd.Export{Name: "vol", Backend: nbd.NewMemBackend(1 << 20)}); err != nil {
				t.Fatal(err)
			}
			l, err := mptcp.Listen(context.Background(), "tcp", "127.0.0.1:0", c.serverMP)
			if err != nil {
				t.Fatal(err)
			}
			var accepted atomic.Int64
			go func() {
				for {
					conn, err := l.Accept()
					if err != nil {
						return
					}
					accepted.Add(1)
					go srv.ServeConn(conn)
				}
			}()
			t.Cleanup(func() {
				l.Close()
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				srv.Shutdown(ctx)
			})
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			conn, info, err := ExportDialer{Logger: slog.New(slog.DiscardHandler)}.DialExport(ctx, l.Addr().String(), "", "vol", true, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			if info.Size != 1<<20 {
				t.Fatalf("export size %d", info.Size)
			}
			if got := mptcp.IsMPTCP(conn); got != c.wantMP {
				t.Fatalf("connection MPTCP %v, want %v", got, c.wantMP)
			}
			// The closed attempts reach the server as connections that
			// end at once.
			deadline := time.Now().Add(5 * time.Second)
			for accepted.Load() < c.wantConns && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
			}
			if n := accepted.Load(); n != c.wantConns {
				t.Fatalf("server accepted %d connections, want %d", n, c.wantConns)
			}
		})
	}
}

// TestDialServers: a replicated volume's servers are dialled at once and
// the one that serves the export is kept, whatever comes before it in
// the list: one that refuses (a replica that is not the primary), one
// whose host takes the connection and never answers. Two that serve
// (a primary that has not yet learnt it was replaced): one is kept, the
// other's dial cancelled or, done already, its connection handed back to
// be closed. None serving: the error
// is a refusal, and names a refusal as superseded when one server gave it.
func TestDialServers(t *testing.T) {
	if err := mptcp.Available(); err != nil {
		t.Skipf("skipping: MPTCP unavailable: %v", err)
	}
	log := slog.New(slog.DiscardHandler)
	serve := func(resolve func(nbd.ConnInfo, string) (nbd.Grant, error)) Server {
		addr := serveVol(t, func(string) func(nbd.ConnInfo, string) (nbd.Grant, error) { return resolve })
		return Server{StorageNode: addr, Addrs: []string{addr}}
	}
	serving := func() Server { return serve(nil) }
	refusing := func(err error) Server {
		return serve(func(nbd.ConnInfo, string) (nbd.Grant, error) { return nbd.Grant{}, err })
	}
	// hung takes connections and never answers.
	hung := func() Server {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		var conns []net.Conn
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					return
				}
				conns = append(conns, c)
			}
		}()
		t.Cleanup(func() { l.Close() })
		return Server{StorageNode: "hung", Addrs: []string{l.Addr().String()}}
	}
	dial := func(servers ...Server) (string, int, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		var d ServerDialer
		dropped := 0
		c, addr, err := DialServers(ctx, &d, servers, func(ctx context.Context, s Server, addr string) (net.Conn, error) {
			c, _, err := ExportDialer{Logger: log}.DialExport(ctx, addr, "", "vol", true, nil)
			return c, err
		}, func(c net.Conn) { dropped++; c.Close() })
		if c != nil {
			c.Close()
		}
		return addr, dropped, err
	}

	primary := serving()
	for _, tc := range []struct {
		name    string
		servers []Server
	}{
		{"a replica refusing first", []Server{refusing(errors.New("not the primary")), primary}},
		{"a hung host first", []Server{hung(), primary}},
		{"both before it", []Server{hung(), refusing(errors.New("not the primary")), primary}},
	} {
		addr, dropped, err := dial(tc.servers...)
		if err != nil || addr != primary.Addrs[0] || dropped != 0 {
			t.Errorf("%s: reached %q (dropped %d), %v; want %s", tc.name, addr, dropped, err, primary.Addrs[0])
		}
	}
	// A replica that refuses, then serves (promoted while the node
	// dials), is asked again while a hung host holds the round: the node
	// reaches it without waiting for the hung one to time out.
	var asked atomic.Int32
	becoming := serve(func(nbd.ConnInfo, string) (nbd.Grant, error) {
		if asked.Add(1) < 3 {
			return nbd.Grant{}, errors.New("not the primary yet")
		}
		return nbd.Grant{Export: "vol"}, nil
	})
	if addr, _, err := dial(hung(), becoming); err != nil || addr != becoming.Addrs[0] {
		t.Errorf("a replica promoted during the round: reached %q, %v; want %s (asked %d times)", addr, err, becoming.Addrs[0], asked.Load())
	}
	other := serving()
	// The other's dial is cancelled, or handed back if it was done.
	if addr, dropped, err := dial(primary, other); err != nil || dropped > 1 || (addr != primary.Addrs[0] && addr != other.Addrs[0]) {
		t.Errorf("two serving: reached %q (dropped %d), %v", addr, dropped, err)
	}
	_, _, err := dial(refusing(errors.New("not the primary")), refusing(errors.New("not the primary")))
	if !errors.Is(err, ErrServerRefused) {
		t.Errorf("none serving: %v, want a refusal", err)
	}
	_, _, err = dial(refusing(errors.New("not the primary")), refusing(fmt.Errorf("replaced: %w", nbd.ErrSuperseded)))
	if !errors.Is(err, nbd.ErrSuperseded) {
		t.Errorf("one refusing as superseded: %v, want nbd.ErrSuperseded in it", err)
	}
}

// TestDialServersLearns: a replicated volume's session learns from the
// server that serves which storage nodes hold the export now, and dials
// them next time: a replica added after the node was given its target
// (a replacement, a drain) is reached when it takes over. The target's
// own servers stay in the list, by name or, without one (no TLS), by
// address.
func TestDialServersLearns(t *testing.T) {
	if err := mptcp.Available(); err != nil {
		t.Skipf("skipping: MPTCP unavailable: %v", err)
	}
	log := slog.New(slog.DiscardHandler)
	var listed atomic.Pointer[[]nbd.ServerAddrs]
	listed.Store(&[]nbd.ServerAddrs{})
	var serving sync.Map // address -> true while it serves
	serve := func() string {
		return serveVol(t, func(addr string) func(nbd.ConnInfo, string) (nbd.Grant, error) {
			return func(nbd.ConnInfo, string) (nbd.Grant, error) {
				if _, ok := serving.Load(addr); !ok {
					return nbd.Grant{}, errors.New("not the primary")
				}
				return nbd.Grant{Export: "vol", Servers: *listed.Load()}, nil
			}
		})
	}
	a, b, c := serve(), serve(), serve()
	// The node was given A (no name: a token, no TLS) and replica B.
	target := Target{Addrs: []string{a}, Replicas: []Server{{StorageNode: "b", Addrs: []string{b}}}}
	kept := filepath.Join(t.TempDir(), "servers", "vol.json")
	var d ServerDialer
	if err := d.KeepIn(kept); err != nil {
		t.Fatalf("no file yet: %v", err)
	}
	dial := func() (string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		conn, addr, err := DialServers(ctx, &d, d.For(target), func(ctx context.Context, s Server, addr string) (net.Conn, error) {
			c, _, err := ExportDialer{Logger: log, Servers: &d}.DialExport(ctx, addr, "", "vol", true, nil)
			return c, err
		}, func(c net.Conn) { c.Close() })
		if conn != nil {
			conn.Close()
		}
		return addr, err
	}
	names := func() []string {
		var out []string
		for _, s := range d.For(target) {
			out = append(out, s.StorageNode+"="+strings.Join(s.Addrs, ","))
		}
		return out
	}
	if got, want := names(), []string{"=" + a, "b=" + b}; !slices.Equal(got, want) {
		t.Fatalf("before any dial: %v, want %v", got, want)
	}
	// A serves and lists itself and C, a replica that replaced B.
	serving.Store(a, true)
	listed.Store(&[]nbd.ServerAddrs{{Node: "a", Addrs: []string{a}}, {Node: "c", Addrs: []string{c}}})
	if addr, err := dial(); err != nil || addr != a {
		t.Fatalf("first dial reached %q, %v; want %s", addr, err, a)
	}
	if got, want := names(), []string{"a=" + a, "c=" + c, "b=" + b}; !slices.Equal(got, want) {
		t.Fatalf("after A listed A and C: %v, want %v", got, want)
	}
	// A is gone and C took over: the session reaches C, which it was
	// never given.
	serving.Delete(a)
	serving.Store(c, true)
	if addr, err := dial(); err != nil || addr != c {
		t.Fatalf("after the failover reached %q, %v; want %s", addr, err, c)
	}
	// A server that lists nothing leaves what was learned.
	listed.Store(&[]nbd.ServerAddrs{})
	if addr, err := dial(); err != nil || addr != c {
		t.Fatalf("dial reached %q, %v; want %s", addr, err, c)
	}
	if got, want := names(), []string{"a=" + a, "c=" + c, "b=" + b}; !slices.Equal(got, want) {
		t.Fatalf("after a server listed nothing: %v, want %v", got, want)
	}
	// The process that serves the volume next (a restart, a handover) is
	// given the target as published: it reaches C through the file.
	d = ServerDialer{}
	if err := d.KeepIn(kept); err != nil {
		t.Fatal(err)
	}
	if got, want := names(), []string{"a=" + a, "c=" + c, "b=" + b}; !slices.Equal(got, want) {
		t.Fatalf("a new process: %v, want %v", got, want)
	}
	if addr, err := dial(); err != nil || addr != c {
		t.Fatalf("a new process reached %q, %v; want %s", addr, err, c)
	}
	// A file that cannot be read: said, and only the target's servers.
	if err := os.WriteFile(kept, []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	d = ServerDialer{}
	if err := d.KeepIn(kept); err == nil {
		t.Fatal("a malformed file was taken")
	}
	if got, want := names(), []string{"=" + a, "b=" + b}; !slices.Equal(got, want) {
		t.Fatalf("after a malformed file: %v, want %v", got, want)
	}
}

// serveVol serves a 1 MiB export "vol" on a loopback MPTCP port until the
// test ends, its grants from the resolver made for its address (nil: every
// name allowed), and returns the address.
func serveVol(t *testing.T, resolver func(addr string) func(nbd.ConnInfo, string) (nbd.Grant, error)) string {
	t.Helper()
	l, err := mptcp.Listen(context.Background(), "tcp", "127.0.0.1:0", true)
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	serveExport(t, l, &nbd.Server{Logger: slog.New(slog.DiscardHandler), Resolve: resolver(addr)}, 1<<20)
	return addr
}

// serveExport serves, on l, srv with an export "vol" of size bytes in
// memory, until t's cleanup shuts it down.
func serveExport(t *testing.T, l net.Listener, srv *nbd.Server, size int64) {
	t.Helper()
	if err := srv.AddExport(&nbd.Export{Name: "vol", Backend: nbd.NewMemBackend(size)}); err != nil {
		t.Fatal(err)
	}
	go srv.Serve(l)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
	})
}
