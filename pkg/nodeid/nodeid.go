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

// Package nodeid gives each node plugin and each storage agent a
// certificate that names the Kubernetes node it runs on, issued through
// the CertificateSigningRequest API, so that the storage network can use
// mutual TLS instead of bearer tokens.
//
// The controller holds the CA (a Secret only it reads) and is the signer
// of two signer names: SignerNode for node plugins (client certificates)
// and SignerStorage for storage agents (server certificates). It approves
// a request only when it comes from the component's ServiceAccount and
// the API server vouches that the requesting pod runs on the node the
// certificate would name: the `authentication.kubernetes.io/node-name`
// extra of a bound ServiceAccount token (Kubernetes 1.30+). A component
// therefore gets a certificate for its own node and no other, and nothing
// a storage agent holds lets it pose as a node.
//
// The certificate names the node in its subject's common name only
// (CommonName): no DNS names or addresses, since peers check the name
// against a publication or a volume's storage node, not a host name.
// The CA's certificate is published in a ConfigMap every component may
// read (BundleConfigMap).
//
// Each component keeps its key and certificate in a file of its state
// directory (Identity), renews them when two thirds of the lifetime has
// passed, and hands the current one to every new TLS handshake.
package nodeid

import (
	"crypto/x509"
	"errors"
	"fmt"
	"strings"

	"k8s.io/apimachinery/pkg/util/validation"
)

// Kind is which component a certificate identifies.
type Kind int

const (
	// Node is a node plugin: a client of the storage network.
	Node Kind = iota
	// Storage is a storage agent: a server of the storage network.
	Storage
)

const (
	// SignerNode and SignerStorage are the signer names of the two kinds.
	SignerNode    = "mpnbd.io/node"
	SignerStorage = "mpnbd.io/storage-node"

	// NodeNameExtra is the user extra in which the API server names the
	// node of the pod a ServiceAccount token is bound to.
	NodeNameExtra = "authentication.kubernetes.io/node-name"

	// CASecret holds the CA (tls.crt, tls.key) in the driver's namespace;
	// BundleConfigMap holds its certificate (BundleKey).
	CASecret        = "mpnbd-ca"
	BundleConfigMap = "mpnbd-ca-bundle"
	BundleKey       = "ca.crt"
)

// String is the kind's name in logs and errors.
func (k Kind) String() string {
	if k == Storage {
		return "storage node"
	}
	return "node"
}

// Signer is the kind's signer name.
func (k Kind) Signer() string {
	if k == Storage {
		return SignerStorage
	}
	return SignerNode
}

// ExtKeyUsage is what a certificate of the kind is checked for in its
// role: a node's as a client, a storage node's as a server.
func (k Kind) ExtKeyUsage() x509.ExtKeyUsage {
	if k == Storage {
		return x509.ExtKeyUsageServerAuth
	}
	return x509.ExtKeyUsageClientAuth
}

// ExtKeyUsages is what a certificate of the kind is issued for: a
// storage node's is a client certificate too, with which its agent
// forwards a replicated volume's changes to the other replicas' agents
// (docs/replication.md).
func (k Kind) ExtKeyUsages() []x509.ExtKeyUsage {
	if k == Storage {
		return []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}
	}
	return []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
}

func (k Kind) prefix() string {
	if k == Storage {
		return "mpnbd-storage:"
	}
	return "mpnbd-node:"
}

// CommonName is the subject common name of the certificate of node.
func CommonName(k Kind, node string) string {
	return k.prefix() + node
}

// KindOfSigner returns the kind a signer name stands for.
func KindOfSigner(signer string) (Kind, bool) {
	switch signer {
	case SignerNode:
		return Node, true
	case SignerStorage:
		return Storage, true
	}
	return 0, false
}

// ValidNodeName reports why name cannot be a node's name, or nil.
func ValidNodeName(name string) error {
	if errs := validation.IsDNS1123Subdomain(name); len(errs) > 0 {
		return fmt.Errorf("node name %q: %s", name, strings.Join(errs, "; "))
	}
	return nil
}

// NodeOf returns the node a certificate of kind k names, checking only
// its name (Verify checks the chain).
func NodeOf(k Kind, cert *x509.Certificate) (string, error) {
	node, ok := strings.CutPrefix(cert.Subject.CommonName, k.prefix())
	if !ok {
		return "", fmt.Errorf("certificate %q is not a %s certificate", cert.Subject.CommonName, k)
	}
	if err := ValidNodeName(node); err != nil {
		return "", err
	}
	return node, nil
}

// Verify checks that chain (the peer's certificates, leaf first) is a
// certificate of kind k issued by a CA of roots, valid now for its role
// (ExtKeyUsage), and returns the node it names.
func Verify(k Kind, roots *x509.CertPool, chain []*x509.Certificate) (string, error) {
	return verify(k, k.ExtKeyUsage(), roots, chain)
}

// VerifyStorageClient checks that chain is a storage node's certificate
// of a CA of roots, valid now as a client's (a storage agent forwarding
// to another), and returns the storage node it names.
func VerifyStorageClient(roots *x509.CertPool, chain []*x509.Certificate) (string, error) {
	return verify(Storage, x509.ExtKeyUsageClientAuth, roots, chain)
}

func verify(k Kind, usage x509.ExtKeyUsage, roots *x509.CertPool, chain []*x509.Certificate) (string, error) {
	if len(chain) == 0 {
		return "", errors.New("no certificate")
	}
	if roots == nil {
		return "", errors.New("no CA to check the certificate against")
	}
	inter := x509.NewCertPool()
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	if _, err := chain[0].Verify(x509.VerifyOptions{
		Roots:         roots,
		Intermediates: inter,
		KeyUsages:     []x509.ExtKeyUsage{usage},
	}); err != nil {
		return "", err
	}
	return NodeOf(k, chain[0])
}
