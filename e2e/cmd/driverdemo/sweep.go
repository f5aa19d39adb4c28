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
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/mpnbd/mpnbd/pkg/mountinfo"
)

// loopsUnder returns the loop devices whose backing file lies below dir.
func loopsUnder(dir string) []string {
	dir = filepath.Clean(dir)
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	var out []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		backing := strings.TrimSuffix(strings.TrimSpace(string(b)), " (deleted)")
		if strings.HasPrefix(backing, dir+"/") {
			out = append(out, "/dev/"+filepath.Base(filepath.Dir(filepath.Dir(f))))
		}
	}
	sort.Strings(out)
	return out
}

// sweep removes whatever the demo's processes may have left behind in
// dir and in the namespaces nss: mounts, loop devices, processes. After
// an orderly teardown there is nothing to do; whatever it finds is
// removed and reported as an error.
func sweep(dir string, nss []string) error {
	var found []string
	unmountAll := func(detach bool) {
		mps, err := mountinfo.Under(dir)
		if err != nil {
			return
		}
		for _, mp := range mps {
			flags := 0
			if detach {
				flags = syscall.MNT_DETACH
			}
			if syscall.Unmount(mp, flags) == nil {
				found = append(found, "mount "+mp)
			}
		}
	}
	// File systems on the volume's device first, then the device, then
	// the FUSE mount under it and its server processes.
	unmountAll(false)
	for _, dev := range loopsUnder(dir) {
		if out, err := exec.Command("losetup", "-d", dev).CombinedOutput(); err == nil {
			found = append(found, "loop device "+dev)
		} else {
			found = append(found, fmt.Sprintf("loop device %s (losetup -d: %v: %s)", dev, err, strings.TrimSpace(string(out))))
		}
	}
	unmountAll(false)
	for _, ns := range nss {
		pids, err := netnsPIDs(ns)
		if err != nil || len(pids) == 0 {
			continue
		}
		for _, pid := range pids {
			found = append(found, fmt.Sprintf("process %d in %s", pid, ns))
			_ = syscall.Kill(pid, syscall.SIGTERM)
		}
		for end := time.Now().Add(5 * time.Second); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
			if left, _ := netnsPIDs(ns); len(left) == 0 {
				break
			}
		}
		left, _ := netnsPIDs(ns)
		for _, pid := range left {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	unmountAll(true)
	if len(found) == 0 {
		return nil
	}
	return errors.New("leftovers removed: " + strings.Join(found, "; "))
}

// leftovers reports what of the demo still exists: mounts and loop
// devices under dir, and the namespaces nss.
func leftovers(dir string, nss []string) []string {
	var out []string
	if mps, err := mountinfo.Under(dir); err == nil {
		for _, mp := range mps {
			out = append(out, "mount "+mp)
		}
	}
	for _, dev := range loopsUnder(dir) {
		out = append(out, "loop device "+dev)
	}
	for _, ns := range nss {
		if _, err := os.Stat("/run/netns/" + ns); err == nil {
			out = append(out, "network namespace "+ns)
		}
	}
	return out
}
