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
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"os"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/mpnbd/mpnbd/pkg/nbd"
)

// Defaults for settings given neither by flag nor by config file.
const (
	defaultListen          = ":10809" // the NBD port registered with IANA
	defaultMetricsAddr     = ":9100"
	defaultLogLevel        = "info"
	defaultLogFormat       = "text"
	defaultShutdownTimeout = 30 * time.Second

	// maxExportName is the longest export name the protocol allows.
	maxExportName = 4096
)

const usageText = `Usage: nbd-server [flags] --export NAME=PATH[,OPTIONS] ...
       nbd-server --cluster --storage-address IP|CIDR[,...] [flags]

Serves files and block devices as NBD exports (fixed newstyle protocol),
over Multipath TCP unless --tcp is given.

With --cluster it is the storage agent of a Kubernetes node instead: it
serves the NBDVolumes whose spec.storageNode is --node-name, each from a
sparse file <volume>.img in --data-dir, only to the nodes they are
published to (export name <volume>/<token>, token from the publication's
Secret in --namespace), and reports the node's capacity in an
NBDStorageNode. --export and --config do not apply then.

Flags:
%s
Export options (--export NAME=PATH[,size=SIZE][,readonly][,create][,desc=TEXT]):
  size=SIZE   export size: bytes, or with a binary suffix K, M, G, T (or Ki,
              Mi, Gi, Ti; 10G = 10Gi = 10*2^30). A smaller existing file is
              grown to SIZE; a larger one is served whole.
  readonly    open PATH read-only; clients cannot write, trim or zero.
  create      make PATH as a sparse file of SIZE if it is missing (needs
              size=, not with readonly). Without it a missing PATH is an error.
  desc=TEXT   description sent to clients that ask for it.
On the command line PATH and TEXT cannot contain commas; use --config for
those. Example: --export disk0=/srv/disk0.img,size=10G,create

Config file (--config FILE) is JSON. Every key is optional; --listen and
--export add to the file's lists, other flags given on the command line
override the file:

  {
    "listen": [":10809", "[::1]:10810"],
    "tcp": false,
    "metrics_addr": ":9100",
    "log_level": "info",
    "log_format": "text",
    "no_list": false,
    "shutdown_timeout": "30s",
    "exports": [
      {"name": "disk0", "path": "/srv/disk0.img", "size": "10G",
       "create": true, "description": "scratch disk"},
      {"name": "base", "path": "/dev/vg0/base", "readonly": true}
    ]
  }

"size" is a number of bytes or a string with a suffix as above; unknown keys
are errors. Without any listen address the server listens on %s, every
address of the host: on a host with networks clients must not reach the
port from, give the addresses clients use instead.

Signals:
  SIGINT, SIGTERM  stop accepting, drain connections (in-flight requests
                   finish, data is flushed) for up to --shutdown-timeout,
                   close the files and exit 0.
  SIGHUP           re-read --config and add, remove or replace exports to
                   match it (plus the --export flags). Connections of a
                   removed or changed export are drained first. Other
                   settings need a restart.

Cluster mode (--cluster):
  --node-name defaults to $NODE_NAME and --namespace to $POD_NAMESPACE;
  both are required. --storage-address (the node's storage IPs, repeatable
  or comma-separated) is required; a CIDR in it stands for every global
  address of the host inside it, found at start (one holding none is an
  error), so that one argument gives each node its own addresses on
  shared storage subnets. --signal-nic keeps MPTCP "signal"
  endpoints on those NICs (interface names or CIDRs); without it the host's
  endpoints are left alone. With it, --auto-backup (on by default) flags
  backup the endpoint of a path much slower than the others, from what its
  subflows deliver, and clears the flag once the path recovers.
  --listen gives only the port (:PORT, default 10809): the agent binds
  it on the --storage-address addresses (an IP address not up yet is
  bound all the same and served once it is) and on the addresses of the
  --signal-nic NICs, following them as they come and go (the port opens
  on an address before its endpoint is announced), never on every
  address. The cluster is reached with --kubeconfig, else
  $KUBECONFIG, else the in-cluster service account. A volume's file is
  deleted only with an NBDVolume that CSI DeleteVolume deleted (annotation
  mpnbd.io/delete-data); the file of one deleted otherwise (by hand, or
  with its CRD) is kept, and like files never backed by an NBDVolume is
  reported as an orphan, never deleted. With --identity (on by
  default) the agent gets this node's storage certificate from the
  controller (a CertificateSigningRequest, renewed before it expires) and
  offers STARTTLS with it; a node presenting its node certificate opens a
  volume published to it by the volume's name, and volumes whose
  spec.encryption is required are served only over TLS. The --tls flags
  are for standalone runs.

TLS (--tls on|require --tls-cert FILE --tls-key FILE [--tls-ca FILE]):
  clients upgrade with NBD_OPT_STARTTLS to TLS 1.3, or 1.2 with ECDHE and
  AES-GCM or ChaCha20-Poly1305, before choosing an export (nbds:// URIs of
  libnbd, qemu's tls-creds-x509). With require, anything else first is
  refused (ERR_TLS_REQD). With --tls-ca, clients must present a
  certificate for client authentication that CA signed (any key type: the
  request names no CA, which GnuTLS clients with RSA keys need).

Connection limits (the storage agent has the same): --max-conns,
--max-conns-per-source (per client IP address) and --max-conns-per-export
bound open connections; --max-handshakes and --max-handshakes-per-source
bound those still negotiating, which must finish within
--handshake-timeout. In cluster mode --reserved-handshakes of the
--max-handshakes slots (default half) are kept for connections from the
storage addresses of the nodes a volume is published to; other sources
share the rest. A connection over a total or per-source limit is
closed as soon as it is accepted; one over --max-conns-per-export is
refused NBD_OPT_GO with NBD_REP_ERR_POLICY (or hung up on after
NBD_OPT_EXPORT_NAME). 0 turns a limit off. Refusals are counted in
mpnbd_server_refused_connections_total{reason}.

Endpoints on --metrics-addr: /metrics (Prometheus), /healthz and /readyz
(ready once serving; in cluster mode once the agent has synced).

Exit status: 0 after a clean stop, 1 on a runtime error (a file or address
that cannot be used), 2 on a usage or config file error.
`

// ExportConfig is one export, from --export or the config file.
type ExportConfig struct {
	Name        string `json:"name"`
	Path        string `json:"path"`
	Size        Size   `json:"size,omitempty"`
	ReadOnly    bool   `json:"readonly,omitempty"`
	Create      bool   `json:"create,omitempty"`
	Description string `json:"description,omitempty"`
}

func (e ExportConfig) validate() error {
	switch {
	case e.Name == "":
		return errors.New("export name is empty")
	case len(e.Name) > maxExportName:
		return fmt.Errorf("export name is %d bytes long, at most %d are allowed", len(e.Name), maxExportName)
	case e.Path == "":
		return fmt.Errorf("export %q: path is empty", e.Name)
	case e.Size < 0:
		return fmt.Errorf("export %q: size %d is negative", e.Name, e.Size)
	case e.Create && e.ReadOnly:
		return fmt.Errorf("export %q: create and readonly cannot be combined", e.Name)
	case e.Create && e.Size == 0:
		return fmt.Errorf("export %q: create needs a size", e.Name)
	}
	return nil
}

// fileConfig is the config file. Pointers tell a missing key from a zero
// value.
type fileConfig struct {
	Listen          []string       `json:"listen"`
	TCP             *bool          `json:"tcp"`
	MetricsAddr     *string        `json:"metrics_addr"`
	LogLevel        *string        `json:"log_level"`
	LogFormat       *string        `json:"log_format"`
	NoList          *bool          `json:"no_list"`
	ShutdownTimeout *Duration      `json:"shutdown_timeout"`
	Exports         []ExportConfig `json:"exports"`
}

// options is the resolved configuration of one run.
type options struct {
	listen          []string
	exports         []ExportConfig // config file exports, then flag exports
	flagExports     []ExportConfig // kept across SIGHUP reloads
	configPath      string
	tcp             bool
	metricsAddr     string
	logLevel        slog.Level
	logFormat       string
	noList          bool
	shutdownTimeout time.Duration
	limits          nbd.Limits
	// tls offers STARTTLS (nil: off); tlsRequired makes every connection
	// upgrade first.
	tls         *tls.Config
	tlsRequired bool
	// cluster, when not nil, runs the storage agent instead of --export.
	cluster *clusterOptions
}

// usage returns the --help text.
func usage(fs *flag.FlagSet) string {
	var b strings.Builder
	fs.VisitAll(func(f *flag.Flag) {
		arg, text := flag.UnquoteUsage(f)
		switch f.Name {
		case "export":
			arg = "NAME=PATH[,OPTIONS]"
		case "storage-address":
			arg = "IP|CIDR[,...]"
		case "signal-nic":
			arg = "NIC[,NIC...]"
		case "topology":
			arg = "KEY=VALUE[,KEY=VALUE...]"
		}
		fmt.Fprintf(&b, "  --%s", f.Name)
		if arg != "" {
			fmt.Fprintf(&b, " %s", arg)
		}
		// reserved-handshakes says its default (half of another flag).
		if f.DefValue != "" && f.DefValue != "false" && f.DefValue != "[]" && f.Name != "reserved-handshakes" {
			text += fmt.Sprintf(" (default %q)", f.DefValue)
		}
		fmt.Fprintf(&b, "\n        %s\n", text)
	})
	return fmt.Sprintf(usageText, b.String(), defaultListen)
}

// listFlag collects a repeatable string flag.
type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ", ") }
func (l *listFlag) Set(s string) error { *l = append(*l, s); return nil }

func newFlagSet() (*flag.FlagSet, *flagValues) {
	v := &flagValues{}
	fs := flag.NewFlagSet("nbd-server", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Var(&v.listen, "listen", "listen on `ADDR` (HOST:PORT); repeatable; "+defaultListen+" (every address) if no address is given; cluster mode: :PORT only, bound on the storage addresses")
	fs.Var(&v.exports, "export", "serve the file or block device PATH as export NAME; repeatable, see Export options")
	fs.StringVar(&v.config, "config", "", "read listen addresses, exports and options from JSON `FILE`")
	fs.BoolVar(&v.tcp, "tcp", false, "listen with plain TCP instead of Multipath TCP")
	fs.StringVar(&v.metricsAddr, "metrics-addr", defaultMetricsAddr, "serve /metrics and /healthz on `ADDR`; empty disables")
	fs.StringVar(&v.logLevel, "log-level", defaultLogLevel, "log `LEVEL`: debug, info, warn or error")
	fs.StringVar(&v.logFormat, "log-format", defaultLogFormat, "log `FORMAT`: text or json")
	fs.BoolVar(&v.noList, "no-list", false, "refuse to list exports to clients (NBD_OPT_LIST)")
	fs.DurationVar(&v.shutdownTimeout, "shutdown-timeout", defaultShutdownTimeout,
		"drain connections for up to `DURATION` on shutdown or export removal, then close them")
	fs.IntVar(&v.maxConns, "max-conns", nbd.DefaultMaxConns, "serve at most `N` client connections at once; 0: no limit")
	fs.IntVar(&v.maxConnsPerSource, "max-conns-per-source", nbd.DefaultMaxConnsPerSource,
		"serve at most `N` connections from one client IP address; 0: no limit")
	fs.IntVar(&v.maxConnsPerExport, "max-conns-per-export", nbd.DefaultMaxConnsPerExport,
		"serve at most `N` connections to one export; 0: no limit")
	fs.IntVar(&v.maxHandshakes, "max-handshakes", nbd.DefaultMaxHandshakes,
		"keep at most `N` connections that have not finished the handshake; 0: no limit")
	fs.IntVar(&v.maxHandshakesPerSource, "max-handshakes-per-source", nbd.DefaultMaxHandshakesPerSource,
		"keep at most `N` connections from one client IP address that have not finished the handshake; 0: no limit")
	fs.DurationVar(&v.handshakeTimeout, "handshake-timeout", nbd.DefaultHandshakeTimeout,
		"close connections that have not finished the handshake within `DURATION`; 0: never")
	fs.StringVar(&v.tls, "tls", "off", "`MODE` of NBD_OPT_STARTTLS: off, on (offered) or require (every connection upgrades first); on and require need --tls-cert and --tls-key")
	fs.StringVar(&v.tlsCert, "tls-cert", "", "server certificate chain, PEM `FILE`")
	fs.StringVar(&v.tlsKey, "tls-key", "", "server private key, PEM `FILE`")
	fs.StringVar(&v.tlsCA, "tls-ca", "", "CA certificates, PEM `FILE`: clients must present a certificate they signed")
	addClusterFlags(fs, &v.cluster)
	return fs, v
}

type flagValues struct {
	listen, exports listFlag
	config          string
	tcp             bool
	metricsAddr     string
	logLevel        string
	logFormat       string
	noList          bool
	shutdownTimeout time.Duration
	cluster         clusterFlags

	maxConns, maxConnsPerSource, maxConnsPerExport int
	maxHandshakes, maxHandshakesPerSource          int
	handshakeTimeout                               time.Duration

	tls, tlsCert, tlsKey, tlsCA string
}

// limits turns the limit flags into nbd.Limits, where 0 means the default
// and a negative value no limit.
func (v *flagValues) limits() (nbd.Limits, error) {
	off := func(name string, n int) (int, error) {
		switch {
		case n < 0:
			return 0, fmt.Errorf("invalid --%s %d: want a number of connections, or 0 for no limit", name, n)
		case n == 0:
			return -1, nil
		}
		return n, nil
	}
	var l nbd.Limits
	var err error
	for _, f := range []struct {
		name string
		val  int
		dst  *int
	}{
		{"max-conns", v.maxConns, &l.MaxConns},
		{"max-conns-per-source", v.maxConnsPerSource, &l.MaxConnsPerSource},
		{"max-conns-per-export", v.maxConnsPerExport, &l.MaxConnsPerExport},
		{"max-handshakes", v.maxHandshakes, &l.MaxHandshakes},
		{"max-handshakes-per-source", v.maxHandshakesPerSource, &l.MaxHandshakesPerSource},
	} {
		if *f.dst, err = off(f.name, f.val); err != nil {
			return nbd.Limits{}, err
		}
	}
	switch {
	case v.handshakeTimeout < 0:
		return nbd.Limits{}, fmt.Errorf("invalid --handshake-timeout %s: want a duration, or 0 for none", v.handshakeTimeout)
	case v.handshakeTimeout == 0:
		l.HandshakeTimeout = -1
	default:
		l.HandshakeTimeout = v.handshakeTimeout
	}
	return l, nil
}

// tlsConfig loads the TLS flags' files.
func (v *flagValues) tlsConfig() (*tls.Config, bool, error) {
	switch v.tls {
	case "off":
		if v.tlsCert != "" || v.tlsKey != "" || v.tlsCA != "" {
			return nil, false, errors.New("--tls-cert, --tls-key and --tls-ca need --tls on or --tls require")
		}
		return nil, false, nil
	case "on", "require":
	default:
		return nil, false, fmt.Errorf("invalid --tls %q: want off, on or require", v.tls)
	}
	if v.tlsCert == "" || v.tlsKey == "" {
		return nil, false, fmt.Errorf("--tls %s needs --tls-cert and --tls-key", v.tls)
	}
	cert, err := tls.LoadX509KeyPair(v.tlsCert, v.tlsKey)
	if err != nil {
		return nil, false, fmt.Errorf("--tls-cert/--tls-key: %w", err)
	}
	var cas *x509.CertPool
	if v.tlsCA != "" {
		pem, err := os.ReadFile(v.tlsCA)
		if err != nil {
			return nil, false, fmt.Errorf("--tls-ca: %w", err)
		}
		cas = x509.NewCertPool()
		if !cas.AppendCertsFromPEM(pem) {
			return nil, false, fmt.Errorf("--tls-ca %s: no PEM certificate in it", v.tlsCA)
		}
	}
	return nbd.ServerTLS(cert, cas), v.tls == "require", nil
}

var singleDash = regexp.MustCompile(`(^|\s)-([a-z][a-z-]*)`)

// parseArgs resolves flags and the config file into options. Every error
// it returns is a usage error; flag.ErrHelp asks for the help text.
func parseArgs(args []string) (*options, error) {
	fs, v := newFlagSet()
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil, err
		}
		msg := err.Error()
		if rest, ok := strings.CutPrefix(msg, "flag provided but not defined: "); ok {
			msg = "unknown flag " + rest
		}
		// The flag package names flags with one dash; the docs use two.
		return nil, errors.New(singleDash.ReplaceAllString(msg, "$1--$2"))
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected argument %q (exports are given with --export NAME=PATH)", fs.Arg(0))
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if err := checkModeFlags(v, set); err != nil {
		return nil, err
	}

	fc := &fileConfig{}
	if v.config != "" {
		var err error
		if fc, err = loadConfig(v.config); err != nil {
			return nil, err
		}
	}

	o := &options{configPath: v.config}
	var err error
	if o.limits, err = v.limits(); err != nil {
		return nil, err
	}
	if o.tls, o.tlsRequired, err = v.tlsConfig(); err != nil {
		return nil, err
	}
	// Scalars: a flag on the command line wins over the file, the file
	// over the flag's default.
	o.tcp = pick(set["tcp"], v.tcp, fc.TCP)
	o.metricsAddr = pick(set["metrics-addr"], v.metricsAddr, fc.MetricsAddr)
	o.noList = pick(set["no-list"], v.noList, fc.NoList)
	o.logFormat = pick(set["log-format"], v.logFormat, fc.LogFormat)
	level := pick(set["log-level"], v.logLevel, fc.LogLevel)
	timeout := v.shutdownTimeout
	if !set["shutdown-timeout"] && fc.ShutdownTimeout != nil {
		timeout = time.Duration(*fc.ShutdownTimeout)
	}

	if o.logLevel, err = parseLogLevel(level); err != nil {
		return nil, err
	}
	if o.logFormat != "text" && o.logFormat != "json" {
		return nil, fmt.Errorf("invalid log format %q: want text or json", o.logFormat)
	}
	if timeout <= 0 {
		return nil, fmt.Errorf("invalid shutdown timeout %s: must be positive", timeout)
	}
	o.shutdownTimeout = timeout
	if o.metricsAddr != "" {
		if err := checkAddr(o.metricsAddr); err != nil {
			return nil, fmt.Errorf("invalid metrics address: %w", err)
		}
	}

	seen := map[string]bool{}
	for _, a := range append(fc.Listen, v.listen...) {
		if err := checkAddr(a); err != nil {
			return nil, fmt.Errorf("invalid listen address: %w", err)
		}
		if seen[a] {
			return nil, fmt.Errorf("listen address %q is given twice", a)
		}
		seen[a] = true
		o.listen = append(o.listen, a)
	}
	if len(o.listen) == 0 {
		o.listen = []string{defaultListen}
	}

	for _, s := range v.exports {
		e, err := parseExportSpec(s)
		if err != nil {
			return nil, err
		}
		o.flagExports = append(o.flagExports, e)
	}
	if o.exports, err = mergeExports(fc.Exports, o.flagExports); err != nil {
		return nil, err
	}
	if v.cluster.enabled {
		if o.cluster, err = v.cluster.resolve(set); err != nil {
			return nil, err
		}
		if o.cluster.port, err = clusterPort(o.listen); err != nil {
			return nil, err
		}
		o.limits.ReservedHandshakes = o.cluster.reservedHandshakes
		if r, m := o.limits.ReservedHandshakes, o.limits.MaxHandshakes; r > 0 && m > 0 && r > m {
			return nil, fmt.Errorf("--reserved-handshakes %d is more than --max-handshakes %d", r, m)
		}
		o.noList = true
		return o, nil
	}
	if len(o.exports) == 0 && o.configPath == "" {
		return nil, errors.New("no exports: give at least one --export NAME=PATH or a --config file (or run with --cluster)")
	}
	return o, nil
}

func pick[T any](flagSet bool, flagValue T, file *T) T {
	if !flagSet && file != nil {
		return *file
	}
	return flagValue
}

func checkAddr(a string) error {
	if _, _, err := net.SplitHostPort(a); err != nil {
		return fmt.Errorf("%q: want HOST:PORT (e.g. :10809 or 127.0.0.1:10809)", a)
	}
	return nil
}

func parseLogLevel(s string) (slog.Level, error) {
	switch strings.ToLower(s) {
	case "debug":
		return slog.LevelDebug, nil
	case "info":
		return slog.LevelInfo, nil
	case "warn", "warning":
		return slog.LevelWarn, nil
	case "error":
		return slog.LevelError, nil
	}
	return 0, fmt.Errorf("invalid log level %q: want debug, info, warn or error", s)
}

// mergeExports joins the config file's exports and the flags' exports,
// refusing a name given twice.
func mergeExports(lists ...[]ExportConfig) ([]ExportConfig, error) {
	var out []ExportConfig
	seen := map[string]bool{}
	for _, l := range lists {
		for _, e := range l {
			if seen[e.Name] {
				return nil, fmt.Errorf("export %q is defined twice", e.Name)
			}
			seen[e.Name] = true
			out = append(out, e)
		}
	}
	return out, nil
}

// parseExportSpec parses NAME=PATH[,size=SIZE][,readonly][,create][,desc=TEXT].
func parseExportSpec(s string) (ExportConfig, error) {
	name, rest, ok := strings.Cut(s, "=")
	if !ok {
		return ExportConfig{}, fmt.Errorf("invalid export %q: want NAME=PATH[,size=SIZE][,readonly][,create][,desc=TEXT]", s)
	}
	parts := strings.Split(rest, ",")
	e := ExportConfig{Name: name, Path: parts[0]}
	bad := func(format string, a ...any) (ExportConfig, error) {
		return ExportConfig{}, fmt.Errorf("invalid export %q: %s", s, fmt.Sprintf(format, a...))
	}
	if name == "" {
		return bad("the name before '=' is empty")
	}
	if e.Path == "" {
		return bad("the path after '=' is empty")
	}
	seen := map[string]bool{}
	for _, opt := range parts[1:] {
		key, val, hasVal := strings.Cut(opt, "=")
		if key == "" {
			return bad("empty option (stray comma?)")
		}
		if seen[key] {
			return bad("option %q is given twice", key)
		}
		seen[key] = true
		switch key {
		case "size":
			if !hasVal {
				return bad("size needs a value (size=SIZE)")
			}
			n, err := parseSize(val)
			if err != nil {
				return bad("%v", err)
			}
			e.Size = Size(n)
		case "readonly", "create":
			if hasVal {
				return bad("option %q takes no value", key)
			}
			if key == "readonly" {
				e.ReadOnly = true
			} else {
				e.Create = true
			}
		case "desc":
			if !hasVal {
				return bad("desc needs a value (desc=TEXT)")
			}
			e.Description = val
		default:
			return bad("unknown option %q (want size=SIZE, readonly, create or desc=TEXT)", opt)
		}
	}
	if err := e.validate(); err != nil {
		return bad("%v", err)
	}
	return e, nil
}

// sizeSuffixes maps the accepted suffixes (upper-cased) to multipliers.
// All are binary: K and Ki both mean 1024.
var sizeSuffixes = map[string]int64{
	"":  1,
	"K": 1 << 10, "KI": 1 << 10,
	"M": 1 << 20, "MI": 1 << 20,
	"G": 1 << 30, "GI": 1 << 30,
	"T": 1 << 40, "TI": 1 << 40,
}

// parseSize parses a positive byte count: digits with an optional binary
// suffix K, M, G, T or Ki, Mi, Gi, Ti (any case).
func parseSize(s string) (int64, error) {
	i := 0
	for i < len(s) && s[i] >= '0' && s[i] <= '9' {
		i++
	}
	digits, suffix := s[:i], s[i:]
	if digits == "" {
		return 0, fmt.Errorf("invalid size %q: want a whole number of bytes, optionally with a suffix K, M, G, T, Ki, Mi, Gi or Ti", s)
	}
	mult, ok := sizeSuffixes[strings.ToUpper(suffix)]
	if !ok {
		return 0, fmt.Errorf("invalid size %q: unknown suffix %q (want K, M, G, T, Ki, Mi, Gi or Ti)", s, suffix)
	}
	n, err := strconv.ParseInt(digits, 10, 64)
	if err != nil || n > math.MaxInt64/mult {
		return 0, fmt.Errorf("invalid size %q: too large", s)
	}
	if n == 0 {
		return 0, fmt.Errorf("invalid size %q: must be greater than zero", s)
	}
	return n * mult, nil
}

// Size is a byte count that JSON gives as a number or as a string with a
// suffix ("10G").
type Size int64

func (s *Size) UnmarshalJSON(b []byte) error {
	if len(b) > 0 && b[0] == '"' {
		var str string
		if err := json.Unmarshal(b, &str); err != nil {
			return err
		}
		n, err := parseSize(str)
		if err != nil {
			return err
		}
		*s = Size(n)
		return nil
	}
	var n int64
	if err := json.Unmarshal(b, &n); err != nil {
		return fmt.Errorf("invalid size %s: want a whole number of bytes or a string such as \"10G\"", b)
	}
	if n <= 0 {
		return fmt.Errorf("invalid size %d: must be greater than zero", n)
	}
	*s = Size(n)
	return nil
}

// Duration is a time.Duration that JSON gives as a string ("30s").
type Duration time.Duration

func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("invalid duration %s: want a string such as \"30s\"", b)
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("invalid duration %q: %v", s, err)
	}
	*d = Duration(v)
	return nil
}

// loadConfig reads and checks a config file.
func loadConfig(path string) (*fileConfig, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("config file: %w", err)
	}
	fc, err := parseConfig(data)
	if err != nil {
		return nil, fmt.Errorf("config file %s: %w", path, err)
	}
	return fc, nil
}

func parseConfig(data []byte) (*fileConfig, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var fc fileConfig
	if err := dec.Decode(&fc); err != nil {
		return nil, jsonError(data, err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, fmt.Errorf("%s: unexpected data after the top-level object", position(data, dec.InputOffset()))
	}
	for i, e := range fc.Exports {
		if err := e.validate(); err != nil {
			return nil, fmt.Errorf("exports[%d]: %w", i, err)
		}
	}
	return &fc, nil
}

// jsonError adds a line:column position to JSON errors that have an
// offset.
func jsonError(data []byte, err error) error {
	var se *json.SyntaxError
	var te *json.UnmarshalTypeError
	switch {
	case errors.As(err, &se):
		return fmt.Errorf("%s: %v", position(data, se.Offset), err)
	case errors.As(err, &te) && te.Field == "":
		return fmt.Errorf("%s: want a JSON object, got JSON %s", position(data, te.Offset), te.Value)
	case errors.As(err, &te):
		want := strings.ReplaceAll(te.Type.String(), "main.", "")
		return fmt.Errorf("%s: %s: want %s, got JSON %s", position(data, te.Offset), te.Field, want, te.Value)
	case errors.Is(err, io.EOF):
		return errors.New("empty file (want a JSON object)")
	}
	return err
}

// position gives the line and column of the last byte the decoder read
// when it stopped after off bytes: the offending character or the end of
// the offending value.
func position(data []byte, off int64) string {
	off = min(max(off-1, 0), int64(len(data)))
	before := data[:off]
	line := bytes.Count(before, []byte("\n")) + 1
	col := int(off) - bytes.LastIndexByte(before, '\n')
	return fmt.Sprintf("line %d, column %d", line, col)
}
