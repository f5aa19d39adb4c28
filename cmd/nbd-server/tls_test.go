package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// selfSigned writes a self-signed certificate and its key as PEM files.
func selfSigned(t *testing.T, dir string) (cert, key string) {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "storage"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &k.PublicKey, k)
	if err != nil {
		t.Fatal(err)
	}
	pk, err := x509.MarshalPKCS8PrivateKey(k)
	if err != nil {
		t.Fatal(err)
	}
	cert, key = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	if err := os.WriteFile(cert, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(key, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: pk}), 0o600); err != nil {
		t.Fatal(err)
	}
	return cert, key
}

func TestParseArgsTLS(t *testing.T) {
	dir := t.TempDir()
	cert, key := selfSigned(t, dir)
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
	if err != nil || o.tls == nil || o.tlsRequired || o.tls.MinVersion != tls.VersionTLS13 || o.tls.ClientAuth != tls.NoClientCert {
		t.Fatalf("--tls on: %+v, %v", o, err)
	}
	o, err = parseArgs(append(base, "--tls", "require", "--tls-cert", cert, "--tls-key", key, "--tls-ca", cert))
	if err != nil || o.tls == nil || !o.tlsRequired || o.tls.ClientAuth != tls.RequireAndVerifyClientCert || o.tls.ClientCAs == nil {
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
