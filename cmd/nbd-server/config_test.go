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
	"errors"
	"flag"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

func TestParseSize(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
	}{
		{"1", 1},
		{"512", 512},
		{"4096", 4096},
		{"4K", 4 << 10},
		{"4k", 4 << 10},
		{"4Ki", 4 << 10},
		{"4ki", 4 << 10},
		{"1M", 1 << 20},
		{"1Mi", 1 << 20},
		{"10G", 10 << 30},
		{"10g", 10 << 30},
		{"10Gi", 10 << 30},
		{"2T", 2 << 40},
		{"2Ti", 2 << 40},
		{"8388607T", 8388607 << 40},
		{"9223372036854775807", math.MaxInt64},
		{"007", 7},
	} {
		got, err := parseSize(tc.in)
		if err != nil || got != tc.want {
			t.Errorf("parseSize(%q) = %d, %v; want %d", tc.in, got, err, tc.want)
		}
	}
}

func TestParseSizeErrors(t *testing.T) {
	for _, tc := range []struct {
		in, want string
	}{
		{"", `invalid size "": want a whole number`},
		{"G", `invalid size "G": want a whole number`},
		{"-1", `invalid size "-1": want a whole number`},
		{"+5", `invalid size "+5": want a whole number`},
		{" 10G", `invalid size " 10G": want a whole number`},
		{"1.5G", `invalid size "1.5G": unknown suffix ".5G"`},
		{"10X", `invalid size "10X": unknown suffix "X"`},
		{"10GB", `invalid size "10GB": unknown suffix "GB"`},
		{"10GiB", `invalid size "10GiB": unknown suffix "GiB"`},
		{"10P", `invalid size "10P": unknown suffix "P"`},
		{"10G ", `invalid size "10G ": unknown suffix "G "`},
		{"0", `invalid size "0": must be greater than zero`},
		{"0K", `invalid size "0K": must be greater than zero`},
		{"9223372036854775808", `invalid size "9223372036854775808": too large`},
		{"8388608T", `invalid size "8388608T": too large`},
		{"99999999999999999999999G", `invalid size "99999999999999999999999G": too large`},
	} {
		got, err := parseSize(tc.in)
		if err == nil {
			t.Errorf("parseSize(%q) = %d, want an error", tc.in, got)
			continue
		}
		if !strings.HasPrefix(err.Error(), tc.want) {
			t.Errorf("parseSize(%q) error %q, want it to start with %q", tc.in, err, tc.want)
		}
	}
}

func TestParseExportSpec(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want ExportConfig
	}{
		{"disk=/srv/disk.img", ExportConfig{Name: "disk", Path: "/srv/disk.img"}},
		{"disk=rel/path.img", ExportConfig{Name: "disk", Path: "rel/path.img"}},
		{"d=/x,size=10G,create", ExportConfig{Name: "d", Path: "/x", Size: 10 << 30, Create: true}},
		{"d=/x,create,size=1Mi", ExportConfig{Name: "d", Path: "/x", Size: 1 << 20, Create: true}},
		{"d=/x,readonly", ExportConfig{Name: "d", Path: "/x", ReadOnly: true}},
		{"d=/x,readonly,size=4096", ExportConfig{Name: "d", Path: "/x", ReadOnly: true, Size: 4096}},
		{"d=/x,desc=scratch disk", ExportConfig{Name: "d", Path: "/x", Description: "scratch disk"}},
		{"d=/x,desc=", ExportConfig{Name: "d", Path: "/x"}},
		{"d=/x,desc=a=b", ExportConfig{Name: "d", Path: "/x", Description: "a=b"}},
		{"with space=/a b", ExportConfig{Name: "with space", Path: "/a b"}},
		{"d=/a=b", ExportConfig{Name: "d", Path: "/a=b"}},
	} {
		got, err := parseExportSpec(tc.in)
		if err != nil || got != tc.want {
			t.Errorf("parseExportSpec(%q) = %+v, %v; want %+v", tc.in, got, err, tc.want)
		}
	}
}

func TestParseExportSpecErrors(t *testing.T) {
	long := strings.Repeat("n", 4097)
	for _, tc := range []struct {
		in, want string
	}{
		{"disk", `invalid export "disk": want NAME=PATH`},
		{"", `invalid export "": want NAME=PATH`},
		{"=/x", `invalid export "=/x": the name before '=' is empty`},
		{"d=", `invalid export "d=": the path after '=' is empty`},
		{"d=,size=1G", `invalid export "d=,size=1G": the path after '=' is empty`},
		{"d=/x,", `invalid export "d=/x,": empty option`},
		{"d=/x,,readonly", `invalid export "d=/x,,readonly": empty option`},
		{"d=/x,size", `invalid export "d=/x,size": size needs a value`},
		{"d=/x,size=", `invalid export "d=/x,size=": invalid size "": want a whole number`},
		{"d=/x,size=10X", `invalid export "d=/x,size=10X": invalid size "10X": unknown suffix "X"`},
		{"d=/x,size=0", `invalid export "d=/x,size=0": invalid size "0": must be greater than zero`},
		{"d=/x,readonly=true", `invalid export "d=/x,readonly=true": option "readonly" takes no value`},
		{"d=/x,create=1,size=1G", `invalid export "d=/x,create=1,size=1G": option "create" takes no value`},
		{"d=/x,desc", `invalid export "d=/x,desc": desc needs a value`},
		{"d=/x,ro", `invalid export "d=/x,ro": unknown option "ro"`},
		{"d=/x,sparse=yes", `invalid export "d=/x,sparse=yes": unknown option "sparse=yes"`},
		{"d=/x,readonly,readonly", `invalid export "d=/x,readonly,readonly": option "readonly" is given twice`},
		{"d=/x,size=1G,size=2G", `invalid export "d=/x,size=1G,size=2G": option "size" is given twice`},
		{"d=/x,create", `invalid export "d=/x,create": export "d": create needs a size`},
		{"d=/x,create,readonly,size=1G", `invalid export "d=/x,create,readonly,size=1G": export "d": create and readonly cannot be combined`},
		{long + "=/x", `export name is 4097 bytes long, at most 4096 are allowed`},
	} {
		got, err := parseExportSpec(tc.in)
		if err == nil {
			t.Errorf("parseExportSpec(%q) = %+v, want an error", tc.in, got)
			continue
		}
		if !strings.Contains(err.Error(), tc.want) {
			t.Errorf("parseExportSpec(%q) error %q, want it to contain %q", tc.in, err, tc.want)
		}
	}
}

func writeFile(t *testing.T, name, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestParseConfig(t *testing.T) {
	fc, err := parseConfig([]byte(`{
  "listen": [":10809", "[::1]:10810"],
  "tcp": true,
  "metrics_addr": "",
  "log_level": "debug",
  "log_format": "json",
  "no_list": true,
  "shutdown_timeout": "1m30s",
  "exports": [
    {"name": "disk0", "path": "/srv/disk0.img", "size": "10G", "create": true, "description": "scratch, with commas"},
    {"name": "base", "path": "/dev/vg0/base", "readonly": true},
    {"name": "raw", "path": "/srv/raw", "size": 1048576}
  ]
}`))
	if err != nil {
		t.Fatal(err)
	}
	want := &fileConfig{
		Listen:          []string{":10809", "[::1]:10810"},
		TCP:             ptr(true),
		MetricsAddr:     ptr(""),
		LogLevel:        ptr("debug"),
		LogFormat:       ptr("json"),
		NoList:          ptr(true),
		ShutdownTimeout: ptr(Duration(90 * time.Second)),
		Exports: []ExportConfig{
			{Name: "disk0", Path: "/srv/disk0.img", Size: 10 << 30, Create: true, Description: "scratch, with commas"},
			{Name: "base", Path: "/dev/vg0/base", ReadOnly: true},
			{Name: "raw", Path: "/srv/raw", Size: 1 << 20},
		},
	}
	if !reflect.DeepEqual(fc, want) {
		t.Fatalf("got %+v\nwant %+v", fc, want)
	}

	empty, err := parseConfig([]byte(`{}`))
	if err != nil || !reflect.DeepEqual(empty, &fileConfig{}) {
		t.Fatalf("{} = %+v, %v", empty, err)
	}
}

func ptr[T any](v T) *T { return &v }

func TestParseConfigErrors(t *testing.T) {
	for _, tc := range []struct {
		name, in, want string
	}{
		{"empty", ``, "empty file"},
		{"not an object", `[]`, "line 1, column 1: want a JSON object, got JSON array"},
		{"syntax", "{\n  \"listen\": [\":1\",]\n}", "line 2, column 19: invalid character ']'"},
		{"unknown key", `{"exprots": []}`, `unknown field "exprots"`},
		{"unknown export key", `{"exports": [{"name": "a", "path": "/a", "read_only": true}]}`, `unknown field "read_only"`},
		{"wrong type", "{\n\"no_list\": \"yes\"}", `line 2, column 16: no_list: want bool, got JSON string`},
		{"listen not a list", `{"listen": ":1"}`, `listen: want []string, got JSON string`},
		{"exports not a list", `{"exports": {"name": "a"}}`, `exports: want []ExportConfig, got JSON object`},
		{"export name not a string", `{"exports": [{"name": 5, "path": "/a"}]}`, `exports.name: want string, got JSON number`},
		{"bad size string", `{"exports": [{"name": "a", "path": "/a", "size": "10X"}]}`, `invalid size "10X": unknown suffix "X"`},
		{"negative size", `{"exports": [{"name": "a", "path": "/a", "size": -5}]}`, `invalid size -5: must be greater than zero`},
		{"fractional size", `{"exports": [{"name": "a", "path": "/a", "size": 1.5}]}`, `invalid size 1.5: want a whole number`},
		{"bad duration", `{"shutdown_timeout": "soon"}`, `invalid duration "soon"`},
		{"numeric duration", `{"shutdown_timeout": 30}`, `invalid duration 30: want a string`},
		{"trailing data", `{} {}`, "line 1, column 4: unexpected data after the top-level object"},
		{"no name", `{"exports": [{"path": "/a"}]}`, "exports[0]: export name is empty"},
		{"no path", `{"exports": [{"name": "a"}, {"name": "b"}]}`, `exports[0]: export "a": path is empty`},
		{"create without size", `{"exports": [{"name": "a", "path": "/a"}, {"name": "b", "path": "/b", "create": true}]}`, `exports[1]: export "b": create needs a size`},
		{"create readonly", `{"exports": [{"name": "a", "path": "/a", "size": "1G", "create": true, "readonly": true}]}`, `export "a": create and readonly cannot be combined`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fc, err := parseConfig([]byte(tc.in))
			if err == nil {
				t.Fatalf("parsed as %+v, want an error", fc)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q, want it to contain %q", err, tc.want)
			}
		})
	}
}

func TestLoadConfigNamesFile(t *testing.T) {
	p := writeFile(t, "bad.json", `{"tcp": 1}`)
	_, err := loadConfig(p)
	if err == nil || !strings.Contains(err.Error(), p) {
		t.Fatalf("error %v does not name %s", err, p)
	}
	missing := filepath.Join(t.TempDir(), "nope.json")
	_, err = loadConfig(missing)
	if err == nil || !strings.Contains(err.Error(), missing) || !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("error %v does not name %s", err, missing)
	}
}

// defaultLimits are the limits the flags give by default.
var defaultLimits = nbd.Limits{
	MaxConnsPerExport:      nbd.DefaultMaxConnsPerExport,
	MaxConnsPerSource:      nbd.DefaultMaxConnsPerSource,
	MaxConns:               nbd.DefaultMaxConns,
	MaxHandshakesPerSource: nbd.DefaultMaxHandshakesPerSource,
	MaxHandshakes:          nbd.DefaultMaxHandshakes,
	HandshakeTimeout:       nbd.DefaultHandshakeTimeout,
}

func TestParseArgsDefaults(t *testing.T) {
	o, err := parseArgs([]string{"--export", "d=/x"})
	if err != nil {
		t.Fatal(err)
	}
	want := &options{
		listen:          []string{defaultListen},
		exports:         []ExportConfig{{Name: "d", Path: "/x"}},
		flagExports:     []ExportConfig{{Name: "d", Path: "/x"}},
		metricsAddr:     defaultMetricsAddr,
		logLevel:        slog.LevelInfo,
		logFormat:       "text",
		shutdownTimeout: defaultShutdownTimeout,
		limits:          defaultLimits,
	}
	if !reflect.DeepEqual(o, want) {
		t.Fatalf("got %+v\nwant %+v", o, want)
	}
}

func TestParseArgsLimits(t *testing.T) {
	o, err := parseArgs([]string{"--export", "d=/x", "--max-conns", "10", "--max-conns-per-source", "0",
		"--max-conns-per-export", "3", "--max-handshakes", "0", "--max-handshakes-per-source", "2",
		"--handshake-timeout", "0"})
	if err != nil {
		t.Fatal(err)
	}
	want := nbd.Limits{MaxConns: 10, MaxConnsPerSource: -1, MaxConnsPerExport: 3, MaxHandshakes: -1,
		MaxHandshakesPerSource: 2, HandshakeTimeout: -1}
	if o.limits != want {
		t.Fatalf("limits %+v, want %+v (0 turns a limit off)", o.limits, want)
	}
	o, err = parseArgs([]string{"--cluster", "--node-name", "n", "--namespace", "ns", "--storage-address", "10.0.0.1",
		"--handshake-timeout", "3s"})
	if err != nil {
		t.Fatal(err)
	}
	if o.limits.HandshakeTimeout != 3*time.Second {
		t.Fatalf("cluster mode limits %+v, want the handshake timeout of the flag", o.limits)
	}
}

func TestParseArgsFlagsAndConfig(t *testing.T) {
	cfg := writeFile(t, "c.json", `{
  "listen": ["127.0.0.1:10809"],
  "tcp": true,
  "metrics_addr": "127.0.0.1:9200",
  "log_level": "debug",
  "log_format": "json",
  "no_list": true,
  "shutdown_timeout": "5s",
  "exports": [{"name": "a", "path": "/a", "size": "1G", "create": true}]
}`)
	// Only the config file.
	o, err := parseArgs([]string{"--config", cfg})
	if err != nil {
		t.Fatal(err)
	}
	want := &options{
		listen:          []string{"127.0.0.1:10809"},
		exports:         []ExportConfig{{Name: "a", Path: "/a", Size: 1 << 30, Create: true}},
		configPath:      cfg,
		tcp:             true,
		metricsAddr:     "127.0.0.1:9200",
		logLevel:        slog.LevelDebug,
		logFormat:       "json",
		noList:          true,
		shutdownTimeout: 5 * time.Second,
		limits:          defaultLimits,
	}
	if !reflect.DeepEqual(o, want) {
		t.Fatalf("config only:\ngot  %+v\nwant %+v", o, want)
	}

	// Flags add listen addresses and exports, and override the scalars,
	// even with their default values.
	o, err = parseArgs([]string{
		"--config", cfg,
		"--listen", "[::1]:10809",
		"--export", "b=/b,readonly",
		"--tcp=false", "--no-list=false",
		"--metrics-addr", "",
		"--log-level", "WARN",
		"--log-format", "text",
		"--shutdown-timeout", "1m",
	})
	if err != nil {
		t.Fatal(err)
	}
	want = &options{
		listen: []string{"127.0.0.1:10809", "[::1]:10809"},
		exports: []ExportConfig{
			{Name: "a", Path: "/a", Size: 1 << 30, Create: true},
			{Name: "b", Path: "/b", ReadOnly: true},
		},
		flagExports:     []ExportConfig{{Name: "b", Path: "/b", ReadOnly: true}},
		configPath:      cfg,
		metricsAddr:     "",
		logLevel:        slog.LevelWarn,
		logFormat:       "text",
		shutdownTimeout: time.Minute,
		limits:          defaultLimits,
	}
	if !reflect.DeepEqual(o, want) {
		t.Fatalf("config and flags:\ngot  %+v\nwant %+v", o, want)
	}

	// A config file without exports is allowed: SIGHUP can add them.
	empty := writeFile(t, "empty.json", `{}`)
	if o, err := parseArgs([]string{"--config", empty}); err != nil || len(o.exports) != 0 {
		t.Fatalf("empty config: %+v, %v", o, err)
	}
}

// TestParseArgsBracketedAddresses: the chart's [$(HTTP_ADDRESS)]:PORT
// expands to a bracketed address, IPv4 or IPv6, which the metrics (and
// listen) addresses take.
func TestParseArgsBracketedAddresses(t *testing.T) {
	for _, a := range []string{"[192.0.2.10]:9810", "[2001:db8::10]:9810", "[::]:9810"} {
		o, err := parseArgs([]string{"--export", "d=/x", "--metrics-addr", a, "--listen", a})
		if err != nil {
			t.Errorf("%s: %v", a, err)
			continue
		}
		if o.metricsAddr != a || len(o.listen) != 1 || o.listen[0] != a {
			t.Errorf("%s: metrics address %q, listen %q", a, o.metricsAddr, o.listen)
		}
	}
}

func TestParseArgsHelp(t *testing.T) {
	for _, arg := range []string{"-h", "--help", "-help"} {
		if _, err := parseArgs([]string{arg}); !errors.Is(err, flag.ErrHelp) {
			t.Errorf("%s: %v, want flag.ErrHelp", arg, err)
		}
	}
}

func TestParseArgsErrors(t *testing.T) {
	cfg := writeFile(t, "c.json", `{"listen": [":7000"], "exports": [{"name": "a", "path": "/a"}]}`)
	bad := writeFile(t, "bad.json", `{"listen": [":7000"],}`)
	missing := filepath.Join(t.TempDir(), "missing.json")
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"no exports", nil, "no exports: give at least one --export"},
		{"unknown flag", []string{"--exprot", "a=/a"}, "unknown flag --exprot"},
		{"missing value", []string{"--export", "a=/a", "--listen"}, "flag needs an argument: --listen"},
		{"positional", []string{"--export", "a=/a", "b=/b"}, `unexpected argument "b=/b"`},
		{"bad export", []string{"--export", "a"}, `invalid export "a"`},
		{"bad size", []string{"--export", "a=/a,size=1Q"}, `invalid size "1Q"`},
		{"duplicate export", []string{"--export", "a=/a", "--export", "a=/b"}, `export "a" is defined twice`},
		{"duplicate with config", []string{"--config", cfg, "--export", "a=/b"}, `export "a" is defined twice`},
		{"bad listen", []string{"--export", "a=/a", "--listen", "10809"}, `invalid listen address: "10809": want HOST:PORT`},
		{"duplicate listen", []string{"--export", "a=/a", "--listen", ":1", "--listen", ":1"}, `listen address ":1" is given twice`},
		{"duplicate listen with config", []string{"--config", cfg, "--listen", ":7000"}, `listen address ":7000" is given twice`},
		{"bad metrics addr", []string{"--export", "a=/a", "--metrics-addr", "9100"}, `invalid metrics address: "9100"`},
		{"unbracketed IPv6 metrics addr", []string{"--export", "a=/a", "--metrics-addr", "2001:db8::10:9100"}, `invalid metrics address: "2001:db8::10:9100"`},
		{"bad log level", []string{"--export", "a=/a", "--log-level", "loud"}, `invalid log level "loud"`},
		{"bad log format", []string{"--export", "a=/a", "--log-format", "xml"}, `invalid log format "xml": want text or json`},
		{"bad timeout", []string{"--export", "a=/a", "--shutdown-timeout", "soon"}, `invalid value "soon" for flag --shutdown-timeout`},
		{"zero timeout", []string{"--export", "a=/a", "--shutdown-timeout", "0s"}, `invalid shutdown timeout 0s: must be positive`},
		{"bad tcp value", []string{"--export", "a=/a", "--tcp=maybe"}, `invalid boolean value "maybe" for --tcp`},
		{"negative limit", []string{"--export", "a=/a", "--max-conns-per-source", "-1"}, `invalid --max-conns-per-source -1`},
		{"negative handshake timeout", []string{"--export", "a=/a", "--handshake-timeout", "-1s"}, `invalid --handshake-timeout -1s`},
		{"missing config", []string{"--config", missing}, missing},
		{"bad config", []string{"--config", bad}, bad + ": line 1, column 22"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o, err := parseArgs(tc.args)
			if err == nil {
				t.Fatalf("parsed as %+v, want an error", o)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q, want it to contain %q", err, tc.want)
			}
		})
	}
}
