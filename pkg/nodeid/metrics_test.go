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
	"crypto/elliptic"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestCertCollector: the validity of the node certificate kept in a
// directory (as the data path reads it) is exposed; none while there is
// no certificate.
func TestCertCollector(t *testing.T) {
	now := time.Now().Truncate(time.Second)
	ca, err := NewCA(now)
	if err != nil {
		t.Fatal(err)
	}
	key := mustECDSA(t, elliptic.P256())
	certPEM, err := ca.Issue(Node, "node-a", &x509.CertificateRequest{PublicKey: key.Public()}, 3*time.Hour, now)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(CertCollector(Node, LeafFromDir(dir)))
	if n, err := testutil.GatherAndCount(reg); err != nil || n != 0 {
		t.Fatalf("without a certificate: %d series, %v", n, err)
	}
	pemFile := append(certPEM, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der})...)
	if err := os.WriteFile(filepath.Join(dir, "node.pem"), pemFile, 0o600); err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf(`# HELP mpnbd_certificate_not_after_timestamp_seconds End of the validity of the certificate this component presents on the storage network (Unix time); it is renewed two thirds into its life.
# TYPE mpnbd_certificate_not_after_timestamp_seconds gauge
mpnbd_certificate_not_after_timestamp_seconds{kind="node"} %d
`, now.Add(3*time.Hour).Unix())
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "mpnbd_certificate_not_after_timestamp_seconds"); err != nil {
		t.Error(err)
	}
	if n, err := testutil.GatherAndCount(reg, "mpnbd_certificate_not_before_timestamp_seconds"); err != nil || n != 1 {
		t.Errorf("not_before: %d series, %v", n, err)
	}
}
