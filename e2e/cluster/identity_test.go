package cluster

import (
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"os"
	"path/filepath"
	"time"
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
