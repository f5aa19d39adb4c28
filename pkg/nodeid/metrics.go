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
	"crypto/tls"
	"crypto/x509"
	"os"
	"path/filepath"

	"github.com/prometheus/client_golang/prometheus"
)

// CertCollector exposes the validity of the certificate leaf returns
// (nothing while it returns nil) as mpnbd_certificate_not_before_timestamp_seconds
// and mpnbd_certificate_not_after_timestamp_seconds, labelled with the
// kind (node or storage): a certificate past its renewal point (two thirds
// into its life) tells of renewals failing before it expires.
func CertCollector(kind Kind, leaf func() *x509.Certificate) prometheus.Collector {
	return &certCollector{kind: kindLabel(kind), leaf: leaf,
		notBefore: prometheus.NewDesc("mpnbd_certificate_not_before_timestamp_seconds",
			"Start of the validity of the certificate this component presents on the storage network (Unix time).", []string{"kind"}, nil),
		notAfter: prometheus.NewDesc("mpnbd_certificate_not_after_timestamp_seconds",
			"End of the validity of the certificate this component presents on the storage network (Unix time); it is renewed two thirds into its life.", []string{"kind"}, nil),
	}
}

// LeafFromDir returns the node certificate kept in dir (an Identity of
// kind Node with that Dir), read at each call; nil when there is none.
func LeafFromDir(dir string) func() *x509.Certificate {
	return func() *x509.Certificate {
		b, err := os.ReadFile(filepath.Join(dir, "node.pem"))
		if err != nil {
			return nil
		}
		c, err := tls.X509KeyPair(b, b)
		if err != nil {
			return nil
		}
		return c.Leaf
	}
}

// Leaf returns the identity's current certificate; nil before it has one.
func (id *Identity) Leaf() *x509.Certificate {
	if c := id.Certificate(); c != nil {
		return c.Leaf
	}
	return nil
}

func kindLabel(k Kind) string {
	if k == Storage {
		return "storage"
	}
	return "node"
}

type certCollector struct {
	kind                string
	leaf                func() *x509.Certificate
	notBefore, notAfter *prometheus.Desc
}

func (c *certCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.notBefore
	ch <- c.notAfter
}

func (c *certCollector) Collect(ch chan<- prometheus.Metric) {
	l := c.leaf()
	if l == nil {
		return
	}
	ch <- prometheus.MustNewConstMetric(c.notBefore, prometheus.GaugeValue, float64(l.NotBefore.Unix()), c.kind)
	ch <- prometheus.MustNewConstMetric(c.notAfter, prometheus.GaugeValue, float64(l.NotAfter.Unix()), c.kind)
}
