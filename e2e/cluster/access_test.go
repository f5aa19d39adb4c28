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

package cluster

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"path/filepath"
	"time"

	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	testpki "github.com/mpnbd/mpnbd/internal/testenv/pki"
	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/nbd"
	"github.com/mpnbd/mpnbd/pkg/nodeid"
)

// kubeClient is an admin client of the suite's cluster that knows the
// driver's resources.
func (s *suite) kubeClient() client.Client {
	s.t.Helper()
	cfg, err := clientcmd.BuildConfigFromFlags("", s.c.Kubeconfig)
	if err != nil {
		s.t.Fatal(err)
	}
	c, err := client.New(cfg, client.Options{})
	if err != nil {
		s.t.Fatal(err)
	}
	if err := v1alpha1.AddToScheme(c.Scheme()); err != nil {
		s.t.Fatal(err)
	}
	return c
}

// nodeTLS is the TLS configuration of the suite's node: the certificate
// its node plugin keeps, checking that the server is the storage agent of
// the same node.
func (s *suite) nodeTLS() *tls.Config {
	return nodeid.FileClientTLS(filepath.Join(s.dir, "node-state", "identity"), s.c.NodeName)
}

// otherNodeTLS is a certificate of the driver's own CA for another node
// (as if a second node plugin presented its own).
func (s *suite) otherNodeTLS(node string) *tls.Config {
	t := s.t
	ca, err := nodeid.LoadOrCreateCA(s.ctx, s.kubeClient(), namespace)
	if err != nil {
		t.Fatalf("the driver's CA: %v", err)
	}
	cert, err := testpki.NodeIDCert(ca, nodeid.Node, node)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca.Cert)
	return nodeid.ClientTLS(s.c.NodeName, func() (*tls.Certificate, error) { return cert, nil }, func() *x509.CertPool { return roots })
}

// dialExport opens export on the suite's storage agent over TLS (bounded).
func (s *suite) dialExport(export string, cfg *tls.Config) (*nbd.Client, error) {
	ctx, cancel := context.WithTimeout(s.ctx, 20*time.Second)
	defer cancel()
	return nbd.Dial(ctx, nbd.DialOptions{Addr: net.JoinHostPort(pathAddr(1, false), "10809"), Export: export, TLS: cfg})
}

// certExport is the export name with which the suite's node opens pv, an
// encrypted volume, over TLS: its name and its publication's epoch.
func (s *suite) certExport(pv string) string {
	var v v1alpha1.NBDVolume
	if err := s.kubeClient().Get(s.ctx, client.ObjectKey{Name: pv}, &v); err != nil {
		s.t.Fatal(err)
	}
	for _, p := range v.Spec.Publications {
		if p.NodeID == s.c.NodeName {
			return access.ExportName(pv, "", p.Epoch)
		}
	}
	s.t.Fatalf("NBDVolume %s is not published to %s: %+v", pv, s.c.NodeName, v.Spec.Publications)
	return ""
}

// onlyThisNode: the export of pv, published to the suite's node, opens
// with that node's certificate, and not with a certificate of the same CA
// naming another node. It returns the open connection.
func (s *suite) onlyThisNode(pv string) *nbd.Client {
	t := s.t
	other := s.c.NodeName + "-second"
	cl, err := s.dialExport(pv, s.otherNodeTLS(other))
	if err == nil {
		cl.Close()
		t.Fatalf("node %s's certificate opened %s, published to %s only", other, pv, s.c.NodeName)
	}
	if !errors.Is(err, nbd.ErrAccessDenied) {
		t.Fatalf("node %s's certificate opening %s: %v, want access denied", other, pv, err)
	}
	cl, err = s.dialExport(s.certExport(pv), s.nodeTLS())
	if err != nil {
		t.Fatalf("the node's own certificate opening %s: %v", pv, err)
	}
	if _, err := cl.ReadAt(make([]byte, 4096), 0); err != nil {
		t.Fatalf("reading %s with the node's certificate: %v", pv, err)
	}
	t.Logf("%s: opened with node %s's certificate, refused to node %s's", pv, s.c.NodeName, other)
	return cl
}

// readOnlyRefusesWrites: the export of pv, published read-only to the
// suite's node, says so and refuses a write from the node.
func (s *suite) readOnlyRefusesWrites(pv string) {
	t := s.t
	var v v1alpha1.NBDVolume
	if err := s.kubeClient().Get(s.ctx, client.ObjectKey{Name: pv}, &v); err != nil {
		t.Fatal(err)
	}
	if len(v.Spec.Publications) != 1 || !v.Spec.Publications[0].ReadOnly {
		t.Fatalf("NBDVolume %s publications %+v, want one, read-only", pv, v.Spec.Publications)
	}
	cl, err := s.dialExport(s.certExport(pv), s.nodeTLS())
	if err != nil {
		t.Fatalf("opening the read-only %s: %v", pv, err)
	}
	defer cl.Close()
	if cl.Info().Flags&nbd.FlagReadOnly == 0 {
		t.Errorf("the read-only publication of %s announced flags %#x", pv, cl.Info().Flags)
	}
	var nerr *nbd.Error
	if _, err := cl.WriteAt(make([]byte, 4096), 1<<20); !errors.As(err, &nerr) || nerr.Errno != nbd.EPERM {
		t.Fatalf("a write to the read-only %s: %v, want EPERM", pv, err)
	}
}

// closedOnUnpublish runs unpublish and checks that the storage agent
// closed cl, the node's connection to pv, within a second of the
// publication's removal from the NBDVolume.
func (s *suite) closedOnUnpublish(pv string, cl *nbd.Client, unpublish func()) {
	t := s.t
	closed := make(chan time.Time, 1)
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		buf := make([]byte, 4096)
		for {
			if _, err := cl.ReadAt(buf, 0); err != nil {
				closed <- time.Now()
				return
			}
			select {
			case <-stop:
				return
			case <-time.After(10 * time.Millisecond):
			}
		}
	}()
	select {
	case at := <-closed:
		t.Fatalf("the node's connection to %s closed at %v, before the unpublish", pv, at)
	case <-time.After(time.Second):
	}
	c := s.kubeClient()
	unpublish()
	// Polled closely: the interval measured is at most 20 ms short.
	var gone time.Time
	for end := time.Now().Add(3 * time.Minute); gone.IsZero(); time.Sleep(20 * time.Millisecond) {
		var v v1alpha1.NBDVolume
		err := c.Get(s.ctx, client.ObjectKey{Name: pv}, &v)
		switch {
		case err == nil && len(v.Spec.Publications) == 0:
			gone = time.Now()
		case time.Now().After(end):
			s.dumpState()
			t.Fatalf("the publication of %s still there 3 minutes after the unpublish began: %v %+v", pv, err, v.Spec.Publications)
		}
	}
	select {
	case at := <-closed:
		d := at.Sub(gone)
		t.Logf("%s: the node's connection closed %v after the publication was seen gone", pv, d.Round(time.Millisecond))
		if d > time.Second {
			t.Fatalf("%s: the node's connection closed %v after its unpublish, want within a second", pv, d)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("%s: the node's connection still open 10 s after its unpublish", pv)
	}
}
