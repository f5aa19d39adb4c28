package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
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
	vc := &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: o.fsType}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
	var vol *csi.Volume
	if err := d.step(fmt.Sprintf("CreateVolume %s, %s, transport=%s", formatBytes(o.volumeSize), o.fsType, o.transport), func() error {
		r, err := cc.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
			Name:               csiName,
			CapacityRange:      &csi.CapacityRange{RequiredBytes: o.volumeSize},
			VolumeCapabilities: []*csi.VolumeCapability{vc},
			Parameters:         map[string]string{driver.ParamTransport: o.transport, driver.ParamFSType: o.fsType},
		})
		if err != nil {
			return err
		}
		vol = r.GetVolume()
		id := vol.GetVolumeId()
		d.onCleanup("DeleteVolume, wait for the backing file to go", func(ctx context.Context) error {
			if _, err := cc.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
				return err
			}
			backing := filepath.Join(d.dir, "volumes", id+".img")
			return waitFor(ctx, "the backing file "+backing+" to be removed", readyTimeout, func() error {
				if _, err := os.Stat(backing); err == nil {
					return errors.New("still there")
				}
				return nil
			})
		})
		fmt.Fprintf(d.out, "     volume %s, %d bytes, context %v\n", id, vol.GetCapacityBytes(), vol.GetVolumeContext())
		return nil
	}); err != nil {
		return err
	}
	id := vol.GetVolumeId()

	var pubCtx map[string]string
	if err := d.step("ControllerPublishVolume to "+workerNode, func() error {
		r, err := cc.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
			VolumeId: id, NodeId: workerNode, VolumeCapability: vc, VolumeContext: vol.GetVolumeContext(),
		})
		if err != nil {
			return err
		}
		d.onCleanup("ControllerUnpublishVolume", func(ctx context.Context) error {
			_, err := cc.ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: workerNode})
			return err
		})
		pubCtx = r.GetPublishContext()
		export := pubCtx[driver.PublishContextExport]
		if v, tok, ok := strings.Cut(export, "/"); ok {
			export = v + "/" + strings.Repeat("*", len(tok)) // the token stays secret
		}
		fmt.Fprintf(d.out, "     export %s at %s\n", export, pubCtx[driver.PublishContextAddresses])
		return nil
	}); err != nil {
		return err
	}

	staging := filepath.Join(d.dir, "kubelet", "staging", id)
	target := filepath.Join(d.dir, "kubelet", "pod", "mount")
	if err := d.step("NodeStageVolume (connect over MPTCP, attach, mkfs, mount)", func() error {
		if err := os.MkdirAll(staging, 0o750); err != nil {
			return err
		}
		_, err := cc.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{
			VolumeId: id, PublishContext: pubCtx, StagingTargetPath: staging, VolumeCapability: vc,
			VolumeContext: vol.GetVolumeContext(),
		})
		// Unstage also after a failed stage: it removes what is left.
		d.onCleanup("NodeUnstageVolume", func(ctx context.Context) error {
			_, err := cc.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
			return err
		})
		if err != nil {
			return err
		}
		fmt.Fprintf(d.out, "     %s: %s\n", staging, mountOf(staging))
		return nil
	}); err != nil {
		return err
	}
	if err := d.step("NodePublishVolume", func() error {
		if err := os.MkdirAll(filepath.Dir(target), 0o750); err != nil {
			return err
		}
		_, err := cc.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
			VolumeId: id, PublishContext: pubCtx, StagingTargetPath: staging, TargetPath: target,
			VolumeCapability: vc, VolumeContext: vol.GetVolumeContext(),
		})
		d.onCleanup("NodeUnpublishVolume", func(ctx context.Context) error {
			_, err := cc.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: id, TargetPath: target})
			return err
		})
		if err != nil {
			return err
		}
		fmt.Fprintf(d.out, "     %s: %s\n", target, mountOf(target))
		return nil
	}); err != nil {
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
		syscall.Sync()
		if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3"), 0o200); err != nil {
			return fmt.Errorf("dropping caches: %w", err)
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
		return d.health(ctx, cc, id, target, len(pubAddrs(pubCtx)))
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

// mountOf describes what is mounted at path ("ext4 on /dev/loop3").
func mountOf(path string) string {
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return err.Error()
	}
	desc := "not a mount point"
	for line := range bytes.Lines(mi) {
		pre, post, ok := strings.Cut(strings.TrimSpace(string(line)), " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if !ok || len(f) < 5 || len(g) < 2 || mountinfo.Unescape(f[4]) != path {
			continue
		}
		desc = fmt.Sprintf("%s on %s", g[0], g[1])
		if f[3] != "/" {
			desc += " (bind of " + f[3] + ")"
		}
	}
	return desc
}
