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

//go:build !linux

package driver

import "fmt"

// unsupportedMounter fails every call: the node plugin runs on Linux only.
type unsupportedMounter struct{}

// NewMounter returns a Mounter that fails: mounting needs Linux.
func NewMounter() Mounter { return unsupportedMounter{} }

func errNoMounter() error { return fmt.Errorf("%w: mounting needs Linux", ErrUnavailable) }

func (unsupportedMounter) FormatAndMount(string, string, string, []string) error {
	return errNoMounter()
}
func (unsupportedMounter) Mount(string, string, string, []string) error { return errNoMounter() }
func (unsupportedMounter) Unmount(string) error                         { return errNoMounter() }
func (unsupportedMounter) IsMountPoint(string) (bool, error)            { return false, errNoMounter() }
func (unsupportedMounter) PathExists(string) (bool, error)              { return false, errNoMounter() }
func (unsupportedMounter) MakeDir(string) error                         { return errNoMounter() }
func (unsupportedMounter) MakeFile(string) error                        { return errNoMounter() }
func (unsupportedMounter) IsBlockDevice(string) (bool, error)           { return false, errNoMounter() }
func (unsupportedMounter) GetDeviceSize(string) (uint64, error)         { return 0, errNoMounter() }
func (unsupportedMounter) DeviceFromMount(string) (string, error)       { return "", errNoMounter() }
func (unsupportedMounter) Resize(string, string) (bool, error)          { return false, errNoMounter() }
func (unsupportedMounter) GrowUnmounted(string) (bool, error)           { return false, errNoMounter() }
func (unsupportedMounter) Statfs(string) (FSStats, error)               { return FSStats{}, errNoMounter() }
