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
	"fmt"
	"os"
	"path/filepath"
)

// FileClientTLS is ClientTLS with the node's certificate and the CA
// bundle read from dir, where an Identity of kind Node with that Dir
// keeps them, at each handshake: the processes of the data path dial
// with the node plugin's certificate, renewed or not, without API access.
func FileClientTLS(dir, storageNode string) *tls.Config {
	return ClientTLS(storageNode, func() (*tls.Certificate, error) {
		f := filepath.Join(dir, "node.pem")
		b, err := os.ReadFile(f)
		if err != nil {
			return nil, fmt.Errorf("no node certificate: %w", err)
		}
		c, err := tls.X509KeyPair(b, b)
		if err != nil {
			return nil, fmt.Errorf("node certificate %s: %w", f, err)
		}
		return &c, nil
	}, func() *x509.CertPool {
		b, err := os.ReadFile(filepath.Join(dir, BundleFile))
		if err != nil {
			return nil
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(b) {
			return nil
		}
		return pool
	})
}
