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
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/pkg/driver"
	"github.com/mpnbd/mpnbd/pkg/mountinfo"
)

// chunk is the size of each write and read of the test file.
const chunk = 4 << 20

// volume runs the CSI calls a CO makes for a pod using a new volume,
// moves data through it and shows its data path.
func (d *demo) volume(ctx context.Context, c client.Client, cc *csiClients) error {
	o := d.o
	v, err := d.createVolume(ctx, cc, csiName, o.volumeSize, mountCapability(o.fsType), "")
	if err != nil {
		return err
	}
	id := v.id
	target := filepath.Join(d.dir, "kubelet", "pod", "mount")
	if err := d.stageVolume(ctx, cc, v, target); err != nil {
		return err
	}

	var data []byte
	var sum string
	if err := d.step(fmt.Sprintf("generate %s of pseudo-random data", formatBytes(o.fileSize)), func() error {
		data = make([]byte, o.fileSize)
		var seed [32]byte
		copy(seed[:], "mpnbd driverdemo "+time.Now().Format(time.RFC3339Nano))
		rand.NewChaCha8(seed).Read(data)
		s := sha256.Sum256(data)
		sum = hex.EncodeToString(s[:])
		d.res.SHA256 = sum
		fmt.Fprintf(d.out, "     sha256 %s\n", sum)
		return nil
	}); err != nil {
		return err
	}
	file := filepath.Join(target, "data.bin")
	if err := d.step(fmt.Sprintf("write %s through the mounted volume, fsync", formatBytes(o.fileSize)), func() error {
		el, err := writeFile(ctx, file, data)
		if err != nil {
			return err
		}
		d.res.WriteMBps = mbps(o.fileSize, el)
		fmt.Fprintf(d.out, "     %.1f MB/s (%s incl. fsync)\n", d.res.WriteMBps, round(el))
		return nil
	}); err != nil {
		return err
	}
	data = nil
	if err := d.step("drop the page cache, read the file back, verify its SHA-256", func() error {
		if err := dropCaches(); err != nil {
			return err
		}
		got, el, err := readFile(ctx, file)
		if err != nil {
			return err
		}
		d.res.ReadMBps = mbps(o.fileSize, el)
		d.res.ChecksumOK = got == sum
		fmt.Fprintf(d.out, "     %.1f MB/s (%s), sha256 %s\n", d.res.ReadMBps, round(el), got)
		if !d.res.ChecksumOK {
			return fmt.Errorf("checksum mismatch: read %s, wrote %s", got, sum)
		}
		fmt.Fprintln(d.out, "     checksum OK")
		return nil
	}); err != nil {
		return err
	}

	if err := d.step("NodeGetVolumeHealth", func() error {
		return d.health(ctx, cc, id, target, len(pubAddrs(v.pubCtx)))
	}); err != nil {
		return err
	}
	if err := d.step("MPTCP subflows of the volume's connection (client namespace)", func() error {
		return d.subflows(ctx)
	}); err != nil {
		return err
	}
	return d.step("kubectl get nbdvol -o wide", func() error {
		v := &v1alpha1.NBDVolume{}
		if err := c.Get(ctx, client.ObjectKey{Name: id}, v); err != nil {
			return err
		}
		return writeVolumeTable(d.out, v, time.Now())
	})
}

// pubAddrs splits the publish context's storage addresses.
func pubAddrs(pc map[string]string) []string {
	var out []string
	for _, a := range strings.Split(pc[driver.PublishContextAddresses], ",") {
		if a = strings.TrimSpace(a); a != "" {
			out = append(out, a)
		}
	}
	return out
}

// health asks the node plugin for the volume's health until it reports
// no problem: no DEGRADED entry means one subflow per storage address.
func (d *demo) health(ctx context.Context, cc *csiClients, id, target string, addrs int) error {
	d.res.StorageAddresses = addrs
	var last *csi.VolumeHealth
	err := waitFor(ctx, "a healthy volume", 20*time.Second, func() error {
		r, err := cc.node.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: id, VolumePublishPath: target})
		if status.Code(err) == codes.Unimplemented {
			return permanent(err)
		}
		if err != nil {
			return err
		}
		last = r.GetVolumeHealth()
		if n := len(last.GetHealthStatuses()); n > 0 {
			return fmt.Errorf("%d problems: %v", n, last.GetHealthStatuses())
		}
		return nil
	})
	if err != nil {
		return err
	}
	d.res.Healthy = true
	fmt.Fprintf(d.out, "     volume %s: healthy, no INACCESSIBLE or DEGRADED entry (%d storage addresses, so %d subflows)\n", id, addrs, addrs)
	return nil
}

// subflows waits until the volume's MPTCP connection has one subflow per
// path and prints them, with ss's own view.
func (d *demo) subflows(ctx context.Context) error {
	subs, err := d.volumeSubflows(ctx)
	d.res.Subflows = len(subs)
	if out, serr := topo.Exec(d.topo.ClientNS, "ss", "-MtniH").CombinedOutput(); serr == nil {
		fmt.Fprintf(d.out, "     ss -Mni, the MPTCP socket:\n")
		for _, l := range mptcpLines(string(out)) {
			fmt.Fprintf(d.out, "       %s\n", l)
		}
	}
	fmt.Fprintf(d.out, "     %d subflows (ss -tni):\n", len(subs))
	_ = writeSubflowTable(d.out, d.topo, subs)
	return err
}

// volumeSubflows waits until the worker's MPTCP connection to the
// storage node has one subflow per path and returns them (those it has
// when it gives up, with an error).
func (d *demo) volumeSubflows(ctx context.Context) ([]topo.Subflow, error) {
	var subs []topo.Subflow
	want := len(d.topo.Paths)
	err := waitFor(ctx, fmt.Sprintf("%d subflows", want), 20*time.Second, func() error {
		all, err := topo.Subflows(d.topo.ClientNS)
		if err != nil {
			return err
		}
		subs = connectionSubflows(all, d.primary())
		if len(subs) < want {
			return fmt.Errorf("%d subflows to %s", len(subs), d.primary())
		}
		return nil
	})
	return subs, err
}

// mptcpLines picks from `ss -MtniH` output the MPTCP sockets (not their
// TCP subflows), each with its info line, spaces squeezed.
func mptcpLines(out string) []string {
	var lines []string
	keep := false
	for _, l := range strings.Split(out, "\n") {
		if strings.TrimSpace(l) == "" {
			continue
		}
		if l[0] != ' ' && l[0] != '\t' {
			keep = strings.HasPrefix(l, "mptcp")
		}
		if keep {
			lines = append(lines, strings.Join(strings.Fields(l), " "))
		}
	}
	return lines
}

// writeFile writes data to path and fsyncs it, timing both. It stops
// early when ctx ends.
func writeFile(ctx context.Context, path string, data []byte) (time.Duration, error) {
	start := time.Now()
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
	if err != nil {
		return 0, err
	}
	for off := 0; off < len(data); off += chunk {
		if err := ctx.Err(); err != nil {
			f.Close()
			return 0, err
		}
		if _, err := f.Write(data[off:min(off+chunk, len(data))]); err != nil {
			f.Close()
			return 0, err
		}
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return 0, err
	}
	if err := f.Close(); err != nil {
		return 0, err
	}
	return time.Since(start), nil
}

// readFile reads path and returns its SHA-256 (hex) and how long reading
// took. Hashing runs alongside the reads so it does not slow them down.
// It stops early when ctx ends.
func readFile(ctx context.Context, path string) (string, time.Duration, error) {
	start := time.Now()
	f, err := os.Open(path)
	if err != nil {
		return "", 0, err
	}
	defer f.Close()
	const nbuf = 4
	free := make(chan []byte, nbuf)
	for range nbuf {
		free <- make([]byte, chunk)
	}
	full := make(chan []byte, nbuf)
	hashed := make(chan string, 1)
	go func() {
		h := sha256.New()
		for b := range full {
			h.Write(b)
			free <- b[:cap(b)]
		}
		hashed <- hex.EncodeToString(h.Sum(nil))
	}()
	var rerr error
	for {
		if rerr = ctx.Err(); rerr != nil {
			break
		}
		b := <-free
		n, err := io.ReadFull(f, b)
		if n > 0 {
			full <- b[:n]
		}
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			break
		}
		if err != nil {
			rerr = err
			break
		}
	}
	el := time.Since(start)
	close(full)
	sum := <-hashed
	return sum, el, rerr
}

// dropCaches writes dirty pages out and empties the page cache, so that
// what is read next comes from the volume.
func dropCaches() error {
	syscall.Sync()
	if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3"), 0o200); err != nil {
		return fmt.Errorf("dropping caches: %w", err)
	}
	return nil
}

// mount is a line of /proc/self/mountinfo.
type mount struct {
	root, fsType, source string
	// opts are the mount's options and the file system's, joined.
	opts string
}

// mountAt returns the topmost mount at path; ok is false when path is
// not a mount point.
func mountAt(mountInfo []byte, path string) (m mount, ok bool) {
	info, err := mountinfo.AtIn(bytes.NewReader(mountInfo), path)
	if err != nil || info == nil {
		return m, false
	}
	m = mount{root: info.Root, fsType: info.FSType, source: info.Source, opts: info.Options}
	if info.VFSOptions != "" {
		m.opts += "," + info.VFSOptions
	}
	return m, true
}

// mountOf describes what is mounted at path ("ext4 on /dev/loop3").
func mountOf(path string) string {
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return err.Error()
	}
	m, ok := mountAt(mi, path)
	if !ok {
		return "not a mount point"
	}
	desc := fmt.Sprintf("%s on %s", m.fsType, m.source)
	if m.root != "/" {
		desc += " (bind of " + m.root + ")"
	}
	return desc
}
