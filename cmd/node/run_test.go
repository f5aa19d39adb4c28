package main

import (
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/mpnbd/mpnbd/pkg/attach"
)

func TestParseArgs(t *testing.T) {
	o, err := parseArgs([]string{"--node-id", "n1", "--transports", "fuse,relay", "--topology", "zone=a,rack=r1",
		"--storage-nic", "eth1,10.0.0.0/24", "--storage-address", "10.0.0.2"})
	if err != nil {
		t.Fatal(err)
	}
	if o.nodeID != "n1" || len(o.transports) != 2 || o.transports[0] != attach.FUSE || o.topology["rack"] != "r1" ||
		len(o.storageNICs) != 2 || o.storageAddrs[0] != "10.0.0.2" {
		t.Fatalf("parsed %+v", o)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{}, "--node-id"},
		{[]string{"--node-id", "n", "--transports", "auto"}, "auto"},
		{[]string{"--node-id", "n", "--transports", "nfs"}, "nfs"},
		{[]string{"--node-id", "n", "--storage-address", "eth0"}, "eth0"},
		{[]string{"--node-id", "n", "--topology", "zone"}, "zone"},
		{[]string{"--node-id", "n", "--endpoint", "csi.sock"}, "--endpoint"},
	} {
		t.Setenv("NODE_NAME", "")
		if _, err := parseArgs(c.args); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("parseArgs(%q) = %v, want an error naming %s", c.args, err, c.want)
		}
	}
}

func TestRunUsage(t *testing.T) {
	var out, errb bytes.Buffer
	if code := run(context.Background(), []string{"--help"}, &out, &errb); code != 0 || !strings.Contains(out.String(), "-storage-nic") {
		t.Fatalf("--help: code %d, output %q", code, out.String())
	}
}

// TestRunServesCSIAndMetrics runs the plugin (fuse transport) until it is
// stopped: the CSI socket answers and /metrics is served.
func TestRunServesCSIAndMetrics(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the node plugin needs root")
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		t.Skipf("no fuse transport here: %v", err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	dir := t.TempDir()
	sock := filepath.Join(dir, "csi.sock")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	var stderr bytes.Buffer
	go func() {
		done <- run(ctx, []string{"--node-id", "n1", "--endpoint", "unix://" + sock, "--state-dir", dir,
			"--transports", "fuse", "--metrics-addr", addr}, io.Discard, &stderr)
	}()
	var body string
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get("http://" + addr + "/metrics")
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				body = string(b)
				break
			}
		}
		if time.Now().After(deadline) {
			cancel()
			t.Fatalf("no metrics at %s: %v\n%s", addr, err, stderr.String())
		}
		time.Sleep(100 * time.Millisecond)
	}
	if !strings.Contains(body, "process_cpu_seconds_total") {
		t.Errorf("metrics without the process collector:\n%.500s", body)
	}
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	info, err := csi.NewNodeClient(conn).NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	if err != nil || info.GetNodeId() != "n1" {
		t.Fatalf("NodeGetInfo = %v, %v", info, err)
	}
	cancel()
	if code := <-done; code != 0 {
		t.Fatalf("run returned %d:\n%s", code, stderr.String())
	}
}
