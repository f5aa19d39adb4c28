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
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/nbd"
	"github.com/mpnbd/mpnbd/pkg/replica"
)

// reignFile, in a volume's log directory, holds the primary epoch whose
// first start here reconciled this node's own ledger.
const reignFile = "reconciled-reign"

// reconcileUnsettled makes the replicas in sync agree with this node's
// copy on every chunk that a forward may have left unsettled, before this
// node serves as the primary (docs/replication.md, "Unsettled writes"):
// the chunks the replicas' ledgers hold (forwards of an earlier primary,
// or of this node's previous process), and, at the first start of this
// node's reign, the chunks its own ledger held while it was a replica.
// This copy's data wins: no node was told of those writes either way. A
// replica that cannot tell, does not answer, or fails the copy is
// recorded out of the in-sync set (it is copied whole later); so is every
// other replica when this node's own ledger is needed and lost (its agent
// restarted since the promotion). It returns the record as it stands
// after its decisions.
func (a *Agent) reconcileUnsettled(ctx context.Context, log *slog.Logger, vol *v1alpha1.NBDVolume, rec *v1alpha1.ReplicationStatus) (*v1alpha1.ReplicationStatus, error) {
	var peers []string
	for _, n := range rec.InSync {
		if n != a.cfg.NodeName && slices.Contains(vol.Spec.ReplicaNodes, n) {
			peers = append(peers, n)
		}
	}
	marker := filepath.Join(a.logDir(vol.Name), reignFile)
	if rec.PrimaryEpoch == 1 && readReign(marker) == 0 {
		// The volume's first primary, starting for the first time:
		// nothing was ever forwarded.
		return rec, writeReign(marker, 1)
	}
	var chunks []nbd.Range
	drop := map[string]error{}
	// Reign 1 had no primary before it; a reign reconciled here before
	// needs only the others' ledgers.
	if rec.PrimaryEpoch > 1 && readReign(marker) != rec.PrimaryEpoch {
		a.mu.RLock()
		l := a.ledgers[vol.Name]
		a.mu.RUnlock()
		var own []nbd.Range
		known := false
		if l != nil {
			own, known = l.Unsettled()
		}
		if !known {
			for _, n := range peers {
				drop[n] = errors.New("this node's ledger of its old primary's unsettled forwards is lost (its agent restarted since the promotion)")
			}
		}
		chunks = append(chunks, own...)
	}
	conns := map[string]*nbd.Client{}
	defer func() {
		for _, cl := range conns {
			cl.Close()
		}
	}()
	for _, n := range peers {
		if drop[n] != nil {
			continue
		}
		// A first request on a connection of this reign's session
		// fences the older ones (this node's previous process's): what
		// they had read is in the ledger once it is answered.
		fence, err := a.dialReplica(ctx, vol.Name, n, rec.PrimaryEpoch)
		if err == nil {
			err = fence.Flush()
			fence.Close()
		}
		var cl *nbd.Client
		if err == nil {
			cl, err = a.dialReplica(ctx, vol.Name, n, rec.PrimaryEpoch, replica.InfoUnsettled)
		}
		if err != nil {
			drop[n] = fmt.Errorf("not reachable to tell its unsettled chunks: %w", err)
			continue
		}
		conns[n] = cl
		theirs, known, err := replica.DecodeUnsettled(cl.Info().Infos[replica.InfoUnsettled])
		switch {
		case err != nil:
			drop[n] = fmt.Errorf("its unsettled chunks: %w (an agent of an older release?)", err)
		case !known:
			drop[n] = errors.New("its ledger cannot tell its unsettled chunks (its agent restarted)")
		default:
			chunks = append(chunks, theirs...)
			continue
		}
		cl.Close()
		delete(conns, n)
	}
	copied, err := a.copyChunks(vol.Name, chunks, conns, drop)
	if err != nil {
		return nil, err
	}
	// The decisions, before anything is served.
	arb := &VolumeArbiter{Client: a.client, Reader: a.reader, Volume: vol.Name, Self: a.cfg.NodeName}
	out := *rec
	out.InSync = slices.Clone(rec.InSync)
	for _, n := range slices.Sorted(maps.Keys(drop)) {
		epoch, err := arb.Drop(ctx, out.Epoch, n, drop[n])
		if err != nil {
			return nil, fmt.Errorf("recording that replica %s leaves the in-sync set: %w", n, err)
		}
		log.Warn("a replica left the in-sync set before the primary served: its unsettled chunks could not be reconciled", "replica", n, "epoch", epoch, "cause", drop[n])
		out.Epoch = epoch
		out.InSync = slices.DeleteFunc(out.InSync, func(x string) bool { return x == n })
	}
	out.InSyncReplicas = int32(len(out.InSync))
	if err := writeReign(marker, rec.PrimaryEpoch); err != nil {
		return nil, err
	}
	if copied > 0 || len(drop) > 0 {
		log.Info("unsettled chunks reconciled before serving", "chunks", copied, "replicas", slices.Sorted(maps.Keys(conns)), "dropped", len(drop))
	}
	return &out, nil
}

// copyChunks writes this node's copy of every chunk of ranges (cut to
// the volume's size) to each replica of conns and flushes them; a replica that fails
// leaves conns for drop. It returns how many chunks it copied.
func (a *Agent) copyChunks(volume string, ranges []nbd.Range, conns map[string]*nbd.Client, drop map[string]error) (int, error) {
	a.mu.RLock()
	v := a.vols[volume]
	a.mu.RUnlock()
	if v == nil || v.backend == nil {
		return 0, fmt.Errorf("volume %s is not open", volume)
	}
	size := v.backend.Size()
	seen := map[int64]bool{}
	buf := make([]byte, replica.Chunk)
	n := 0
	for _, r := range ranges {
		for off := r.Off / replica.Chunk * replica.Chunk; off < r.Off+r.Len && off < size; off += replica.Chunk {
			if seen[off] || len(conns) == 0 {
				continue
			}
			seen[off] = true
			b := buf[:min(replica.Chunk, size-off)]
			if _, err := v.backend.ReadAt(b, off); err != nil {
				return n, fmt.Errorf("reading this copy at %d: %w", off, err)
			}
			for name, cl := range conns {
				if _, err := cl.WriteAt(b, off); err != nil {
					drop[name] = fmt.Errorf("copying an unsettled chunk to it: %w", err)
					cl.Close()
					delete(conns, name)
				}
			}
			n++
		}
	}
	for name, cl := range conns {
		if err := cl.Flush(); err != nil {
			drop[name] = fmt.Errorf("flushing the unsettled chunks copied to it: %w", err)
			cl.Close()
			delete(conns, name)
		}
	}
	return n, nil
}

// readReign reads the primary epoch in path (0 when there is none).
func readReign(path string) int64 {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	n, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	return n
}

// writeReign records epoch in path, durably.
func writeReign(path string, epoch int64) error {
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("recording the reconciled reign: %w", err)
	}
	_, err = fmt.Fprintf(f, "%d\n", epoch)
	err = cmp.Or(err, f.Sync(), f.Close())
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err == nil {
		var d *os.File
		if d, err = os.Open(filepath.Dir(path)); err == nil {
			err = cmp.Or(d.Sync(), d.Close())
		}
	}
	if err != nil {
		return fmt.Errorf("recording the reconciled reign: %w", err)
	}
	return nil
}
