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

package pki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"os"
	"path/filepath"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nodeid"
)

// NodeIDPEM is a certificate of kind k naming node, issued by ca for a
// day (as the controller's signer would, without the API), and its new
// key: PEM, as nodeid.Identity keeps it in its directory.
func NodeIDPEM(ca *nodeid.CA, k nodeid.Kind, node string) ([]byte, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	certPEM, err := ca.Issue(k, node, &x509.CertificateRequest{PublicKey: key.Public()}, 24*time.Hour, time.Now())
	if err != nil {
		return nil, err
	}
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, err
	}
	return append(certPEM, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der})...), nil
}

// NodeIDCert is NodeIDPEM as a TLS certificate.
func NodeIDCert(ca *nodeid.CA, k nodeid.Kind, node string) (*tls.Certificate, error) {
	b, err := NodeIDPEM(ca, k, node)
	if err != nil {
		return nil, err
	}
	c, err := tls.X509KeyPair(b, b)
	if err != nil {
		return nil, err
	}
	return &c, nil
}

// NodeIDFiles are the files of a storage server and a node of one test CA:
// the server's storage certificate and key (ServerPEM), the CA's
// certificate it checks clients with (CAPEM), and a node's identity
// directory (node.pem and the CA bundle, as nodeid.Identity keeps them).
type NodeIDFiles struct {
	ServerPEM, CAPEM, IdentityDir string
}

// WriteNodeIDFiles makes a CA and writes its NodeIDFiles: ServerPEM and
// CAPEM into dir, the identity of node into identityDir; the server's
// certificate names storageNode.
func WriteNodeIDFiles(dir, identityDir, storageNode, node string) (*NodeIDFiles, error) {
	ca, err := nodeid.NewCA(time.Now())
	if err != nil {
		return nil, err
	}
	server, err := NodeIDPEM(ca, nodeid.Storage, storageNode)
	if err != nil {
		return nil, err
	}
	client, err := NodeIDPEM(ca, nodeid.Node, node)
	if err != nil {
		return nil, err
	}
	f := &NodeIDFiles{ServerPEM: filepath.Join(dir, "server.pem"), CAPEM: filepath.Join(dir, "ca.pem"), IdentityDir: identityDir}
	for name, b := range map[string][]byte{
		f.ServerPEM: server, f.CAPEM: ca.PEM,
		filepath.Join(identityDir, "node.pem"): client, filepath.Join(identityDir, nodeid.BundleFile): ca.PEM,
	} {
		if err := os.WriteFile(name, b, 0o600); err != nil {
			return nil, err
		}
	}
	return f, nil
}
