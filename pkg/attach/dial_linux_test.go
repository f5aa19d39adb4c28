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
	"log/slog"
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
