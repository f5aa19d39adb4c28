package driver

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

func TestParseAttachSpec(t *testing.T) {
	pub := func(export, addrs string) map[string]string {
		return map[string]string{PublishContextExport: export, PublishContextAddresses: addrs}
	}
	tests := []struct {
		name    string
		pub     map[string]string
		vol     map[string]string
		want    attachSpec
		wantErr string
	}{
		{
			name: "defaults",
			pub:  pub("pv-1.tok", "10.0.0.1:10809"),
			want: attachSpec{Transport: attach.Auto, FSType: "ext4", Target: attach.Target{VolumeID: "pv-1", Export: "pv-1.tok", Addrs: []string{"10.0.0.1:10809"}}},
		},
		{
			name: "everything",
			pub:  pub("e", " 10.0.0.1:1, [fd00::1]:2 "),
			vol: map[string]string{ParamTransport: "relay", ParamFSType: "xfs", ParamDeadConnTimeout: "1m", ParamRequestTimeout: "10s", ParamBlockSize: "1024",
				ParamStorageNode: "ignored here", "csi.storage.k8s.io/pod.name": "p", "storage.kubernetes.io/csiProvisionerIdentity": "id"},
			want: attachSpec{
				Transport: attach.Relay, FSType: "xfs",
				Target:  attach.Target{VolumeID: "pv-1", Export: "e", Addrs: []string{"10.0.0.1:1", "[fd00::1]:2"}},
				Options: attach.Options{DeadConnTimeout: time.Minute, RequestTimeout: 10 * time.Second, BlockSize: 1024},
			},
		},
		{name: "no export", pub: map[string]string{PublishContextAddresses: "a:1"}, wantErr: `"export"`},
		{name: "no addresses", pub: map[string]string{PublishContextExport: "e"}, wantErr: `"addresses"`},
		{name: "empty address", pub: pub("e", "a:1,"), wantErr: `"addresses"`},
		{name: "no port", pub: pub("e", "a"), wantErr: `"addresses"`},
		{name: "bad fs", pub: pub("e", "a:1"), vol: map[string]string{ParamFSType: "ntfs"}, wantErr: "fsType"},
		{name: "bad timeout", pub: pub("e", "a:1"), vol: map[string]string{ParamRequestTimeout: "soon"}, wantErr: "requestTimeout"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseAttachSpec("pv-1", tt.pub, tt.vol)
			if tt.wantErr != "" {
				if !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v, want InvalidArgument naming %s", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got.Transport != tt.want.Transport || got.FSType != tt.want.FSType || got.Options != tt.want.Options ||
				got.Target.VolumeID != tt.want.Target.VolumeID || got.Target.Export != tt.want.Target.Export || !slices.Equal(got.Target.Addrs, tt.want.Target.Addrs) {
				t.Errorf("got %+v, want %+v", got, tt.want)
			}
		})
	}
}
