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

// Package kubelog sends what the Kubernetes libraries log (klog, used by
// client-go, and controller-runtime's logr) through a slog handler, so
// that a command's every line has its format, level and keys.
package kubelog

import (
	"io"
	"log/slog"

	"github.com/go-logr/logr"
	"k8s.io/klog/v2"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/mpnbd/mpnbd/pkg/logging"
)

// Bridge makes klog and controller-runtime log through log's handler.
// Call it before the libraries start goroutines that log.
func Bridge(log *slog.Logger) {
	l := logr.FromSlogHandler(log.Handler())
	klog.SetLogger(l)
	ctrllog.SetLogger(l)
}

// Setup makes the logger of a command: logging.New and logging.Setup, with
// klog and controller-runtime bridged into it.
func Setup(w io.Writer, level slog.Level, format string) *slog.Logger {
	log := logging.New(w, level, format)
	logging.Setup(log, level, format)
	Bridge(log)
	return log
}
