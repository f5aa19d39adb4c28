package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

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
