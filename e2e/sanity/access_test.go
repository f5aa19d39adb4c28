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

package sanity

import (
	"bytes"
	"context"
	"errors"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/driver"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// otherNode is a second worker whose storage address is 127.0.0.2.
const otherNode = "worker-2"

func blockCap(m csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: m},
	}
}

// open dials export on the storage node of a publish context from source
// address src with MPTCP, as a node would.
func open(ctx context.Context, pc map[string]string, export, src string) (*nbd.Client, error) {
	addr, _, _ := strings.Cut(pc[driver.PublishContextAddresses], ",")
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
	return nbd.Dial(ctx, nbd.DialOptions{Addr: addr, Export: export, MPTCP: true, Dialer: d})
}

// nodeExport is the export a node with token opens for a publish context
// (with its publication's epoch).
func nodeExport(pc map[string]string, token string) string {
	epoch, _ := strconv.ParseInt(pc[driver.PublishContextEpoch], 10, 64)
	return access.ExportName(pc[driver.PublishContextExport], token, epoch)
}

func wantRefused(t *testing.T, what string, c *nbd.Client, err error) {
	t.Helper()
	if err == nil {
		c.Close()
		t.Errorf("%s: the export opened", what)
		return
	}
	if !errors.Is(err, nbd.ErrAccessDenied) && !errors.Is(err, nbd.ErrUnknownExport) {
		t.Errorf("%s: %v; want the server to refuse the export", what, err)
	}
}

func wantCode(t *testing.T, what string, err error, code codes.Code) {
	t.Helper()
	if status.Code(err) != code {
		t.Fatalf("%s: %v; want %s", what, err, code)
	}
}

// TestAccessControl checks, with the real controller, storage agent and
// MPTCP server, that an export opens only for a node it is published to,
// with that node's token, from that node's storage address; that the
// publish context holds no token; that a
// single-node volume cannot be published to a second node; and that
// unpublishing closes the node's connection and refuses it afterwards.
func TestAccessControl(t *testing.T) {
	cl := startCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	otherToken, err := access.NewToken()
	if err != nil {
		t.Fatal(err)
	}
	other := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: otherNode,
		Annotations: map[string]string{access.AnnotationStorageAddresses: "127.0.0.2", access.AnnotationTokenSHA256: access.TokenHash(otherToken)}}}
	if err := cl.client.Create(ctx, other); err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient("unix://"+cl.controllerSock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() }) // after the volumes' cleanups
	ctl := csi.NewControllerClient(conn)
	create := func(name string, m csi.VolumeCapability_AccessMode_Mode) string {
		resp, err := ctl.CreateVolume(ctx, &csi.CreateVolumeRequest{
			Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20},
			VolumeCapabilities: []*csi.VolumeCapability{blockCap(m)},
		})
		if err != nil {
			t.Fatalf("create %s: %v", name, err)
		}
		id := resp.GetVolume().GetVolumeId()
		t.Cleanup(func() {
			if _, err := ctl.ControllerUnpublishVolume(context.Background(), &csi.ControllerUnpublishVolumeRequest{VolumeId: id}); err != nil {
				t.Errorf("unpublish %s: %v", id, err)
			}
			if _, err := ctl.DeleteVolume(context.Background(), &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
				t.Errorf("delete %s: %v", id, err)
			}
		})
		return id
	}
	publish := func(id, node string, m csi.VolumeCapability_AccessMode_Mode) (map[string]string, error) {
		resp, err := ctl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
			VolumeId: id, NodeId: node, VolumeCapability: blockCap(m)})
		return resp.GetPublishContext(), err
	}

	rwo := csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER
	id := create("access-rwo", rwo)
	pc, err := publish(id, nodeID, rwo)
	if err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte("mpnbd"), 4096/5+1)[:4096]
	if pc[driver.PublishContextExport] != id {
		t.Fatalf("the publish context names export %q, want %q alone (it is kept in the VolumeAttachment)", pc[driver.PublishContextExport], id)
	}

	// The published node, with its token, from its storage address.
	c, err := open(ctx, pc, nodeExport(pc, cl.nodeToken), "127.0.0.1")
	if err != nil {
		t.Fatalf("the published node cannot open its export: %v", err)
	}
	defer c.Close()
	if _, err := c.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}

	// Everyone else is refused.
	exportName := nodeExport(pc, cl.nodeToken)
	forged, _ := access.NewToken()
	for _, tc := range []struct{ what, export, src string }{
		{"the right token from another address", exportName, "127.0.0.2"},
		{"the bare volume name", id, "127.0.0.1"},
		{"a forged token", access.NodeExport(id, forged), "127.0.0.1"},
		{"another volume's name with this token", access.NodeExport("other-volume", cl.nodeToken), "127.0.0.1"},
	} {
		c2, err := open(ctx, pc, tc.export, tc.src)
		wantRefused(t, tc.what, c2, err)
	}

	// The fence: a single-node volume cannot go to a second node, so
	// the second node never gets a token.
	_, err = publish(id, otherNode, rwo)
	wantCode(t, "publish a single-node volume to a second node", err, codes.FailedPrecondition)

	// A multi-node reader-only volume is published to both; each token
	// works only from its node's address, read-only.
	rox := csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY
	shared := create("access-rox", rox)
	pc1, err := publish(shared, nodeID, rox)
	if err != nil {
		t.Fatal(err)
	}
	pc2, err := publish(shared, otherNode, rox)
	if err != nil {
		t.Fatal(err)
	}
	if pc1[driver.PublishContextExport] != shared || pc2[driver.PublishContextExport] != shared {
		t.Fatalf("publish contexts name exports %q and %q, want %q alone", pc1[driver.PublishContextExport], pc2[driver.PublishContextExport], shared)
	}
	c2, err := open(ctx, pc2, nodeExport(pc2, otherToken), "127.0.0.1")
	wantRefused(t, "worker-2's token from worker-1's address", c2, err)
	c2, err = open(ctx, pc2, nodeExport(pc2, otherToken), "127.0.0.2")
	if err != nil {
		t.Fatalf("worker-2 cannot open the shared volume: %v", err)
	}
	if _, err := c2.ReadAt(make([]byte, 4096), 0); err != nil {
		t.Errorf("read-only read: %v", err)
	}
	if _, err := c2.WriteAt(data, 0); err == nil {
		t.Error("a reader-only publication could write")
	}
	c2.Close()

	// Unpublishing closes the node's open connection and refuses it.
	if _, err := ctl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: nodeID}); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	if _, err := c.ReadAt(buf, 0); err == nil {
		t.Error("the connection of an unpublished node still serves I/O")
	}
	c3, err := open(ctx, pc, exportName, "127.0.0.1")
	wantRefused(t, "the old token after unpublish", c3, err)

	// Now the second node may have it, and sees the first node's data.
	pcOther, err := publish(id, otherNode, rwo)
	if err != nil {
		t.Fatalf("publish to the second node after unpublish: %v", err)
	}
	c4, err := open(ctx, pcOther, nodeExport(pcOther, otherToken), "127.0.0.2")
	if err != nil {
		t.Fatal(err)
	}
	defer c4.Close()
	if _, err := c4.ReadAt(buf, 0); err != nil || !bytes.Equal(buf, data) {
		t.Fatalf("second node reads %q..., %v; want the first node's data", buf[:10], err)
	}
}
