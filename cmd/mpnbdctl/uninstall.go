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
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"k8s.io/apimachinery/pkg/api/meta"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/access"
)

// errVolumesExist: uninstall-check found volumes.
var errVolumesExist = errors.New("volumes exist")

// uninstallCheck says whether the driver can go without stranding a
// volume or snapshot: it fails, listing them, while any NBDVolume or
// NBDSnapshot exists. The chart
// runs it as a pre-delete hook, so that helm uninstall refuses instead of
// removing the storage agents and the node plugins from under volumes in
// use (their backing files would stay, their NBDVolumes stuck behind the
// agent's finalizer, the pods using them with I/O errors).
func uninstallCheck(ctx context.Context, o *options, api client.Reader, w io.Writer) error {
	inv, err := readInventory(ctx, api, o)
	if err != nil {
		if meta.IsNoMatchError(errors.Unwrap(err)) || meta.IsNoMatchError(err) {
			fmt.Fprintln(w, "no volumes: the mpnbd CRDs are not installed")
			return nil
		}
		return err
	}
	// Snapshots hold files on the storage nodes too, behind the agent's
	// finalizer (none on a release from before snapshots).
	var snaps v1alpha1.NBDSnapshotList
	if err := api.List(ctx, &snaps); err != nil && !meta.IsNoMatchError(err) {
		return fmt.Errorf("listing NBDSnapshots: %w", err)
	}
	if len(inv.volumes) == 0 && len(snaps.Items) == 0 {
		fmt.Fprintln(w, "no volumes: the driver can be uninstalled")
		return nil
	}
	if len(snaps.Items) > 0 {
		fmt.Fprintf(w, "%d snapshot(s) still exist; their files stay on the storage nodes:\n", len(snaps.Items))
		for _, s := range snaps.Items {
			origin := s.Annotations[access.AnnotationVolumeSnapshot]
			if origin == "" {
				origin = "no VolumeSnapshot"
			}
			fmt.Fprintf(w, "  %s\t%s\tof volume %s\tstorage node %s\n", s.Name, origin, s.Spec.SourceVolume, s.Spec.StorageNode)
		}
		fmt.Fprintln(w, "Delete the VolumeSnapshots (and the VolumeSnapshotContents a Retain deletion policy keeps), wait until `kubectl get nbdsnap` lists none.")
	}
	if len(inv.volumes) == 0 {
		fmt.Fprintln(w, "`helm uninstall --no-hooks` skips this check and leaves them behind.")
		return errVolumesExist
	}
	rep := buildReport(inv, nil)
	fmt.Fprintf(w, "%d volume(s) still exist; uninstalling the driver now would strand them, and the pods using them:\n", len(rep.Volumes))
	for _, v := range rep.Volumes {
		claim := v.PVC
		if claim == "" {
			claim = "no claim"
		}
		var nodes []string
		for _, p := range v.Publications {
			nodes = append(nodes, p.Node)
		}
		pub := "not published"
		if len(nodes) > 0 {
			pub = "published to " + strings.Join(nodes, ",")
		}
		fmt.Fprintf(w, "  %s\t%s\tstorage node %s\t%s\n", v.Name, claim, v.StorageNode, pub)
	}
	fmt.Fprintln(w, "Delete the claims (and the PVs a Retain reclaim policy keeps), wait until `kubectl get nbdvol` lists none, then uninstall.")
	fmt.Fprintln(w, "`helm uninstall --no-hooks` skips this check and leaves them behind.")
	return errVolumesExist
}
