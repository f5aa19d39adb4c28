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
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/mpnbd/mpnbd/e2e/standins/internal/fakecsi"
	"github.com/mpnbd/mpnbd/e2e/standins/internal/sidecar"
)

const testDriver = "nbd.mptcp.mpnbd.io"

func TestParseFlagsChartArgs(t *testing.T) {
	all, err := sidecar.ManifestArgs("deploy/node.yaml", "node-driver-registrar")
	if err != nil {
		t.Fatal(err)
	}
	for _, args := range all {
		o, err := parseFlags(args, io.Discard)
		if err != nil {
			t.Fatalf("chart args %q: %v", args, err)
		}
		if o.csiAddress != "/csi/csi.sock" || o.kubeletRegPath != "/var/lib/kubelet/plugins/nbd.mptcp.mpnbd.io/csi.sock" ||
			o.pluginRegPath != "/registration" || o.verbosity != 2 || o.httpEndpoint != "[$(HTTP_ADDRESS)]:9815" {
			t.Errorf("chart args %q parsed as %+v", args, o)
		}
	}
	for _, args := range [][]string{
		{"--kubelet-registration-path=/x", "--mode=kubelet-registration-probe"},
		{},                                       // no registration path
		{"--kubelet-registration-path=relative"}, // not absolute
		{"--kubelet-registration-path=/x", "extra"},
	} {
		if _, err := parseFlags(args, io.Discard); err == nil {
			t.Errorf("%q accepted", args)
		}
	}
}

func freePort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func waitFor(t *testing.T, what string, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %v", what, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// start runs the registrar for a fake plugin with a registration
// directory of its own, and returns that directory, the healthz address
// and the channel of run's result.
func start(t *testing.T, ctx context.Context) (string, string, chan error) {
	sock := fakecsi.Serve(t, &fakecsi.Plugin{Name: testDriver})
	regDir, err := os.MkdirTemp("", "reg")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(regDir) })
	health := freePort(t)
	o, err := parseFlags([]string{
		"--csi-address=" + sock,
		"--kubelet-registration-path=/var/lib/kubelet/plugins/nbd.mptcp.mpnbd.io/csi.sock",
		"--plugin-registration-path=" + regDir,
		"--http-endpoint=" + health,
		"--v=5",
	}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	log := sidecar.NewLogger(fakecsi.NewLog(t), o.verbosity) // sets klog: before any goroutine
	go func() { done <- run(ctx, log, o) }()
	return regDir, health, done
}

// kubelet dials the registration socket as the kubelet's plugin
// watcher does.
func kubelet(t *testing.T, regDir string) registerapi.RegistrationClient {
	t.Helper()
	path := filepath.Join(regDir, testDriver+"-reg.sock")
	waitFor(t, "registration socket", func() error {
		_, err := os.Stat(path)
		return err
	})
	cc, err := grpc.NewClient("unix:"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return registerapi.NewRegistrationClient(cc)
}

func TestRegistration(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	regDir, health, done := start(t, ctx)
	kc := kubelet(t, regDir)

	info, err := kc.GetInfo(ctx, &registerapi.InfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if info.Type != registerapi.CSIPlugin || info.Name != testDriver ||
		info.Endpoint != "/var/lib/kubelet/plugins/nbd.mptcp.mpnbd.io/csi.sock" ||
		len(info.SupportedVersions) != 1 || info.SupportedVersions[0] != "1.0.0" {
		t.Errorf("plugin info %+v", info)
	}
	if _, err := kc.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: true}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "healthz", func() error {
		resp, err := http.Get("http://" + health + "/healthz")
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("status %d", resp.StatusCode)
		}
		return nil
	})

	// Without its socket it is unhealthy (the kubelet no longer sees the
	// plugin); the kubelet then restarts it.
	if err := os.Remove(filepath.Join(regDir, testDriver+"-reg.sock")); err != nil {
		t.Fatal(err)
	}
	if code, err := get("http://" + health + "/healthz"); err != nil || code != http.StatusNotFound {
		t.Errorf("healthz without the socket: %d %v, want 404", code, err)
	}

	// SIGTERM (the context) stops it cleanly.
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("run: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the registrar did not stop")
	}
}

// TestStopRemovesSocket: SIGTERM removes the registration socket.
func TestStopRemovesSocket(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	regDir, _, done := start(t, ctx)
	kubelet(t, regDir)
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("run: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the registrar did not stop")
	}
	if _, err := os.Stat(filepath.Join(regDir, testDriver+"-reg.sock")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("socket left after stop: %v", err)
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

func TestRegistrationRefused(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	regDir, _, done := start(t, ctx)
	kc := kubelet(t, regDir)
	if _, err := kc.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: false, Error: "unsupported version"}); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err == nil {
			t.Error("run returned no error after the kubelet refused the plugin")
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the registrar went on after the kubelet refused it")
	}
}

func TestStaleSocketReplaced(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sock := fakecsi.Serve(t, &fakecsi.Plugin{Name: testDriver})
	regDir, err := os.MkdirTemp("", "reg")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(regDir)
	stale := filepath.Join(regDir, testDriver+"-reg.sock")
	if err := os.WriteFile(stale, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	o, err := parseFlags([]string{"--csi-address=" + sock, "--kubelet-registration-path=/p/csi.sock", "--plugin-registration-path=" + regDir}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	log := sidecar.NewLogger(fakecsi.NewLog(t), 0)
	go func() { done <- run(ctx, log, o) }()
	kc := kubelet(t, regDir)
	waitFor(t, "GetInfo on the new socket", func() error {
		_, err := kc.GetInfo(ctx, &registerapi.InfoRequest{})
		return err
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("run after the cancel: %v", err)
	}
}
