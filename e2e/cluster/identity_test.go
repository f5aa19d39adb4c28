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

package cluster

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// identityScenario checks that the node plugin and the storage agent got
// their certificates from the controller's signer with the tokens the
// kubelet gave their pods (whose node name the API server vouches for),
// and that the node plugin keeps its own in its state directory.
func (s *suite) identityScenario(stateDir string) {
	s.step("node and storage certificates issued through CertificateSigningRequests", func() {
		for _, want := range []struct{ signer, cn string }{
			{"mpnbd.io/node", "mpnbd-node:" + s.c.NodeName},
			{"mpnbd.io/storage-node", "mpnbd-storage:" + s.c.NodeName},
		} {
			s.waitFor("a certificate "+want.cn, 2*time.Minute, func() string {
				return s.issued(want.signer, want.cn)
			})
		}
		b, err := os.ReadFile(filepath.Join(stateDir, "identity", "node.pem"))
		if err != nil {
			s.t.Fatalf("the node plugin's kept certificate: %v", err)
		}
		if blk, _ := pem.Decode(b); blk == nil || blk.Type != "CERTIFICATE" {
			s.t.Fatal("the node plugin's kept certificate is no PEM certificate")
		} else if c, err := x509.ParseCertificate(blk.Bytes); err != nil || c.Subject.CommonName != "mpnbd-node:"+s.c.NodeName {
			s.t.Fatalf("the node plugin's kept certificate: %v (%v)", c.Subject, err)
		}
	})
}

// issued is "" once a request of signer holds an issued certificate for
// common name cn, else what is there.
func (s *suite) issued(signer, cn string) string {
	out, err := s.c.Kubectl(s.ctx, "get", "csr", "-o", "json")
	if err != nil {
		return err.Error()
	}
	var l struct {
		Items []struct {
			Metadata struct{ Name string }
			Spec     struct {
				SignerName string
				Username   string
			}
			Status struct {
				Certificate []byte
				Conditions  []struct{ Type, Message string }
			}
		}
	}
	if err := json.Unmarshal([]byte(out), &l); err != nil {
		return err.Error()
	}
	seen := ""
	for _, it := range l.Items {
		if it.Spec.SignerName != signer {
			continue
		}
		seen += fmt.Sprintf("%s by %s %+v; ", it.Metadata.Name, it.Spec.Username, it.Status.Conditions)
		blk, _ := pem.Decode(it.Status.Certificate)
		if blk == nil {
			continue
		}
		if c, err := x509.ParseCertificate(blk.Bytes); err == nil && c.Subject.CommonName == cn {
			return ""
		}
	}
	return "requests of " + signer + ": " + seen
}

// encryptedScenario: a StorageClass with encryption: required. A pod
// writes and a new pod reads back the same data; the volume has no token
// anywhere (no Secret, nothing in its VolumeAttachment but its name),
// its storage agent serves it only over TLS with the node certificate,
// and a client without one is refused.
func (s *suite) encryptedScenario() {
	t := s.t
	s.apply(fuseClass("mpnbd-encrypted", "required", "WaitForFirstConsumer", ""))
	s.apply(pvc("enc", "mpnbd-encrypted", "256Mi", false))
	var sum string
	s.step("encrypted: write from a pod, read back from a new pod", func() {
		out := s.runPod("enc-writer", pod("enc-writer", "enc",
			`head -c 32M /dev/urandom > /data/file && sync && echo sum=$(sha256sum /data/file | cut -d' ' -f1)`, false))
		if sum = field(out, "sum"); len(sum) != 64 {
			t.Fatalf("writer output %q", out)
		}
		out = s.runPod("enc-reader", pod("enc-reader", "enc", `echo sum=$(sha256sum /data/file | cut -d' ' -f1)`, false))
		if got := field(out, "sum"); got != sum {
			t.Fatalf("read back sha256 %q, want %q", got, sum)
		}
	})
	pv := s.jsonpath("{.spec.volumeName}", "get", "pvc", "enc")
	s.step("encrypted: a read-only clone holds the data and refuses the node's writes", func() {
		// Cloned while the source is not mounted: a clean filesystem,
		// which a read-only mount takes as it is.
		s.apply(strings.Replace(pvcFrom("enc-ro", "mpnbd-encrypted", "256Mi", "PersistentVolumeClaim", "enc"),
			"accessModes: [ReadWriteOnce]", "accessModes: [ReadOnlyMany]", 1))
		s.startPod("enc-ro-app", pod("enc-ro-app", "enc-ro", `echo sum=$(sha256sum /data/file | cut -d' ' -f1); sleep 3600`, false))
		s.waitFor("the read-only clone's checksum", time.Minute, func() string {
			if got := field(s.kubectl("logs", "enc-ro-app"), "sum"); got != sum {
				return fmt.Sprintf("sha256 %q, want %q", got, sum)
			}
			return ""
		})
		s.readOnlyRefusesWrites(s.jsonpath("{.spec.volumeName}", "get", "pvc", "enc-ro"))
		s.kubectl("delete", "pod", "enc-ro-app", "--wait=true", "--timeout=120s")
		s.kubectl("delete", "pvc", "enc-ro", "--wait=true", "--timeout=180s")
	})
	s.step("encrypted: no credential in its VolumeAttachment, no Secret", func() {
		s.startPod("enc-app", pod("enc-app", "enc", `sleep 3600`, false))
		var meta map[string]string
		s.waitFor("the VolumeAttachment of "+pv, time.Minute, func() string {
			out, err := s.c.Kubectl(s.ctx, "get", "volumeattachments", "-o", "json")
			if err != nil {
				return err.Error()
			}
			var l struct {
				Items []struct {
					Spec struct {
						Source struct{ PersistentVolumeName string }
					}
					Status struct {
						Attached           bool
						AttachmentMetadata map[string]string
					}
				}
			}
			if err := json.Unmarshal([]byte(out), &l); err != nil {
				return err.Error()
			}
			for _, va := range l.Items {
				if va.Spec.Source.PersistentVolumeName == pv && va.Status.Attached {
					meta = va.Status.AttachmentMetadata
					return ""
				}
			}
			return "not attached yet"
		})
		if meta["export"] != pv || meta["storageNode"] != s.c.NodeName {
			t.Fatalf("attachment metadata %v: want the export %s by its name alone and storage node %s", meta, pv, s.c.NodeName)
		}
		if sec := s.jsonpath("{.items[*].metadata.name}", "get", "secrets", "-n", namespace, "-l", "mpnbd.io/volume="+pv); sec != "" {
			t.Fatalf("Secrets of the encrypted volume: %s", sec)
		}
		if enc := s.jsonpath("{.spec.encryption}", "get", "nbdvolume", pv); enc != "required" {
			t.Fatalf("NBDVolume %s spec.encryption %q", pv, enc)
		}
		if refs := s.jsonpath("{.spec.publications[*].secretRef}", "get", "nbdvolume", pv); refs != "" {
			t.Fatalf("NBDVolume %s publications name Secrets: %s", pv, refs)
		}
	})
	var held *nbd.Client
	s.step("encrypted: served to its node's certificate, refused to another node's", func() {
		held = s.onlyThisNode(pv)
	})
	s.step("encrypted: a client without a node certificate is refused", func() {
		addr := net.JoinHostPort(pathAddr(1, false), "10809")
		for _, export := range []string{pv, pv + "/0123456789abcdef0123456789abcdef"} {
			ctx, cancel := context.WithTimeout(s.ctx, 20*time.Second)
			cl, err := nbd.Dial(ctx, nbd.DialOptions{Addr: addr, Export: export})
			cancel()
			if err == nil {
				cl.Close()
				t.Fatalf("a plaintext client opened %q", export)
			}
			if !errors.Is(err, nbd.ErrAccessDenied) && !errors.Is(err, nbd.ErrTLSRequired) {
				t.Fatalf("a plaintext client opening %q: %v, want a refusal", export, err)
			}
		}
	})
	s.step("encrypted: no secret in any log, Event or metrics", func() {
		s.noSecretsExposed()
	})
	s.step("encrypted: unpublished, the node's connection closed within a second", func() {
		defer held.Close()
		s.closedOnUnpublish(pv, held, func() {
			s.kubectl("delete", "pod", "enc-app", "--wait=true", "--timeout=120s")
		})
	})
	s.step("encrypted: deleted", func() {
		s.kubectl("delete", "pvc", "enc", "--wait=true", "--timeout=180s")
		s.waitFor("the encrypted volume gone", 3*time.Minute, func() string {
			if v := s.jsonpath("{.metadata.name}", "get", "pv", pv, "--ignore-not-found"); v != "" {
				return "PV left"
			}
			return ""
		})
		s.kubectl("delete", "storageclass", "mpnbd-encrypted")
	})
}

// noSecretsExposed searches every log line of the driver's pods, every
// Event, every VolumeAttachment and the node plugin's metrics for the
// secrets the driver holds: the node's private key (and any PEM private
// key), the node's token and the tokens of publications made by earlier
// releases; and every VolumeAttachment and Event for the value of any
// Secret of the driver's namespace.
func (s *suite) noSecretsExposed() { s.searchSecrets(0) }

// tokenScenario: with a volume of a class without encryption attached
// (opened with the node's token), no log line, Event, VolumeAttachment or
// metric holds the token, and no VolumeAttachment or Event any Secret's
// value; and the ServiceAccount tokens the kubelet gave the node plugin's
// and the storage agent's pods write only what is theirs of the volume.
func (s *suite) tokenScenario() {
	// A class of its own that names none: the chart's classes name no
	// encryption, and the controller's default (required) applies to them.
	s.apply(fuseClass("mpnbd-plain", "none", "WaitForFirstConsumer", "csi.storage.k8s.io/fstype: ext4"))
	s.apply(pvc("tok", "mpnbd-plain", "64Mi", false))
	var pv string
	s.step("tokens: none in any log, Event, VolumeAttachment or metrics while a volume is published with one", func() {
		s.startPod("tok-app", pod("tok-app", "tok", `head -c 8M /dev/urandom > /data/f && sync && sleep 3600`, false))
		pv = s.jsonpath("{.spec.volumeName}", "get", "pvc", "tok")
		s.waitFor("the VolumeAttachment of "+pv, time.Minute, func() string {
			if !strings.Contains(s.jsonpath("{.items[*].spec.source.persistentVolumeName}", "get", "volumeattachments"), pv) {
				return "no VolumeAttachment yet"
			}
			return ""
		})
		s.searchSecrets(1)
	})
	s.step("pod tokens: the node plugin writes only its own attachment entry, the storage agent no spec", func() {
		s.ownNodeWritesOnly(pv)
	})
	s.step("tokens: the volume deleted", func() {
		s.kubectl("delete", "pod", "tok-app", "--wait=true", "--timeout=120s")
		s.kubectl("delete", "pvc", "tok", "--wait=true", "--timeout=180s")
		s.waitFor("the volume "+pv+" gone", 3*time.Minute, func() string {
			if v := s.jsonpath("{.metadata.name}", "get", "pv", pv, "--ignore-not-found"); v != "" {
				return "PV left"
			}
			return ""
		})
		s.kubectl("delete", "storageclass", "mpnbd-plain")
	})
}

// searchSecrets is noSecretsExposed, failing when fewer than minTokens
// publication tokens exist to search for.
func (s *suite) searchSecrets(minTokens int) {
	t := s.t
	var secrets []string
	b, err := os.ReadFile(filepath.Join(s.dir, "node-state", "identity", "node.pem"))
	if err != nil {
		t.Fatal(err)
	}
	for rest := b; ; {
		var blk *pem.Block
		if blk, rest = pem.Decode(rest); blk == nil {
			break
		}
		if blk.Type == "PRIVATE KEY" {
			// Any 32 bytes of the key's DER, in base64 as a PEM would hold it.
			secrets = append(secrets, base64.StdEncoding.EncodeToString(blk.Bytes)[8:40])
		}
	}
	if len(secrets) == 0 {
		t.Fatal("no private key in the node's kept identity")
	}
	tokens := strings.Fields(s.jsonpath("{.items[*].data.token}", "get", "secrets", "-n", namespace, "-l", "mpnbd.io/volume"))
	for i, tok := range tokens {
		raw, err := base64.StdEncoding.DecodeString(tok)
		if err != nil {
			t.Fatal(err)
		}
		tokens[i] = string(raw)
	}
	if b, err := os.ReadFile(filepath.Join(s.dir, "node-state", "token")); err == nil {
		tokens = append(tokens, strings.TrimSpace(string(b)))
	}
	if len(tokens) < minTokens {
		t.Fatalf("%d tokens to search for, want at least %d", len(tokens), minTokens)
	}
	secrets = append(secrets, tokens...)
	vas := s.kubectl("get", "volumeattachments", "-o", "json")
	events := s.kubectl("get", "events", "-A", "-o", "yaml")
	s.noSecretValueIn(vas+events, "VolumeAttachments and Events")
	var haystack strings.Builder
	haystack.WriteString(vas)
	pods := strings.Fields(s.jsonpath("{.items[*].metadata.name}", "get", "pods", "-n", namespace))
	for _, p := range pods {
		out, err := s.c.Kubectl(s.ctx, "logs", "-n", namespace, p, "--all-containers")
		if err != nil {
			t.Fatalf("logs of %s: %v", p, err)
		}
		haystack.WriteString(out)
	}
	haystack.WriteString(events)
	resp, err := http.Get(s.nodeMetricsURL())
	if err != nil {
		t.Fatal(err)
	}
	m, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	haystack.Write(m)
	all := haystack.String()
	if strings.Contains(all, "PRIVATE KEY") {
		t.Error("a PEM private key appears in a log, an Event or the metrics")
	}
	for i, sec := range secrets {
		if strings.Contains(all, sec) {
			t.Errorf("secret %d of %d (a private key or a token) appears in a log, an Event, a VolumeAttachment or the metrics", i+1, len(secrets))
		}
	}
	t.Logf("searched %d bytes of logs (%d pods), Events, VolumeAttachments and metrics for %d secrets", len(all), len(pods), len(secrets))
}

// noSecretValueIn fails when the value of any Secret of the driver's
// namespace (of 16 bytes or more: shorter ones could match by chance;
// certificates excepted: they are public, the CA's is published in a
// ConfigMap), raw or in base64, appears in text, which where names.
func (s *suite) noSecretValueIn(text, where string) {
	t := s.t
	var l struct {
		Items []struct {
			Metadata struct{ Name string }
			Data     map[string]string
		}
	}
	if err := json.Unmarshal([]byte(s.kubectl("get", "secrets", "-n", namespace, "-o", "json")), &l); err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, sec := range l.Items {
		for k, b64 := range sec.Data {
			raw, err := base64.StdEncoding.DecodeString(b64)
			if err != nil {
				t.Fatal(err)
			}
			if len(raw) < 16 || certificatesOnly(raw) {
				continue
			}
			n++
			if strings.Contains(text, string(raw)) || strings.Contains(text, b64) {
				t.Errorf("the value of Secret %s/%s key %s appears in %s", namespace, sec.Metadata.Name, k, where)
			}
		}
	}
	t.Logf("no value of the %d Secret values of %s in %d bytes of %s", n, namespace, len(text), where)
}

// certificatesOnly: b is one or more PEM certificates and nothing else.
func certificatesOnly(b []byte) bool {
	n := 0
	for {
		blk, rest := pem.Decode(b)
		if blk == nil {
			return n > 0 && len(bytes.TrimSpace(b)) == 0
		}
		if blk.Type != "CERTIFICATE" {
			return false
		}
		n, b = n+1, rest
	}
}
