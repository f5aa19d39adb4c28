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

// Package kubeevents records Events through a controller-runtime client,
// aggregated as kubectl shows them, and words the Events the controller,
// the node plugin and the storage agent share: the slow-path watch's
// decisions (Path).
package kubeevents

import (
	"context"
	"log/slog"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/record"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// NewRecorder returns an EventRecorder that writes through c, with
// client-go's correlator: a repeat of an Event raises the count of the
// one Event object (and a burst of similar ones is combined) instead of
// making one object each. stop flushes and ends it.
func NewRecorder(c client.Client, component string, log *slog.Logger) (rec record.EventRecorder, stop func()) {
	b := record.NewBroadcaster()
	w := b.StartRecordingToSink(eventSink{c})
	if log != nil {
		// The broadcaster's own failures (an Event refused) are logged
		// by klog; say where they come from at debug level here.
		b.StartEventWatcher(func(e *corev1.Event) {
			log.Debug("event", "object", e.InvolvedObject.Kind+"/"+e.InvolvedObject.Name, "type", e.Type, "reason", e.Reason, "message", e.Message)
		})
	}
	return b.NewRecorder(c.Scheme(), corev1.EventSource{Component: component}), func() {
		w.Stop()
		b.Shutdown()
	}
}

// eventSink is record.EventSink over a controller-runtime client.
type eventSink struct{ c client.Client }

// sinkTimeout bounds each write of an Event.
const sinkTimeout = 10 * time.Second

func (s eventSink) Create(e *corev1.Event) (*corev1.Event, error) {
	ctx, cancel := context.WithTimeout(context.Background(), sinkTimeout)
	defer cancel()
	err := s.c.Create(ctx, e)
	return e, err
}

func (s eventSink) Update(e *corev1.Event) (*corev1.Event, error) {
	ctx, cancel := context.WithTimeout(context.Background(), sinkTimeout)
	defer cancel()
	err := s.c.Update(ctx, e)
	return e, err
}

func (s eventSink) Patch(e *corev1.Event, data []byte) (*corev1.Event, error) {
	ctx, cancel := context.WithTimeout(context.Background(), sinkTimeout)
	defer cancel()
	out := e.DeepCopy()
	err := s.c.Patch(ctx, out, client.RawPatch(types.StrategicMergePatchType, data))
	return out, err
}
