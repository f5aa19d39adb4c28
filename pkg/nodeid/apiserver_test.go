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

package nodeid

import (
	"bytes"
	"context"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
	certv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// TestCertificatesThroughAPIServer runs the whole issuance against a real
// API server: the controller's CA and signer, and node plugins and
// storage agents asking for certificates as their ServiceAccounts, with
// the node their token is bound to in the user extra (impersonated).
func TestCertificatesThroughAPIServer(t *testing.T) {
	cfg, c := apiserver.Start(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	// The deploy tree's namespace and RBAC; every component below acts as
	// its ServiceAccount.
	const ns = "mpnbd-system"
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}); err != nil {
		t.Fatal(err)
	}
	if err := apiserver.Apply(ctx, c, "deploy/rbac-controller.yaml", "deploy/rbac-node.yaml", "deploy/rbac-storage-agent.yaml"); err != nil {
		t.Fatal(err)
	}
	controller := as(cfg, c, controllerUser, "")
	ca, err := LoadOrCreateCA(ctx, controller, ns)
	if err != nil {
		t.Fatal(err)
	}
	if again, err := LoadOrCreateCA(ctx, controller, ns); err != nil || !again.Cert.Equal(ca.Cert) {
		t.Fatalf("a second start made another CA (%v)", err)
	}
	var cm corev1.ConfigMap
	if err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: BundleConfigMap}, &cm); err != nil || cm.Data[BundleKey] != string(ca.PEM) {
		t.Fatalf("the bundle does not hold the CA: %v", err)
	}

	wc, err := client.NewWithWatch(impersonate(cfg, controllerUser, ""), client.Options{Scheme: c.Scheme()})
	if err != nil {
		t.Fatal(err)
	}
	signer := NewSigner(SignerConfig{Client: wc, CA: ca, NodeUser: nodeUser, StorageUser: storageUser, Logger: testLogger(t)})
	sctx, stopSigner := context.WithCancel(ctx)
	signed := make(chan struct{})
	go func() {
		defer close(signed)
		_ = signer.Run(sctx)
	}()
	defer func() {
		stopSigner()
		<-signed
	}()

	as := func(user, node string) client.Client { return as(cfg, c, user, node) }
	identity := func(cl client.Client, k Kind, node, dir string) *Identity {
		t.Helper()
		id, err := NewIdentity(IdentityConfig{Client: cl, Kind: k, NodeName: node, Namespace: ns, Dir: dir, Lifetime: time.Hour, Logger: testLogger(t)})
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	start := func(id *Identity, within time.Duration) error { return id.Start(ctx, within) }

	nodeDir := t.TempDir()
	nodeA := identity(as(nodeUser, "node-a"), Node, "node-a", nodeDir)
	if err := start(nodeA, 30*time.Second); err != nil {
		t.Fatalf("node-a's certificate: %v", err)
	}
	if got, err := Verify(Node, nodeA.Roots(), []*x509.Certificate{nodeA.Certificate().Leaf}); err != nil || got != "node-a" {
		t.Fatalf("node-a's certificate names %q (%v)", got, err)
	}
	if life := nodeA.Certificate().Leaf.NotAfter.Sub(nodeA.Certificate().Leaf.NotBefore); life < time.Hour || life > time.Hour+backdate {
		t.Errorf("lifetime %v, want the hour asked for", life)
	}
	if fi, err := os.Stat(filepath.Join(nodeDir, "node.pem")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("the kept certificate: %v (mode %v)", err, fi)
	}
	if b, err := os.ReadFile(filepath.Join(nodeDir, BundleFile)); err != nil || !bytes.Equal(b, ca.PEM) {
		t.Fatalf("the kept CA bundle: %v", err)
	}
	var csrs certv1.CertificateSigningRequestList
	if err := c.List(ctx, &csrs); err != nil || len(csrs.Items) != 1 || !hasCondition(&csrs.Items[0], certv1.CertificateApproved) ||
		!strings.HasPrefix(csrs.Items[0].Name, "mpnbd-node-node-a-") {
		t.Fatalf("requests after one certificate: %+v (%v)", csrs.Items, err)
	}
	// A restart reads the kept certificate: no new request.
	restarted := identity(as(nodeUser, "node-a"), Node, "node-a", nodeDir)
	if err := start(restarted, 30*time.Second); err != nil || restarted.Requested() != 0 || !restarted.Certificate().Leaf.Equal(nodeA.Certificate().Leaf) {
		t.Fatalf("after a restart: %v, %d requests", err, restarted.Requested())
	}

	store1 := identity(as(storageUser, "store-1"), Storage, "store-1", "")
	if err := start(store1, 30*time.Second); err != nil {
		t.Fatalf("store-1's certificate: %v", err)
	}

	t.Run("mutual TLS", func(t *testing.T) {
		if node, err := handshake(t, store1.ServerConfig(), nodeA.ClientConfig("store-1")); err != nil || node != "node-a" {
			t.Errorf("node-a to store-1: peer %q, %v", node, err)
		}
		if _, err := handshake(t, store1.ServerConfig(), nodeA.ClientConfig("store-2")); err == nil || !strings.Contains(err.Error(), "not store-2") {
			t.Errorf("node-a expecting store-2 reached store-1: %v", err)
		}
		// A storage agent's certificate is a client's too (it forwards
		// a replicated volume's changes to the other replicas' agents),
		// and names a storage node, never a node.
		store2 := identity(as(storageUser, "store-2"), Storage, "store-2", "")
		if err := start(store2, 30*time.Second); err != nil {
			t.Fatalf("store-2's certificate: %v", err)
		}
		if peer, err := handshake(t, store1.ServerConfig(), store2.ClientConfig("store-1")); err != nil || peer != "storage node store-2" {
			t.Errorf("store-2 to store-1: peer %q, %v", peer, err)
		}
		if peer, err := handshake(t, store1.ServerConfig(), store1ClientConfig(store1)); err != nil || peer != "storage node store-1" {
			t.Errorf("store-1's certificate as a client: peer %q, %v", peer, err)
		}
		// A node certificate of another CA.
		other, err := NewCA(time.Now())
		if err != nil {
			t.Fatal(err)
		}
		forged := nodeA.ClientConfig("store-1")
		fake := issuedPair(t, other, Node, "node-a", time.Now().Add(-time.Minute), time.Now().Add(time.Hour))
		forged.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return fake, nil }
		if _, err := handshake(t, store1.ServerConfig(), forged); err == nil {
			t.Error("a node certificate of another CA was accepted")
		}
	})

	t.Run("refused", func(t *testing.T) {
		for _, tc := range []struct {
			name string
			cl   client.Client
			kind Kind
			node string
			want string
		}{
			{"another node's certificate", as(nodeUser, "node-a"), Node, "node-b", "may ask only for CN=mpnbd-node:node-a"},
			{"token bound to no node", as(nodeUser, ""), Node, "node-a", "not bound to a pod"},
			{"node plugin asking as storage", as(nodeUser, "node-a"), Storage, "node-a", "only"},
		} {
			err := start(identity(tc.cl, tc.kind, tc.node, ""), 3*time.Second)
			if err == nil || !strings.Contains(err.Error(), "Denied") || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%s: %v, want a denial saying %q", tc.name, err, tc.want)
			}
		}
	})

	t.Run("refused to anyone else", func(t *testing.T) {
		// Another ServiceAccount may not even read the CA bundle.
		err := start(identity(as("system:serviceaccount:default:app", "node-a"), Node, "node-a", ""), 3*time.Second)
		if err == nil || !strings.Contains(err.Error(), "forbidden") {
			t.Errorf("another ServiceAccount: %v, want forbidden", err)
		}
		// A cluster administrator's request, right as it is, is denied.
		key := mustECDSA(t, elliptic.P256())
		csr := request(t, SignerNode, "", "", key, &x509.CertificateRequest{Subject: pkix.Name{CommonName: "mpnbd-node:node-a"}},
			certv1.UsageDigitalSignature, certv1.UsageClientAuth)
		csr.GenerateName = "admin-"
		if err := c.Create(ctx, csr); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(30 * time.Second)
		for !hasCondition(csr, certv1.CertificateDenied) {
			if time.Now().After(deadline) || len(csr.Status.Certificate) > 0 {
				t.Fatalf("an administrator's request: %+v", csr.Status)
			}
			time.Sleep(100 * time.Millisecond)
			if err := c.Get(ctx, client.ObjectKeyFromObject(csr), csr); err != nil {
				t.Fatal(err)
			}
		}
		if msg := csr.Status.Conditions[0].Message; !strings.Contains(msg, "requested by") {
			t.Errorf("denied saying %q", msg)
		}
	})

	t.Run("renewal", func(t *testing.T) {
		dir := t.TempDir()
		write := func(pair *tls.Certificate) {
			t.Helper()
			if err := os.WriteFile(filepath.Join(dir, "node.pem"), pairPEM(t, pair), 0o600); err != nil {
				t.Fatal(err)
			}
		}
		now := time.Now()
		// Due for renewal (two thirds of its life gone) but valid: renewed
		// at start.
		write(issuedPair(t, ca, Node, "node-c", now.Add(-time.Hour), now.Add(20*time.Minute)))
		id := identity(as(nodeUser, "node-c"), Node, "node-c", dir)
		if err := start(id, 30*time.Second); err != nil || id.Requested() != 1 || id.Certificate().Leaf.NotAfter.Before(now.Add(50*time.Minute)) {
			t.Fatalf("a certificate due for renewal: %v, %d requests, expires %v", err, id.Requested(), id.Certificate().Leaf.NotAfter)
		}
		// Another node's kept certificate is not used.
		write(issuedPair(t, ca, Node, "node-x", now.Add(-time.Minute), now.Add(time.Hour)))
		id = identity(as(nodeUser, "node-c"), Node, "node-c", dir)
		if err := start(id, 30*time.Second); err != nil || id.Requested() != 1 {
			t.Fatalf("over another node's kept certificate: %v, %d requests", err, id.Requested())
		}
		// Good for 3 s more before it is due: used, then renewed in the
		// background while handshakes go on; none fails.
		write(issuedPair(t, ca, Node, "node-c", now.Add(-9*time.Second), now.Add(9*time.Second)))
		id = identity(as(nodeUser, "node-c"), Node, "node-c", dir)
		if err := start(id, 30*time.Second); err != nil || id.Requested() != 0 {
			t.Fatalf("a fresh kept certificate: %v, %d requests", err, id.Requested())
		}
		first := id.Certificate().Leaf
		deadline := time.Now().Add(30 * time.Second)
		handshakes := 0
		for id.Requested() == 0 {
			if time.Now().After(deadline) {
				t.Fatal("not renewed 30 s after it was due")
			}
			if node, err := handshake(t, store1.ServerConfig(), id.ClientConfig("store-1")); err != nil || node != "node-c" {
				t.Fatalf("handshake %d while renewing: %q, %v", handshakes, node, err)
			}
			handshakes++
			time.Sleep(50 * time.Millisecond)
		}
		if id.Certificate().Leaf.Equal(first) {
			t.Fatal("renewed, yet the same certificate is served")
		}
		if node, err := handshake(t, store1.ServerConfig(), id.ClientConfig("store-1")); err != nil || node != "node-c" {
			t.Fatalf("after the renewal: %q, %v", node, err)
		}
		t.Logf("renewed in the background after %d handshakes with the old certificate", handshakes)
	})
}

const controllerUser = "system:serviceaccount:mpnbd-system:mpnbd-controller"

// impersonate is cfg acting as user, its token bound to a pod on node
// ("" for none).
func impersonate(cfg *rest.Config, user, node string) *rest.Config {
	ic := rest.CopyConfig(cfg)
	ic.Impersonate = rest.ImpersonationConfig{UserName: user, Groups: []string{"system:serviceaccounts", "system:authenticated"}}
	if node != "" {
		ic.Impersonate.Extra = map[string][]string{NodeNameExtra: {node}}
	}
	return ic
}

func as(cfg *rest.Config, c client.Client, user, node string) client.Client {
	cl, err := client.New(impersonate(cfg, user, node), client.Options{Scheme: c.Scheme()})
	if err != nil {
		panic(err)
	}
	return cl
}

// store1ClientConfig presents the storage certificate as a client would.
func store1ClientConfig(id *Identity) *tls.Config {
	return &tls.Config{
		MinVersion:         tls.VersionTLS13,
		InsecureSkipVerify: true,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			return id.Certificate(), nil
		},
	}
}

// handshake runs a TLS handshake over a pipe and returns the node the
// server sees ("storage node <name>" for a storage node's certificate),
// or the first error of either side.
func handshake(t *testing.T, server, clientCfg *tls.Config) (string, error) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	type result struct {
		conn *tls.Conn
		err  error
	}
	done := make(chan result, 1)
	go func() {
		a, err := l.Accept()
		if err != nil {
			done <- result{err: err}
			return
		}
		_ = a.SetDeadline(time.Now().Add(10 * time.Second))
		srv := tls.Server(a, server)
		err = srv.Handshake()
		if err == nil {
			// A TLS 1.3 client is done before the server has checked its
			// certificate: a byte through makes both sides agree.
			_, err = srv.Write([]byte{1})
		}
		done <- result{srv, err}
	}()
	b, err := net.DialTimeout("tcp", l.Addr().String(), 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	_ = b.SetDeadline(time.Now().Add(10 * time.Second))
	cl := tls.Client(b, clientCfg)
	cerr := cl.Handshake()
	if cerr == nil {
		_, cerr = io.ReadFull(cl, make([]byte, 1))
	}
	b.Close()
	r := <-done
	if r.conn != nil {
		defer r.conn.Close()
	}
	if err := errors.Join(cerr, r.err); err != nil {
		return "", err
	}
	// The server's VerifyConnection checked the chain.
	leaf := r.conn.ConnectionState().PeerCertificates[0]
	if node, err := NodeOf(Node, leaf); err == nil {
		return node, nil
	}
	node, err := NodeOf(Storage, leaf)
	if err != nil {
		return "", err
	}
	return "storage node " + node, nil
}

func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// issuedPair is a certificate of kind k for node from ca, valid over the
// given times (which Issue would clamp).
func issuedPair(t *testing.T, ca *CA, k Kind, node string, notBefore, notAfter time.Time) *tls.Certificate {
	t.Helper()
	key := mustECDSA(t, elliptic.P256())
	serial, err := newSerial()
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.CreateCertificate(rand.Reader, &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: CommonName(k, node)},
		NotBefore:    notBefore, NotAfter: notAfter,
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{k.ExtKeyUsage()},
	}, ca.Cert, key.Public(), ca.Key)
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return &tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}
}

func pairPEM(t *testing.T, c *tls.Certificate) []byte {
	t.Helper()
	return append(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Certificate[0]}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: mustPKCS8(t, c.PrivateKey)})...)
}
