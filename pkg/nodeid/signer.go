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
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"time"

	certv1 "k8s.io/api/certificates/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/internal/backoff"
)

// DefaultLifetime is a certificate's lifetime when the request names none.
const DefaultLifetime = 24 * time.Hour

// SignerConfig configures the controller's signer.
type SignerConfig struct {
	Client client.WithWatch
	CA     *CA
	// NodeUser and StorageUser are the user names the API server gives
	// the node plugin's and the storage agent's ServiceAccounts
	// (system:serviceaccount:NAMESPACE:NAME): only they get certificates.
	NodeUser, StorageUser string
	Logger                *slog.Logger
	// Resync is how often every request is looked at again without an
	// event (default 1 minute).
	Resync time.Duration
}

// Signer approves and signs, or denies, the requests for SignerNode and
// SignerStorage certificates.
type Signer struct {
	cfg SignerConfig
	log *slog.Logger
}

// NewSigner returns a signer; Run runs it.
func NewSigner(cfg SignerConfig) *Signer {
	if cfg.Resync <= 0 {
		cfg.Resync = time.Minute
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Signer{cfg: cfg, log: log}
}

// Check says whether the request may have its certificate: it returns
// the kind and node the certificate will name, or why not. It looks at
// who asked (the ServiceAccount and the node its token is bound to) and
// at what is asked (one common name, no other names, the kind's usage, a
// key of a sound type and size).
func (s *Signer) Check(csr *certv1.CertificateSigningRequest) (Kind, string, *x509.CertificateRequest, error) {
	k, ok := KindOfSigner(csr.Spec.SignerName)
	if !ok {
		return 0, "", nil, fmt.Errorf("signer %q is not ours", csr.Spec.SignerName)
	}
	user := s.cfg.NodeUser
	if k == Storage {
		user = s.cfg.StorageUser
	}
	if user == "" || csr.Spec.Username != user {
		return 0, "", nil, fmt.Errorf("requested by %q; only %q may ask for %s certificates", csr.Spec.Username, user, k)
	}
	nodes := csr.Spec.Extra[NodeNameExtra]
	if len(nodes) != 1 {
		return 0, "", nil, fmt.Errorf("the requester's token is not bound to a pod on a node (no %s)", NodeNameExtra)
	}
	node := nodes[0]
	if err := ValidNodeName(node); err != nil {
		return 0, "", nil, err
	}
	block, rest := pem.Decode(csr.Spec.Request)
	if block == nil || block.Type != "CERTIFICATE REQUEST" || len(bytes.TrimSpace(rest)) > 0 {
		return 0, "", nil, errors.New("the request is not one PEM CERTIFICATE REQUEST")
	}
	req, err := x509.ParseCertificateRequest(block.Bytes)
	if err != nil {
		return 0, "", nil, fmt.Errorf("the request: %w", err)
	}
	if err := req.CheckSignature(); err != nil {
		return 0, "", nil, fmt.Errorf("the request's signature: %w", err)
	}
	if want := CommonName(k, node); req.Subject.CommonName != want || len(req.Subject.Names) != 1 {
		return 0, "", nil, fmt.Errorf("the request's subject is %q; a pod on node %s may ask only for CN=%s", req.Subject.String(), node, want)
	}
	if len(req.DNSNames)+len(req.IPAddresses)+len(req.EmailAddresses)+len(req.URIs) > 0 {
		return 0, "", nil, errors.New("the request asks for subject alternative names; none are issued")
	}
	if err := soundKey(req.PublicKey); err != nil {
		return 0, "", nil, err
	}
	want := certv1.UsageClientAuth
	allowed := []certv1.KeyUsage{certv1.UsageDigitalSignature, certv1.UsageKeyEncipherment, want}
	if k == Storage {
		// A storage node's certificate is its server's, and its
		// agent's as a client of the other replicas' agents.
		want = certv1.UsageServerAuth
		allowed = append(allowed, want)
	}
	for _, u := range csr.Spec.Usages {
		if !slices.Contains(allowed, u) {
			return 0, "", nil, fmt.Errorf("usage %q is not issued for %s certificates", u, k)
		}
	}
	if !slices.Contains(csr.Spec.Usages, want) {
		return 0, "", nil, fmt.Errorf("a %s certificate is for %q, which the request does not ask for", k, want)
	}
	return k, node, req, nil
}

func soundKey(pub any) error {
	switch k := pub.(type) {
	case *ecdsa.PublicKey:
		if k.Curve == elliptic.P256() || k.Curve == elliptic.P384() {
			return nil
		}
		return fmt.Errorf("ECDSA curve %s is not accepted (P-256 or P-384)", k.Curve.Params().Name)
	case ed25519.PublicKey:
		return nil
	case *rsa.PublicKey:
		if k.N.BitLen() >= 2048 {
			return nil
		}
		return fmt.Errorf("an RSA key of %d bits is too small (2048 or more)", k.N.BitLen())
	}
	return fmt.Errorf("a %T key is not accepted", pub)
}

// Run handles every request of our signers, now and as they come, until
// ctx ends.
func (s *Signer) Run(ctx context.Context) error {
	for ctx.Err() == nil {
		rv, err := s.handleAll(ctx)
		if err != nil {
			s.log.Warn("listing certificate signing requests", "error", err)
			_ = backoff.Sleep(ctx, 5*time.Second)
			continue
		}
		s.watch(ctx, rv)
	}
	return nil
}

// handleAll handles every request and returns the list's version.
func (s *Signer) handleAll(ctx context.Context) (string, error) {
	var l certv1.CertificateSigningRequestList
	if err := s.cfg.Client.List(ctx, &l); err != nil {
		return "", err
	}
	for i := range l.Items {
		s.Handle(ctx, &l.Items[i])
	}
	return l.ResourceVersion, nil
}

// watch handles requests as they change, until the watch ends, ctx ends
// or Resync passes.
func (s *Signer) watch(ctx context.Context, rv string) {
	wctx, cancel := context.WithTimeout(ctx, s.cfg.Resync)
	defer cancel()
	w, err := s.cfg.Client.Watch(wctx, &certv1.CertificateSigningRequestList{}, &client.ListOptions{Raw: &metav1.ListOptions{ResourceVersion: rv}})
	if err != nil {
		s.log.Warn("watching certificate signing requests", "error", err)
		_ = backoff.Sleep(wctx, 5*time.Second)
		return
	}
	defer w.Stop()
	for {
		select {
		case <-wctx.Done():
			return
		case ev, ok := <-w.ResultChan():
			if !ok {
				return
			}
			if ev.Type != watch.Added && ev.Type != watch.Modified {
				continue
			}
			if csr, ok := ev.Object.(*certv1.CertificateSigningRequest); ok {
				s.Handle(ctx, csr)
			}
		}
	}
}

func hasCondition(csr *certv1.CertificateSigningRequest, t certv1.RequestConditionType) bool {
	return slices.ContainsFunc(csr.Status.Conditions, func(c certv1.CertificateSigningRequestCondition) bool {
		return c.Type == t && c.Status == corev1.ConditionTrue
	})
}

// Handle approves and signs, or denies, one request, if it is for one of
// our signers and not decided yet; errors are logged (the next resync
// tries again).
func (s *Signer) Handle(ctx context.Context, csr *certv1.CertificateSigningRequest) {
	if _, ok := KindOfSigner(csr.Spec.SignerName); !ok {
		return
	}
	if hasCondition(csr, certv1.CertificateDenied) || hasCondition(csr, certv1.CertificateFailed) || len(csr.Status.Certificate) > 0 {
		return
	}
	log := s.log.With("csr", csr.Name, "signer", csr.Spec.SignerName, "requester", csr.Spec.Username)
	k, node, req, err := s.Check(csr)
	if err != nil {
		// An approval by someone else does not change what we sign.
		t := certv1.CertificateDenied
		if hasCondition(csr, certv1.CertificateApproved) {
			t = certv1.CertificateFailed
		}
		log.Warn("certificate request refused", "reason", err)
		csr.Status.Conditions = append(csr.Status.Conditions, certv1.CertificateSigningRequestCondition{
			Type: t, Status: corev1.ConditionTrue, Reason: "MpnbdRefused", Message: err.Error(),
			LastUpdateTime: metav1.Now(),
		})
		var uerr error
		if t == certv1.CertificateDenied {
			uerr = s.cfg.Client.SubResource("approval").Update(ctx, csr)
		} else {
			uerr = s.cfg.Client.Status().Update(ctx, csr)
		}
		if uerr != nil && !apierrors.IsNotFound(uerr) {
			log.Warn("writing the refusal", "error", uerr)
		}
		return
	}
	if !hasCondition(csr, certv1.CertificateApproved) {
		csr.Status.Conditions = append(csr.Status.Conditions, certv1.CertificateSigningRequestCondition{
			Type: certv1.CertificateApproved, Status: corev1.ConditionTrue, Reason: "MpnbdNodeMatches",
			Message:        fmt.Sprintf("requested from a pod on node %s by its %s component", node, k),
			LastUpdateTime: metav1.Now(),
		})
		if err := s.cfg.Client.SubResource("approval").Update(ctx, csr); err != nil {
			if !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
				log.Warn("approving", "error", err)
			}
			return
		}
	}
	lifetime := DefaultLifetime
	if e := csr.Spec.ExpirationSeconds; e != nil {
		lifetime = time.Duration(*e) * time.Second
	}
	certPEM, err := s.cfg.CA.Issue(k, node, req, lifetime, time.Now())
	if err != nil {
		log.Warn("signing", "error", err)
		return
	}
	csr.Status.Certificate = certPEM
	if err := s.cfg.Client.Status().Update(ctx, csr); err != nil {
		if !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			log.Warn("writing the certificate", "error", err)
		}
		return
	}
	log.Info("certificate issued", "kind", k.String(), "node", node, "lifetime", clampLifetime(lifetime))
}
