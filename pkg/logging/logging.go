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

// Package logging gives every command and data-path process of the driver
// one way to log: log/slog, as text or JSON, at a level, with the same
// keys everywhere (volume_id, transport, error, ...). A command makes its
// logger with New and installs it with Setup, which also records the
// settings in the environment, so that the processes it starts (a fuse
// volume's server, a ublk volume's process) log the same way through
// FromEnv. The kubelog subpackage bridges klog and controller-runtime into
// the same handler.
package logging

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
)

// Environment variables by which a process passes its settings to the
// processes it starts.
const (
	EnvFormat = "MPNBD_LOG_FORMAT"
	EnvLevel  = "MPNBD_LOG_LEVEL"
)

// Formats New knows.
const (
	FormatText = "text"
	FormatJSON = "json"
)

// CheckFormat refuses a format New does not know.
func CheckFormat(format string) error {
	if format != FormatText && format != FormatJSON {
		return fmt.Errorf("log format %q (want %s or %s)", format, FormatText, FormatJSON)
	}
	return nil
}

// New returns a logger writing to w in format (FormatJSON, or text for
// anything else) at level.
func New(w io.Writer, level slog.Level, format string) *slog.Logger {
	ho := &slog.HandlerOptions{Level: level}
	if format == FormatJSON {
		return slog.New(slog.NewJSONHandler(w, ho))
	}
	return slog.New(slog.NewTextHandler(w, ho))
}

// Setup makes log the process's default logger and passes level and
// format on to the processes it will start.
func Setup(log *slog.Logger, level slog.Level, format string) {
	slog.SetDefault(log)
	os.Setenv(EnvFormat, format)
	os.Setenv(EnvLevel, level.String())
}

// FromEnv is the logger of a process started by one that called Setup:
// its format and level, writing to w. Without them it logs text at Info.
func FromEnv(w io.Writer) *slog.Logger {
	var level slog.Level
	if v := os.Getenv(EnvLevel); v != "" {
		if err := level.UnmarshalText([]byte(strings.TrimSpace(v))); err != nil {
			level = slog.LevelInfo
		}
	}
	return New(w, level, os.Getenv(EnvFormat))
}
