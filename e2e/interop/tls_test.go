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

package interop

import (
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mpnbd/mpnbd/internal/testenv/pki"
)

// writePKI writes a CA and a server and a client certificate into dir in
// the layout GnuTLS peers read (libnbd's tls-certificates, qemu's
// tls-creds-x509) and returns them; the server requires a client
// certificate of that CA.
func writePKI(t *testing.T, dir string) *pki.PKI {
	t.Helper()
	p, err := pki.New()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.WriteDir(dir); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestServerTLSInterop: our server with TLS required and client
// certificates checked, against libnbd (nbdinfo, nbdcopy with nbds://) and
// qemu-img with x509 credentials: data both ways byte for byte, and
// plaintext refused.
func TestServerTLSInterop(t *testing.T) {
	needTools(t, "nbdinfo", "nbdcopy", "qemu-img")
	dir := t.TempDir()
	p := writePKI(t, dir)
	const size = 8 << 20
	data := randomBytes(41, size)
	ts := startServer(t, serverOptions{TLS: p.Server, TLSRequired: true},
		exportSpec{Name: "disk", Size: size, Fill: data}, exportSpec{Name: "target", Size: size})
	nbds := func(export string) string {
		return "nbds://" + ts.Addr + "/" + export + "?tls-certificates=" + dir
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
	if err := p.WriteCAOnly(anon); err != nil {
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
	mustRun(t, "qemu-img", "convert", "--object", "tls-creds-x509,id=tls0,endpoint=client,dir="+dir,
		"--image-opts", opts, "-O", "raw", qout)
	if got := readFile(t, qout); sum(got) != sum(data) {
		t.Fatalf("qemu-img over TLS read other data: %s", firstDiff(got, data))
	}
	if n := ts.obs.transmissions(); n == 0 {
		t.Fatal("no request reached the server")
	}
}
