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
	"strings"
	"testing"
)

func TestEnv(t *testing.T) {
	for _, args := range [][]string{
		{"env", "--name", "xy", "--asym", "--backup-slow"},
		{"--name", "xy", "--asym", "--backup-slow", "env"},
	} {
		var out, errb bytes.Buffer
		if err := run(args, &out, &errb); err != nil {
			t.Fatalf("%q: %v (%s)", args, err, errb.String())
		}
		s := out.String()
		for _, want := range []string{"CLIENT_NS='xy-cli'\n", "SERVER_NS='xy-srv'\n", "SERVER_ADDR4='10.77.4.2'\n", "RATE_MBIT4='100'\n", "BACKUP4='1'\n", "BACKUP3='0'\n", "JOIN_PORT='10900'\n"} {
			if !strings.Contains(s, want) {
				t.Errorf("%q: output lacks %q:\n%s", args, want, s)
			}
		}
	}
}

func TestEnvPathsRate(t *testing.T) {
	var out, errb bytes.Buffer
	if err := run([]string{"env", "--name", "z", "--paths", "2", "--rate", "250", "--subnet", "10.99", "--join-port", "-1"}, &out, &errb); err != nil {
		t.Fatal(err)
	}
	s := out.String()
	for _, want := range []string{"PATHS='2'\n", "RATE_MBIT2='250'\n", "CLIENT_ADDR2='10.99.2.1'\n", "JOIN_PORT='0'\n"} {
		if !strings.Contains(s, want) {
			t.Errorf("output lacks %q:\n%s", want, s)
		}
	}
	if strings.Contains(s, "ADDR3") {
		t.Errorf("3rd path in output:\n%s", s)
	}
}

func TestBadArgs(t *testing.T) {
	for _, args := range [][]string{nil, {"frob"}, {"env", "extra"}, {"env", "--name", "bad name"}, {"env", "--nope"}} {
		var out, errb bytes.Buffer
		if err := run(args, &out, &errb); err == nil {
			t.Errorf("%q: no error", args)
		}
	}
}
