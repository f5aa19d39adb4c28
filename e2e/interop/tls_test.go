package interop

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// writePKI writes a CA and a server and a client certificate into dir in
// the layout GnuTLS peers read (libnbd's tls-certificates, qemu's
// tls-creds-x509: ca-cert.pem, server-cert.pem, server-key.pem,
// client-cert.pem, client-key.pem), and returns the server's TLS
// configuration, which requires a client certificate of that CA.
func writePKI(t *testing.T, dir string) *tls.Config {
	t.Helper()
	newKey := func() *ecdsa.PrivateKey {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	write := func(name, typ string, der []byte) {
		if err := os.WriteFile(filepath.Join(dir, name), pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	caKey := newKey()
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "interop CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		t.Fatal(err)
	}
	write("ca-cert.pem", "CERTIFICATE", caDER)
	leaf := func(serial int64, role string, usage x509.ExtKeyUsage) tls.Certificate {
		key := newKey()
		tmpl := &x509.Certificate{
			SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: role},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
			KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
			ExtKeyUsage: []x509.ExtKeyUsage{usage},
			DNSNames:    []string{"localhost"}, IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		pk, err := x509.MarshalPKCS8PrivateKey(key)
		if err != nil {
			t.Fatal(err)
		}
		write(role+"-cert.pem", "CERTIFICATE", der)
		write(role+"-key.pem", "PRIVATE KEY", pk)
		return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
	}
	server := leaf(2, "server", x509.ExtKeyUsageServerAuth)
	leaf(3, "client", x509.ExtKeyUsageClientAuth)
	pool := x509.NewCertPool()
	pool.AddCert(ca)
	return &tls.Config{Certificates: []tls.Certificate{server}, ClientCAs: pool, ClientAuth: tls.RequireAndVerifyClientCert}
}

// TestServerTLSInterop: our server with TLS required and client
// certificates checked, against libnbd (nbdinfo, nbdcopy with nbds://) and
// qemu-img with x509 credentials: data both ways byte for byte, and
// plaintext refused.
func TestServerTLSInterop(t *testing.T) {
	needTools(t, "nbdinfo", "nbdcopy", "qemu-img")
	pki := t.TempDir()
	const size = 8 << 20
	data := randomBytes(41, size)
	ts := startServer(t, serverOptions{TLS: writePKI(t, pki), TLSRequired: true},
		exportSpec{Name: "disk", Size: size, Fill: data}, exportSpec{Name: "target", Size: size})
	nbds := func(export string) string {
		return "nbds://" + ts.Addr + "/" + export + "?tls-certificates=" + pki
	}

	var info nbdinfoOutput
	if err := json.Unmarshal([]byte(mustRun(t, "nbdinfo", "--json", nbds("disk"))), &info); err != nil {
		t.Fatal(err)
	}
	if info.TLS == nil || !*info.TLS || len(info.Exports) != 1 || info.Exports[0].Size == nil || *info.Exports[0].Size != size {
		t.Fatalf("nbdinfo over TLS: %+v", info)
	}

	// Plaintext: GO refused (libnbd reports ERR_TLS_REQD as "not
	// supported").
	r := runCmd(t, "nbdinfo", ts.URI("disk"))
	if r.ExitCode == 0 || !strings.Contains(r.Stderr, "opt_go") {
		t.Fatalf("plaintext nbdinfo: exit %d, stderr %q; want GO refused", r.ExitCode, r.Stderr)
	}
	// TLS without a client certificate: refused by the handshake.
	anon := t.TempDir()
	ca, err := os.ReadFile(filepath.Join(pki, "ca-cert.pem"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(anon, "ca-cert.pem"), ca, 0o600); err != nil {
		t.Fatal(err)
	}
	if r := runCmd(t, "nbdinfo", "nbds://"+ts.Addr+"/disk?tls-certificates="+anon); r.ExitCode == 0 {
		t.Fatal("nbdinfo without a client certificate was served")
	}

	// nbdcopy both ways.
	out := filepath.Join(t.TempDir(), "out.img")
	mustRun(t, "nbdcopy", nbds("disk"), out)
	if got := readFile(t, out); sum(got) != sum(data) {
		t.Fatalf("nbdcopy from nbds:// read other data: %s", firstDiff(got, data))
	}
	mustRun(t, "nbdcopy", out, nbds("target"))
	if got := readFile(t, ts.Paths["target"]); sum(got) != sum(data) {
		t.Fatalf("nbdcopy to nbds:// wrote other data: %s", firstDiff(got, data))
	}

	// qemu-img with x509 credentials.
	qout := filepath.Join(t.TempDir(), "qemu.img")
	opts := "driver=nbd,server.type=inet,server.host=127.0.0.1,server.port=" + ts.Port() + ",export=disk,tls-creds=tls0"
	mustRun(t, "qemu-img", "convert", "--object", "tls-creds-x509,id=tls0,endpoint=client,dir="+pki,
		"--image-opts", opts, "-O", "raw", qout)
	if got := readFile(t, qout); sum(got) != sum(data) {
		t.Fatalf("qemu-img over TLS read other data: %s", firstDiff(got, data))
	}
	if n := ts.obs.transmissions(); n == 0 {
		t.Fatal("no request reached the server")
	}
}
