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

//go:build linux

package guest

import (
	"context"
	"io"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/mdlayher/genetlink"
	"golang.org/x/sys/unix"
)

func inVM(t *testing.T) {
	t.Helper()
	if os.Getenv("MPNBD_IN_VM") != "1" {
		t.Skip("runs only inside the e2e VM (MPNBD_IN_VM=1); the host test internal/testenv/vm TestVMSmoke runs it there")
	}
}

func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// TestGuestNBDDevice checks what the NBD node tests rely on: the nbd
// driver and its netlink family, MPTCP, a block device to make a file
// system on, and network namespaces with veth pairs and tbf shaping.
func TestGuestNBDDevice(t *testing.T) {
	inVM(t)
	var uts unix.Utsname
	if err := unix.Uname(&uts); err == nil {
		t.Logf("kernel %s", unix.ByteSliceToString(uts.Release[:]))
	}

	t.Run("nbd_device", func(t *testing.T) {
		st, err := os.Stat("/dev/nbd0")
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode()&os.ModeDevice == 0 {
			t.Fatalf("/dev/nbd0 is not a device: %v", st.Mode())
		}
	})

	t.Run("nbd_netlink_family", func(t *testing.T) {
		c, err := genetlink.Dial(nil)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		f, err := c.GetFamily("nbd")
		if err != nil {
			t.Fatalf("generic netlink family nbd: %v", err)
		}
		if f.ID == 0 || f.Name != "nbd" {
			t.Fatalf("bad family %+v", f)
		}
		t.Logf("family nbd: id %d version %d, %d multicast groups", f.ID, f.Version, len(f.Groups))
	})

	t.Run("nbd_netlink_in_netns", func(t *testing.T) {
		// Informational: in 6.1 the nbd family is not netns-aware, so it
		// resolves only from the initial network namespace.
		errc := make(chan error, 1)
		go func() {
			// The thread leaves the initial namespace and is not
			// unlocked, so it exits with this goroutine.
			runtime.LockOSThread()
			if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
				errc <- err
				return
			}
			c, err := genetlink.Dial(nil)
			if err != nil {
				errc <- err
				return
			}
			defer c.Close()
			_, err = c.GetFamily("nbd")
			errc <- err
		}()
		if err := <-errc; err != nil {
			t.Logf("nbd family from a new network namespace: %v (use a netlink socket opened in the initial namespace)", err)
		} else {
			t.Logf("nbd family resolves from a new network namespace")
		}
	})

	t.Run("mptcp", func(t *testing.T) {
		if b, err := os.ReadFile("/proc/sys/net/mptcp/enabled"); err != nil || strings.TrimSpace(string(b)) != "1" {
			t.Fatalf("net.mptcp.enabled: %q %v", b, err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		var lc net.ListenConfig
		lc.SetMultipathTCP(true)
		ln, err := lc.Listen(ctx, "tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		accepted := make(chan net.Conn, 1)
		go func() {
			c, err := ln.Accept()
			if err != nil {
				close(accepted)
				return
			}
			accepted <- c
		}()
		var d net.Dialer
		d.SetMultipathTCP(true)
		c, err := d.DialContext(ctx, "tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		sc, ok := <-accepted
		if !ok {
			t.Fatal("accept failed")
		}
		defer sc.Close()
		for name, conn := range map[string]net.Conn{"client": c, "server": sc} {
			mp, err := conn.(*net.TCPConn).MultipathTCP()
			if err != nil || !mp {
				t.Errorf("%s connection MultipathTCP() = %v, %v; want true", name, mp, err)
			}
		}
		if _, err := c.Write([]byte("ping")); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 4)
		if _, err := io.ReadFull(sc, buf); err != nil || string(buf) != "ping" {
			t.Fatalf("read %q, %v", buf, err)
		}
	})

	t.Run("mkfs_ext4", func(t *testing.T) {
		dev := "/dev/ram0"
		if _, err := os.Stat(dev); err != nil {
			// No brd: a loop device over a file in the (tmpfs) root.
			img := t.TempDir() + "/disk.img"
			if err := os.WriteFile(img, nil, 0o644); err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(img, 64<<20); err != nil {
				t.Fatal(err)
			}
			dev = strings.TrimSpace(run(t, "losetup", "-f"))
			run(t, "losetup", dev, img)
			// Best effort, as the other cleanups here: the VM goes away.
			defer func() { _ = exec.Command("losetup", "-d", dev).Run() }()
		}
		run(t, "mkfs.ext4", "-q", "-F", dev)
		mnt := t.TempDir()
		if err := unix.Mount(dev, mnt, "ext4", 0, ""); err != nil {
			t.Fatalf("mount %s: %v", dev, err)
		}
		defer func() { _ = unix.Unmount(mnt, 0) }()
		if err := os.WriteFile(mnt+"/hello", []byte("hello"), 0o644); err != nil {
			t.Fatal(err)
		}
		if b, err := os.ReadFile(mnt + "/hello"); err != nil || string(b) != "hello" {
			t.Fatalf("read back %q, %v", b, err)
		}
	})

	t.Run("netns_veth_tbf", func(t *testing.T) {
		for _, tool := range []string{"ip", "tc"} {
			if _, err := exec.LookPath(tool); err != nil {
				t.Fatal(err)
			}
		}
		defer func() { _ = exec.Command("ip", "netns", "del", "vmsmoke").Run() }()
		run(t, "ip", "netns", "add", "vmsmoke")
		run(t, "ip", "link", "add", "vsa", "type", "veth", "peer", "name", "vsb", "netns", "vmsmoke")
		defer func() { _ = exec.Command("ip", "link", "del", "vsa").Run() }()
		run(t, "ip", "addr", "add", "10.99.0.1/24", "dev", "vsa")
		run(t, "ip", "link", "set", "vsa", "up")
		run(t, "ip", "-n", "vmsmoke", "addr", "add", "10.99.0.2/24", "dev", "vsb")
		run(t, "ip", "-n", "vmsmoke", "link", "set", "vsb", "up")
		run(t, "ip", "-n", "vmsmoke", "link", "set", "lo", "up")
		run(t, "tc", "qdisc", "replace", "dev", "vsa", "root", "tbf", "rate", "10mbit", "burst", "128kb", "latency", "50ms")
		if out := run(t, "tc", "qdisc", "show", "dev", "vsa"); !strings.Contains(out, "tbf") {
			t.Fatalf("no tbf qdisc: %s", out)
		}
		run(t, "ip", "-n", "vmsmoke", "mptcp", "endpoint", "flush")
		run(t, "ip", "netns", "exec", "vmsmoke", "ping", "-c", "1", "-W", "5", "10.99.0.1")
	})
}
