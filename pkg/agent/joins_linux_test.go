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
	"context"
	"fmt"
	"net"
	"strconv"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/mptcp"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// TestStrayJoinClosed: the agent serves in the server namespace of a
// 2-path topology, where every MPTCP connection gets a second subflow
// from the client's path-2 address. A node published with both its
// addresses keeps its connection; a node published with its path-1
// address only has its connection closed once the path-2 subflow joins,
// counted, while the agent goes on serving the other.
func TestStrayJoinClosed(t *testing.T) {
	tp := topo.NewForTest(t, topo.Uniform(topo.UniqueName("sj"), 2, 1000))
	if err := mptcp.Available(); err != nil {
		t.Skipf("skipping: MPTCP unavailable: %v", err)
	}
	cfg, c := apiserver.Start(t)
	ctx := context.Background()
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: testNamespace}}); err != nil {
		t.Fatal(err)
	}
	var l net.Listener
	if err := tp.InServer(func() error {
		var err error
		l, err = mptcp.Listen(ctx, "tcp", net.JoinHostPort(tp.ServerAddr(1).String(), "0"), true)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	r := startAgentOn(t, cfg, t.TempDir(), l, tp.ServerAddr(1).String())
	port := strconv.Itoa(l.Addr().(*net.TCPAddr).Port)

	for _, name := range []string{"both", "one"} {
		if err := c.Create(ctx, newVolume(name, 16<<20)); err != nil {
			t.Fatal(err)
		}
		waitObserved(t, c, name)
	}
	tokBoth := publish(t, c, "both", "node-both", false, tp.ClientAddr(1).String(), tp.ClientAddr(2).String())
	tokOne := publish(t, c, "one", "node-one", false, tp.ClientAddr(1).String())

	dial := func(export string) *nbd.Client {
		t.Helper()
		var cl *nbd.Client
		if err := tp.InClient(func() error {
			dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			var err error
			cl, err = nbd.Dial(dctx, nbd.DialOptions{Addr: net.JoinHostPort(tp.ServerAddr(1).String(), port),
				Export: export, MPTCP: true, Logger: testLogger(t)})
			return err
		}); err != nil {
			t.Fatalf("dial %s: %v", export, err)
		}
		t.Cleanup(func() { cl.Close() })
		return cl
	}
	subflows := func(cl *nbd.Client) int {
		subs, err := mptcp.GetSubflows(cl.Conns()[0])
		if err != nil {
			return 0
		}
		return len(subs)
	}
	io := func(cl *nbd.Client) error {
		buf := make([]byte, 64<<10)
		if _, err := cl.WriteAt(buf, 0); err != nil {
			return err
		}
		_, err := cl.ReadAt(buf, 0)
		return err
	}

	both := dial(access.NodeExport("both", tokBoth))
	eventually(t, "the published node's second subflow", func() string {
		if n := subflows(both); n != 2 {
			return fmt.Sprintf("%d subflows", n)
		}
		return ""
	})

	one := dial(access.NodeExport("one", tokOne))
	eventually(t, "the connection with a stray subflow closed", func() string {
		if err := io(one); err == nil {
			return fmt.Sprintf("still served (%d subflows)", subflows(one))
		}
		return ""
	})
	if n := r.obs.strays("one"); n < 1 {
		t.Errorf("%d stray subflow connections counted for volume one", n)
	}

	// The node published with both addresses kept its connection through
	// several checks.
	time.Sleep(3 * joinCheckInterval)
	if err := io(both); err != nil {
		t.Fatalf("the connection of the node published with both addresses: %v", err)
	}
	if n := r.obs.strays("both"); n != 0 {
		t.Errorf("%d stray subflow connections counted for volume both", n)
	}
}
