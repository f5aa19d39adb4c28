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

package nodeattach

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"k8s.io/client-go/tools/clientcmd"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/e2e/internal/replenv"
	"github.com/mpnbd/mpnbd/internal/testenv/apiserver"
	"github.com/mpnbd/mpnbd/internal/testenv/topo"
	"github.com/mpnbd/mpnbd/internal/testenv/vm"
	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/ublk"
)

// What the guest of TestReplicatedInVM is given: the host's API server
// (its administrator's kubeconfig, and where the guest reaches it) and the
// controller's binary.
const (
	envAPIKubeconfig = "MPNBD_TEST_API_KUBECONFIG"
	envAPIAddr       = "MPNBD_TEST_API_ADDR"
	envControllerBin = "MPNBD_TEST_CONTROLLER"
)

// TestReplicatedInVM runs TestReplicatedTransports in the VM (the kernel
// of the ublk tests: nbd and ublk drivers both), with this host's API
// server (its CRDs and the storage agent's RBAC installed) reached through
// a host forward: the agents and the controller run in the guest.
func TestReplicatedInVM(t *testing.T) {
	if os.Getenv("MPNBD_IN_VM") == "1" {
		t.Skip("already inside the VM")
	}
	names := selectGuestTests(t, []string{"TestReplicatedTransports"})
	cfg := vm.DefaultUblk(t)
	cfg.MemoryMB = 3072
	cfg.Timeout = 25 * time.Minute
	addFaultTools(t, &cfg)
	ctl := vm.BuildGo(t, "./cmd/controller")
	cfg.Tools = append(cfg.Tools, ctl)
	api, c := apiserver.Start(t)
	if err := apiserver.Apply(context.Background(), c, "deploy/rbac-storage-agent.yaml"); err != nil {
		t.Fatal(err)
	}
	if cfg.Files == nil {
		cfg.Files = map[string]string{}
	}
	cfg.Files["/etc/mpnbd-test/kubeconfig"] = apiserver.WriteKubeconfig(t, api)
	cfg.HostForwards = []vm.HostForward{{Port: 6443, To: strings.TrimSuffix(strings.TrimPrefix(api.Host, "https://"), "/")}}
	cfg.Env[envAPIKubeconfig] = "/etc/mpnbd-test/kubeconfig"
	cfg.Env[envAPIAddr] = vm.HostAddr + ":6443"
	cfg.Env[envControllerBin] = ctl
	runGuestTests(t, cfg, names)
}

// TestReplicatedTransports: a volume of three replicas on three storage
// hosts (each its agent, `nbd-server --cluster`; the controller fails
// volumes over), attached in turn with each transport of the kernel's
// drivers that a replicated volume takes (relay, tcp and multiconn
// through nbd, ublk), fio --verify=crc32c rounds on it while the storage
// host of its primary dies (every packet of its namespace dropped, its agent
// SIGKILLed): another replica is promoted, the device's I/O goes on with
// no error and the rounds verify; the host comes back, rebuilt in sync.
// A probe writer prints the longest I/O pause. The client host is the
// guest's initial network namespace (where nbd's netlink family is).
func TestReplicatedTransports(t *testing.T) {
	kc := os.Getenv(envAPIKubeconfig)
	if kc == "" {
		t.Skip("needs the host's API server: TestReplicatedInVM runs this in the VM")
	}
	requireGuest(t)
	requireFaultTools(t)
	topo.RequireNft(t)
	bin := t.TempDir()
	for name, path := range map[string]string{"nbd-server": os.Getenv(envOurServer), "controller": os.Getenv(envControllerBin)} {
		if path == "" {
			t.Fatalf("no %s binary in the guest", name)
		}
		if err := os.Symlink(path, filepath.Join(bin, name)); err != nil {
			t.Fatal(err)
		}
	}
	api, err := clientcmd.BuildConfigFromFlags("", kc)
	if err != nil {
		t.Fatal(err)
	}
	api.Host = "https://127.0.0.1:" + strconv.Itoa(replenv.ForwardAPI(t, "", os.Getenv(envAPIAddr)))
	scheme, err := apiserver.Scheme()
	if err != nil {
		t.Fatal(err)
	}
	c, err := client.New(api, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	e := replenv.New(t, replenv.Options{Bin: bin, API: api, Client: c, StorageHosts: 3, Paths: 2,
		ClientInRoot: true, Heartbeat: 2 * time.Second})

	modes := []attach.Transport{attach.Relay, attach.TCP, attach.MultiConn}
	if ublk.Available() == nil {
		modes = append(modes, attach.Ublk)
	} else {
		t.Logf("ublk not run: %v", ublk.Available())
	}
	for _, mode := range modes {
		replicatedFailover(t, e, mode)
	}
}

// replicatedFailover is TestReplicatedTransports for one transport.
func replicatedFailover(t *testing.T, e *replenv.Env, mode attach.Transport) {
	const size = 32 << 20
	name := "rv-" + string(mode)
	all := []string{"store-1", "store-2", "store-3"}
	token := e.CreatePublished(name, size, all[0], all[1:]...)
	record := func() *v1alpha1.ReplicationStatus { return e.Volume(name).Status.Replication }
	inSync := func() string {
		v := e.Volume(name)
		if r := v.Status.Replication; v.Status.Phase != v1alpha1.VolumeAvailable || r == nil || !slices.Equal(r.InSync, all) {
			return fmt.Sprintf("status %+v", v.Status)
		}
		return ""
	}
	e.WaitFor(name+" served, its three replicas in sync", 3*time.Minute, inSync)
	tg := attach.Target{VolumeID: name, Export: access.ExportName(name, token, 1), Addrs: e.Servers("s1"),
		Replicas: []attach.Server{{StorageNode: "store-2", Addrs: e.Servers("s2")}, {StorageNode: "store-3", Addrs: e.Servers("s3")}}}
	var a attach.Attacher
	if mode == attach.Ublk {
		a = newUblkAttacher(t, &topo.Topology{}, t.TempDir())
	} else {
		a, _ = newAttacher(t, &topo.Topology{}, mode)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	att, err := a.Attach(ctx, tg, attach.Options{})
	cancel()
	if err != nil {
		t.Fatalf("%s: attach: %v", mode, err)
	}
	detached := false
	detach := func() {
		if detached {
			return
		}
		detached = true
		if err := a.Detach(context.Background(), name); err != nil {
			t.Errorf("%s: detach: %v", mode, err)
		}
	}
	defer detach()
	dev := att.Device
	t.Logf("%s: %s attached as %s", mode, name, dev)
	probe := replenv.StartPauseProbe(t, dev, size-4096)
	stuck := attacherStuck(t, a, tg, dev)

	// One round before, one across the death, one after the return.
	round := func(seed int, during func()) {
		t.Helper()
		run := startFio(t, dev, seed)
		if during != nil {
			during()
		}
		if res := run.wait(t, 5*time.Minute, stuck); !res.ok() {
			t.Fatalf("%s: fio round %d: %v\n%s", mode, seed, res, tail(res.output, 20))
		}
	}
	round(1, nil)
	old := e.Hosts[record().Primary]
	round(2, func() {
		time.Sleep(2 * time.Second)
		killed := time.Now()
		old.Die(t)
		e.WaitFor(string(mode)+": another replica promoted", 2*time.Minute, func() string {
			if r := record(); r.Primary == old.Node {
				return fmt.Sprintf("record %+v", r)
			}
			return ""
		})
		t.Logf("%s: %s died; %s promoted %v later", mode, old.Node, record().Primary, time.Since(killed).Round(time.Millisecond))
	})
	pause, err := probe.Pause(time.Minute)
	if err != nil {
		t.Fatalf("%s: across the failover: %v", mode, err)
	}
	t.Logf("%s: the primary's host died under fio --verify: 0 errors, the longest I/O pause %v", mode, pause.Round(time.Millisecond))
	old.Revive(t)
	e.WaitFor(string(mode)+": the dead host back in sync", 3*time.Minute, inSync)
	round(3, nil)
	probe.End()
	detach()
	// The copies agree.
	r := record()
	want, err := os.ReadFile(filepath.Join(e.Hosts[r.Primary].Dir, name+".img"))
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range r.InSync {
		if got, err := os.ReadFile(filepath.Join(e.Hosts[n].Dir, name+".img")); err != nil || string(got) != string(want) {
			t.Errorf("%s: the copy on %s, in sync, differs from the primary's on %s (%v)", mode, n, r.Primary, err)
		}
	}
}
