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

package nbddev

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// record is what a state file keeps about an attached volume, so that a
// fresh process can re-adopt its devices. Export names may carry a
// per-node secret: the files are private to root.
type record struct {
	Mode    attach.Transport `json:"mode"`
	Target  attach.Target    `json:"target"`
	Options attach.Options   `json:"options"`
	// Session is the volume's NBD session, kept so that the connections of
	// a re-adopting process supersede (and fence) those of the last one.
	Session nbd.SessionID `json:"session"`
}

func (a *Attacher) statePath(volumeID string) string {
	return filepath.Join(a.cfg.StateDir, stateName(volumeID)+".json")
}

// stateName keeps volume IDs from escaping the state directory.
func stateName(id string) string {
	return strings.NewReplacer("/", "_", "\x00", "_").Replace(id)
}

func (a *Attacher) saveState(v *volume) error {
	if a.cfg.StateDir == "" {
		return nil
	}
	b, err := json.Marshal(record{Mode: a.cfg.Mode, Target: v.target, Options: v.opts, Session: v.session})
	if err != nil {
		return err
	}
	return attach.WriteFileAtomic(a.statePath(v.target.VolumeID), b)
}

// loadSession returns the session recorded for a volume, or a new one.
func (a *Attacher) loadSession(volumeID string) nbd.SessionID {
	if a.cfg.StateDir != "" {
		if b, err := os.ReadFile(a.statePath(volumeID)); err == nil {
			var r record
			if json.Unmarshal(b, &r) == nil && r.Session != (nbd.SessionID{}) {
				return r.Session
			}
		}
	}
	return nbd.NewSessionID()
}

func (a *Attacher) dropState(volumeID string) {
	if a.cfg.StateDir == "" {
		return
	}
	if err := os.Remove(a.statePath(volumeID)); err != nil && !errors.Is(err, os.ErrNotExist) {
		a.log.Warn("remove state file", "volume_id", volumeID, "error", err)
	}
}

// Adopt re-adopts, after a restart, every volume of this transport that
// the state directory lists and whose device still exists (found by its
// backend identifier): fresh sockets go to the kernel with RECONFIGURE and
// the relay is rebuilt. State for devices that are gone is removed.
func (a *Attacher) Adopt(ctx context.Context) ([]*attach.Attachment, error) {
	if a.cfg.StateDir == "" {
		return nil, nil
	}
	files, err := filepath.Glob(filepath.Join(a.cfg.StateDir, "*.json"))
	if err != nil {
		return nil, err
	}
	var out []*attach.Attachment
	var errs []error
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		var r record
		if err := json.Unmarshal(b, &r); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", f, err))
			continue
		}
		if r.Mode != a.cfg.Mode {
			continue
		}
		if _, found, err := a.cfg.Devices.FindByBackend(r.Target.VolumeID); err != nil {
			errs = append(errs, err)
			continue
		} else if !found {
			a.log.Info("dropping state of a volume whose device is gone", "volume_id", r.Target.VolumeID)
			a.dropState(r.Target.VolumeID)
			continue
		}
		att, err := a.Attach(ctx, r.Target, r.Options)
		if err != nil {
			errs = append(errs, fmt.Errorf("re-adopt %s: %w", r.Target.VolumeID, err))
			continue
		}
		out = append(out, att)
	}
	return out, errors.Join(errs...)
}
