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

package vm

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/repo"
)

// Environment variables understood by Default:
//
//	MPNBD_VM_REQUIRE=1   fail instead of skip when the VM cannot be had
//	MPNBD_VM_DISABLE=1   skip every VM test
//	MPNBD_VM_VERBOSE=1   stream the guest console to stderr
//	MPNBD_VM_CACHE, MPNBD_VM_KERNEL_PKG, MPNBD_VM_MODULES
//	                     passed to hack/vm-kernel.sh
//	MPNBD_VM_ACCEL       qemu accelerator (default tcg)
const (
	envRequire = "MPNBD_VM_REQUIRE"
	envDisable = "MPNBD_VM_DISABLE"
	envVerbose = "MPNBD_VM_VERBOSE"
)

// Kernel describes the cached guest kernel that hack/vm-kernel.sh
// provides.
type Kernel struct {
	Image   string   // vmlinuz
	Modules []string // .ko paths in load order
	Release string   // e.g. 6.1.0-57-cloud-amd64
	Package string   // Debian package and version
}

// moduleParams are the parameters Default loads modules with.
var moduleParams = map[string]string{
	"nbd":  "nbds_max=8",
	"brd":  "rd_nr=1 rd_size=131072", // /dev/ram0, 128 MiB, allocated on use
	"loop": "max_loop=4",
}

// defaultTools are copied into the guest by Default when the host has
// them: iproute2 (busybox's ip lacks netns, mptcp and tc options the e2e
// topology uses), e2fsprogs, and the fsck and blkid of util-linux that
// mount-utils runs when it formats, checks and mounts.
var defaultTools = []string{"ip", "tc", "ss", "mkfs.ext4", "e2fsck", "fsck", "fsck.ext4", "blkid", "resize2fs"}

// defaultFiles are host configuration files Default copies when present.
var defaultFiles = []string{"/etc/mke2fs.conf", "/etc/iproute2"}

var (
	kernelOnce sync.Once
	kernelInfo Kernel
	kernelErr  error
)

// unavailable skips t, or fails it if MPNBD_VM_REQUIRE is set.
func unavailable(t testing.TB, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf("vm: "+format, args...)
	if os.Getenv(envRequire) == "1" {
		t.Fatalf("%s (%s=1)", msg, envRequire)
	}
	t.Skip(msg)
}

// goPackage returns where to run the go command for pkg and the package
// argument to give it. A path relative to the repository root (such as
// "./pkg/ublk" or "./e2e/nodeattach") is built in its own directory, so
// that the go command uses the module that holds it (the driver's or the
// e2e module); an import path is resolved from the working directory's
// module.
func goPackage(pkg string) (dir, arg string, err error) {
	if !strings.HasPrefix(pkg, "./") && !strings.HasPrefix(pkg, "../") {
		return "", pkg, nil
	}
	root, err := repo.Root()
	if err != nil {
		return "", "", err
	}
	return filepath.Join(root, filepath.FromSlash(pkg)), ".", nil
}

// LoadKernel runs hack/vm-kernel.sh (once per process) and returns the
// kernel it provides. The first call may download the kernel package and
// install the host packages the harness needs.
func LoadKernel() (Kernel, error) {
	kernelOnce.Do(func() {
		kernelInfo, kernelErr = loadKernel()
	})
	return kernelInfo, kernelErr
}

func loadKernel(env ...string) (Kernel, error) {
	var k Kernel
	root, err := repo.Root()
	if err != nil {
		return k, err
	}
	script := filepath.Join(root, "hack", "vm-kernel.sh")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", script)
	cmd.Env = append(os.Environ(), env...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return k, fmt.Errorf("%s: %v: %s", script, err, strings.TrimSpace(stderr.String()))
	}
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		key, val, ok := strings.Cut(sc.Text(), "=")
		if !ok {
			continue
		}
		switch key {
		case "KERNEL":
			k.Image = val
		case "MODULE":
			k.Modules = append(k.Modules, val)
		case "VERSION":
			k.Release = val
		case "PACKAGE":
			k.Package = val
		}
	}
	if k.Image == "" {
		return k, fmt.Errorf("%s printed no kernel: %s", script, strings.TrimSpace(stderr.String()))
	}
	return k, nil
}

// UblkKernelPackage is the kernel DefaultUblk boots: Debian 12's stock
// 6.12 kernel (bookworm), which ships ublk_drv and nbd as modules (its nbd
// refuses MPTCP sockets, like every stock kernel). MPNBD_VM_UBLK_KERNEL_PKG
// names another.
const UblkKernelPackage = "linux-image-6.12.117+deb12-amd64"

// cachedKernel is a kernel loaded once per test binary.
type cachedKernel struct {
	once sync.Once
	k    Kernel
	err  error
}

// config loads the kernel (hack/vm-kernel.sh with env) on first use and
// returns a Config booting it, or skips (fails, with MPNBD_VM_REQUIRE)
// saying that what is missing.
func (c *cachedKernel) config(t testing.TB, what string, env ...string) Config {
	t.Helper()
	checkHost(t)
	c.once.Do(func() { c.k, c.err = loadKernel(env...) })
	if c.err != nil {
		unavailable(t, "no %s: %v", what, c.err)
	}
	return configFor(t, c.k)
}

var ublkKernel cachedKernel

// DefaultUblk is Default on UblkKernelPackage, with ublk_drv loaded
// besides Default's modules: /dev/ublk-control exists in the guest; and
// virtio_net, for Config.HostForwards, bridge (topo.Fabric) and
// nf_tables (hosts and paths silenced).
func DefaultUblk(t testing.TB) Config {
	t.Helper()
	pkg := os.Getenv("MPNBD_VM_UBLK_KERNEL_PKG")
	if pkg == "" {
		pkg = UblkKernelPackage
	}
	return ublkKernel.config(t, "ublk guest kernel", "MPNBD_VM_KERNEL_PKG="+pkg,
		"MPNBD_VM_MODULES=ublk_drv nbd veth sch_tbf loop brd ext4 crc32c_generic virtio_net bridge nf_tables")
}

// NewestKernelSuite is where DefaultNewest takes its kernel: Debian 13's
// backports, whose kernel follows the newest stable release (7.3 at the
// time of writing), with a ublk driver that can resize a device online
// (UBLK_F_UPDATE_SIZE, Linux 6.14 and later).
const NewestKernelSuite = "trixie-backports"

var newestKernel cachedKernel

// DefaultNewest is Default on the kernel that linux-image-amd64 of
// NewestKernelSuite depends on, with ublk_drv loaded besides Default's
// modules.
func DefaultNewest(t testing.TB) Config {
	t.Helper()
	return newestKernel.config(t, "guest kernel from "+NewestKernelSuite, "MPNBD_VM_KERNEL_SUITE="+NewestKernelSuite,
		"MPNBD_VM_KERNEL_META=linux-image-amd64", "MPNBD_VM_MODULES=ublk_drv nbd veth sch_tbf loop brd ext4")
}

// Default returns a Config for tests: the cached Debian cloud kernel with
// the nbd, veth, sch_tbf, sch_netem, loop, brd and nf_tables (for nft
// rules that silence a host or a path) modules loaded (nbd with
// nbds_max=8, brd providing a 128 MiB /dev/ram0), iproute2 and e2fsprogs
// tools, 1 GiB of memory, 2 CPUs and a 5 minute timeout. It skips the test
// with the reason if the VM cannot be had (not linux/amd64, -short, no
// qemu, no kernel and no way to fetch it), or fails it instead when
// MPNBD_VM_REQUIRE is set.
func Default(t testing.TB) Config {
	t.Helper()
	checkHost(t)
	k, err := LoadKernel()
	if err != nil {
		unavailable(t, "no guest kernel: %v", err)
	}
	return configFor(t, k)
}

// configFor is the test Config booting k with its modules.
func configFor(t testing.TB, k Kernel) Config {
	t.Helper()
	cfg := baseConfig(t, k.Image)
	for _, m := range k.Modules {
		name := strings.TrimSuffix(filepath.Base(m), ".ko")
		if p := moduleParams[name]; p != "" {
			m += " " + p
		}
		cfg.Modules = append(cfg.Modules, m)
	}
	return cfg
}

// checkHost skips (or fails, see unavailable) t when no VM can run here.
func checkHost(t testing.TB) {
	t.Helper()
	if runtime.GOOS != "linux" || runtime.GOARCH != "amd64" {
		unavailable(t, "needs linux/amd64, have %s/%s", runtime.GOOS, runtime.GOARCH)
	}
	if os.Getenv("MPNBD_IN_VM") == "1" {
		t.Skip("vm: already inside the VM")
	}
	if os.Getenv(envDisable) != "" {
		t.Skipf("vm: %s is set", envDisable)
	}
	if testing.Short() {
		t.Skip("vm: skipped in -short mode")
	}
	for _, bin := range []string{"qemu-system-x86_64", "busybox"} {
		if _, err := exec.LookPath(bin); err != nil {
			unavailable(t, "%v", err)
		}
	}
}

// baseConfig is the Config Default and DefaultMPTCP share, without
// modules.
func baseConfig(t testing.TB, kernel string) Config {
	t.Helper()
	cfg := Config{
		Kernel:   kernel,
		Files:    map[string]string{},
		MemoryMB: defaultMemoryMB,
		CPUs:     defaultCPUs,
		Timeout:  defaultTimeout,
	}
	for _, tool := range defaultTools {
		if p, err := exec.LookPath(tool); err == nil {
			cfg.Tools = append(cfg.Tools, p)
		}
	}
	for _, f := range defaultFiles {
		if _, err := os.Stat(f); err == nil {
			cfg.Files[f] = f
		}
	}
	if os.Getenv(envVerbose) != "" {
		cfg.Output = os.Stderr
	}
	return cfg
}

// goEnv returns the environment for building guest binaries: static
// (CGO_ENABLED=0) linux/amd64, without -race, which needs cgo.
func goEnv() []string {
	env := append([]string{}, os.Environ()...)
	var flags []string
	for _, f := range strings.Fields(os.Getenv("GOFLAGS")) {
		if f != "-race" && !strings.HasPrefix(f, "-race=") {
			flags = append(flags, f)
		}
	}
	return append(env, "CGO_ENABLED=0", "GOOS=linux", "GOARCH=amd64", "GOFLAGS="+strings.Join(flags, " "))
}

func goCommand(dir string, args ...string) *exec.Cmd {
	// go test puts $GOROOT/bin first in the PATH of test binaries.
	gotool := "go"
	if p, err := exec.LookPath("go"); err == nil {
		gotool = p
	} else if p := filepath.Join(os.Getenv("GOROOT"), "bin", "go"); os.Getenv("GOROOT") != "" && fileExists(p) {
		gotool = p
	}
	cmd := exec.Command(gotool, args...)
	cmd.Dir = dir
	cmd.Env = goEnv()
	return cmd
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// BuildGoTest compiles the tests of pkg (an import path, or a path
// relative to the repository root such as "./internal/testenv/vm/guest"
// or "./e2e/nodeattach") into a static test binary for the guest and
// returns its path and the package's source directory. The binary lives
// in t.TempDir().
func BuildGoTest(t testing.TB, pkg string) (bin, srcDir string) {
	t.Helper()
	dir, arg, err := goPackage(pkg)
	if err != nil {
		t.Fatal(err)
	}
	out, err := goCommand(dir, "list", "-f", "{{.Dir}}", arg).CombinedOutput()
	if err != nil {
		t.Fatalf("vm: go list %s: %v\n%s", pkg, err, out)
	}
	srcDir = strings.TrimSpace(string(out))
	bin = filepath.Join(t.TempDir(), filepath.Base(srcDir)+".test")
	start := time.Now()
	out, err = goCommand(dir, "test", "-c", "-o", bin, arg).CombinedOutput()
	if err != nil {
		t.Fatalf("vm: go test -c %s: %v\n%s", pkg, err, out)
	}
	if !fileExists(bin) {
		t.Fatalf("vm: go test -c %s wrote no binary (package without tests?)\n%s", pkg, out)
	}
	t.Logf("vm: built %s in %v", pkg, time.Since(start).Round(time.Millisecond))
	return bin, srcDir
}

// BuildGo compiles the main package pkg (an import path, or a path
// relative to the repository root such as "./cmd/nbd-server") into a
// static binary for the guest and returns its path in t.TempDir().
func BuildGo(t testing.TB, pkg string) string {
	t.Helper()
	dir, arg, err := goPackage(pkg)
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), path.Base(pkg))
	if out, err := goCommand(dir, "build", "-o", bin, arg).CombinedOutput(); err != nil {
		t.Fatalf("vm: go build %s: %v\n%s", pkg, err, out)
	}
	return bin
}

// RunGoTest runs the tests of pkg matching run (all if empty) inside a VM
// configured by Default, with -test.v and the extra test flags args
// (e.g. "-test.count=2"). In the guest, MPNBD_IN_VM=1 is set and the test
// binary runs as root in /mpnbd/test, next to a copy of the package's
// testdata directory. The host test fails if the guest test fails or runs
// no test; the guest console output is logged, with the tail of the
// kernel log after a failure.
func RunGoTest(t *testing.T, pkg string, run string, args ...string) {
	t.Helper()
	RunGoTestWith(t, Default(t), pkg, run, args...)
}

// guestTestDir is where RunGoTestWith puts the test binary and testdata.
const guestTestDir = "/mpnbd/test"

// RunGoTestWith is RunGoTest with a caller-provided Config (e.g. Default
// with extra Files or Tools). cfg.Cmd is replaced.
func RunGoTestWith(t *testing.T, cfg Config, pkg string, run string, args ...string) Result {
	t.Helper()
	return runGoTest(t, cfg, pkg, run, args...)
}

func runGoTest(t testing.TB, cfg Config, pkg string, run string, args ...string) Result {
	t.Helper()
	bin, srcDir := BuildGoTest(t, pkg)

	files := make(map[string]string, len(cfg.Files)+2)
	for g, h := range cfg.Files {
		files[g] = h
	}
	name := filepath.Base(bin)
	files[guestTestDir+"/"+name] = bin
	if td := filepath.Join(srcDir, "testdata"); fileExists(td) {
		files[guestTestDir+"/testdata"] = td
	}
	cfg.Files = files

	if cfg.Timeout <= 0 {
		cfg.Timeout = defaultTimeout
	}
	if d, ok := t.(interface{ Deadline() (time.Time, bool) }); ok {
		if dl, ok := d.Deadline(); ok {
			if left := time.Until(dl) - 10*time.Second; left < cfg.Timeout {
				cfg.Timeout = max(left, 10*time.Second)
			}
		}
	}
	// Let the guest test time out (and print its goroutines) before the VM
	// is killed.
	guestTimeout := max(cfg.Timeout-30*time.Second, cfg.Timeout/2)

	argv := []string{"./" + name, "-test.v", "-test.timeout", guestTimeout.String()}
	if run != "" {
		argv = append(argv, "-test.run", run)
	}
	argv = append(argv, args...)
	quoted := make([]string, len(argv))
	for i, a := range argv {
		quoted[i] = shellQuote(a)
	}
	// On failure, the kernel log tail helps (nbd reports at info level,
	// below the console's loglevel).
	cfg.Cmd = "cd " + guestTestDir + " || exit 125\n" +
		strings.Join(quoted, " ") + "\n" +
		"code=$?\n" +
		"[ $code = 0 ] || { echo '---- dmesg (tail) ----'; dmesg | tail -n 60; }\n" +
		"exit $code"

	res, err := Run(t.Context(), cfg)
	out := trimLog(res.Output, 1500)
	what := fmt.Sprintf("guest test %s (-test.run %q)", pkg, run)
	switch {
	case err != nil:
		t.Errorf("vm: %s: %v (VM ran %v)\n---- guest console ----\n%s", what, err, res.Duration.Round(time.Millisecond), out)
	case strings.Contains(res.Output, "testing: warning: no tests to run"):
		t.Errorf("vm: %s ran no test\n---- guest console ----\n%s", what, out)
	default:
		t.Logf("vm: %s passed (VM ran %v)\n---- guest console ----\n%s", what, res.Duration.Round(time.Millisecond), out)
	}
	return res
}

// trimLog keeps at most limit lines of s: the first fifth and the rest
// from the end.
func trimLog(s string, limit int) string {
	s = strings.TrimRight(s, "\n")
	lines := strings.Split(s, "\n")
	if len(lines) <= limit {
		return s
	}
	head := limit / 5
	tail := limit - head
	return strings.Join(lines[:head], "\n") +
		fmt.Sprintf("\n... (%d lines omitted) ...\n", len(lines)-limit) +
		strings.Join(lines[len(lines)-tail:], "\n")
}
