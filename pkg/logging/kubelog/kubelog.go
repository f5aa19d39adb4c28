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
