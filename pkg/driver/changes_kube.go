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

package driver

import (
	"context"
	"fmt"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/rest"
	toolscache "k8s.io/client-go/tools/cache"
	"sigs.k8s.io/controller-runtime/pkg/cache"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
)

// WatchChanges watches NBDVolumes and NBDSnapshots (their metadata only:
// a change of status changes the resource version too) and tells ch of
// every event. It returns once the watches have synced, or with an error
// (they did not sync within syncTimeout: no API server, no RBAC to watch);
// they stop when ctx ends. The controller's waits then read a volume when
// it changed instead of polling it: with many volumes in flight, a few
// reads per change instead of five a second per volume.
func WatchChanges(ctx context.Context, cfg *rest.Config, scheme *runtime.Scheme, ch *Changes, syncTimeout time.Duration) error {
	ca, err := cache.New(cfg, cache.Options{Scheme: scheme})
	if err != nil {
		return fmt.Errorf("watch of volumes and snapshots: %w", err)
	}
	for _, w := range []struct {
		kind string
		key  func(string) string
	}{{"NBDVolume", VolumeKey}, {"NBDSnapshot", SnapshotKey}} {
		obj := &metav1.PartialObjectMetadata{}
		obj.SetGroupVersionKind(v1alpha1.GroupVersion.WithKind(w.kind))
		inf, err := ca.GetInformer(ctx, obj)
		if err != nil {
			return fmt.Errorf("watch of %ss: %w", w.kind, err)
		}
		notify := func(o any) {
			if d, ok := o.(toolscache.DeletedFinalStateUnknown); ok {
				o = d.Obj
			}
			if m, ok := o.(metav1.Object); ok {
				ch.Notify(w.key(m.GetName()))
			}
		}
		if _, err := inf.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
			AddFunc:    notify,
			UpdateFunc: func(_, o any) { notify(o) },
			DeleteFunc: notify,
		}); err != nil {
			return fmt.Errorf("watch of %ss: %w", w.kind, err)
		}
	}
	run, stop := context.WithCancel(ctx)
	context.AfterFunc(ctx, stop)
	errc := make(chan error, 1)
	go func() { errc <- ca.Start(run) }()
	sync, cancel := context.WithTimeout(ctx, syncTimeout)
	defer cancel()
	if !ca.WaitForCacheSync(sync) {
		stop()
		select {
		case err := <-errc:
			if err != nil {
				return fmt.Errorf("watch of volumes and snapshots: %w", err)
			}
		case <-time.After(time.Second):
		}
		return fmt.Errorf("watch of volumes and snapshots: not synced within %v", syncTimeout)
	}
	return nil
}
