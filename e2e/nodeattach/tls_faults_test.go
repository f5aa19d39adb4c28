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

package nodeattach

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/pki"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// The TLS fault tests run the kill rounds of TestTransportsServerKills on
// a volume whose connections are NBD over TLS: our nbd-server requires
// STARTTLS and a node certificate of a test CA, and presents a storage
// certificate of that CA; the node dials with the certificate of its
// identity directory, as the node plugin's data path does.

// tlsStorageNode is the storage node the server's certificate names.
const tlsStorageNode = "store-vm"

// refusalLimit bounds an attach the server or the node must refuse.
const refusalLimit = 30 * time.Second

// tlsFiles are a test CA's files: the server's certificate for
// tlsStorageNode, and the identity directory of node-vm.
type tlsFiles = pki.NodeIDFiles

func newTLSFiles(t *testing.T) *tlsFiles {
	t.Helper()
	f, err := pki.WriteNodeIDFiles(t.TempDir(), t.TempDir(), tlsStorageNode, "node-vm")
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// overTLS is tg dialled over TLS with the node's identity, expecting the
// server's certificate to name storageNode.
func overTLS(f *tlsFiles, tg attach.Target, storageNode string) attach.Target {
	tg.TLS = &attach.TargetTLS{StorageNode: storageNode, IdentityDir: f.IdentityDir}
	return tg
}

// requireTLSOnly shows that srv's export can be reached only over TLS, to
// the storage node its certificate names: attached by a in plaintext, the
// server refuses it (TLS required); attached over TLS by a node that
// expects another storage node, the node refuses the server's
// certificate. Each attempt must fail within refusalLimit.
func requireTLSOnly(t *testing.T, a attach.Attacher, srv *ourServer, tf *tlsFiles) {
	t.Helper()
	refused := func(what string, tg attach.Target) error {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), refusalLimit)
		defer cancel()
		begin := time.Now()
		att, err := a.Attach(ctx, tg, attach.Options{})
		if err == nil {
			if derr := a.Detach(context.Background(), tg.VolumeID); derr != nil {
				t.Errorf("detach: %v", derr)
			}
			t.Fatalf("%s: attached as %s", what, att.Device)
		}
		t.Logf("%s: refused after %v: %v", what, time.Since(begin).Round(time.Millisecond), err)
		return err
	}
	// The server's reply is named in the error: the ublk volume process
	// reports it across a pipe, where only ErrServerRefused stays a type.
	tlsReqd := nbd.RepName(nbd.RepErrTLSReqd)
	plain := srv.target(volID(t) + "-plain")
	if err := refused("attach in plaintext", plain); !errors.Is(err, attach.ErrServerRefused) || !strings.Contains(err.Error(), tlsReqd) {
		t.Fatalf("attach in plaintext: %v; want the server's refusal (%s)", err, tlsReqd)
	}
	const other = "store-other"
	wrong := overTLS(tf, srv.target(volID(t)+"-other"), other)
	if err := refused("attach expecting storage node "+other, wrong); !strings.Contains(err.Error(), "the storage server is "+tlsStorageNode+", not "+other) {
		t.Fatalf("attach expecting storage node %s: %v; want the node to refuse the certificate of %s", other, err, tlsStorageNode)
	}
}

// TestRelayTLSServerKills: a relay volume (/dev/nbdX fed by this
// process) whose connection is NBD over TLS with the node's certificate,
// under fio write+verify rounds while our nbd-server, which requires TLS
// and a node certificate of its CA, is SIGKILLed and started again every
// few seconds: each reconnect makes a new TLS session from the identity
// directory, no round sees an error, every block verifies, and the device
// reads back the server's file. A plaintext attach of the same export is
// refused, so the rounds' I/O went over TLS.
func TestRelayTLSServerKills(t *testing.T) {
	requireGuest(t)
	requireFaultTools(t)
	// The fault tests wait out outages, stalls and timeouts side by side.
	t.Parallel()
	total, every, down := killTimes()
	tp := guestTopology(t)
	tf := newTLSFiles(t)
	srv := startOurServerTLS(t, tp, faultExportSize, tf)
	a, _ := newAttacher(t, tp, attach.Relay)
	requireTLSOnly(t, a, srv, tf)
	tg := overTLS(tf, srv.target(volID(t)), tlsStorageNode)
	att := attachTLS(t, a, tg, "relay")
	killRounds(t, srv, a, tg, att.Device, 1, total, every, down)
}

// TestUblkTLSServerKills is TestRelayTLSServerKills for a ublk volume
// (/dev/ublkbN served by a volume process of its own, which reads the
// node's certificate from the identity directory at each dial): no round
// sees an error, every block verifies, the device reads back the server's
// file, and the volume's process is the same throughout.
func TestUblkTLSServerKills(t *testing.T) {
	requireUblkGuest(t)
	requireFaultTools(t)
	total, every, down := killTimes()
	tp := guestTopology(t)
	tf := newTLSFiles(t)
	srv := startOurServerTLS(t, tp, faultExportSize, tf)
	a := newUblkAttacher(t, tp, t.TempDir())
	requireTLSOnly(t, a, srv, tf)
	tg := overTLS(tf, srv.target(volID(t)), tlsStorageNode)
	att := attachTLS(t, a, tg, "ublk")
	pid := a.ServerPID(tg.VolumeID)
	killRounds(t, srv, a, tg, att.Device, 1, total, every, down)
	if now := a.ServerPID(tg.VolumeID); now != pid {
		t.Fatalf("the volume's process is %d, was %d: it was replaced while only the storage server died", now, pid)
	}
}

// attachTLS attaches tg with a (its transport named what), bounded, and
// detaches it when the test ends.
func attachTLS(t *testing.T, a attach.Attacher, tg attach.Target, what string) *attach.Attachment {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	att, err := a.Attach(ctx, tg, attach.Options{})
	cancel()
	if err != nil {
		t.Fatalf("attach %s over TLS: %v", what, err)
	}
	t.Cleanup(func() {
		if err := a.Detach(context.Background(), tg.VolumeID); err != nil {
			t.Errorf("detach: %v", err)
		}
	})
	t.Logf("%s attached over TLS as %s (%d bytes, MPTCP %v)", what, att.Device, att.Size, att.MPTCP)
	return att
}
