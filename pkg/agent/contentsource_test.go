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

package agent

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
)

// TestContentSourceNamesOnly: a content source that is not an object's
// name (a path climbing out of the data directory, an absolute path, a
// name the API server would refuse) fails the volume with InvalidArgument
// and the offending value in its status; no file is read or made, inside
// the data directory or out of it.
func TestContentSourceNamesOnly(t *testing.T) {
	e := newDeletionEnv(t)
	// A snapshot file beside the data directory: "../outside" would
	// reach it.
	outside := filepath.Join(filepath.Dir(e.dir), "outside"+snapshotSuffix)
	secret := bytes.Repeat([]byte{0x42}, 4096)
	if err := os.WriteFile(outside, secret, 0o600); err != nil {
		t.Fatal(err)
	}
	for i, cs := range []v1alpha1.ContentSource{
		{Snapshot: "../outside"},
		{Snapshot: "../../etc/x"},
		{Snapshot: "/etc/passwd"},
		{Snapshot: outside[:len(outside)-len(snapshotSuffix)]},
		{Snapshot: "a/../../outside"},
		{Snapshot: "Snap_1"},
		{Snapshot: ".."},
		{Volume: "../outside"},
		{Volume: "/etc/x"},
	} {
		name := "vol-cs-" + string(rune('a'+i))
		v := newVolume(name, int64(len(secret)))
		v.Spec.ContentSource = &cs
		if err := e.c.Create(context.Background(), v); err != nil {
			t.Fatal(err)
		}
		e.reconcile(name)
		got := e.object(name)
		value := cs.Snapshot + cs.Volume
		if got.Status.Phase != v1alpha1.VolumeFailed || got.Status.Code != "InvalidArgument" ||
			!strings.Contains(got.Status.Message, value) {
			t.Errorf("content source %+v: status %s %s %q, want Failed InvalidArgument naming %q",
				cs, got.Status.Phase, got.Status.Code, got.Status.Message, value)
		}
		if _, err := os.Stat(filepath.Join(e.dir, name+fileSuffix)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("content source %+v: the volume's backing file: %v, want none", cs, err)
		}
		if _, ok := e.srv.Export(name); ok {
			t.Errorf("content source %+v: the volume is exported", cs)
		}
	}
	if b, err := os.ReadFile(outside); err != nil || !bytes.Equal(b, secret) {
		t.Errorf("the file outside the data directory: %v (unchanged %v)", err, bytes.Equal(b, secret))
	}
}
