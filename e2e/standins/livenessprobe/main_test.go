package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
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
			if o.csiAddress != "/csi/csi.sock" || o.healthPort != port || o.addr() != fmt.Sprintf(":%d", port) {
				t.Errorf("%s args %q parsed as %+v", file, args, o)
			}
		}
	}
	for _, args := range [][]string{{"--metrics-address=:1"}, {"--health-port=0"}, {"--probe-timeout=0s"}, {"x"}} {
		if _, err := parseFlags(args, io.Discard); err == nil {
			t.Errorf("%q accepted", args)
		}
	}
	o, err := parseFlags([]string{"--http-endpoint=127.0.0.1:1234", "--health-port=9808"}, io.Discard)
	if err != nil || o.addr() != "127.0.0.1:1234" {
		t.Errorf("--http-endpoint: %v %v", o.addr(), err)
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
	o, err := parseFlags([]string{"--csi-address=unix://" + sock, fmt.Sprintf("--health-port=%d", port), "--probe-timeout=2s"}, io.Discard)
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
