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
)

// mountsUnder returns the mount points at or below dir listed in
// mountinfo (the text of /proc/self/mountinfo), deepest first.
func mountsUnder(mountinfo, dir string) []string {
	dir = filepath.Clean(dir)
	var out []string
	for line := range strings.SplitSeq(mountinfo, "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		mp := unescapeMountinfo(f[4])
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			out = append(out, mp)
		}
	}
	// Longer paths first: a mount below another comes before it.
	sort.Slice(out, func(i, j int) bool {
		if len(out[i]) != len(out[j]) {
			return len(out[i]) > len(out[j])
		}
		return out[i] < out[j]
	})
	return out
}

// unescapeMountinfo undoes the octal escapes (\040 for a space) of a
// mountinfo field.
func unescapeMountinfo(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var v byte
			ok := true
			for _, c := range []byte(s[i+1 : i+4]) {
				if c < '0' || c > '7' {
					ok = false
					break
				}
				v = v*8 + c - '0'
			}
			if ok {
				b.WriteByte(v)
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

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
		mi, err := os.ReadFile("/proc/self/mountinfo")
		if err != nil {
			return
		}
		for _, mp := range mountsUnder(string(mi), dir) {
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
	if mi, err := os.ReadFile("/proc/self/mountinfo"); err == nil {
		for _, mp := range mountsUnder(string(mi), dir) {
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
