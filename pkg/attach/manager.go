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

package attach

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
)

// Manager routes attaches to the transports this node has and resolves
// auto: kernel where the kernel accepts MPTCP sockets (learnt from the
// first refusal and remembered), else ublk where the kernel has it, else
// relay, else fuse.
type Manager struct {
	attachers map[Transport]Attacher
	log       *slog.Logger

	// serversDir, when set, keeps per volume the storage nodes its
	// servers named (KeepServersIn).
	serversDir string

	mu             sync.Mutex
	kernelRefused  bool
	kernelRefusal  string // the first refusal's reason
	chosen         map[string]Transport
	fallbackEvents []Fallback
}

// Fallback records one automatic fallback, for logs and status.
type Fallback struct {
	VolumeID string
	From, To Transport
	Reason   string
}

// NewManager returns a manager over the given transports; a transport
// missing from the map is unavailable on this node.
func NewManager(attachers map[Transport]Attacher, log *slog.Logger) *Manager {
	if log == nil {
		log = slog.Default()
	}
	return &Manager{attachers: attachers, log: log, chosen: make(map[string]Transport)}
}

// KeepServersIn makes every volume attached from now on keep, in a file
// of its own under dir, the storage nodes its servers name as holding it
// (Options.ServersFile), so that the process that serves it after a
// restart, an adopt or a handover reaches it where it is now. The file
// goes with the volume's detach.
func (m *Manager) KeepServersIn(dir string) { m.serversDir = dir }

// serversFile is where volume id keeps its servers; empty without a
// directory. The name is the ID, escaped; an ID that would make a hidden
// or overlong name is named by its hash instead.
func (m *Manager) serversFile(id string) string {
	if m.serversDir == "" || id == "" {
		return ""
	}
	name := url.PathEscape(id)
	if strings.HasPrefix(name, ".") || len(name) > 200 {
		sum := sha256.Sum256([]byte(id))
		name = hex.EncodeToString(sum[:])
	}
	return filepath.Join(m.serversDir, name+".json")
}

// Available lists the transports this node can use, auto excluded.
func (m *Manager) Available() []Transport {
	var out []Transport
	for _, t := range Transports[1:] {
		if _, ok := m.attachers[t]; ok {
			out = append(out, t)
		}
	}
	return out
}

// candidates resolves a requested transport to what will be tried, in
// order; for auto also the transports passed over without a try (missing
// on this node, or the kernel's known refusal), in auto's order.
func (m *Manager) candidates(tr Transport, encrypted bool) (out []Transport, passed []passedOver, err error) {
	if tr != Auto {
		if _, ok := m.attachers[tr]; !ok {
			return nil, nil, fmt.Errorf("%w: %s (this node has %v)", ErrUnsupported, tr, m.Available())
		}
		if encrypted && !CanEncrypt(tr) {
			return nil, nil, fmt.Errorf("%w: the volume's encryption is required, and %s", ErrInvalid, NoEncryption(tr))
		}
		return []Transport{tr}, nil, nil
	}
	m.mu.Lock()
	refused, refusal := m.kernelRefused, m.kernelRefusal
	m.mu.Unlock()
	for _, t := range []Transport{Kernel, Ublk, Relay, FUSE} {
		switch _, ok := m.attachers[t]; {
		case !ok:
			passed = append(passed, passedOver{t, ""})
		case encrypted && !CanEncrypt(t):
			passed = append(passed, passedOver{t, "the volume is encrypted and " + NoEncryption(t)})
		case t == Kernel && refused:
			passed = append(passed, passedOver{t, "refused by an earlier attach on this node: " + refusal})
		default:
			out = append(out, t)
		}
	}
	if len(out) == 0 {
		return nil, nil, fmt.Errorf("%w: no transport for auto on this node", ErrUnsupported)
	}
	return out, passed, nil
}

// NoEncryption says why transport t cannot encrypt (for !CanEncrypt(t)).
func NoEncryption(t Transport) string {
	return fmt.Sprintf("the %s transport cannot encrypt a volume's connections: the kernel's NBD client holds them and speaks no TLS", t)
}

// passedOver is a transport auto did not try: missing on the node
// (reason empty) or known to refuse.
type passedOver struct {
	t      Transport
	reason string
}

// choice says how a volume came to transport c, given what auto passed
// over without a try and the fallbacks of this attach.
func choice(requested, c Transport, passed []passedOver, fallbacks []Fallback) *Choice {
	ch := &Choice{Requested: requested}
	for _, p := range passed {
		if slices.Index(Transports, p.t) > slices.Index(Transports, c) {
			continue // auto never reached it
		}
		if p.reason == "" {
			ch.Missing = append(ch.Missing, p.t)
		} else {
			ch.Skipped = append(ch.Skipped, Fallback{From: p.t, Reason: p.reason})
		}
	}
	ch.Skipped = append(ch.Skipped, fallbacks...)
	// A known refusal skipped without a try falls back to the first
	// transport tried.
	for i := range ch.Skipped {
		if ch.Skipped[i].To == "" {
			ch.Skipped[i].To = c
			if i+1 < len(ch.Skipped) {
				ch.Skipped[i].To = ch.Skipped[i+1].From
			}
		}
	}
	return ch
}

// Attach attaches t with the requested transport (auto falls back on
// ErrUnsupported). The transport used is remembered for Detach and Health.
func (m *Manager) Attach(ctx context.Context, tr Transport, t Target, o Options) (*Attachment, error) {
	if o.ServersFile == "" {
		o.ServersFile = m.serversFile(t.VolumeID)
	}
	m.mu.Lock()
	if prev, ok := m.chosen[t.VolumeID]; ok {
		m.mu.Unlock()
		if tr != Auto && tr != "" && tr != prev {
			return nil, fmt.Errorf("%w: volume %s is attached with %s, not %s", ErrInvalid, t.VolumeID, prev, tr)
		}
		return m.attachers[prev].Attach(ctx, t, o)
	}
	m.mu.Unlock()
	if tr == "" {
		tr = Auto
	}
	cands, passed, err := m.candidates(tr, t.EncryptionRequired())
	if err != nil {
		return nil, err
	}
	var errs []error
	var fallbacks []Fallback
	for i, c := range cands {
		att, err := m.attachers[c].Attach(ctx, t, o)
		if err == nil {
			m.mu.Lock()
			m.chosen[t.VolumeID] = c
			m.mu.Unlock()
			m.log.Info("transport chosen", "volume_id", t.VolumeID, "requested", string(tr), "transport", string(c), "device", att.Device)
			// A copy: the transport may keep att.
			a := *att
			a.Choice = choice(tr, c, passed, fallbacks)
			return &a, nil
		}
		errs = append(errs, fmt.Errorf("%s: %w", c, err))
		if !errors.Is(err, ErrUnsupported) || i == len(cands)-1 {
			break
		}
		fb := Fallback{VolumeID: t.VolumeID, From: c, To: cands[i+1], Reason: err.Error()}
		fallbacks = append(fallbacks, fb)
		m.mu.Lock()
		if c == Kernel && !m.kernelRefused {
			m.kernelRefused, m.kernelRefusal = true, fb.Reason
		}
		m.fallbackEvents = append(m.fallbackEvents, fb)
		m.mu.Unlock()
		m.log.Warn("transport unsupported, falling back", "volume_id", t.VolumeID, "from", string(fb.From), "to", string(fb.To), "reason", fb.Reason)
	}
	return nil, errors.Join(errs...)
}

// Detach detaches a volume with the transport that attached it; for a
// volume this process does not know, every transport is asked (each
// succeeds on volumes it does not have).
func (m *Manager) Detach(ctx context.Context, volumeID string) error {
	m.mu.Lock()
	tr, ok := m.chosen[volumeID]
	m.mu.Unlock()
	if ok {
		if err := m.attachers[tr].Detach(ctx, volumeID); err != nil {
			return err
		}
		m.mu.Lock()
		delete(m.chosen, volumeID)
		m.mu.Unlock()
		m.forgetServers(volumeID)
		return nil
	}
	var errs []error
	for _, t := range m.Available() {
		errs = append(errs, m.attachers[t].Detach(ctx, volumeID))
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	m.forgetServers(volumeID)
	return nil
}

// forgetServers removes the servers a detached volume kept.
func (m *Manager) forgetServers(volumeID string) {
	p := m.serversFile(volumeID)
	if p == "" {
		return
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
		m.log.Warn("remove the storage nodes a detached volume kept", "volume_id", volumeID, "error", err)
	}
}

// Health reports the data path of an attached volume.
func (m *Manager) Health(volumeID string) (Transport, Health, error) {
	m.mu.Lock()
	tr, ok := m.chosen[volumeID]
	m.mu.Unlock()
	if !ok {
		return "", Health{}, fmt.Errorf("%w: %s", ErrNotAttached, volumeID)
	}
	h, err := m.attachers[tr].Health(volumeID)
	return tr, h, err
}

// Chosen returns the transport a volume was attached with.
func (m *Manager) Chosen(volumeID string) (Transport, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	tr, ok := m.chosen[volumeID]
	return tr, ok
}

// Fallbacks returns the automatic fallbacks so far.
func (m *Manager) Fallbacks() []Fallback {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]Fallback(nil), m.fallbackEvents...)
}

// KernelRefused reports whether the kernel transport was found unsupported.
func (m *Manager) KernelRefused() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.kernelRefused
}

// Resize grows the device of an attached volume to its export's size,
// which must be at least newSize. A volume this process did not attach is
// looked for in every transport.
func (m *Manager) Resize(ctx context.Context, volumeID string, newSize uint64) (uint64, error) {
	m.mu.Lock()
	tr, ok := m.chosen[volumeID]
	m.mu.Unlock()
	if ok {
		return m.attachers[tr].Resize(ctx, volumeID, newSize)
	}
	for _, t := range m.Available() {
		n, err := m.attachers[t].Resize(ctx, volumeID, newSize)
		if !errors.Is(err, ErrNotAttached) {
			return n, err
		}
	}
	return 0, fmt.Errorf("%w: %s", ErrNotAttached, volumeID)
}

// Adopt lets every transport that can take over the volumes an earlier
// process attached, and remembers which transport has each. Errors of one
// transport do not stop the others.
func (m *Manager) Adopt(ctx context.Context) ([]*Attachment, error) {
	var out []*Attachment
	var errs []error
	for _, t := range m.Available() {
		ad, ok := m.attachers[t].(Adopter)
		if !ok {
			continue
		}
		atts, err := ad.Adopt(ctx)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", t, err))
		}
		m.mu.Lock()
		for _, a := range atts {
			m.chosen[a.VolumeID] = t
		}
		m.mu.Unlock()
		for _, a := range atts {
			m.log.Info("volume adopted", "volume_id", a.VolumeID, "transport", string(t), "device", a.Device)
		}
		out = append(out, atts...)
	}
	return out, errors.Join(errs...)
}

// Volumes returns the volumes attached through this manager (including
// adopted ones) and their transports.
func (m *Manager) Volumes() map[string]Transport {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make(map[string]Transport, len(m.chosen))
	for id, t := range m.chosen {
		out[id] = t
	}
	return out
}

// HandOff quiesces a volume for a successor process, through its
// transport (which must be a HandingOver); once released, the volume is
// no longer this manager's.
func (m *Manager) HandOff(ctx context.Context, volumeID string) (*Handoff, error) {
	m.mu.Lock()
	tr, ok := m.chosen[volumeID]
	m.mu.Unlock()
	if !ok {
		return nil, fmt.Errorf("%w: %s", ErrNotAttached, volumeID)
	}
	ho, ok := m.attachers[tr].(HandingOver)
	if !ok {
		return nil, fmt.Errorf("%w: the %s transport cannot hand volumes off", ErrUnsupported, tr)
	}
	h, err := ho.HandOff(ctx, volumeID)
	if err != nil {
		return nil, err
	}
	release := h.Release
	h.Release = func() {
		release()
		m.mu.Lock()
		delete(m.chosen, volumeID)
		m.mu.Unlock()
	}
	return h, nil
}

// TakeHandoff prepares to serve a volume a predecessor hands off; once
// started, the volume is this manager's.
func (m *Manager) TakeHandoff(ctx context.Context, h *Handoff) (*Attachment, error) {
	ho, ok := m.attachers[h.Transport].(HandingOver)
	if !ok {
		for _, f := range h.Files {
			f.Close()
		}
		return nil, fmt.Errorf("%w: this node cannot take %s volumes over", ErrUnsupported, h.Transport)
	}
	att, err := ho.TakeHandoff(ctx, h)
	if err != nil {
		return nil, err
	}
	start := h.Start
	h.Start = func() error {
		if err := start(); err != nil {
			return err
		}
		m.mu.Lock()
		m.chosen[h.VolumeID] = h.Transport
		m.mu.Unlock()
		m.log.Info("volume taken from a predecessor", "volume_id", h.VolumeID, "transport", string(h.Transport), "device", att.Device)
		return nil
	}
	return att, nil
}
