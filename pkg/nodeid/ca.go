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
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

const (
	// caLifetime is the CA's validity; certificates it issues are short.
	caLifetime = 10 * 365 * 24 * time.Hour
	// MinLifetime and MaxLifetime bound what a request may ask for
	// (MinLifetime is the API's own minimum for expirationSeconds).
	MinLifetime = 10 * time.Minute
	MaxLifetime = 7 * 24 * time.Hour
	// backdate covers clocks a little behind the controller's.
	backdate = 5 * time.Minute
)

// labels mark the CA's Secret and bundle as the driver's. They are not
// the Helm release's: an uninstall keeps the CA, so that a reinstall
// trusts the certificates nodes still hold.
var labels = map[string]string{"app.kubernetes.io/name": "mpnbd", "app.kubernetes.io/component": "controller"}

// CA issues the node and storage certificates.
type CA struct {
	Cert *x509.Certificate
	Key  crypto.Signer
	// PEM is Cert in PEM form, as published in the bundle.
	PEM []byte
}

// NewCA makes a self-signed CA with an ECDSA P-256 key.
func NewCA(now time.Time) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	serial, err := newSerial()
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: "mpnbd storage network CA"},
		NotBefore:             now.Add(-backdate),
		NotAfter:              now.Add(caLifetime),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &CA{Cert: cert, Key: key, PEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}, nil
}

// parseCA reads a CA from PEM certificate and key.
func parseCA(certPEM, keyPEM []byte) (*CA, error) {
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, err
	}
	cert := pair.Leaf
	if cert == nil {
		if cert, err = x509.ParseCertificate(pair.Certificate[0]); err != nil {
			return nil, err
		}
	}
	if !cert.IsCA {
		return nil, errors.New("the certificate is not a CA's")
	}
	key, ok := pair.PrivateKey.(crypto.Signer)
	if !ok {
		return nil, errors.New("the key cannot sign")
	}
	return &CA{Cert: cert, Key: key, PEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cert.Raw})}, nil
}

// LoadOrCreateCA reads the CA from the Secret CASecret of namespace,
// making it on first use (when two controllers race, the first write
// wins and both use it), and publishes its certificate in the ConfigMap
// BundleConfigMap.
func LoadOrCreateCA(ctx context.Context, c client.Client, namespace string) (*CA, error) {
	ca, err := loadOrCreateCA(ctx, c, namespace)
	if err != nil {
		return nil, err
	}
	if err := publishBundle(ctx, c, namespace, ca.PEM); err != nil {
		return nil, err
	}
	return ca, nil
}

func loadOrCreateCA(ctx context.Context, c client.Client, namespace string) (*CA, error) {
	var s corev1.Secret
	err := c.Get(ctx, client.ObjectKey{Namespace: namespace, Name: CASecret}, &s)
	switch {
	case err == nil:
		ca, err := parseCA(s.Data[corev1.TLSCertKey], s.Data[corev1.TLSPrivateKeyKey])
		if err != nil {
			return nil, fmt.Errorf("secret %s/%s: %w", namespace, CASecret, err)
		}
		return ca, nil
	case !apierrors.IsNotFound(err):
		return nil, fmt.Errorf("reading secret %s/%s: %w", namespace, CASecret, err)
	}
	ca, err := NewCA(time.Now())
	if err != nil {
		return nil, err
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(ca.Key)
	if err != nil {
		return nil, err
	}
	s = corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: CASecret, Labels: labels},
		Type:       corev1.SecretTypeTLS,
		Data: map[string][]byte{
			corev1.TLSCertKey:       ca.PEM,
			corev1.TLSPrivateKeyKey: pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}),
		},
	}
	if err := c.Create(ctx, &s); apierrors.IsAlreadyExists(err) {
		return loadOrCreateCA(ctx, c, namespace)
	} else if err != nil {
		return nil, fmt.Errorf("writing secret %s/%s: %w", namespace, CASecret, err)
	}
	return ca, nil
}

// publishBundle makes the ConfigMap hold exactly caPEM.
func publishBundle(ctx context.Context, c client.Client, namespace string, caPEM []byte) error {
	var cm corev1.ConfigMap
	err := c.Get(ctx, client.ObjectKey{Namespace: namespace, Name: BundleConfigMap}, &cm)
	switch {
	case apierrors.IsNotFound(err):
		cm = corev1.ConfigMap{
			ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: BundleConfigMap, Labels: labels},
			Data:       map[string]string{BundleKey: string(caPEM)},
		}
		if err := c.Create(ctx, &cm); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("writing configmap %s/%s: %w", namespace, BundleConfigMap, err)
		}
		return nil
	case err != nil:
		return fmt.Errorf("reading configmap %s/%s: %w", namespace, BundleConfigMap, err)
	case cm.Data[BundleKey] == string(caPEM):
		return nil
	}
	if cm.Data == nil {
		cm.Data = map[string]string{}
	}
	cm.Data[BundleKey] = string(caPEM)
	if err := c.Update(ctx, &cm); err != nil {
		return fmt.Errorf("updating configmap %s/%s: %w", namespace, BundleConfigMap, err)
	}
	return nil
}

// Issue signs a certificate of kind k for node with the request's public
// key, valid for lifetime (clamped to [MinLifetime, MaxLifetime] and to
// the CA's own validity). It returns the certificate in PEM form.
func (ca *CA) Issue(k Kind, node string, req *x509.CertificateRequest, lifetime time.Duration, now time.Time) ([]byte, error) {
	lifetime = clampLifetime(lifetime)
	serial, err := newSerial()
	if err != nil {
		return nil, err
	}
	notAfter := now.Add(lifetime)
	if notAfter.After(ca.Cert.NotAfter) {
		notAfter = ca.Cert.NotAfter
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: CommonName(k, node)},
		NotBefore:    now.Add(-backdate),
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  k.ExtKeyUsages(),
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, req.PublicKey, ca.Key)
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), nil
}

// clampLifetime is the lifetime a certificate asked to live d gets.
func clampLifetime(d time.Duration) time.Duration {
	return min(max(d, MinLifetime), MaxLifetime)
}

func newSerial() (*big.Int, error) {
	return rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
}
