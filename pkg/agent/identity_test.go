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
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/testenv/pki"
	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/nbd"
	"github.com/mpnbd/mpnbd/pkg/nodeid"
)

// issue is a certificate of kind k for node from ca.
func issue(t *testing.T, ca *nodeid.CA, k nodeid.Kind, node string) *tls.Certificate {
	t.Helper()
	c, err := pki.NodeIDCert(ca, k, node)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestAgentNodeCertificates serves volumes to nodes that show their node
// certificate over TLS: a volume published without a token opens by its
// name alone, only for the node the certificate names; a token and a
// certificate must agree; an encrypted volume is refused in plaintext.
func TestAgentNodeCertificates(t *testing.T) {
	sc := newStorageCluster(t)
	ctx, c, ca, rootsOf := context.Background(), sc.c, sc.ca, sc.rootsOf
	r := sc.start(testNode)

	// as dials export presenting cert (nil: plaintext).
	as := func(cert *tls.Certificate, export string) (*nbd.Client, error) {
		t.Helper()
		dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		o := nbd.DialOptions{Addr: r.addr, Export: export, MPTCP: true, Logger: testLogger(t)}
		if cert != nil {
			o.TLS = nodeid.ClientTLS(testNode, func() (*tls.Certificate, error) { return cert, nil }, rootsOf)
		}
		cl, err := nbd.Dial(dctx, o)
		if err == nil {
			t.Cleanup(func() { cl.Close() })
		}
		return cl, err
	}
	refusedAs := func(what string, cert *tls.Certificate, export string) {
		t.Helper()
		if cl, err := as(cert, export); err == nil {
			cl.Close()
			t.Errorf("%s: open %q succeeded", what, export)
		}
	}
	node1, node2 := issue(t, ca, nodeid.Node, "node-1"), issue(t, ca, nodeid.Node, "node-2")

	// An encrypted volume, published to node-1 by certificate.
	enc := newVolume("vol-enc", 1<<20)
	enc.Spec.Encryption = v1alpha1.EncryptionRequired
	if err := c.Create(ctx, enc); err != nil {
		t.Fatal(err)
	}
	if v := waitObserved(t, c, "vol-enc"); v.Status.Phase != v1alpha1.VolumeAvailable {
		t.Fatalf("vol-enc: %+v", v.Status)
	}
	editVolume(t, c, "vol-enc", func(v *v1alpha1.NBDVolume) {
		v.Spec.Publications = append(v.Spec.Publications, v1alpha1.Publication{NodeID: "node-1", Addresses: []string{"127.0.0.1"}})
	})
	var cl1 *nbd.Client
	eventually(t, "node-1 opens vol-enc with its certificate", func() string {
		var err error
		if cl1, err = as(node1, "vol-enc"); err != nil {
			return err.Error()
		}
		return ""
	})
	data := bytes.Repeat([]byte("certified"), 512)
	if _, err := cl1.WriteAt(data, 4096); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(data))
	if _, err := cl1.ReadAt(got, 4096); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read back over TLS: %v (equal %v)", err, bytes.Equal(got, data))
	}
	refusedAs("another node's certificate", node2, "vol-enc")
	refusedAs("no certificate", nil, "vol-enc")
	other, err := nodeid.NewCA(time.Now())
	if err != nil {
		t.Fatal(err)
	}
	refusedAs("node-1's name from another CA", issue(t, other, nodeid.Node, "node-1"), "vol-enc")
	refusedAs("a storage certificate", issue(t, ca, nodeid.Storage, "node-1"), "vol-enc")

	// A token does not open an encrypted volume in plaintext.
	tok2 := publish(t, c, "vol-enc", "node-2", false)
	eventually(t, "node-2 opens vol-enc with its token over TLS", func() string {
		cl, err := as(node2, access.NodeExport("vol-enc", tok2))
		if err != nil {
			return err.Error()
		}
		cl.Close()
		return ""
	})
	if _, err := as(nil, access.NodeExport("vol-enc", tok2)); !errors.Is(err, nbd.ErrTLSRequired) {
		t.Errorf("a token in plaintext on an encrypted volume: %v, want ErrTLSRequired", err)
	}
	// The certificate and the token must name the same node.
	refusedAs("node-1's certificate with node-2's token", node1, access.NodeExport("vol-enc", tok2))

	// A plaintext volume: a token opens it with or without TLS.
	if err := c.Create(ctx, newVolume("vol-plain", 1<<20)); err != nil {
		t.Fatal(err)
	}
	waitObserved(t, c, "vol-plain")
	tokP := publish(t, c, "vol-plain", "node-1", false)
	eventually(t, "node-1 opens vol-plain in plaintext and over TLS", func() string {
		for _, cert := range []*tls.Certificate{nil, node1} {
			cl, err := as(cert, access.NodeExport("vol-plain", tokP))
			if err != nil {
				return err.Error()
			}
			cl.Close()
		}
		return ""
	})
	// By name, a certificate of a node it is published to opens it too
	// (the certificate proves more than the token); another node's not.
	if cl, err := as(node1, "vol-plain"); err != nil {
		t.Errorf("vol-plain by name with node-1's certificate: %v", err)
	} else {
		cl.Close()
	}
	refusedAs("vol-plain by name with node-2's certificate", node2, "vol-plain")

	// Unpublishing node-1 closes its open connection.
	if _, err := cl1.ReadAt(got, 0); err != nil {
		t.Fatalf("node-1's connection before unpublishing: %v", err)
	}
	closed := time.Now()
	unpublish(t, c, "vol-enc", "node-1")
	eventually(t, "node-1's connection closed", func() string {
		if _, err := cl1.ReadAt(got, 0); err == nil {
			return "I/O still works"
		}
		return ""
	})
	t.Logf("node-1's connection closed %v after it was unpublished", time.Since(closed).Round(time.Millisecond))
	refusedAs("node-1 after unpublishing", node1, "vol-enc")

	// Published to node-1 again: a session of the first publication
	// (which presented none, or an older epoch) is refused as superseded
	// although the certificate is the same; the new one opens.
	editVolume(t, c, "vol-enc", func(v *v1alpha1.NBDVolume) {
		v.Spec.Publications = append(v.Spec.Publications, v1alpha1.Publication{NodeID: "node-1", Addresses: []string{"127.0.0.1"}, Epoch: 7})
	})
	eventually(t, "node-1 opens vol-enc at epoch 7", func() string {
		cl, err := as(node1, access.ExportName("vol-enc", "", 7))
		if err != nil {
			return err.Error()
		}
		cl.Close()
		return ""
	})
	for _, name := range []string{"vol-enc", access.ExportName("vol-enc", "", 6)} {
		if cl, err := as(node1, name); !errors.Is(err, nbd.ErrSuperseded) {
			if cl != nil {
				cl.Close()
			}
			t.Errorf("node-1's certificate opening %q after it was published again: %v, want a refusal as superseded", name, err)
		}
	}
}
