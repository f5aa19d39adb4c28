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
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

func TestParseParams(t *testing.T) {
	p, err := ParseParams(map[string]string{
		"fsType": "xfs", "transport": "relay", "storageNode": "node-a", "storageNodeSelector": "zone=a, rack=3",
		"deadConnTimeout": "90s", "requestTimeout": "10s", "deadPeerTimeout": "4s", "blockSize": "512", "encryption": "required", "replicas": "2",
		"csi.storage.k8s.io/pvc/name": "data",
	})
	if err != nil {
		t.Fatal(err)
	}
	if p.FSType != "xfs" || p.Transport != attach.Relay || p.StorageNode != "node-a" || p.NodeSelector["rack"] != "3" ||
		p.DeadConnTimeout != 90*time.Second || p.RequestTimeout != 10*time.Second || p.DeadPeerTimeout != 4*time.Second || p.BlockSize != 512 || p.Encryption != "required" || p.Replicas != 2 {
		t.Fatalf("%+v", p)
	}
	def, err := ParseParams(nil)
	if err != nil || def.FSType != "ext4" || def.Transport != attach.Auto || def.Encryption != "none" || def.Replicas != 1 {
		t.Fatalf("defaults: %+v %v", def, err)
	}
}

func TestParseParamsEncryptionNeedsATransportThatCan(t *testing.T) {
	for _, tr := range []string{"kernel", "tcp", "multiconn"} {
		_, err := ParseParams(map[string]string{"encryption": "required", "transport": tr})
		if !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "encryption") || !strings.Contains(err.Error(), tr) {
			t.Errorf("required with %s: %v", tr, err)
		}
		if _, err := ParseParams(map[string]string{"encryption": "preferred", "transport": tr}); err != nil {
			t.Errorf("preferred with %s: %v", tr, err)
		}
	}
	for _, tr := range []string{"auto", "relay", "ublk", "fuse"} {
		if _, err := ParseParams(map[string]string{"encryption": "required", "transport": tr}); err != nil {
			t.Errorf("required with %s: %v", tr, err)
		}
	}
}

// A kernel socket must die of the dead-peer bound before the kernel's
// request timeout requeues its requests: a class that sets both keeps
// the request timeout at least twice the bound.
func TestParseParamsDeadPeerBelowRequestTimeout(t *testing.T) {
	_, err := ParseParams(map[string]string{"requestTimeout": "10s", "deadPeerTimeout": "6s"})
	if !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "deadPeerTimeout") || !strings.Contains(err.Error(), "requestTimeout") {
		t.Fatalf("requestTimeout 10s with deadPeerTimeout 6s: %v", err)
	}
	if _, err := ParseParams(map[string]string{"requestTimeout": "10s", "deadPeerTimeout": "5s"}); err != nil {
		t.Fatal(err)
	}
}

func TestParseParamsErrorsNameTheKey(t *testing.T) {
	for key, val := range map[string]string{
		"fsType": "btrfs", "transport": "iscsi", "storageNode": "a b", "storageNodeSelector": "novalue",
		"deadConnTimeout": "forever", "requestTimeout": "-1s", "deadPeerTimeout": "1s", "blockSize": "8192", "replicas": "4", "encryption": "yes",
	} {
		_, err := ParseParams(map[string]string{key: val})
		if !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), key) {
			t.Errorf("%s=%s: %v", key, val, err)
		}
		if st, _ := status.FromError(toStatus(err)); st.Code() != codes.InvalidArgument {
			t.Errorf("%s: code %v", key, st.Code())
		}
	}
}

func TestToStatus(t *testing.T) {
	cases := map[error]codes.Code{
		ErrNotFound:                codes.NotFound,
		ErrAlreadyExists:           codes.AlreadyExists,
		ErrExhausted:               codes.ResourceExhausted,
		ErrPrecondition:            codes.FailedPrecondition,
		ErrAborted:                 codes.Aborted,
		attach.ErrServerRefused:    codes.FailedPrecondition,
		attach.ErrUnsupported:      codes.Unavailable,
		errors.New("disk on fire"): codes.Internal,
	}
	for err, want := range cases {
		st, _ := status.FromError(toStatus(err))
		if st.Code() != want {
			t.Errorf("%v: %v, want %v", err, st.Code(), want)
		}
	}
	if toStatus(nil) != nil {
		t.Error("nil error mapped to a status")
	}
	pre := status.Error(codes.OutOfRange, "x")
	if toStatus(pre) != pre {
		t.Error("status errors must pass through")
	}
}
