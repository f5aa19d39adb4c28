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

// Command topo creates and removes the multi-path test topology of
// package internal/testenv/topo, so that shell scripts (benchmarks, demos)
// use exactly the same setup as the Go tests. It is in the e2e module: from
// the repository's root,
//
//	go -C e2e run ./cmd/topo up    [flags]   # create; print shell variables
//	go -C e2e run ./cmd/topo env   [flags]   # print the variables only
//	go -C e2e run ./cmd/topo down  [flags]   # remove (idempotent)
//	go -C e2e run ./cmd/topo bench [flags]   # create, measure, remove
//
// Typical use from a script:
//
//	eval "$(go -C e2e run ./cmd/topo up --name demo)"
//	trap 'go -C e2e run ./cmd/topo down --name demo' EXIT
//	ip netns exec "$SERVER_NS" ./server --listen "$SERVER_ADDR1:10809" &
//	ip netns exec "$CLIENT_NS" ./client "$SERVER_ADDR1:10809"
//
// up and env print NAME=value lines (TOPO_NAME, CLIENT_NS, SERVER_NS,
// PATHS, JOIN_PORT and, per path i, CLIENT_IFi, SERVER_IFi, CLIENT_ADDRi,
// SERVER_ADDRi, RATE_MBITi, BACKUPi) on standard output; everything else
// goes to standard error.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/mpnbd/mpnbd/internal/testenv/topo"
)

func main() {
	if err := run(os.Args[1:], os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "topo:", err)
		os.Exit(1)
	}
}

const usage = `usage: topo up|down|env|bench [flags]

flags:
`

func run(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("topo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	defName := os.Getenv("TOPO_NAME")
	if defName == "" {
		defName = "mpnbd"
	}
	name := fs.String("name", defName, "topology name: prefix of namespace and interface names (default $TOPO_NAME or mpnbd)")
	asym := fs.Bool("asym", false, "asymmetric topology: 3 paths of 1000 Mbit/s and 1 of 100 Mbit/s (ignores --paths/--rate)")
	paths := fs.Int("paths", 4, "number of paths")
	rate := fs.Int("rate", topo.DefaultRateMbit, "rate of every path in Mbit/s")
	backupSlow := fs.Bool("backup-slow", false, "mark the slowest path (the last one with the lowest rate) as MPTCP backup")
	subnet := fs.String("subnet", topo.DefaultSubnet, "first two octets of the path addresses")
	joinPort := fs.Int("join-port", topo.DefaultJoinPort, "port of the server's MP_JOIN listeners on paths 2..N; -1 announces the addresses without a port (server must then listen on the wildcard address)")
	seconds := fs.Float64("seconds", 5, "bench: measurement time per run")
	mode := fs.String("mode", "both", "bench: tcp (one TCP stream per path), mptcp (one MPTCP connection) or both")
	fs.Usage = func() {
		fmt.Fprint(stderr, usage)
		fs.PrintDefaults()
	}

	// Accept the command before or after the flags.
	var cmd string
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		cmd, args = args[0], args[1:]
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if cmd == "" && fs.NArg() > 0 {
		cmd = fs.Arg(0)
		if err := fs.Parse(fs.Args()[1:]); err != nil {
			return err
		}
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}

	var cfg topo.Config
	if *asym {
		cfg = topo.Asymmetric(*name)
	} else {
		cfg = topo.Uniform(*name, *paths, *rate)
	}
	cfg.Subnet = *subnet
	cfg.JoinPort = *joinPort
	if *backupSlow {
		slow := 0
		for i, p := range cfg.Paths {
			if p.RateMbit <= cfg.Paths[slow].RateMbit {
				slow = i
			}
		}
		cfg.Paths[slow].Backup = true
	}

	switch cmd {
	case "up":
		t, err := topo.Up(cfg)
		if err != nil {
			return err
		}
		printEnv(stdout, t)
		return nil
	case "env":
		t, err := topo.Plan(cfg)
		if err != nil {
			return err
		}
		printEnv(stdout, t)
		return nil
	case "down":
		return topo.Down(*name)
	case "bench":
		return bench(cfg, *mode, time.Duration(*seconds*float64(time.Second)), stdout)
	case "":
		fs.Usage()
		return errors.New("missing command")
	default:
		fs.Usage()
		return fmt.Errorf("unknown command %q", cmd)
	}
}

func printEnv(w io.Writer, t *topo.Topology) {
	for _, kv := range t.Env() {
		k, v, _ := strings.Cut(kv, "=")
		fmt.Fprintf(w, "%s='%s'\n", k, v) // values never contain quotes
	}
}

func bench(cfg topo.Config, mode string, d time.Duration, w io.Writer) (err error) {
	if mode != "tcp" && mode != "mptcp" && mode != "both" {
		return fmt.Errorf("invalid --mode %q", mode)
	}
	t, err := topo.Up(cfg)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, t.Down()) }()
	if mode == "tcp" || mode == "both" {
		m, err := topo.MeasureTCP(t, d)
		if err != nil {
			return err
		}
		fmt.Fprintln(w, m)
	}
	if mode == "mptcp" || mode == "both" {
		m, err := topo.MeasureMPTCP(t, d)
		if err != nil {
			return err
		}
		fmt.Fprintln(w, m)
	}
	return nil
}
