package nodeattach

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/attach"
	"github.com/mpnbd/mpnbd/pkg/datapath"
	"github.com/mpnbd/mpnbd/pkg/ublk"
)

// handoverModes are the transports the datapath handover runs with in
// this guest: the kernel's own where its nbd takes MPTCP, ublk where the
// kernel has it, the relay (and a kernel-socket transport) elsewhere.
func handoverModes() []attach.Transport {
	switch {
	case os.Getenv(envMPTCPKernel) == "1":
		return []attach.Transport{attach.Kernel, attach.Ublk, attach.Relay}
	case ublk.Available() == nil:
		return []attach.Transport{attach.Ublk}
	}
	return []attach.Transport{attach.Relay, attach.TCP}
}

// TestDatapathHandover: a planned upgrade of the datapath component. A
// datapath process serves a volume while fio writes and verifies on it; a
// second one starts beside it and takes the volume over (the relay's end
// of the kernel's socket over SCM_RIGHTS; ublk through the driver's
// recovery; the kernel's sockets stay), then the first is SIGKILLed, as
// the pod deletion that follows a surge would; a third takes over from
// the second the same way. fio must end without an error or a verify
// failure, the device must read back the server's file, and the last
// process must report the volume connected and detach it.
func TestDatapathHandover(t *testing.T) {
	requireGuest(t)
	requireFaultTools(t)
	for _, mode := range handoverModes() {
		t.Run(string(mode), func(t *testing.T) {
			if mode == attach.Ublk && ublk.Available() != nil {
				t.Skipf("no ublk: %v", ublk.Available())
			}
			tp := guestTopology(t)
			st := newStorage(t, tp, faultExportSize, mode != attach.TCP)
			state := t.TempDir()
			cs := childSpec{ClientNS: tp.ClientNS, Target: st.target(volID(t)), StateDir: state, Mode: mode,
				Datapath: filepath.Join(state, "datapath.sock")}
			prev, dev, taken := startChildTaken(t, cs)
			if taken != 0 {
				t.Fatalf("the first datapath took %d volumes over, want 0", taken)
			}
			before := writeIOs(dev)
			f := startFio(t, dev, int(time.Now().UnixNano()%1000000)+5)
			stuck := func(what string) { reportStuck(t, dev, what, "(served by a datapath process)") }
			for round := 1; round <= 2; round++ {
				// The handover must meet a writer: a fast transport may
				// finish a round first; it is checked, and another starts.
				deadline := time.Now().Add(time.Minute)
				for writeIOs(dev)-before < 128 || !f.running() {
					if !f.running() {
						if res := f.wait(t, roundLimit, stuck); !res.ok() {
							t.Fatalf("fio before handover %d: %v\n%s", round, res, tail(res.output, 40))
						}
						before = writeIOs(dev)
						f = startFio(t, dev, int(time.Now().UnixNano()%1000000)+5+round)
					}
					if time.Now().After(deadline) {
						t.Fatalf("fio completed %d writes in a minute before handover %d", writeIOs(dev)-before, round)
					}
					time.Sleep(20 * time.Millisecond)
				}
				next, dev2, taken := startChildTaken(t, cs)
				if taken != 1 || dev2 != dev {
					t.Fatalf("round %d: the new datapath took %d volumes, device %s; want 1, %s", round, taken, dev2, dev)
				}
				// The predecessor is idle now: what a pod deletion does to it
				// must not reach the volume.
				prev.Process.Kill()
				prev.Wait()
				t.Logf("round %d: handed over after %d writes, predecessor SIGKILLed", round, writeIOs(dev)-before)
				time.Sleep(time.Second) // fio may end meanwhile: its result is checked next
				prev, before = next, writeIOs(dev)
			}
			res := f.wait(t, roundLimit, stuck)
			if !res.ok() {
				t.Fatalf("fio across two handovers: %v\n%s", res, tail(res.output, 40))
			}
			t.Logf("fio across two handovers: %v", res)
			compareWithImage(t, st.path, dev, stuck)
			c := &datapath.Client{Path: cs.Datapath}
			tr, h, err := c.Health(cs.Target.VolumeID)
			if err != nil || tr != mode || !h.Connected {
				t.Fatalf("health from the last datapath: %s %+v %v", tr, h, err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			if err := c.Detach(ctx, cs.Target.VolumeID); err != nil {
				t.Fatalf("detach through the last datapath: %v", err)
			}
			waitServerConns(t, st, 0)
			if _, err := os.Stat(dev); err == nil && mode == attach.Ublk {
				t.Fatalf("%s still exists after the detach", dev)
			}
		})
	}
}
