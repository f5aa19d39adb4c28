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

package driver

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

// testNodeToken is the node token of the node services under test.
const testNodeToken = "00112233445566778899aabbccddeeff"

func TestParseAttachSpec(t *testing.T) {
	legacy := "pv-1/ffeeddccbbaa99887766554433221100"
	pub := func(export, addrs string) map[string]string {
		return map[string]string{PublishContextExport: export, PublishContextAddresses: addrs}
	}
	tests := []struct {
		name    string
		pub     map[string]string
		vol     map[string]string
		idDir   string
		noToken bool
		want    attachSpec
		wantErr string
		// wantPrecondition: the error is ErrPrecondition, not
		// ErrInvalidArgument.
		wantPrecondition bool
	}{
		{
			name: "defaults",
			pub:  pub("pv-1", "10.0.0.1:10809"),
			want: attachSpec{Transport: attach.Auto, FSType: "ext4", Target: attach.Target{VolumeID: "pv-1", Export: "pv-1/" + testNodeToken, Addrs: []string{"10.0.0.1:10809"}}},
		},
		{
			name: "a token in the publish context (an earlier controller's)",
			pub:  pub(legacy, "10.0.0.1:10809"),
			want: attachSpec{Transport: attach.Auto, FSType: "ext4", Target: attach.Target{VolumeID: "pv-1", Export: legacy, Addrs: []string{"10.0.0.1:10809"}}},
		},
		{name: "no node token", noToken: true, pub: pub("pv-1", "a:1"), wantErr: "no node token", wantPrecondition: true},
		{
			name: "epoch",
			pub:  map[string]string{PublishContextExport: "pv-1", PublishContextAddresses: "a:1", PublishContextEpoch: "42"},
			want: attachSpec{Transport: attach.Auto, FSType: "ext4", Target: attach.Target{VolumeID: "pv-1", Export: "pv-1/" + testNodeToken + "@42", Addrs: []string{"a:1"}}},
		},
		{name: "bad epoch", pub: map[string]string{PublishContextExport: "pv-1", PublishContextAddresses: "a:1", PublishContextEpoch: "0"}, wantErr: `"epoch"`},
		{
			name: "everything",
			pub:  pub("e", " 10.0.0.1:1, [fd00::1]:2 "),
			vol: map[string]string{ParamTransport: "relay", ParamFSType: "xfs", ParamDeadConnTimeout: "1m", ParamRequestTimeout: "10s", ParamBlockSize: "1024",
				ParamStorageNode: "ignored here", "csi.storage.k8s.io/pod.name": "p", "storage.kubernetes.io/csiProvisionerIdentity": "id"},
			want: attachSpec{
				Transport: attach.Relay, FSType: "xfs",
				Target:  attach.Target{VolumeID: "pv-1", Export: "e/" + testNodeToken, Addrs: []string{"10.0.0.1:1", "[fd00::1]:2"}},
				Options: attach.Options{DeadConnTimeout: time.Minute, RequestTimeout: 10 * time.Second, BlockSize: 1024},
			},
		},
		{
			name: "replicas",
			pub: map[string]string{PublishContextExport: "pv-1", PublishContextAddresses: "a:1", PublishContextStorageNode: "s1",
				PublishContextReplicas: formatReplicas([]attach.Server{{StorageNode: "s2", Addrs: []string{"b:1", "[fd00::2]:1"}}, {StorageNode: "s3", Addrs: []string{"c:1"}}})},
			want: attachSpec{Transport: attach.Auto, FSType: "ext4", Target: attach.Target{VolumeID: "pv-1", Export: "pv-1/" + testNodeToken, Addrs: []string{"a:1"},
				Replicas: []attach.Server{{StorageNode: "s2", Addrs: []string{"b:1", "[fd00::2]:1"}}, {StorageNode: "s3", Addrs: []string{"c:1"}}}}},
		},
		{name: "replica without a node", pub: map[string]string{PublishContextExport: "e", PublishContextAddresses: "a:1", PublishContextReplicas: "b:1"}, wantErr: `"replicas"`},
		{name: "replica without a port", pub: map[string]string{PublishContextExport: "e", PublishContextAddresses: "a:1", PublishContextReplicas: "s2=b:1;s3=c"}, wantErr: `"replicas": storage node s3`},
		{name: "no export", pub: map[string]string{PublishContextAddresses: "a:1"}, wantErr: `"export"`},
		{name: "no addresses", pub: map[string]string{PublishContextExport: "e"}, wantErr: `"addresses"`},
		{name: "empty address", pub: pub("e", "a:1,"), wantErr: `"addresses"`},
		{name: "no port", pub: pub("e", "a"), wantErr: `"addresses"`},
		{name: "bad fs", pub: pub("e", "a:1"), vol: map[string]string{ParamFSType: "ntfs"}, wantErr: "fsType"},
		{name: "bad timeout", pub: pub("e", "a:1"), vol: map[string]string{ParamRequestTimeout: "soon"}, wantErr: "requestTimeout"},
		{
			name: "encryption required", idDir: "/state/identity",
			pub: map[string]string{PublishContextExport: "pv-1", PublishContextAddresses: "a:1", PublishContextStorageNode: "store-1"},
			vol: map[string]string{ParamEncryption: "required"},
			want: attachSpec{Transport: attach.Auto, FSType: "ext4", Target: attach.Target{VolumeID: "pv-1", Export: "pv-1", Addrs: []string{"a:1"},
				TLS: &attach.TargetTLS{StorageNode: "store-1", IdentityDir: "/state/identity"}}},
		},
		{
			name: "encryption preferred", idDir: "/state/identity",
			pub: map[string]string{PublishContextExport: "pv-1", PublishContextAddresses: "a:1", PublishContextStorageNode: "store-1"},
			vol: map[string]string{ParamEncryption: "preferred"},
			want: attachSpec{Transport: attach.Auto, FSType: "ext4", Target: attach.Target{VolumeID: "pv-1", Export: "pv-1/" + testNodeToken, Addrs: []string{"a:1"},
				TLS: &attach.TargetTLS{StorageNode: "store-1", IdentityDir: "/state/identity", Optional: true}}},
		},
		{
			name: "encryption preferred without a certificate",
			pub:  map[string]string{PublishContextExport: "pv-1", PublishContextAddresses: "a:1", PublishContextStorageNode: "store-1"},
			vol:  map[string]string{ParamEncryption: "preferred"},
			want: attachSpec{Transport: attach.Auto, FSType: "ext4", Target: attach.Target{VolumeID: "pv-1", Export: "pv-1/" + testNodeToken, Addrs: []string{"a:1"}}},
		},
		{name: "encryption required, no storage node", idDir: "/id", pub: pub("pv-1", "a:1"), vol: map[string]string{ParamEncryption: "required"}, wantErr: `"storageNode"`},
		{name: "bad encryption", pub: pub("e", "a:1"), vol: map[string]string{ParamEncryption: "yes"}, wantErr: "encryption"},
		{
			name: "encryption required without a certificate", pub: map[string]string{PublishContextExport: "pv-1", PublishContextAddresses: "a:1", PublishContextStorageNode: "s"},
			vol: map[string]string{ParamEncryption: "required"}, wantErr: "no node certificate", wantPrecondition: true,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tok := testNodeToken
			if tt.noToken {
				tok = ""
			}
			got, err := parseAttachSpec("pv-1", tt.pub, tt.vol, tt.idDir, tok)
			if tt.wantErr != "" {
				want := ErrInvalidArgument
				if tt.wantPrecondition {
					want = ErrPrecondition
				}
				if !errors.Is(err, want) || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v, want %v naming %s", err, want, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got.Transport != tt.want.Transport || got.FSType != tt.want.FSType || got.Options != tt.want.Options ||
				got.Target.VolumeID != tt.want.Target.VolumeID || got.Target.Export != tt.want.Target.Export || !slices.Equal(got.Target.Addrs, tt.want.Target.Addrs) ||
				!slices.EqualFunc(got.Target.Replicas, tt.want.Target.Replicas, func(a, b attach.Server) bool {
					return a.StorageNode == b.StorageNode && slices.Equal(a.Addrs, b.Addrs)
				}) ||
				(got.Target.TLS == nil) != (tt.want.Target.TLS == nil) || got.Target.TLS != nil && *got.Target.TLS != *tt.want.Target.TLS {
				t.Errorf("got %+v, want %+v", got, tt.want)
			}
		})
	}
}
