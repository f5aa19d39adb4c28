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

// The --fio measurement: what the volume's data path gives users, through
// the block device and through a file system, as a ratio to our raw NBD
// client on the same paths, to the same storage agent, in the same run.
//
// Each column has a volume of its own, created, used and torn down in
// full before the next (so that the demo's sweep checks each one's
// leftovers):
//
//   - raw: bin/nbdload --mptcp in the worker's network namespace, on the
//     export of a volume that is published to the worker but not staged
//     (the export name and addresses come from the publish context, as
//     the node plugin gets them; the storage agent accepts the
//     connection because it comes from the worker's storage addresses);
//   - block: fio (libaio, O_DIRECT) on the device at the target of a Block
//     volume: the fuse transport's loop device on the FUSE file;
//   - ext4, xfs: fio on a file in a Filesystem volume's target, O_DIRECT,
//     then a buffered write of a new file ended by fsync and a buffered
//     read of it with a cold page cache.
//
// Every run uses the same span (half the volume), written in full and
// verified before the measured runs, so that no run pays for the storage
// node's first touch of its pages and every path is checked to carry the
// data intact.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/driver"
)

// fioRamp is the unmeasured start of each timed run.
const fioRamp = 2 * time.Second

// fioSpan is the region of a volume of size bytes that the runs use: half
// of it, in whole MiB, which leaves a file system room to spare.
func fioSpan(size int64) int64 { return size / 2 &^ (1<<20 - 1) }

// shm is where --fio keeps the work directory, and with it the volumes'
// backing files, when it is a tmpfs.
const shm = "/dev/shm"

// fioWorkParent returns the directory to make the work directory in for
// --fio: /dev/shm when it is a tmpfs, else "" (the default temporary
// directory). On tmpfs a flush of the volume costs the storage node
// nothing, so the columns compare data paths, not the storage node's
// disk: ext4 and xfs flush (journal commits, fsync) where the raw client
// and fio on the device do not, and on a disk each flush would write back
// whatever the runs before left dirty.
func fioWorkParent() string {
	if fsTypeOf(shm) == "tmpfs" && unix.Access(shm, unix.W_OK) == nil {
		return shm
	}
	return ""
}

// fsMagics names the file systems the backing directory may be on.
var fsMagics = map[int64]string{
	unix.TMPFS_MAGIC: "tmpfs", unix.EXT4_SUPER_MAGIC: "ext4", unix.XFS_SUPER_MAGIC: "xfs",
	unix.BTRFS_SUPER_MAGIC: "btrfs", unix.OVERLAYFS_SUPER_MAGIC: "overlayfs",
}

// fsTypeOf names the file system dir is on.
func fsTypeOf(dir string) string {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return "unknown (" + err.Error() + ")"
	}
	if n, ok := fsMagics[int64(st.Type)]; ok {
		return n
	}
	return fmt.Sprintf("0x%x", st.Type)
}

// fsBench runs the measurement after the demo; the results go to
// d.res.FS, which the summary prints.
func (d *demo) fsBench(ctx context.Context, cc *csiClients) error {
	o := d.o
	b := newFSBench()
	b.Seconds, b.RampSeconds = o.fioTime.Seconds(), fioRamp.Seconds()
	b.VolumeBytes, b.SpanBytes = o.volumeSize, fioSpan(o.volumeSize)
	b.BackingDir = filepath.Join(d.dir, "volumes")
	b.BackingFS = fsTypeOf(b.BackingDir)
	d.res.FS = b
	if err := d.step("fio: the volumes' backing store", func() error {
		var st unix.Statfs_t
		if err := unix.Statfs(b.BackingDir, &st); err != nil {
			return err
		}
		free := int64(st.Bavail) * st.Bsize
		fmt.Fprintf(d.out, "     %s on %s, %d MiB free; each column's volume %s, runs over its first %s, %s each after %s\n",
			b.BackingDir, b.BackingFS, free>>20, formatBytes(b.VolumeBytes), formatBytes(b.SpanBytes), o.fioTime, fioRamp)
		if b.BackingFS != "tmpfs" {
			fmt.Fprintln(d.out, "     (not tmpfs: the file systems' flushes also wait for the storage node's disk)")
		}
		if free < b.VolumeBytes+256<<20 {
			return fmt.Errorf("%s has %d MiB free, a volume needs %d MiB and some room", b.BackingDir, free>>20, b.VolumeBytes>>20)
		}
		return nil
	}); err != nil {
		return err
	}
	for _, col := range fsColumns {
		mark := len(d.undos)
		c := FSColumn{Name: col}
		var err error
		if col == colRaw {
			err = d.rawColumn(ctx, cc, b, &c)
		} else {
			err = d.deviceColumn(ctx, cc, b, &c)
		}
		b.Columns = append(b.Columns, c)
		if terr := d.tearDown("tear down the "+col+" column's volume", mark); err == nil {
			err = terr
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// rawColumn measures the raw NBD client on a volume published to the
// worker and not staged.
func (d *demo) rawColumn(ctx context.Context, cc *csiClients, b *FSBench, c *FSColumn) error {
	c.What = "nbdload --mptcp in the worker's namespace on the export of a published, unstaged volume"
	v, err := d.createVolume(ctx, cc, csiName+"-raw", b.VolumeBytes, blockCapability(), "the raw client's, not staged")
	if err != nil {
		return err
	}
	addrs := pubAddrs(v.pubCtx)
	if len(addrs) == 0 || v.pubCtx[driver.PublishContextExport] == "" {
		return errors.New("the publish context has no export or no storage address")
	}
	// As the node opens it: with its token and the publication's epoch.
	epoch, _ := strconv.ParseInt(v.pubCtx[driver.PublishContextEpoch], 10, 64)
	export := access.ExportName(v.pubCtx[driver.PublishContextExport], d.nodeToken, epoch)
	span := strconv.FormatInt(b.SpanBytes, 10)
	if err := d.step(fmt.Sprintf("raw: write the first %s and verify it (nbdload --verify)", formatBytes(b.SpanBytes)), func() error {
		_, _, err := d.nbdload(ctx, addrs[0], export, "--verify", "--rw", "write", "--bs", "1M", "--qd", "8", "--span", span)
		return err
	}); err != nil {
		return err
	}
	for _, w := range directWorkloads {
		if err := d.step(fmt.Sprintf("raw: %s, %s", w.label(), d.o.fioTime), func() error {
			cell, err := d.measure(ctx, v.id, "", func() (*FSCell, error) {
				cell, subflows, err := d.nbdload(ctx, addrs[0], export, "--rw", w.rw, "--bs", strconv.FormatInt(w.bs, 10),
					"--qd", strconv.Itoa(w.qd), "--time", d.o.fioTime.String(), "--warmup", fioRamp.String(), "--span", span)
				c.Subflows = subflows
				return cell, err
			})
			if err != nil {
				return err
			}
			b.set(w.name, colRaw, cell)
			fmt.Fprintf(d.out, "     %s; %d MPTCP subflows\n", cell, c.Subflows)
			return nil
		}); err != nil {
			return err
		}
	}
	return nil
}

// nbdload runs the raw client in the worker's network namespace against
// the export at addr. The export name, which holds the access token,
// reaches it on its standard input and appears in no error. Like the
// driver's processes it enters the network namespace only (nsenter, not
// ip netns exec): a mount namespace of its own would hold copies of the
// volumes mounted meanwhile, and their loop devices busy.
func (d *demo) nbdload(ctx context.Context, addr, export string, args ...string) (*FSCell, int, error) {
	argv := append([]string{"nsenter", "--net=/run/netns/" + d.topo.ClientNS, "--", filepath.Join(d.o.binDir, "nbdload"),
		"--addr", addr, "--export-file", "/dev/stdin", "--mptcp"}, args...)
	hide := func(err error) error {
		if err == nil {
			return nil
		}
		return errors.New(strings.ReplaceAll(err.Error(), export, maskedExport(export)))
	}
	out, runErr := runTool(ctx, "nbdload", d.o.fioTime+fioRamp+5*time.Minute, export, argv)
	cell, subflows, err := nbdloadCell(out)
	if runErr != nil {
		return nil, 0, hide(errors.Join(runErr, err))
	}
	return cell, subflows, hide(err)
}

// deviceColumn measures fio on a volume staged and published on the
// worker: on the block device of a Block volume, or on a file in a
// Filesystem volume of the column's file system.
func (d *demo) deviceColumn(ctx context.Context, cc *csiClients, b *FSBench, c *FSColumn) error {
	o := d.o
	vc := blockCapability()
	c.What = "fio on the block device (" + o.transport + " transport)"
	if c.Name != colBlock {
		vc = mountCapability(c.Name)
		c.What = "fio on a file in " + c.Name + " on the block device (" + o.transport + " transport)"
	}
	v, err := d.createVolume(ctx, cc, csiName+"-"+c.Name, b.VolumeBytes, vc, "")
	if err != nil {
		return err
	}
	if err := d.stageVolume(ctx, cc, v, filepath.Join(d.dir, "kubelet", "pod-"+c.Name, "volume")); err != nil {
		return err
	}
	file := v.target
	if vc.GetMount() != nil {
		file = filepath.Join(v.target, "fio.dat")
	}
	if err := d.step(c.Name+": the device, its queue and the volume's MPTCP subflows", func() error {
		return d.describeColumn(ctx, v, c)
	}); err != nil {
		return err
	}
	fill := fsWorkload{name: "fill", rw: "write", bs: 1 << 20, qd: 8}
	if err := d.step(fmt.Sprintf("%s: write the first %s and verify it (fio --verify=crc32c)", c.Name, formatBytes(b.SpanBytes)), func() error {
		// No verify state file in the working directory.
		_, err := d.fio(ctx, append(fioArgs(fill, file, b.SpanBytes, 0, 0), "--verify=crc32c", "--verify_state_save=0"))
		return err
	}); err != nil {
		return err
	}
	run := func(w fsWorkload, file string, runtime time.Duration) error {
		return d.step(fmt.Sprintf("%s: %s", c.Name, w.label()), func() error {
			cell, err := d.measure(ctx, v.id, c.Device, func() (*FSCell, error) {
				return d.fio(ctx, fioArgs(w, file, b.SpanBytes, runtime, fioRamp))
			})
			if err != nil {
				return err
			}
			b.set(w.name, c.Name, cell)
			fmt.Fprintf(d.out, "     %s\n", cell)
			return nil
		})
	}
	for _, w := range directWorkloads {
		if err := run(w, file, o.fioTime); err != nil {
			return err
		}
	}
	if vc.GetMount() == nil {
		return nil
	}
	// An application writing a big file: a new file, through the page
	// cache, ended by fsync (fio's runtime includes it); then reading it
	// with nothing of it cached.
	if err := os.Remove(file); err != nil {
		return err
	}
	file = filepath.Join(v.target, "buffered.dat")
	for _, w := range bufferedWorkloads {
		if !isWrite(w.rw) {
			if err := dropCaches(); err != nil {
				return err
			}
		}
		if err := run(w, file, 0); err != nil {
			return err
		}
	}
	return nil
}

// describeColumn records and prints the volume's device, its queue
// settings, its mount options and its connection's subflows.
func (d *demo) describeColumn(ctx context.Context, v *csiVolume, c *FSColumn) error {
	subs, err := d.volumeSubflows(ctx)
	c.Subflows = len(subs)
	if err != nil {
		return err
	}
	var st unix.Stat_t
	if err := unix.Stat(v.target, &st); err != nil {
		return err
	}
	dev := st.Dev // the file system's device
	if st.Mode&unix.S_IFMT == unix.S_IFBLK {
		dev = st.Rdev
	}
	link, err := os.Readlink(fmt.Sprintf("/sys/dev/block/%d:%d", unix.Major(dev), unix.Minor(dev)))
	if err != nil {
		return fmt.Errorf("the device of %s: %w", v.target, err)
	}
	name := filepath.Base(link)
	c.Device = "/dev/" + name
	c.Queue = queueSettings(name)
	if mi, err := os.ReadFile("/proc/self/mountinfo"); err == nil && v.cap.GetMount() != nil {
		if m, ok := mountAt(mi, v.target); ok {
			c.MountOptions = m.opts
		}
	}
	fmt.Fprintf(d.out, "     %s: %s\n", c.Device, formatQueue(c.Queue))
	if c.MountOptions != "" {
		fmt.Fprintf(d.out, "     mounted %s\n", c.MountOptions)
	}
	fmt.Fprintf(d.out, "     %d MPTCP subflows\n", c.Subflows)
	return nil
}

// queueKeys are the block device settings that shape its requests.
var queueKeys = []string{"queue/max_sectors_kb", "queue/max_hw_sectors_kb", "queue/max_segments",
	"queue/max_segment_size", "queue/optimal_io_size", "queue/read_ahead_kb", "queue/nr_requests",
	"queue/logical_block_size", "queue/scheduler", "loop/dio"}

// queueSettings reads queueKeys of block device name from sysfs.
func queueSettings(name string) map[string]string {
	q := map[string]string{}
	for _, k := range queueKeys {
		if b, err := os.ReadFile(filepath.Join("/sys/block", name, k)); err == nil {
			q[filepath.Base(k)] = strings.TrimSpace(string(b))
		}
	}
	return q
}

// formatQueue prints queue settings in queueKeys' order.
func formatQueue(q map[string]string) string {
	var parts []string
	for _, k := range queueKeys {
		if v, ok := q[filepath.Base(k)]; ok {
			parts = append(parts, filepath.Base(k)+" "+v)
		}
	}
	return strings.Join(parts, ", ")
}

func isWrite(rw string) bool { return strings.HasSuffix(rw, "write") }

// fioArgs returns fio's arguments for workload w on file (a block device
// or a regular file), over its first span bytes. Direct workloads use
// libaio and O_DIRECT at the workload's queue depth; with runtime > 0
// they are time based after ramp, else one pass over the span. Buffered
// workloads go through the page cache one request at a time, once over
// the span; a write ends with fsync.
func fioArgs(w fsWorkload, file string, span int64, runtime, ramp time.Duration) []string {
	args := []string{
		"--output-format=json",
		"--name=" + w.name,
		"--filename=" + file,
		"--rw=" + w.rw,
		"--bs=" + strconv.FormatInt(w.bs, 10),
		"--size=" + strconv.FormatInt(span, 10),
		"--numjobs=1",
	}
	if w.buffered {
		args = append(args, "--ioengine=psync", "--direct=0")
		if isWrite(w.rw) {
			// No preallocation: the file grows as the application's
			// would.
			args = append(args, "--end_fsync=1", "--fallocate=none")
		}
		return args
	}
	args = append(args, "--ioengine=libaio", "--direct=1", "--iodepth="+strconv.Itoa(w.qd))
	if runtime > 0 {
		args = append(args, "--time_based", "--runtime="+fioMillis(runtime), "--ramp_time="+fioMillis(ramp))
	}
	if strings.HasPrefix(w.rw, "rand") {
		// Uniformly random offsets, as nbdload's.
		args = append(args, "--norandommap", "--randrepeat=0")
	}
	return args
}

// fioMillis formats a duration for fio's time options.
func fioMillis(d time.Duration) string { return strconv.FormatInt(d.Milliseconds(), 10) + "ms" }

// fio runs fio with args on the host and returns its result.
func (d *demo) fio(ctx context.Context, args []string) (*FSCell, error) {
	out, runErr := runTool(ctx, "fio", d.o.fioTime+fioRamp+5*time.Minute, "", append([]string{"fio"}, args...))
	cell, err := fioCell(out)
	if runErr != nil || err != nil {
		return nil, errors.Join(runErr, err)
	}
	return cell, nil
}

// measure makes one measured run and adds to its result what the block
// device dev (none for "") and the storage agent saw of it, ramp
// included: the mean size of their requests and the flushes.
func (d *demo) measure(ctx context.Context, volumeID, dev string, run func() (*FSCell, error)) (*FSCell, error) {
	counts := func() (dc, ac ioCounts, err error) {
		if dev != "" {
			if dc, err = deviceCounts(dev); err != nil {
				return dc, ac, err
			}
		}
		ac, err = d.agentCounts(ctx, volumeID)
		return dc, ac, err
	}
	dev0, agent0, err := counts()
	if err != nil {
		return nil, err
	}
	cell, err := run()
	if err != nil {
		return nil, err
	}
	dev1, agent1, err := counts()
	if err != nil {
		return nil, err
	}
	if dev != "" {
		dc := dev1.sub(dev0)
		cell.Device, cell.DeviceRequestKiB, cell.DeviceFlushes = dev, dc.meanRequestKiB(), dc.flushes
	}
	ac := agent1.sub(agent0)
	cell.AgentRequestKiB, cell.AgentFlushes = ac.meanRequestKiB(), ac.flushes
	return cell, nil
}

// runTool runs argv (the tool name) with stdin as its standard input,
// at most timeout, and returns its standard output; a failure carries the
// end of its standard error.
func runTool(ctx context.Context, name string, timeout time.Duration, stdin string, argv []string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	var stdout, stderr bytes.Buffer
	cmd.Stdin, cmd.Stdout, cmd.Stderr = strings.NewReader(stdin), &stdout, &stderr
	// Its own process group, killed whole when ctx ends, and killed when
	// the demo dies.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Run(); err != nil {
		msg := strings.TrimSpace(stderr.String())
		if len(msg) > 600 {
			msg = "..." + msg[len(msg)-600:]
		}
		return stdout.Bytes(), fmt.Errorf("%s: %w: %s", name, err, msg)
	}
	return stdout.Bytes(), nil
}
