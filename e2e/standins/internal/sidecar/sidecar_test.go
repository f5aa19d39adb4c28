package sidecar

import (
	"io"
	"log/slog"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
)

func TestManifestArgs(t *testing.T) {
	all, err := ManifestArgs("deploy/node.yaml", "node-driver-registrar")
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 1 || len(all[0]) == 0 || all[0][0] != "--csi-address=/csi/csi.sock" {
		t.Errorf("args %q", all)
	}
	if _, err := ManifestArgs("deploy/node.yaml", "no-such-container"); err == nil {
		t.Error("missing container found")
	}
}

func TestParseRejects(t *testing.T) {
	fs := NewFlagSet("x", io.Discard)
	fs.String("a", "", "")
	if err := Parse(fs, []string{"--a=1", "--b=2"}); err == nil {
		t.Error("unknown flag accepted")
	}
	fs = NewFlagSet("x", io.Discard)
	if err := Parse(fs, []string{"pos"}); err == nil {
		t.Error("positional argument accepted")
	}
}

func TestTargetAndLevel(t *testing.T) {
	if Target("/csi/csi.sock") != "unix:/csi/csi.sock" || Target("unix:///csi/csi.sock") != "unix:///csi/csi.sock" {
		t.Error("target")
	}
	if Level(2) != slog.LevelInfo || Level(4) != slog.LevelDebug || Level(5) != slog.LevelDebug {
		t.Error("level")
	}
}

func TestAccessMode(t *testing.T) {
	for _, tc := range []struct {
		m    corev1.PersistentVolumeAccessMode
		snmw bool
		want csi.VolumeCapability_AccessMode_Mode
	}{
		{corev1.ReadWriteOnce, true, csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER},
		{corev1.ReadWriteOnce, false, csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		{corev1.ReadWriteOncePod, true, csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER},
		{corev1.ReadWriteOncePod, false, csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		{corev1.ReadOnlyMany, true, csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY},
		{corev1.ReadWriteMany, false, csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER},
	} {
		got, err := AccessMode(tc.m, tc.snmw)
		if err != nil || got != tc.want {
			t.Errorf("%s snmw=%v: %v %v, want %v", tc.m, tc.snmw, got, err, tc.want)
		}
	}
	if _, err := AccessMode("Sometimes", true); err == nil {
		t.Error("unknown mode accepted")
	}
}
