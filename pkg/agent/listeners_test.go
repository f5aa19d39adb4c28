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

package agent

import (
	"errors"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// TestListenersBindOnlyTheirAddresses: the port listens on the fixed
// addresses and the followed ones, and refuses connections on every other
// address of the host; a followed address that leaves closes the port
// there, one that comes opens it; all share the first bind's port.
func TestListenersBindOnlyTheirAddresses(t *testing.T) {
	srv := &nbd.Server{Logger: testLogger(t)}
	ls := NewListeners(srv, 0, false, testLogger(t))
	t.Cleanup(ls.Close)
	addr := netip.MustParseAddr
	if err := ls.Bind([]netip.Addr{addr("127.0.0.11"), addr("127.0.0.12")}); err != nil {
		t.Fatal(err)
	}
	ls.Serve()
	port := ls.Port()
	if port == 0 {
		t.Fatal("no port after Bind")
	}
	// reaches reports whether a TCP connection to host on the port is
	// accepted (and the server greets it).
	reaches := func(host string) bool {
		t.Helper()
		c, err := net.DialTimeout("tcp", net.JoinHostPort(host, strconv.Itoa(port)), 5*time.Second)
		if errors.Is(err, syscall.ECONNREFUSED) {
			return false
		}
		if err != nil {
			t.Fatalf("dial %s: %v", host, err)
		}
		defer c.Close()
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Read(make([]byte, 8)); err != nil {
			t.Fatalf("%s: no greeting: %v", host, err)
		}
		return true
	}
	check := func(what string, want map[string]bool) {
		t.Helper()
		for host, ok := range want {
			if got := reaches(host); got != ok {
				t.Errorf("%s: connection to %s accepted: %v, want %v", what, host, got, ok)
			}
		}
	}
	check("fixed addresses", map[string]bool{"127.0.0.11": true, "127.0.0.12": true, "127.0.0.1": false, "127.0.0.13": false})

	ls.Follow([]netip.Addr{addr("127.0.0.13"), addr("127.0.0.12")})
	check("a followed address came", map[string]bool{"127.0.0.13": true, "127.0.0.11": true, "127.0.0.1": false})
	want := []string{"127.0.0.11:" + strconv.Itoa(port), "127.0.0.12:" + strconv.Itoa(port), "127.0.0.13:" + strconv.Itoa(port)}
	if got := ls.Addrs(); !slices.Equal(got, want) {
		t.Errorf("Addrs %v, want %v", got, want)
	}

	// A followed address that leaves closes the port there; a fixed one
	// that the NICs no longer select stays.
	ls.Follow(nil)
	check("the followed address left", map[string]bool{"127.0.0.13": false, "127.0.0.12": true})

	ls.Close()
	ls.Follow([]netip.Addr{addr("127.0.0.14")})
	check("closed", map[string]bool{"127.0.0.11": false, "127.0.0.14": false})
}
