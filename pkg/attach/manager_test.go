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
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

type fakeAttacher struct {
	name     Transport
	err      error
	attached map[string]bool
	calls    int
	detaches int
	// adoptable are volumes Adopt finds.
	adoptable []string
	// opts are the options of the last attach.
	opts Options
}

func (f *fakeAttacher) Attach(_ context.Context, t Target, o Options) (*Attachment, error) {
	f.calls++
	f.opts = o
	if f.err != nil {
		return nil, f.err
	}
	if f.attached == nil {
		f.attached = map[string]bool{}
	}
	f.attached[t.VolumeID] = true
	return &Attachment{VolumeID: t.VolumeID, Transport: f.name, Device: "/dev/" + string(f.name)}, nil
}

func (f *fakeAttacher) Detach(_ context.Context, id string) error {
	f.detaches++
	delete(f.attached, id)
	return nil
}

func (f *fakeAttacher) Health(id string) (Health, error) {
	if !f.attached[id] {
		return Health{}, ErrNotAttached
	}
	return Health{Connected: true}, nil
}

func (f *fakeAttacher) Resize(_ context.Context, id string, n uint64) (uint64, error) {
	if !f.attached[id] {
		return 0, ErrNotAttached
	}
	return n, nil
}

// Adopt reports every volume in adoptable as attached by an earlier process.
func (f *fakeAttacher) Adopt(context.Context) ([]*Attachment, error) {
	var out []*Attachment
	for _, id := range f.adoptable {
		if f.attached == nil {
			f.attached = map[string]bool{}
		}
		f.attached[id] = true
		out = append(out, &Attachment{VolumeID: id, Transport: f.name})
	}
	return out, nil
}

func newTestManager(ts map[Transport]*fakeAttacher) *Manager {
	m := map[Transport]Attacher{}
	for k, v := range ts {
		v.name = k
		m[k] = v
	}
	return NewManager(m, slog.New(slog.NewTextHandler(io.Discard, nil)))
}

var target = Target{VolumeID: "v1", Export: "e", Addrs: []string{"a:1"}}

func TestAutoPrefersKernel(t *testing.T) {
	k, r := &fakeAttacher{}, &fakeAttacher{}
	m := newTestManager(map[Transport]*fakeAttacher{Kernel: k, Relay: r})
	att, err := m.Attach(context.Background(), Auto, target, Options{})
	if err != nil || att.Transport != Kernel || r.calls != 0 {
		t.Fatalf("auto: %+v %v (relay calls %d)", att, err, r.calls)
	}
}

func TestAutoFallsBackAndRemembers(t *testing.T) {
	k := &fakeAttacher{err: ErrUnsupported}
	r := &fakeAttacher{}
	m := newTestManager(map[Transport]*fakeAttacher{Kernel: k, Relay: r, FUSE: {}})
	att, err := m.Attach(context.Background(), Auto, target, Options{})
	if err != nil || att.Transport != Relay {
		t.Fatalf("auto with a refusing kernel: %+v %v", att, err)
	}
	if !m.KernelRefused() || len(m.Fallbacks()) != 1 || m.Fallbacks()[0].To != Relay {
		t.Fatalf("fallback not recorded: %v %+v", m.KernelRefused(), m.Fallbacks())
	}
	// The refusal is remembered: the next volume goes straight to relay.
	t2 := target
	t2.VolumeID = "v2"
	if _, err := m.Attach(context.Background(), Auto, t2, Options{}); err != nil {
		t.Fatal(err)
	}
	if k.calls != 1 {
		t.Fatalf("kernel tried %d times, want 1", k.calls)
	}
	if tr, ok := m.Chosen("v2"); !ok || tr != Relay {
		t.Fatalf("chosen = %v %v", tr, ok)
	}
	// Idempotent: attaching v1 again goes to the same transport.
	if att, err := m.Attach(context.Background(), Auto, target, Options{}); err != nil || att.Transport != Relay {
		t.Fatalf("re-attach: %+v %v", att, err)
	}
	if _, err := m.Attach(context.Background(), FUSE, target, Options{}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("re-attach with another transport: %v", err)
	}
}

func TestAutoWithoutNBDUsesFUSE(t *testing.T) {
	f := &fakeAttacher{}
	m := newTestManager(map[Transport]*fakeAttacher{FUSE: f})
	att, err := m.Attach(context.Background(), "", target, Options{})
	if err != nil || att.Transport != FUSE {
		t.Fatalf("%+v %v", att, err)
	}
	if _, err := m.Attach(context.Background(), Relay, Target{VolumeID: "x"}, Options{}); !errors.Is(err, ErrUnsupported) {
		t.Fatalf("explicit relay on a node without it: %v", err)
	}
}

func TestOtherErrorsDoNotFallBack(t *testing.T) {
	k := &fakeAttacher{err: ErrServerRefused}
	r := &fakeAttacher{}
	m := newTestManager(map[Transport]*fakeAttacher{Kernel: k, Relay: r})
	if _, err := m.Attach(context.Background(), Auto, target, Options{}); !errors.Is(err, ErrServerRefused) {
		t.Fatalf("err = %v", err)
	}
	if r.calls != 0 || m.KernelRefused() {
		t.Fatal("a refused export must not fall back to another transport")
	}
}

func TestExplicitKernelDoesNotFallBack(t *testing.T) {
	k := &fakeAttacher{err: ErrUnsupported}
	r := &fakeAttacher{}
	m := newTestManager(map[Transport]*fakeAttacher{Kernel: k, Relay: r})
	if _, err := m.Attach(context.Background(), Kernel, target, Options{}); !errors.Is(err, ErrUnsupported) {
		t.Fatalf("err = %v", err)
	}
	if r.calls != 0 {
		t.Fatal("explicit kernel fell back")
	}
}

func TestDetachAndHealth(t *testing.T) {
	r, f := &fakeAttacher{}, &fakeAttacher{}
	m := newTestManager(map[Transport]*fakeAttacher{Relay: r, FUSE: f})
	if _, err := m.Attach(context.Background(), Relay, target, Options{}); err != nil {
		t.Fatal(err)
	}
	if tr, h, err := m.Health("v1"); err != nil || tr != Relay || !h.Connected {
		t.Fatalf("health: %v %+v %v", tr, h, err)
	}
	if err := m.Detach(context.Background(), "v1"); err != nil || r.detaches != 1 || f.detaches != 0 {
		t.Fatalf("detach: %v relay=%d fuse=%d", err, r.detaches, f.detaches)
	}
	if _, _, err := m.Health("v1"); !errors.Is(err, ErrNotAttached) {
		t.Fatalf("health after detach: %v", err)
	}
	// Unknown volume: every transport is asked, and it succeeds.
	if err := m.Detach(context.Background(), "unknown"); err != nil || r.detaches != 2 || f.detaches != 1 {
		t.Fatalf("detach unknown: %v relay=%d fuse=%d", err, r.detaches, f.detaches)
	}
}

// TestManagerKeepsServersPerVolume: with a directory to keep servers in,
// each volume attached gets a file of its own there (named by its ID,
// never outside the directory), and its detach removes it.
func TestManagerKeepsServersPerVolume(t *testing.T) {
	dir := t.TempDir()
	f := &fakeAttacher{}
	m := newTestManager(map[Transport]*fakeAttacher{FUSE: f})
	m.KeepServersIn(dir)
	long := strings.Repeat("x", 300)
	for _, id := range []string{"pvc-1", "a/../../b", "..", long} {
		tg := target
		tg.VolumeID = id
		if _, err := m.Attach(context.Background(), FUSE, tg, Options{}); err != nil {
			t.Fatal(err)
		}
		p := f.opts.ServersFile
		if filepath.Dir(p) != dir || strings.HasPrefix(filepath.Base(p), ".") || len(filepath.Base(p)) > 255 {
			t.Fatalf("volume %.20q keeps its servers in %q, want a plain file of %s", id, p, dir)
		}
		if err := os.WriteFile(p, []byte("[]"), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := m.Detach(context.Background(), id); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(p); !errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("volume %.20q detached, its servers file: %v", id, err)
		}
	}
	if _, err := m.Attach(context.Background(), FUSE, target, Options{ServersFile: "/given"}); err != nil || f.opts.ServersFile != "/given" {
		t.Fatalf("a servers file given is replaced by %q (%v)", f.opts.ServersFile, err)
	}
	// Without a directory: none.
	m = newTestManager(map[Transport]*fakeAttacher{FUSE: f})
	if _, err := m.Attach(context.Background(), FUSE, target, Options{}); err != nil || f.opts.ServersFile != "" {
		t.Fatalf("no directory, servers file %q (%v)", f.opts.ServersFile, err)
	}
}

func TestParseTransport(t *testing.T) {
	for _, s := range []string{"", "auto", "kernel", "relay", "multiconn", "tcp", "fuse"} {
		if _, err := ParseTransport(s); err != nil {
			t.Errorf("%q: %v", s, err)
		}
	}
	if _, err := ParseTransport("iscsi"); !errors.Is(err, ErrInvalid) {
		t.Errorf("iscsi: %v", err)
	}
}

func TestManagerResizeAndAdopt(t *testing.T) {
	relay := &fakeAttacher{adoptable: []string{"pv-old"}}
	fuse := &fakeAttacher{}
	m := newTestManager(map[Transport]*fakeAttacher{Relay: relay, FUSE: fuse})
	ctx := context.Background()
	if _, err := m.Resize(ctx, "pv-old", 10); !errors.Is(err, ErrNotAttached) {
		t.Fatalf("Resize of an unknown volume: %v, want ErrNotAttached", err)
	}
	atts, err := m.Adopt(ctx)
	if err != nil || len(atts) != 1 || atts[0].VolumeID != "pv-old" {
		t.Fatalf("Adopt = %v, %v", atts, err)
	}
	if tr, ok := m.Chosen("pv-old"); !ok || tr != Relay {
		t.Fatalf("adopted volume's transport = %v, %v; want relay", tr, ok)
	}
	if n, err := m.Resize(ctx, "pv-old", 10); err != nil || n != 10 {
		t.Fatalf("Resize after Adopt = %d, %v", n, err)
	}
	if _, err := m.Attach(ctx, FUSE, Target{VolumeID: "pv-new"}, Options{}); err != nil {
		t.Fatal(err)
	}
	if n, err := m.Resize(ctx, "pv-new", 20); err != nil || n != 20 {
		t.Fatalf("Resize of a fuse volume = %d, %v", n, err)
	}
}

// TestAttachChoice: a fresh attach says how its transport was chosen
// (for the claim's Events); a repeated attach says nothing.
func TestAttachChoice(t *testing.T) {
	refusing := func() *fakeAttacher { return &fakeAttacher{err: fmt.Errorf("%w: EINVAL", ErrUnsupported)} }
	cases := []struct {
		name      string
		ts        map[Transport]*fakeAttacher
		requested Transport
		want      Transport
		skipped   string // from>to per fallback
		missing   []Transport
	}{
		{"auto, first choice", map[Transport]*fakeAttacher{Kernel: {}, Relay: {}}, Auto, Kernel, "", nil},
		{"auto, only fuse", map[Transport]*fakeAttacher{FUSE: {}}, "", FUSE, "", []Transport{Kernel, Ublk, Relay}},
		{"auto, kernel refused", map[Transport]*fakeAttacher{Kernel: refusing(), Relay: {}, FUSE: {}}, Auto, Relay, "kernel>relay", []Transport{Ublk}},
		{"auto, two refused", map[Transport]*fakeAttacher{Kernel: refusing(), Ublk: refusing(), FUSE: {}}, Auto, FUSE, "kernel>ublk ublk>fuse", []Transport{Relay}},
		{"pinned", map[Transport]*fakeAttacher{Kernel: {}, TCP: {}}, TCP, TCP, "", nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			m := newTestManager(tc.ts)
			att, err := m.Attach(context.Background(), tc.requested, target, Options{})
			if err != nil || att.Transport != tc.want || att.Choice == nil {
				t.Fatalf("attach = %+v, %v", att, err)
			}
			req := tc.requested
			if req == "" {
				req = Auto
			}
			var skipped []string
			for _, f := range att.Choice.Skipped {
				skipped = append(skipped, string(f.From)+">"+string(f.To))
				if f.Reason == "" {
					t.Errorf("fallback %+v without a reason", f)
				}
			}
			if c := att.Choice; c.Requested != req || strings.Join(skipped, " ") != tc.skipped || !slices.Equal(c.Missing, tc.missing) {
				t.Fatalf("choice %+v (skipped %v), want requested %s, skipped %q, missing %v", c, skipped, req, tc.skipped, tc.missing)
			}
			again, err := m.Attach(context.Background(), tc.requested, target, Options{})
			if err != nil || again.Choice != nil {
				t.Fatalf("repeated attach = %+v, %v; want no choice", again, err)
			}
		})
	}

	// A kernel refusal learnt from an earlier volume is a fallback of the
	// next one too, with the reason it was refused.
	k := refusing()
	m := newTestManager(map[Transport]*fakeAttacher{Kernel: k, Relay: {}})
	if _, err := m.Attach(context.Background(), Auto, target, Options{}); err != nil {
		t.Fatal(err)
	}
	att, err := m.Attach(context.Background(), Auto, Target{VolumeID: "v2"}, Options{})
	if err != nil || k.calls != 1 {
		t.Fatalf("second attach: %v, kernel tried %d times", err, k.calls)
	}
	if s := att.Choice.Skipped; len(s) != 1 || s[0].From != Kernel || s[0].To != Relay || !strings.Contains(s[0].Reason, "earlier") || !strings.Contains(s[0].Reason, "EINVAL") {
		t.Fatalf("skipped %+v, want kernel>relay refused earlier with EINVAL", s)
	}
}

// TestEncryptedVolumesSkipTheKernel: auto passes over the transports that
// cannot encrypt for a volume whose encryption is required (without
// trying them, and without marking the kernel refused for the others),
// and says why; a transport named that cannot encrypt is an invalid
// request; a preferred encryption lets the kernel have the volume.
func TestEncryptedVolumesSkipTheKernel(t *testing.T) {
	k, u, r := &fakeAttacher{}, &fakeAttacher{}, &fakeAttacher{}
	m := newTestManager(map[Transport]*fakeAttacher{Kernel: k, Ublk: u, Relay: r, TCP: {}})
	enc := target
	enc.TLS = &TargetTLS{StorageNode: "store-1", IdentityDir: "/id"}
	att, err := m.Attach(context.Background(), Auto, enc, Options{})
	if err != nil || att.Transport != Ublk || k.calls != 0 {
		t.Fatalf("auto for an encrypted volume: %+v, %v (kernel tried %d times)", att, err, k.calls)
	}
	if c := att.Choice; c == nil || len(c.Skipped) != 1 || c.Skipped[0].From != Kernel || c.Skipped[0].To != Ublk ||
		!strings.Contains(c.Skipped[0].Reason, "cannot encrypt") {
		t.Fatalf("choice %+v, want the kernel skipped for its lack of TLS", att.Choice)
	}
	if m.KernelRefused() {
		t.Fatal("an encrypted volume marked the kernel refused for every volume")
	}
	for _, tr := range []Transport{Kernel, TCP} {
		e := enc
		e.VolumeID = "v-" + string(tr)
		if _, err := m.Attach(context.Background(), tr, e, Options{}); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "cannot encrypt") {
			t.Errorf("%s named for an encrypted volume: %v, want ErrInvalid", tr, err)
		}
	}
	if _, err := m.Attach(context.Background(), Relay, Target{VolumeID: "v-relay", Export: "e", Addrs: []string{"a:1"}, TLS: enc.TLS}, Options{}); err != nil {
		t.Errorf("relay named for an encrypted volume: %v", err)
	}
	pref := target
	pref.VolumeID = "v-pref"
	pref.TLS = &TargetTLS{StorageNode: "store-1", IdentityDir: "/id", Optional: true}
	if att, err := m.Attach(context.Background(), Auto, pref, Options{}); err != nil || att.Transport != Kernel {
		t.Fatalf("auto for a volume that prefers encryption: %+v, %v", att, err)
	}
}
