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
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"net"
	"strings"
	"testing"
	"time"

	certv1 "k8s.io/api/certificates/v1"
)

const (
	nodeUser    = "system:serviceaccount:mpnbd-system:mpnbd-node"
	storageUser = "system:serviceaccount:mpnbd-system:mpnbd-storage-agent"
)

func csrPEM(t *testing.T, key any, tmpl *x509.CertificateRequest) []byte {
	t.Helper()
	der, err := x509.CreateCertificateRequest(rand.Reader, tmpl, key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der})
}

func mustECDSA(t *testing.T, c elliptic.Curve) *ecdsa.PrivateKey {
	t.Helper()
	k, err := ecdsa.GenerateKey(c, rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// request is a request as the API server stores it for user on node.
func request(t *testing.T, signer, user, node string, key any, tmpl *x509.CertificateRequest, usages ...certv1.KeyUsage) *certv1.CertificateSigningRequest {
	t.Helper()
	csr := &certv1.CertificateSigningRequest{Spec: certv1.CertificateSigningRequestSpec{
		SignerName: signer, Username: user, Usages: usages,
		Request: csrPEM(t, key, tmpl),
	}}
	if node != "" {
		csr.Spec.Extra = map[string]certv1.ExtraValue{NodeNameExtra: {node}}
	}
	return csr
}

func TestSignerCheck(t *testing.T) {
	s := NewSigner(SignerConfig{NodeUser: nodeUser, StorageUser: storageUser})
	p256 := mustECDSA(t, elliptic.P256())
	cn := func(name string) *x509.CertificateRequest {
		return &x509.CertificateRequest{Subject: pkix.Name{CommonName: name}}
	}
	client := []certv1.KeyUsage{certv1.UsageDigitalSignature, certv1.UsageClientAuth}
	server := []certv1.KeyUsage{certv1.UsageDigitalSignature, certv1.UsageKeyEncipherment, certv1.UsageServerAuth}

	t.Run("accepted", func(t *testing.T) {
		_, edKey, _ := ed25519.GenerateKey(rand.Reader)
		for _, tc := range []struct {
			name string
			csr  *certv1.CertificateSigningRequest
			kind Kind
		}{
			{"node, P-256", request(t, SignerNode, nodeUser, "node-a", p256, cn("mpnbd-node:node-a"), client...), Node},
			{"node, Ed25519", request(t, SignerNode, nodeUser, "node-a", edKey, cn("mpnbd-node:node-a"), client...), Node},
			{"storage, P-384", request(t, SignerStorage, storageUser, "store-1.example", mustECDSA(t, elliptic.P384()), cn("mpnbd-storage:store-1.example"), server...), Storage},
			{"storage, server and client", request(t, SignerStorage, storageUser, "store-1", p256, cn("mpnbd-storage:store-1"), append(server, certv1.UsageClientAuth)...), Storage},
		} {
			k, node, req, err := s.Check(tc.csr)
			if err != nil || k != tc.kind || req == nil || !strings.HasSuffix(req.Subject.CommonName, node) {
				t.Errorf("%s: kind %v, node %q, %v", tc.name, k, node, err)
			}
		}
	})

	rsa1024, err := rsa.GenerateKey(rand.Reader, 1024)
	if err != nil {
		t.Fatal(err)
	}
	withSAN := cn("mpnbd-node:node-a")
	withSAN.IPAddresses = []net.IP{net.IPv4(10, 0, 0, 1)}
	withOrg := &x509.CertificateRequest{Subject: pkix.Name{CommonName: "mpnbd-node:node-a", Organization: []string{"system:masters"}}}
	garbled := request(t, SignerNode, nodeUser, "node-a", p256, cn("mpnbd-node:node-a"), client...)
	garbled.Spec.Request = []byte("-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n")
	twoBlocks := request(t, SignerNode, nodeUser, "node-a", p256, cn("mpnbd-node:node-a"), client...)
	twoBlocks.Spec.Request = append(twoBlocks.Spec.Request, twoBlocks.Spec.Request...)
	badSig := request(t, SignerNode, nodeUser, "node-a", p256, cn("mpnbd-node:node-a"), client...)
	{
		b, _ := pem.Decode(badSig.Spec.Request)
		b.Bytes[len(b.Bytes)-3] ^= 0xff
		badSig.Spec.Request = pem.EncodeToMemory(b)
	}
	for _, tc := range []struct {
		name string
		csr  *certv1.CertificateSigningRequest
		want string
	}{
		{"another signer", request(t, "kubernetes.io/kube-apiserver-client", nodeUser, "node-a", p256, cn("mpnbd-node:node-a"), client...), "not ours"},
		{"another node's name", request(t, SignerNode, nodeUser, "node-a", p256, cn("mpnbd-node:node-b"), client...), "may ask only for CN=mpnbd-node:node-a"},
		{"storage name from the node plugin", request(t, SignerNode, nodeUser, "node-a", p256, cn("mpnbd-storage:node-a"), client...), "may ask only for CN=mpnbd-node:node-a"},
		{"node plugin asks the storage signer", request(t, SignerStorage, nodeUser, "node-a", p256, cn("mpnbd-storage:node-a"), server...), "only \"" + storageUser + "\""},
		{"storage agent asks the node signer", request(t, SignerNode, storageUser, "node-a", p256, cn("mpnbd-node:node-a"), client...), "only \"" + nodeUser + "\""},
		{"a user", request(t, SignerNode, "alice", "node-a", p256, cn("mpnbd-node:node-a"), client...), "requested by \"alice\""},
		{"token not bound to a node", request(t, SignerNode, nodeUser, "", p256, cn("mpnbd-node:node-a"), client...), "not bound to a pod"},
		{"bad node name", request(t, SignerNode, nodeUser, "Node_A", p256, cn("mpnbd-node:Node_A"), client...), "node name"},
		{"subject alternative names", request(t, SignerNode, nodeUser, "node-a", p256, withSAN, client...), "alternative names"},
		{"organization", request(t, SignerNode, nodeUser, "node-a", p256, withOrg, client...), "subject is"},
		{"server usage for a node", request(t, SignerNode, nodeUser, "node-a", p256, cn("mpnbd-node:node-a"), server...), "server auth"},
		{"client usage alone for a storage node", request(t, SignerStorage, storageUser, "store-1", p256, cn("mpnbd-storage:store-1"), client...), "does not ask for"},
		{"no client usage", request(t, SignerNode, nodeUser, "node-a", p256, cn("mpnbd-node:node-a"), certv1.UsageDigitalSignature), "does not ask for"},
		{"signing usage", request(t, SignerNode, nodeUser, "node-a", p256, cn("mpnbd-node:node-a"), certv1.UsageCertSign, certv1.UsageClientAuth), "cert sign"},
		{"small RSA key", request(t, SignerNode, nodeUser, "node-a", rsa1024, cn("mpnbd-node:node-a"), client...), "1024 bits"},
		{"P-224", request(t, SignerNode, nodeUser, "node-a", mustECDSA(t, elliptic.P224()), cn("mpnbd-node:node-a"), client...), "P-224"},
		{"garbled", garbled, "the request"},
		{"two blocks", twoBlocks, "one PEM"},
		{"bad signature", badSig, "signature"},
	} {
		_, _, _, err := s.Check(tc.csr)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want one containing %q", tc.name, err, tc.want)
		}
	}
}

func TestIssueAndVerify(t *testing.T) {
	now := time.Now().Truncate(time.Second) // certificates hold whole seconds
	ca, err := NewCA(now)
	if err != nil {
		t.Fatal(err)
	}
	other, err := NewCA(now)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca.Cert)
	key := mustECDSA(t, elliptic.P256())
	req := &x509.CertificateRequest{PublicKey: key.Public()}
	issue := func(ca *CA, k Kind, node string, life time.Duration) *x509.Certificate {
		t.Helper()
		p, err := ca.Issue(k, node, req, life, now)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := pem.Decode(p)
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	nodeCert := issue(ca, Node, "node-a", time.Hour)
	if got, err := Verify(Node, roots, []*x509.Certificate{nodeCert}); err != nil || got != "node-a" {
		t.Errorf("node certificate: %q, %v", got, err)
	}
	if life := nodeCert.NotAfter.Sub(now); life != time.Hour {
		t.Errorf("lifetime %v, want 1h", life)
	}
	if _, err := Verify(Storage, roots, []*x509.Certificate{nodeCert}); err == nil {
		t.Error("a node certificate passed as a storage one")
	}
	storageCert := issue(ca, Storage, "store-1", time.Hour)
	if got, err := Verify(Storage, roots, []*x509.Certificate{storageCert}); err != nil || got != "store-1" {
		t.Errorf("storage certificate: %q, %v", got, err)
	}
	if _, err := Verify(Node, roots, []*x509.Certificate{storageCert}); err == nil {
		t.Error("a storage certificate passed as a node one")
	}
	// A storage node's certificate is also its agent's as a client of
	// the other replicas' agents; a node's is not a storage client's.
	if got, err := VerifyStorageClient(roots, []*x509.Certificate{storageCert}); err != nil || got != "store-1" {
		t.Errorf("storage certificate as a client: %q, %v", got, err)
	}
	if _, err := VerifyStorageClient(roots, []*x509.Certificate{nodeCert}); err == nil {
		t.Error("a node certificate passed as a storage client's")
	}
	serverOnly := issue(ca, Storage, "store-1", time.Hour)
	{
		// As issued before storage certificates were clients' too.
		tmpl := *serverOnly
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		der, err := x509.CreateCertificate(rand.Reader, &tmpl, ca.Cert, key.Public(), ca.Key)
		if err != nil {
			t.Fatal(err)
		}
		if serverOnly, err = x509.ParseCertificate(der); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := Verify(Storage, roots, []*x509.Certificate{serverOnly}); err != nil {
		t.Errorf("a server-only storage certificate: %v", err)
	}
	if _, err := VerifyStorageClient(roots, []*x509.Certificate{serverOnly}); err == nil {
		t.Error("a server-only storage certificate passed as a client's")
	}
	if _, err := Verify(Node, roots, []*x509.Certificate{issue(other, Node, "node-a", time.Hour)}); err == nil {
		t.Error("a certificate of another CA passed")
	}
	if _, err := Verify(Node, nil, []*x509.Certificate{nodeCert}); err == nil {
		t.Error("passed with no CA")
	}
	if _, err := Verify(Node, roots, nil); err == nil {
		t.Error("passed with no certificate")
	}
	if c := issue(ca, Node, "node-a", time.Second); c.NotAfter.Sub(now) != MinLifetime {
		t.Errorf("a 1 s lifetime gave %v, want the minimum %v", c.NotAfter.Sub(now), MinLifetime)
	}
	if c := issue(ca, Node, "node-a", 365*24*time.Hour); c.NotAfter.Sub(now) != MaxLifetime {
		t.Errorf("a year's lifetime gave %v, want the maximum %v", c.NotAfter.Sub(now), MaxLifetime)
	}
	// The CA and its key round-trip through PEM, as in its Secret.
	keyDER, err := x509.MarshalPKCS8PrivateKey(ca.Key)
	if err != nil {
		t.Fatal(err)
	}
	back, err := parseCA(ca.PEM, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}))
	if err != nil || !back.Cert.Equal(ca.Cert) {
		t.Fatalf("the CA read back: %v", err)
	}
	if _, err := parseCA(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: nodeCert.Raw}), pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: mustPKCS8(t, key)})); err == nil {
		t.Error("a leaf certificate was taken for a CA")
	}
}

func mustPKCS8(t *testing.T, key any) []byte {
	t.Helper()
	b, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// FuzzSignerCheck: a request's bytes come from whoever may create
// CertificateSigningRequests; Check never panics on them, and anything it
// accepts is a request of our kind for the requester's node, signed by
// its key.
func FuzzSignerCheck(f *testing.F) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		f.Fatal(err)
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{Subject: pkix.Name{CommonName: "mpnbd-node:node-a"}}, key)
	if err != nil {
		f.Fatal(err)
	}
	good := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der})
	f.Add(good, "node-a")
	f.Add(append(append([]byte{}, good...), good...), "node-a")
	f.Add([]byte("-----BEGIN CERTIFICATE REQUEST-----\nMA==\n-----END CERTIFICATE REQUEST-----\n"), "node-a")
	f.Add(der, "node-b")
	s := NewSigner(SignerConfig{NodeUser: nodeUser, StorageUser: storageUser})
	f.Fuzz(func(t *testing.T, req []byte, node string) {
		csr := &certv1.CertificateSigningRequest{Spec: certv1.CertificateSigningRequestSpec{
			SignerName: SignerNode, Username: nodeUser, Request: req,
			Usages: []certv1.KeyUsage{certv1.UsageDigitalSignature, certv1.UsageClientAuth},
			Extra:  map[string]certv1.ExtraValue{NodeNameExtra: {node}},
		}}
		k, got, parsed, err := s.Check(csr)
		if err != nil {
			return
		}
		if k != Node || got != node || parsed == nil || parsed.Subject.CommonName != CommonName(Node, node) || parsed.CheckSignature() != nil {
			t.Fatalf("accepted %q for node %q: kind %v, node %q", req, node, k, got)
		}
	})
}
