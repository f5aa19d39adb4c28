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
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mpnbd/mpnbd/e2e/standins/internal/fakecsi"
	"github.com/mpnbd/mpnbd/e2e/standins/internal/sidecar"
)

func TestParseFlagsChartArgs(t *testing.T) {
	for file, port := range map[string]int{"deploy/controller.yaml": 9808, "deploy/node.yaml": 9809} {
		all, err := sidecar.ManifestArgs(file, "liveness-probe")
		if err != nil {
			t.Fatal(err)
		}
		for _, args := range all {
			o, err := parseFlags(args, io.Discard)
			if err != nil {
				t.Fatalf("%s args %q: %v", file, args, err)
			}
			if o.csiAddress != "/csi/csi.sock" || o.httpEndpoint != fmt.Sprintf("[$(HTTP_ADDRESS)]:%d", port) ||
				o.addr() != fmt.Sprintf("[$(HTTP_ADDRESS)]:%d", port) {
				t.Errorf("%s args %q parsed as %+v", file, args, o)
			}
		}
	}
	for _, args := range [][]string{{"--metrics-address=:1"}, {"--health-port=0"}, {"--probe-timeout=0s"}, {"x"},
		{"--http-endpoint=:1234", "--health-port=9809"}} {
		if _, err := parseFlags(args, io.Discard); err == nil {
			t.Errorf("%q accepted", args)
		}
	}
	// The default --health-port given explicitly is no conflict (as with
	// the real one).
	o, err := parseFlags([]string{"--http-endpoint=127.0.0.1:1234", "--health-port=9808"}, io.Discard)
	if err != nil || o.addr() != "127.0.0.1:1234" {
		t.Errorf("--http-endpoint: %v %v", o.addr(), err)
	}
	o, err = parseFlags([]string{"--health-port=9809"}, io.Discard)
	if err != nil || o.addr() != ":9809" {
		t.Errorf("--health-port: %v %v", o.addr(), err)
	}
}

func get(url string) (int, error) {
	resp, err := http.Get(url)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	return resp.StatusCode, nil
}

func TestHealthz(t *testing.T) {
	plugin := &fakecsi.Plugin{Name: "nbd.mptcp.mpnbd.io"}
	sock := fakecsi.Serve(t, plugin)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	o, err := parseFlags([]string{"--csi-address=unix://" + sock, fmt.Sprintf("--http-endpoint=127.0.0.1:%d", port), "--probe-timeout=2s"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	log := sidecar.NewLogger(fakecsi.NewLog(t), 4) // sets klog: before any goroutine
	go func() { done <- run(ctx, log, o) }()
	defer func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("run after the cancel: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("livenessprobe did not stop")
		}
	}()
	url := fmt.Sprintf("http://127.0.0.1:%d/healthz", port)

	expect := func(want int) {
		t.Helper()
		deadline := time.Now().Add(60 * time.Second)
		for {
			code, err := get(url)
			if err == nil && code == want {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("healthz: %d, %v; want %d", code, err, want)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	expect(http.StatusOK)
	before := plugin.Probes()
	expect(http.StatusOK)
	if plugin.Probes() <= before {
		t.Error("healthz answered without calling Probe")
	}

	plugin.SetReady(false, nil)
	expect(http.StatusInternalServerError)
	plugin.SetReady(true, status.Error(codes.FailedPrecondition, "broken"))
	expect(http.StatusInternalServerError)
	plugin.SetReady(true, nil)
	expect(http.StatusOK)

	// /metrics counts them.
	resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", port))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{"# TYPE livenessprobe_probes_total counter", `livenessprobe_probes_total{result="not_ready"} `,
		`livenessprobe_probes_total{result="error"} `} {
		if !strings.Contains(string(body), want) {
			t.Errorf("/metrics lacks %q:\n%s", want, body)
		}
	}
	if m := regexp.MustCompile(`livenessprobe_probes_total\{result="ok"\} ([0-9]+)`).FindStringSubmatch(string(body)); m == nil || m[1] == "0" {
		t.Errorf("/metrics counts no successful probe:\n%s", body)
	}
}

func TestHealthzPluginGone(t *testing.T) {
	// No plugin behind the socket: the probe times out and healthz fails.
	cc, err := sidecar.Dial("/nonexistent/csi.sock")
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	p := &prober{log: sidecar.NewLogger(fakecsi.NewLog(t), 0), ids: csi.NewIdentityClient(cc), timeout: 300 * time.Millisecond}
	rec := httptest.NewRecorder()
	p.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/healthz", nil))
	if rec.Code != http.StatusInternalServerError || !strings.Contains(rec.Body.String(), "probe") {
		t.Errorf("code %d body %q", rec.Code, rec.Body.String())
	}
}
