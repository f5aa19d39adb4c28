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
	"context"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
)

// TestCreateVolumeFSMinimum checks that CreateVolume raises a small xfs
// Filesystem volume to the 300 MiB mkfs.xfs needs, refuses it when
// limit_bytes is below that, and leaves Block and ext4 volumes alone.
func TestCreateVolumeFSMinimum(t *testing.T) {
	const (
		mib     = int64(1) << 20
		xfsMin  = int64(314572800) // 300 MiB
		xfsName = "xfs"
	)
	xfs := map[string]string{"fsType": xfsName}
	ext4 := map[string]string{"fsType": "ext4"}
	withRange := func(req *csi.CreateVolumeRequest, required, limit int64) *csi.CreateVolumeRequest {
		req.CapacityRange = &csi.CapacityRange{RequiredBytes: required, LimitBytes: limit}
		return req
	}
	for _, tc := range []struct {
		name string
		req  *csi.CreateVolumeRequest
		want int64      // size of the volume; 0 when the call fails
		code codes.Code // when it fails
		msgs []string
	}{
		{name: "100Mi xfs rounded up", req: createReq("", 100*mib, xfs), want: xfsMin},
		{name: "100Mi xfs from the capability's fs_type", want: xfsMin,
			req: createReq("", 100*mib, nil, mountCap(rwo, xfsName))},
		{name: "100Mi xfs with 512-byte blocks", want: xfsMin,
			req: createReq("", 100*mib, map[string]string{"fsType": xfsName, "blockSize": "512"})},
		{name: "100Mi xfs limit 300Mi", req: withRange(createReq("", 0, xfs), 100*mib, xfsMin), want: xfsMin},
		{name: "100Mi xfs limit 1Gi", req: withRange(createReq("", 0, xfs), 100*mib, gib), want: xfsMin},
		{name: "100Mi xfs limit 200Mi refused", req: withRange(createReq("", 0, xfs), 100*mib, 200*mib),
			code: codes.OutOfRange, msgs: []string{"xfs", "314572800", "300 MiB", "limit_bytes 209715200"}},
		{name: "xfs with only a limit of 200Mi refused", req: withRange(createReq("", 0, xfs), 0, 200*mib),
			code: codes.OutOfRange, msgs: []string{"314572800"}},
		{name: "1Gi xfs unchanged", req: createReq("", gib, xfs), want: gib},
		{name: "xfs default size unchanged", req: createReq("", 0, xfs), want: gib},
		{name: "301Mi xfs unchanged", req: createReq("", 301*mib, xfs), want: 301 * mib},
		{name: "100Mi ext4 unchanged", req: createReq("", 100*mib, ext4), want: 100 * mib},
		{name: "100Mi default fs unchanged", req: createReq("", 100*mib, nil), want: 100 * mib},
		{name: "capability's ext4 wins over xfs parameter", want: 100 * mib,
			req: createReq("", 100*mib, xfs, mountCap(rwo, "ext4"))},
		{name: "100Mi xfs Block unchanged", req: createReq("", 100*mib, xfs, rawCap(rwo)), want: 100 * mib},
		{name: "xfs Block limit 200Mi unchanged", req: withRange(createReq("", 0, xfs, rawCap(rwo)), 100*mib, 200*mib),
			want: 100 * mib},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctl, c, _ := setup(t)
			tc.req.Name = "sized"
			resp, err := ctl.CreateVolume(context.Background(), tc.req)
			if tc.want == 0 {
				wantStatus(t, err, tc.code, tc.msgs...)
				var list v1alpha1.NBDVolumeList
				if err := c.List(context.Background(), &list); err != nil {
					t.Fatal(err)
				}
				if len(list.Items) != 0 {
					t.Errorf("a refused call left %d NBDVolumes", len(list.Items))
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := resp.GetVolume().GetCapacityBytes(); got != tc.want {
				t.Errorf("capacity %d bytes, want %d", got, tc.want)
			}
			if got := getVolume(t, c, resp.GetVolume().GetVolumeId()).Spec.SizeBytes; got != tc.want {
				t.Errorf("spec.sizeBytes %d, want %d", got, tc.want)
			}
			// A retry of the same call finds the (raised) volume fitting.
			again, err := ctl.CreateVolume(context.Background(), tc.req)
			if err != nil || again.GetVolume().GetCapacityBytes() != tc.want {
				t.Errorf("repeated CreateVolume = %v, %v; want %d bytes", again, err, tc.want)
			}
		})
	}
}
