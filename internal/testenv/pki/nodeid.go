package pki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
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
