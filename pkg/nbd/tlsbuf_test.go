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

package nbd

import (
	"context"
	"crypto/tls"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/pki"
)

// TestTLSBuffersAfterVerification: the server gives a connection its
// TLS transport buffers (a quarter megabyte) only once the client is
// verified and chose an export, never to one whose certificate is
// refused or that presents none, so that unverified STARTTLS handshakes
// cost the server no more than plaintext ones.
func TestTLSBuffersAfterVerification(t *testing.T) {
	p, err := pki.New()
	if err != nil {
		t.Fatal(err)
	}
	stranger, err := pki.New()
	if err != nil {
		t.Fatal(err)
	}
	s := newTestServer(t, &Export{Name: "disk", Backend: NewMemBackend(1 << 20)})
	s.TLSConfig, s.TLSRequired = p.Server, true
	addr := tcpServer(t, s)

	settled := func(what string) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for s.ConnStats().Conns != 0 {
			if time.Now().After(deadline) {
				t.Fatalf("%s: the server still holds %+v after 10s", what, s.ConnStats())
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	noCert := p.Client.Clone()
	noCert.Certificates = nil
	wrongCA := p.Client.Clone()
	wrongCA.Certificates = stranger.Client.Certificates

	before := serverTLSBuffers.Load()
	for _, tc := range []struct {
		name string
		cfg  *tls.Config
	}{
		{"no client certificate", noCert},
		{"certificate of another CA", wrongCA},
	} {
		if cl, err := dialTLS(t, addr, "disk", tc.cfg); err == nil {
			cl.Close()
			t.Fatalf("%s: the server accepted the client", tc.name)
		}
		settled(tc.name)
		if n := serverTLSBuffers.Load() - before; n != 0 {
			t.Errorf("%s: the server allocated TLS buffers for %d refused connections, want none", tc.name, n)
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cl, err := Dial(ctx, DialOptions{Addr: addr, Export: "disk", TLS: p.Client, Logger: quietLogger()})
	if err != nil {
		t.Fatalf("verified client: %v", err)
	}
	data := randBytes(64 << 10)
	if _, err := cl.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(data))
	if _, err := cl.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	cl.Close()
	settled("verified client")
	if n := serverTLSBuffers.Load() - before; n != 1 {
		t.Errorf("the server allocated TLS buffers for %d connections, want 1 (the verified client's)", n)
	}
}
