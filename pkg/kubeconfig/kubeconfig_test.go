package kubeconfig

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestLoad(t *testing.T) {
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(path, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://10.1.2.3:6443"}}]
users: [{name: u, user: {token: secret}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
`), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := Load(path)
	if err != nil || c.Host != "https://10.1.2.3:6443" || c.BearerToken != "secret" {
		t.Fatalf("Load = %+v, %v", c, err)
	}
	if _, err := Load(filepath.Join(t.TempDir(), "missing")); err == nil || !strings.Contains(err.Error(), "missing") {
		t.Fatalf("Load of a missing file: %v", err)
	}
	// Without a path, $KUBECONFIG is used.
	t.Setenv("KUBECONFIG", path)
	if c, err := Load(""); err != nil || c.Host != "https://10.1.2.3:6443" {
		t.Fatalf("Load via $KUBECONFIG = %+v, %v", c, err)
	}
}
