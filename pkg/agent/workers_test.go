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
	"errors"
	"io"
	"net"
	"os"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/util/retry"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// TestDrainDoesNotHoldOtherVolumes: a volume whose publication change
// waits on a connection that cannot drain (its client asked for far more
// than the socket buffers hold and reads nothing, so the server's replies
// block) keeps draining up to DrainTimeout; meanwhile another volume is
// created and reported Available.
func TestDrainDoesNotHoldOtherVolumes(t *testing.T) {
	cfg, c := apiserver.Start(t)
	ctx := context.Background()
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: testNamespace}}); err != nil {
		t.Fatal(err)
	}
	r := startAgent(t, cfg, t.TempDir())
	if err := c.Create(ctx, newVolume("stuck", 64<<20)); err != nil {
		t.Fatal(err)
	}
	waitObserved(t, c, "stuck")
	tok := publish(t, c, "stuck", "node-s", false)

	conn, err := net.DialTimeout("tcp", r.addr, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	if _, err := nbd.Negotiate(conn, access.NodeExport("stuck", tok)); err != nil {
		t.Fatal(err)
	}
	hdr := make([]byte, 28)
	for i := range 16 {
		req := nbd.Request{Type: nbd.CmdRead, Handle: uint64(i + 1), Length: nbd.MaxRequestSize}
		req.Encode(hdr)
		if _, err := conn.Write(hdr); err != nil {
			t.Fatal(err)
		}
	}
	// Let the server fill the socket buffers and block.
	time.Sleep(500 * time.Millisecond)

	// Revoke the node: the agent drains its connection.
	revoked := time.Now()
	if err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		v := getVolume(t, c, "stuck")
		v.Spec.Publications = slices.DeleteFunc(v.Spec.Publications, func(p v1alpha1.Publication) bool { return p.NodeID == "node-s" })
		return c.Update(ctx, v)
	}); err != nil {
		t.Fatal(err)
	}
	// The revocation's reconcile starts long before the next creation.
	time.Sleep(time.Second)
	if err := c.Create(ctx, newVolume("other", 1<<20)); err != nil {
		t.Fatal(err)
	}
	waitObserved(t, c, "other")
	created := time.Since(revoked)
	if s := getVolume(t, c, "stuck"); s.Status.ObservedGeneration == s.Generation {
		t.Fatalf("the other volume became Available %v after the revocation, only once the revocation was applied: the drain held it up (or the connection drained, and the test proves nothing)", created)
	}
	t.Logf("another volume created %v after a revocation that is still draining", created.Round(10*time.Millisecond))

	// The stuck connection goes at DrainTimeout and the revocation is
	// reported.
	waitObserved(t, c, "stuck")
	t.Logf("revocation applied %v after it was asked (DrainTimeout %v)", time.Since(revoked).Round(10*time.Millisecond), r.agent.cfg.DrainTimeout)
	if err := conn.SetReadDeadline(time.Now().Add(10 * time.Second)); err != nil {
		t.Fatal(err)
	}
	// Closed hard: the rest of the replies, then EOF or a reset.
	if _, err := io.Copy(io.Discard, conn); errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("the revoked connection was not closed: %v", err)
	}
}
