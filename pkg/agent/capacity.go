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
	"context"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/snapshot"
)

// usage is the data directory's filesystem, its volume files and its
// snapshot files.
type usage struct {
	capacity int64 // filesystem size
	free     int64 // bytes an unprivileged writer may still allocate
	// reserved is what the volume files may still allocate: for each, its
	// size minus its allocated bytes, plus its bytes shared with a snapshot
	// or a clone, which a write to them copies to new blocks.
	reserved int64
	// shared is the volume files' bytes shared with other files.
	shared int64
	// snapshots is the number of snapshot files; snapshotBytes is what
	// they use on their own (allocated, not shared). Snapshots are never
	// written, so they reserve nothing.
	snapshots     int
	snapshotBytes int64
	files         []string // volume names of the *.img files
}

// available is what new volumes may take if every volume filled up.
func (u usage) available() int64 {
	return max(0, u.free-u.reserved)
}

// diskUsage measures dir: statfs of its filesystem, every *.img file and
// every *.snap file.
func diskUsage(dir string) (usage, error) {
	var u usage
	var err error
	if u.capacity, u.free, err = fsSpace(dir); err != nil {
		return u, err
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return u, err
	}
	for _, e := range entries {
		name, volume := strings.CutSuffix(e.Name(), fileSuffix)
		ok := volume
		if !volume {
			name, ok = strings.CutSuffix(e.Name(), snapshotSuffix)
		}
		if !ok || name == "" || !e.Type().IsRegular() {
			continue
		}
		fi, err := e.Info()
		if err != nil {
			continue // removed meanwhile
		}
		space := fileSpace(filepath.Join(dir, e.Name()), fi)
		if volume {
			u.files = append(u.files, name)
			u.reserved += max(0, fi.Size()-space.Allocated) + space.Shared
			u.shared += space.Shared
		} else {
			u.snapshots++
			u.snapshotBytes += max(0, space.Allocated-space.Shared)
		}
	}
	return u, nil
}

// fileSpace is what the file at path uses; where its extents cannot be
// read, its allocated bytes as fi tells them and no sharing.
func fileSpace(path string, fi fs.FileInfo) snapshot.Space {
	if s, err := snapshot.Usage(path); err == nil {
		return s
	}
	return snapshot.Space{Allocated: allocated(fi)}
}

// runHeartbeat reports the NBDStorageNode at start, every heartbeat
// interval and soon after a volume is created, grown or deleted.
func (a *Agent) runHeartbeat(ctx context.Context) error {
	if a.mgrCache != nil && !a.mgrCache.WaitForCacheSync(ctx) {
		return nil
	}
	t := time.NewTicker(a.cfg.HeartbeatInterval)
	defer t.Stop()
	var lastOrphans []string
	for {
		orphans, err := a.reportNode(ctx)
		a.started.Store(true)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			a.log.Warn("storage node report failed", "error", err)
		} else if !slices.Equal(orphans, lastOrphans) {
			if len(orphans) > 0 {
				a.log.Warn("backing files without an NBDVolume (kept, not deleted)", "data_dir", a.cfg.DataDir, "orphans", orphans)
			}
			lastOrphans = orphans
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		case <-a.capacityKick:
		}
	}
}

// reportNode writes the NBDStorageNode status (creating the object if
// missing) and returns the orphan files it reported.
func (a *Agent) reportNode(ctx context.Context) ([]string, error) {
	u, err := diskUsage(a.cfg.DataDir)
	if err != nil {
		return nil, fmt.Errorf("measuring %s: %w", a.cfg.DataDir, err)
	}
	if a.cfg.Exports != nil {
		// Before the API calls: the metrics stay current while the API
		// server is out of reach.
		a.cfg.Exports.Capacity(u.capacity, u.available())
	}
	var vols v1alpha1.NBDVolumeList
	if err := a.client.List(ctx, &vols); err != nil {
		return nil, fmt.Errorf("listing volumes: %w", err)
	}
	if a.replicas != nil {
		var held v1alpha1.NBDVolumeList
		if err := a.replicas.List(ctx, &held); err != nil {
			return nil, fmt.Errorf("listing the volumes of the replicas held here: %w", err)
		}
		vols.Items = append(vols.Items, held.Items...)
	}
	known := make(map[string]bool, len(vols.Items))
	for _, v := range vols.Items {
		if v.Spec.StorageNode == a.cfg.NodeName || slices.Contains(v.Spec.ReplicaNodes, a.cfg.NodeName) {
			known[v.Name] = true
		}
	}
	var orphans []string
	for _, f := range u.files {
		if !known[f] {
			orphans = append(orphans, f)
		}
	}
	slices.Sort(orphans)

	// Read uncached: the agent needs only its own NBDStorageNode.
	var node v1alpha1.NBDStorageNode
	err = a.reader.Get(ctx, types.NamespacedName{Name: a.cfg.NodeName}, &node)
	if apierrors.IsNotFound(err) {
		node = v1alpha1.NBDStorageNode{ObjectMeta: metav1.ObjectMeta{Name: a.cfg.NodeName}}
		if err = a.client.Create(ctx, &node); err == nil {
			a.log.Info("storage node created")
		}
	}
	if err != nil {
		return nil, fmt.Errorf("storage node %s: %w", a.cfg.NodeName, err)
	}
	a.nodeUID.Store(node.UID)
	orig := node.DeepCopy()
	node.Status = v1alpha1.NBDStorageNodeStatus{
		CapacityBytes:  u.capacity,
		AvailableBytes: u.available(),
		Addresses:      append([]string(nil), a.cfg.Addresses...),
		Port:           a.cfg.Port,
		Topology:       a.cfg.Topology,
		Heartbeat:      metav1.Now(),
		Orphans:        orphans,
		Snapshots:      int32(min(u.snapshots, math.MaxInt32)),
		SnapshotBytes:  u.snapshotBytes,
		SharedBytes:    u.shared,
		// The controller's (Ready): an agent cannot say it is gone.
		Conditions: node.Status.Conditions,
	}
	if err := a.client.Status().Patch(ctx, &node, client.MergeFrom(orig)); err != nil {
		return nil, fmt.Errorf("storage node %s status: %w", a.cfg.NodeName, err)
	}
	return orphans, nil
}
