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
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"math"
	mrand "math/rand/v2"
	"os"
	"path/filepath"
	"sync/atomic"
	"time"

	certv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/internal/backoff"
)

// IdentityConfig configures a component's certificate.
type IdentityConfig struct {
	Client client.Client
	Kind   Kind
	// NodeName is the node the component runs on, the one its token is
	// bound to.
	NodeName string
	// Namespace holds the CA bundle.
	Namespace string
	// Dir keeps the key and certificate across restarts (a 0600 file,
	// node.pem or storage.pem) and the CA bundle (BundleFile); "" keeps
	// them in memory only.
	Dir string
	// Lifetime is asked for each certificate (default DefaultLifetime).
	Lifetime time.Duration
	// BundleRefresh is how often the CA bundle is read again (default 5
	// minutes).
	BundleRefresh time.Duration
	Logger        *slog.Logger
}

// BundleFile is the CA bundle's file in IdentityConfig.Dir.
const BundleFile = "ca.pem"

// Identity is a component's certificate, kept valid: Start gets one and
// renews it in the background; every TLS handshake takes the current one.
type Identity struct {
	cfg   IdentityConfig
	log   *slog.Logger
	cert  atomic.Pointer[tls.Certificate]
	roots atomic.Pointer[x509.CertPool]
	// renewals counts certificates obtained through a request.
	renewals atomic.Int64
}

// NewIdentity returns an identity with no certificate yet.
func NewIdentity(cfg IdentityConfig) (*Identity, error) {
	if err := ValidNodeName(cfg.NodeName); err != nil {
		return nil, err
	}
	if cfg.Lifetime <= 0 {
		cfg.Lifetime = DefaultLifetime
	}
	cfg.Lifetime = clampLifetime(cfg.Lifetime)
	if cfg.BundleRefresh <= 0 {
		cfg.BundleRefresh = 5 * time.Minute
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Identity{cfg: cfg, log: log.With("identity", CommonName(cfg.Kind, cfg.NodeName))}, nil
}

// Certificate is the current certificate, nil before Start succeeded.
func (id *Identity) Certificate() *tls.Certificate { return id.cert.Load() }

// Roots is the current CA bundle, nil before Start succeeded.
func (id *Identity) Roots() *x509.CertPool { return id.roots.Load() }

// Requested is how many certificates were obtained through requests.
func (id *Identity) Requested() int64 { return id.renewals.Load() }

// Start reads the CA bundle and gets a certificate: the one kept in Dir
// while it is not due for renewal, else a new one through a request (a
// kept one still valid is used if the request fails). It returns once
// there is a certificate, or with the error when within (0: no bound)
// passes first, and keeps both fresh in the background until ctx ends.
func (id *Identity) Start(ctx context.Context, within time.Duration) error {
	life := ctx
	if within > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, within)
		defer cancel()
	}
	for wait := time.Second; ; wait = min(2*wait, time.Minute) {
		err := id.readBundle(ctx)
		if err == nil {
			break
		}
		id.log.Warn("reading the CA bundle", "error", err, "retry_in", wait)
		if backoff.Sleep(ctx, wait) != nil {
			return fmt.Errorf("the CA bundle: %w", err)
		}
	}
	if kept, err := id.load(); err != nil {
		id.log.Warn("the kept certificate is not usable; asking for a new one", "error", err)
	} else if kept != nil {
		id.cert.Store(kept)
		id.log.Info("certificate read from the state directory", "expires", kept.Leaf.NotAfter)
	}
	pause := backoff.New(time.Second, renewBackoffMax)
	for {
		cur := id.cert.Load()
		if cur != nil && time.Now().Before(renewAt(cur.Leaf)) {
			break
		}
		err := id.renew(ctx)
		if err == nil {
			break
		}
		if cur != nil && time.Now().Before(cur.Leaf.NotAfter) {
			id.log.Warn("renewing the certificate failed; the current one is used meanwhile", "error", err, "expires", cur.Leaf.NotAfter)
			break
		}
		id.log.Warn("getting a certificate", "error", err)
		if pause.Wait(ctx) != nil {
			return fmt.Errorf("getting a %s certificate: %w", id.cfg.Kind, err)
		}
	}
	go id.keepFresh(life)
	return nil
}

// renewBackoffMax caps the pause between a certificate's requests: a
// cluster that denies them (one older than 1.30, whose tokens name no
// node) gets one every 5 minutes.
const renewBackoffMax = 5 * time.Minute

// renewAt is when a certificate is renewed: two thirds into its life.
func renewAt(c *x509.Certificate) time.Time {
	life := c.NotAfter.Sub(c.NotBefore)
	return c.NotBefore.Add(life * 2 / 3)
}

// keepFresh renews the certificate when due (with up to 5 % of its life
// earlier, so that a fleet does not renew at once), retrying with backoff
// while it fails, and reads the bundle every BundleRefresh.
func (id *Identity) keepFresh(ctx context.Context) {
	bundle := time.NewTicker(id.cfg.BundleRefresh)
	defer bundle.Stop()
	pause := backoff.New(time.Second, renewBackoffMax)
	var retryAt time.Time
	for ctx.Err() == nil {
		leaf := id.cert.Load().Leaf
		due := renewAt(leaf).Add(-time.Duration(mrand.Float64() * 0.05 * float64(leaf.NotAfter.Sub(leaf.NotBefore))))
		if retryAt.After(due) {
			due = retryAt
		}
		t := time.NewTimer(time.Until(due))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-bundle.C:
			t.Stop()
			if err := id.readBundle(ctx); err != nil {
				id.log.Warn("reading the CA bundle", "error", err)
			}
		case <-t.C:
			if err := id.renew(ctx); err != nil {
				wait := pause.Next()
				id.log.Warn("renewing the certificate", "error", err, "retry_in", wait, "expires", leaf.NotAfter)
				retryAt = time.Now().Add(wait)
				continue
			}
			retryAt = time.Time{}
			pause.Reset()
		}
	}
}

// readBundle reads the CA certificates from the bundle ConfigMap.
func (id *Identity) readBundle(ctx context.Context) error {
	var cm corev1.ConfigMap
	if err := id.cfg.Client.Get(ctx, client.ObjectKey{Namespace: id.cfg.Namespace, Name: BundleConfigMap}, &cm); err != nil {
		return fmt.Errorf("configmap %s/%s: %w", id.cfg.Namespace, BundleConfigMap, err)
	}
	bundle := []byte(cm.Data[BundleKey])
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(bundle) {
		return fmt.Errorf("configmap %s/%s holds no CA certificate under %s", id.cfg.Namespace, BundleConfigMap, BundleKey)
	}
	if id.cfg.Dir != "" {
		// For the processes that dial without API access (the data path).
		f := filepath.Join(id.cfg.Dir, BundleFile)
		if old, err := os.ReadFile(f); err != nil || !bytes.Equal(old, bundle) {
			if err := writeFileAtomic(f, bundle); err != nil {
				return fmt.Errorf("keeping the CA bundle: %w", err)
			}
		}
	}
	id.roots.Store(pool)
	return nil
}

func (id *Identity) file() string {
	if id.cfg.Dir == "" {
		return ""
	}
	name := "node.pem"
	if id.cfg.Kind == Storage {
		name = "storage.pem"
	}
	return filepath.Join(id.cfg.Dir, name)
}

// load reads the kept certificate: nil when there is none, an error when
// it is unusable (another node's, expired, not of our CA).
func (id *Identity) load() (*tls.Certificate, error) {
	f := id.file()
	if f == "" {
		return nil, nil
	}
	b, err := os.ReadFile(f)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	} else if err != nil {
		return nil, err
	}
	cert, err := tls.X509KeyPair(b, b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", f, err)
	}
	if err := id.check(&cert); err != nil {
		return nil, fmt.Errorf("%s: %w", f, err)
	}
	return &cert, nil
}

// check makes sure cert is ours: our kind and node, of the CA, valid now.
func (id *Identity) check(cert *tls.Certificate) error {
	node, err := Verify(id.cfg.Kind, id.roots.Load(), []*x509.Certificate{cert.Leaf})
	if err != nil {
		return err
	}
	if node != id.cfg.NodeName {
		return fmt.Errorf("the certificate names node %s, this is %s", node, id.cfg.NodeName)
	}
	return nil
}

// renew asks for a new certificate with a new key, waits (at most two
// minutes) for the controller to issue it, keeps it and makes it current.
func (id *Identity) renew(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		Subject: pkix.Name{CommonName: CommonName(id.cfg.Kind, id.cfg.NodeName)},
	}, key)
	if err != nil {
		return err
	}
	usages := []certv1.KeyUsage{certv1.UsageDigitalSignature, certv1.UsageClientAuth}
	if id.cfg.Kind == Storage {
		usages = append(usages, certv1.UsageServerAuth)
	}
	secs := int32(math.Min(id.cfg.Lifetime.Seconds(), math.MaxInt32))
	csr := &certv1.CertificateSigningRequest{
		ObjectMeta: metav1.ObjectMeta{GenerateName: requestPrefix(id.cfg.Kind, id.cfg.NodeName)},
		Spec: certv1.CertificateSigningRequestSpec{
			Request:           pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der}),
			SignerName:        id.cfg.Kind.Signer(),
			Usages:            usages,
			ExpirationSeconds: &secs,
		},
	}
	if err := id.cfg.Client.Create(ctx, csr); err != nil {
		return fmt.Errorf("creating a certificate signing request: %w", err)
	}
	certPEM, err := id.await(ctx, csr.Name)
	if err != nil {
		return err
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return err
	}
	pair := append(append([]byte{}, certPEM...), pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})...)
	cert, err := tls.X509KeyPair(pair, pair)
	if err != nil {
		return fmt.Errorf("the issued certificate (%s): %w", csr.Name, err)
	}
	if err := id.check(&cert); err != nil {
		return fmt.Errorf("the issued certificate (%s): %w", csr.Name, err)
	}
	if f := id.file(); f != "" {
		if err := writeFileAtomic(f, pair); err != nil {
			// The certificate works; only a restart would ask again.
			id.log.Warn("keeping the certificate in the state directory", "error", err)
		}
	}
	id.cert.Store(&cert)
	id.renewals.Add(1)
	id.log.Info("certificate issued", "csr", csr.Name, "expires", cert.Leaf.NotAfter)
	return nil
}

// requestPrefix is the generateName of a request: readable in `kubectl
// get csr`, short enough for any node name.
func requestPrefix(k Kind, node string) string {
	p := "mpnbd-node-"
	if k == Storage {
		p = "mpnbd-storage-"
	}
	if len(node) > 200 {
		node = node[:200]
	}
	return p + node + "-"
}

// await polls the request until it holds a certificate or is refused.
func (id *Identity) await(ctx context.Context, name string) ([]byte, error) {
	wait := 100 * time.Millisecond
	for {
		var csr certv1.CertificateSigningRequest
		err := id.cfg.Client.Get(ctx, client.ObjectKey{Name: name}, &csr)
		switch {
		case err != nil:
			id.log.Debug("reading the certificate signing request", "csr", name, "error", err)
		case len(csr.Status.Certificate) > 0:
			return csr.Status.Certificate, nil
		default:
			for _, c := range csr.Status.Conditions {
				if (c.Type == certv1.CertificateDenied || c.Type == certv1.CertificateFailed) && c.Status == corev1.ConditionTrue {
					return nil, fmt.Errorf("certificate signing request %s %s: %s", name, c.Type, c.Message)
				}
			}
		}
		if backoff.Sleep(ctx, wait) != nil {
			return nil, fmt.Errorf("certificate signing request %s: no certificate issued: %w", name, ctx.Err())
		}
		wait = min(2*wait, 2*time.Second)
	}
}

// writeFileAtomic writes b to path (0600) so that a crash leaves the old
// file or the new one.
func writeFileAtomic(path string, b []byte) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer os.Remove(tmp)
	if _, err := f.Write(b); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// ClientConfig is the TLS configuration a node plugin, or a storage
// agent forwarding to another replica, dials storageNode with (ClientTLS
// with the current certificate and CA bundle).
func (id *Identity) ClientConfig(storageNode string) *tls.Config {
	return ClientTLS(storageNode, id.current, id.roots.Load)
}

// ServerConfig is the TLS configuration a storage agent serves with
// (ServerTLS with the current certificate and CA bundle).
func (id *Identity) ServerConfig() *tls.Config {
	return ServerTLS(id.current, id.roots.Load)
}

// ClientTLS is a node's TLS configuration for dialling storageNode: TLS
// 1.3, the certificate cert returns at each handshake, and the server's
// certificate checked to be storageNode's storage certificate of the CA
// roots returns.
func ClientTLS(storageNode string, cert func() (*tls.Certificate, error), roots func() *x509.CertPool) *tls.Config {
	return &tls.Config{
		// 1.3 only: the storage agent is the driver's too, and under 1.2
		// the node certificate would cross the network in the clear.
		MinVersion: tls.VersionTLS13,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			return cert()
		},
		// The chain and the name are checked in VerifyConnection: the
		// certificate names a node, not a host.
		InsecureSkipVerify: true,
		VerifyConnection: func(cs tls.ConnectionState) error {
			node, err := Verify(Storage, roots(), cs.PeerCertificates)
			if err != nil {
				return fmt.Errorf("the storage server's certificate: %w", err)
			}
			if node != storageNode {
				return fmt.Errorf("the storage server is %s, not %s", node, storageNode)
			}
			return nil
		},
	}
}

// ServerTLS is a storage agent's TLS configuration: TLS 1.3, the
// certificate cert returns at each handshake, and a certificate of the
// CA roots returns required of every client: a node's, or a storage
// node's forwarding a replicated volume's changes (which node it names,
// and which kind, is for the caller to match, with PeerNode or
// PeerStorageNode).
func ServerTLS(cert func() (*tls.Certificate, error), roots func() *x509.CertPool) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			return cert()
		},
		// The chain is checked in VerifyConnection, not by ClientCAs, so
		// the request names no CA (see nbd.ServerTLS for the GnuTLS
		// clients this keeps working).
		ClientAuth: tls.RequireAnyClientCert,
		VerifyConnection: func(cs tls.ConnectionState) error {
			_, err := Verify(Node, roots(), cs.PeerCertificates)
			if err == nil {
				return nil
			}
			if _, serr := VerifyStorageClient(roots(), cs.PeerCertificates); serr == nil {
				return nil
			}
			return fmt.Errorf("the client's certificate: %w", err)
		},
	}
}

func (id *Identity) current() (*tls.Certificate, error) {
	c := id.cert.Load()
	if c == nil {
		return nil, errors.New("no certificate yet")
	}
	return c, nil
}

// PeerNode is the node a verified TLS client's certificate names ("" and
// an error when the connection has none of ours).
func PeerNode(cs *tls.ConnectionState, roots *x509.CertPool) (string, error) {
	if cs == nil {
		return "", errors.New("not a TLS connection")
	}
	return Verify(Node, roots, cs.PeerCertificates)
}

// PeerStorageNode is the storage node a verified TLS client's certificate
// names: another storage agent forwarding to this one ("" and an error
// when the connection has no storage certificate of ours).
func PeerStorageNode(cs *tls.ConnectionState, roots *x509.CertPool) (string, error) {
	if cs == nil {
		return "", errors.New("not a TLS connection")
	}
	return VerifyStorageClient(roots, cs.PeerCertificates)
}
