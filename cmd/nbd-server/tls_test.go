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

package main

import (
	"crypto/tls"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mpnbd/mpnbd/internal/testenv/pki"
)

func TestParseArgsTLS(t *testing.T) {
	dir := t.TempDir()
	p, err := pki.New()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.WriteDir(dir); err != nil {
		t.Fatal(err)
	}
	cert, key := filepath.Join(dir, pki.ServerCert), filepath.Join(dir, pki.ServerKey)
	ca := filepath.Join(dir, pki.CACert)
	junk := filepath.Join(dir, "junk.pem")
	if err := os.WriteFile(junk, []byte("not a certificate"), 0o600); err != nil {
		t.Fatal(err)
	}
	base := []string{"--export", "d=" + filepath.Join(dir, "d.img") + ",size=1M,create"}

	o, err := parseArgs(base)
	if err != nil || o.tls != nil || o.tlsRequired {
		t.Fatalf("default: tls %v required %v, %v", o.tls, o.tlsRequired, err)
	}
	o, err = parseArgs(append(base, "--tls", "on", "--tls-cert", cert, "--tls-key", key))
	// The floor is pkg/nbd's (TLS 1.2 with its suites), not raised here.
	if err != nil || o.tls == nil || o.tlsRequired || o.tls.MinVersion > tls.VersionTLS12 || o.tls.ClientAuth != tls.NoClientCert {
		t.Fatalf("--tls on: %+v, %v", o, err)
	}
	// The client's certificate is checked against --tls-ca without naming
	// the CA in the request (nbd.ServerTLS).
	o, err = parseArgs(append(base, "--tls", "require", "--tls-cert", cert, "--tls-key", key, "--tls-ca", ca))
	if err != nil || o.tls == nil || !o.tlsRequired || o.tls.ClientAuth != tls.RequireAnyClientCert ||
		o.tls.ClientCAs != nil || o.tls.VerifyConnection == nil {
		t.Fatalf("--tls require with --tls-ca: %+v, %v", o, err)
	}

	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--tls", "maybe"}, `invalid --tls "maybe"`},
		{[]string{"--tls", "on"}, "--tls on needs --tls-cert and --tls-key"},
		{[]string{"--tls-cert", cert, "--tls-key", key}, "need --tls on or --tls require"},
		{[]string{"--tls", "on", "--tls-cert", cert, "--tls-key", junk}, "--tls-cert/--tls-key"},
		{[]string{"--tls", "on", "--tls-cert", cert, "--tls-key", key, "--tls-ca", junk}, "no PEM certificate"},
		{[]string{"--tls", "on", "--tls-cert", cert, "--tls-key", key, "--tls-ca", filepath.Join(dir, "missing")}, "--tls-ca"},
	} {
		_, err := parseArgs(append(base, c.args...))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: error %v, want %q", c.args, err, c.want)
		}
	}
}
