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
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
	"github.com/mpnbd/mpnbd/pkg/access"
)

// waitUntil polls cond until it returns "" (30 s at most).
func waitUntil(t *testing.T, what string, cond func() string) {
	t.Helper()
	end := time.Now().Add(30 * time.Second)
	for {
		msg := cond()
		if msg == "" {
			return
		}
		if time.Now().After(end) {
			t.Fatalf("%s: %s", what, msg)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestRunCluster runs the command in cluster mode against a real API
// server: a volume gets a file and an export, a published node reads and
// writes it, and a stop keeps the file.
func TestRunCluster(t *testing.T) {
	cfg, c := apiserver.Start(t)
	ctx := context.Background()
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "mpnbd"}}); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	r := start(t, "--cluster", "--node-name", "n1", "--namespace", "mpnbd", "--storage-address", "127.0.0.1",
		"--listen", ":0", "--metrics-addr", "127.0.0.1:0", "--data-dir", dir,
		"--kubeconfig", apiserver.WriteKubeconfig(t, cfg), "--heartbeat", "1s", "--log-format", "json")

	waitUntil(t, "/readyz", func() string {
		resp, err := http.Get("http://" + r.metricsAddr + "/readyz")
		if err != nil {
			return err.Error()
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			return fmt.Sprintf("%s %q", resp.Status, body)
		}
		return ""
	})

	vol := &v1alpha1.NBDVolume{
		ObjectMeta: metav1.ObjectMeta{Name: "pvc-1", Finalizers: []string{v1alpha1.Finalizer}},
		Spec:       v1alpha1.NBDVolumeSpec{SizeBytes: 4 << 20, StorageNode: "n1", AccessType: v1alpha1.AccessFilesystem},
	}
	if err := c.Create(ctx, vol); err != nil {
		t.Fatal(err)
	}
	tok, err := access.NewToken()
	if err != nil {
		t.Fatal(err)
	}
	// The agent writes the status meanwhile: retry conflicts.
	err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if err := c.Get(ctx, client.ObjectKeyFromObject(vol), vol); err != nil {
			return err
		}
		vol.Spec.Publications = []v1alpha1.Publication{{NodeID: "w1", SecretRef: access.SecretName("pvc-1", "w1"), TokenSHA256: access.TokenHash(tok), Addresses: []string{"127.0.0.1"}}}
		return c.Update(ctx, vol)
	})
	if err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(r.addr)
	// The NBD port listens on the storage address only: another address
	// of the host refuses the connection.
	if c, err := net.DialTimeout("tcp", net.JoinHostPort("127.0.0.2", port), 5*time.Second); err == nil {
		c.Close()
		t.Fatalf("the NBD port %s accepts connections on 127.0.0.2, which is no storage address", port)
	}
	waitUntil(t, "volume available", func() string {
		if err := c.Get(ctx, client.ObjectKeyFromObject(vol), vol); err != nil {
			return err.Error()
		}
		st := vol.Status
		if st.ObservedGeneration != vol.Generation || st.Phase != v1alpha1.VolumeAvailable {
			return fmt.Sprintf("generation %d, status %+v", vol.Generation, st)
		}
		if st.Export == nil || strconv.Itoa(int(st.Export.Port)) != port {
			return fmt.Sprintf("export %+v, want port %s", st.Export, port)
		}
		return ""
	})

	cl, err := dial(t, r.addr, access.NodeExport("pvc-1", tok), true)
	if err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte{0x5a}, 4096)
	if _, err := cl.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 4096)
	if _, err := cl.ReadAt(got, 0); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read back: %v", err)
	}
	if _, err := dial(t, r.addr, "pvc-1", true); err == nil {
		t.Fatal("the plain volume name was served")
	}
	waitUntil(t, "storage node reported", func() string {
		var n v1alpha1.NBDStorageNode
		if err := c.Get(ctx, types.NamespacedName{Name: "n1"}, &n); err != nil {
			return err.Error()
		}
		if n.Status.CapacityBytes <= 0 || strconv.Itoa(int(n.Status.Port)) != port {
			return fmt.Sprintf("status %+v", n.Status)
		}
		return ""
	})

	if code := r.stop(t); code != exitOK {
		t.Fatalf("exit %d", code)
	}
	if st, err := os.Stat(filepath.Join(dir, "pvc-1.img")); err != nil || st.Size() != 4<<20 {
		t.Fatalf("backing file after stop: %v, %v", st, err)
	}
}
