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
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"sync"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

// fakeAttacher attaches volumes to made-up devices.
type fakeAttacher struct {
	mu        sync.Mutex
	attached  map[string]*attach.Attachment
	opts      map[string]attach.Options
	targets   map[string]attach.Target
	health    map[string]attach.Health
	attachErr error
	detachErr error
	attaches  int
	detaches  []string
	// exportSize, when set for a volume, is what Resize finds on the
	// server; resized records Resize calls.
	exportSize map[string]uint64
	resized    []string

	// When gate is set, Attach signals entered and waits for gate.
	gate    chan struct{}
	entered chan struct{}
}

func newFakeAttacher() *fakeAttacher {
	return &fakeAttacher{attached: map[string]*attach.Attachment{}, opts: map[string]attach.Options{}, health: map[string]attach.Health{}}
}

func (f *fakeAttacher) Attach(ctx context.Context, tr attach.Transport, t attach.Target, o attach.Options) (*attach.Attachment, error) {
	if f.gate != nil {
		f.entered <- struct{}{}
		<-f.gate
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.attaches++
	if f.attachErr != nil {
		return nil, f.attachErr
	}
	if a, ok := f.attached[t.VolumeID]; ok {
		return a, nil
	}
	a := &attach.Attachment{VolumeID: t.VolumeID, Transport: attach.FUSE, Device: fmt.Sprintf("/dev/fake%d", len(f.attached)), Size: 1 << 30}
	f.attached[t.VolumeID] = a
	f.opts[t.VolumeID] = o
	if f.targets == nil {
		f.targets = map[string]attach.Target{}
	}
	f.targets[t.VolumeID] = t
	// Like the manager's: only the attach that made it says how.
	fresh := *a
	fresh.Choice = &attach.Choice{Requested: tr, Missing: []attach.Transport{attach.Kernel, attach.Ublk, attach.Relay}}
	return &fresh, nil
}

func (f *fakeAttacher) Detach(ctx context.Context, volumeID string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.detaches = append(f.detaches, volumeID)
	if f.detachErr != nil {
		return f.detachErr
	}
	delete(f.attached, volumeID)
	return nil
}

func (f *fakeAttacher) Health(volumeID string) (attach.Transport, attach.Health, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.attached[volumeID]; !ok {
		return "", attach.Health{}, fmt.Errorf("%w: %s", attach.ErrNotAttached, volumeID)
	}
	h, ok := f.health[volumeID]
	if !ok {
		h = attach.Health{Connected: true, MPTCP: true, Subflows: []int{2}}
	}
	return attach.FUSE, h, nil
}

func (f *fakeAttacher) Resize(ctx context.Context, volumeID string, n uint64) (uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	a, ok := f.attached[volumeID]
	if !ok {
		return 0, fmt.Errorf("%w: %s", attach.ErrNotAttached, volumeID)
	}
	size, ok := f.exportSize[volumeID]
	if !ok {
		size = max(a.Size, n)
	}
	if size < n {
		return 0, fmt.Errorf("%w: %d < %d", attach.ErrTooSmall, size, n)
	}
	a.Size = size
	f.resized = append(f.resized, volumeID)
	return size, nil
}

func (f *fakeAttacher) isAttached(id string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	_, ok := f.attached[id]
	return ok
}

// fakeMount is one mount of the fakeMounter.
type fakeMount struct {
	source, fstype string
	options        []string
	formatted      bool
}

// fakeMounter keeps mounts in a map; directories and files are real
// (under the test's temporary directory).
type fakeMounter struct {
	mu        sync.Mutex
	mounts    map[string]fakeMount
	blockDevs map[string]uint64
	stats     FSStats
	formatErr error
	mountErr  error
	resized   []string
	formats   int
	// grownUnmounted are the devices GrowUnmounted was asked to grow;
	// resizeErr fails Resize.
	grownUnmounted []string
	resizeErr      error
}

func newFakeMounter() *fakeMounter {
	return &fakeMounter{mounts: map[string]fakeMount{}, blockDevs: map[string]uint64{}}
}

func (m *fakeMounter) FormatAndMount(source, target, fstype string, options []string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.formats++
	if m.formatErr != nil {
		return m.formatErr
	}
	m.mounts[target] = fakeMount{source: source, fstype: fstype, options: slices.Clone(options), formatted: true}
	return nil
}

func (m *fakeMounter) Mount(source, target, fstype string, options []string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.mountErr != nil {
		return m.mountErr
	}
	if _, err := os.Stat(target); err != nil {
		return err
	}
	m.mounts[target] = fakeMount{source: source, fstype: fstype, options: slices.Clone(options)}
	return nil
}

func (m *fakeMounter) Unmount(target string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.mounts[target]; !ok {
		return fmt.Errorf("%s: not mounted", target)
	}
	delete(m.mounts, target)
	return nil
}

func (m *fakeMounter) IsMountPoint(path string) (bool, error) {
	if _, err := os.Stat(path); err != nil {
		return false, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	_, ok := m.mounts[path]
	return ok, nil
}

func (m *fakeMounter) mount(path string) (fakeMount, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	mt, ok := m.mounts[path]
	return mt, ok
}

func (m *fakeMounter) PathExists(path string) (bool, error) {
	_, err := os.Stat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	return err == nil, err
}

func (m *fakeMounter) MakeDir(path string) error { return os.MkdirAll(path, 0o750) }

func (m *fakeMounter) MakeFile(path string) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDONLY, 0o640)
	if err != nil {
		return err
	}
	return f.Close()
}

func (m *fakeMounter) IsBlockDevice(path string) (bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	_, ok := m.blockDevs[path]
	return ok, nil
}

func (m *fakeMounter) GetDeviceSize(path string) (uint64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if n, ok := m.blockDevs[path]; ok {
		return n, nil
	}
	return 0, fmt.Errorf("%s: not a block device", path)
}

func (m *fakeMounter) DeviceFromMount(mountPath string) (string, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	mt, ok := m.mounts[mountPath]
	if !ok {
		return "", fmt.Errorf("%w: nothing mounted at %s", ErrNotFound, mountPath)
	}
	return mt.source, nil
}

func (m *fakeMounter) Resize(devicePath, mountPath string) (bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.resizeErr != nil {
		return false, m.resizeErr
	}
	m.resized = append(m.resized, devicePath+" "+mountPath)
	return true, nil
}

func (m *fakeMounter) GrowUnmounted(devicePath string) (bool, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, mt := range m.mounts {
		if mt.source == devicePath {
			return false, fmt.Errorf("%s is mounted", devicePath)
		}
	}
	m.grownUnmounted = append(m.grownUnmounted, devicePath)
	return false, nil
}

func (m *fakeMounter) Statfs(path string) (FSStats, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.stats, nil
}
