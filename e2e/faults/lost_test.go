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

package faults

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/e2e/internal/replenv"
	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/attach"
)

// TestLostStorageNodeStaysFenced: a client writes an unreplicated volume
// and its storage host dies (every packet dropped, the agent SIGKILLed)
// while the client has more writes pending. The operator declares the
// node lost for good (mpnbdctl forget) and the controller's
// ControllerUnpublishVolume returns without the agent. Then the host comes
// back with its agent over the same data: the client's session, still
// redialling, is refused (its publication is gone), and the backing file
// holds exactly what the client had written before the death, checked by
// its SHA-256 after the agent has run for a while.
func TestLostStorageNodeStaysFenced(t *testing.T) {
	e := newReplicatedEnv(t)
	ctx := context.Background()
	const name = "lost"
	const size = 16 << 20
	token := e.CreatePublished(name, size, "store-1")
	e.WaitFor("the volume served", time.Minute, func() string {
		v := e.Volume(name)
		if v.Status.Phase != v1alpha1.VolumeAvailable || v.Status.ObservedGeneration != v.Generation {
			return "status " + string(v.Status.Phase)
		}
		return ""
	})
	dev := e.startClient(attach.Target{VolumeID: name, Export: access.ExportName(name, token, 1), Addrs: e.Servers("s1")})
	before := make([]byte, 4<<20)
	if _, err := rand.Read(before); err != nil {
		t.Fatal(err)
	}
	if err := replenv.DirectIO(dev, before, 0, true); err != nil {
		t.Fatal(err)
	}
	want := sha256.Sum256(before)

	h := e.Hosts["store-1"]
	h.Die(t)
	// The old session's writes, left pending: none may land.
	e.abandoned[name] = true
	go func() {
		after := bytes.Repeat([]byte{0x5a}, 1<<20)
		for off := int64(0); off < 4<<20; off += 1 << 20 {
			if replenv.DirectIO(dev, after, off, true) != nil {
				return
			}
		}
	}()

	e.WaitFor("the controller's word that store-1's agent is not reporting", time.Minute, func() string {
		var sn v1alpha1.NBDStorageNode
		if err := e.C.Get(ctx, client.ObjectKey{Name: h.Node}, &sn); err != nil {
			return err.Error()
		}
		for _, c := range sn.Status.Conditions {
			if c.Type == v1alpha1.ConditionReady {
				if c.Reason == v1alpha1.ReasonAgentNotReporting {
					return ""
				}
				return c.Reason
			}
		}
		return "no Ready condition"
	})
	fctx, cancel := context.WithTimeout(ctx, time.Minute)
	out, err := exec.CommandContext(fctx, filepath.Join(e.Bin, "mpnbdctl"), "--kubeconfig", e.Admin, "forget", h.Node).CombinedOutput()
	cancel()
	if err != nil {
		t.Fatalf("mpnbdctl forget %s: %v\n%s", h.Node, err, out)
	}
	t.Logf("mpnbdctl forget:\n%s", out)

	conn, err := grpc.NewClient(e.CSI, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	uctx, cancel := context.WithTimeout(ctx, 90*time.Second)
	start := time.Now()
	_, err = csi.NewControllerClient(conn).ControllerUnpublishVolume(uctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: name, NodeId: "cli"})
	cancel()
	if err != nil {
		t.Fatalf("ControllerUnpublishVolume of a volume on a node lost for good: %v", err)
	}
	t.Logf("unpublished without the agent in %v", time.Since(start).Round(time.Millisecond))
	if p := e.Volume(name).Spec.Publications; len(p) != 0 {
		t.Fatalf("publications after the unpublish: %+v", p)
	}

	// The host back, its agent over the same data.
	h.Revive(t)
	e.WaitFor("store-1's agent back and Ready", 2*time.Minute, func() string {
		var sn v1alpha1.NBDStorageNode
		if err := e.C.Get(ctx, client.ObjectKey{Name: h.Node}, &sn); err != nil {
			return err.Error()
		}
		for _, c := range sn.Status.Conditions {
			if c.Type == v1alpha1.ConditionReady && c.Status == "True" {
				return ""
			}
		}
		return "not Ready yet"
	})
	// Long enough for the client's redials (every few seconds at most)
	// to reach the agent several times.
	time.Sleep(15 * time.Second)
	file := filepath.Join(h.Dir, name+".img")
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	if got := sha256.Sum256(b[:4<<20]); got != want {
		t.Fatalf("the backing file changed after the node was forgotten and came back: sha256 %x, want %x (the fenced session's writes landed)", got, want)
	}
}
