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
	"cmp"
	"context"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/driver"
)

// nodePluginComponent is the source component of the Events the node
// plugin records on claims (pkg/driver KubeEvents).
const nodePluginComponent = "mpnbd-node"

// inventory is what the API server says: the volumes to show and what
// surrounds them. Only the NBDVolumes are required; a part that cannot be
// read (RBAC, say) becomes a warning.
type inventory struct {
	// volumes are those to show: every volume, or those the filters
	// (--storage-node, --node) keep, or the volume NAME asked for.
	volumes []v1alpha1.NBDVolume
	// all are the volumes read, before the filters.
	all []v1alpha1.NBDVolume
	// pvs are the PVs of this driver by CSI volume handle (the volume
	// ID); nil when they could not be read.
	pvs map[string]*corev1.PersistentVolume
	// nodeAddrs are the InternalIPs of the Nodes by name; nil when they
	// were not needed or could not be read.
	nodeAddrs map[string]string
	// nodePlugins are the node plugin pods by the node they run on,
	// sorted by namespace and name; nil when they were not needed or
	// could not be read.
	nodePlugins map[string][]corev1.Pod
	// events are the node plugin's Warning Events on each volume's
	// claim, by volume ID (volume NAME only).
	events map[string][]corev1.Event
	// single: the volume NAME asked for, not every volume.
	single   bool
	warnings []string
}

// readInventory reads the volumes o asks for and what surrounds them,
// each request within o.timeout.
func readInventory(ctx context.Context, api client.Reader, o *options) (*inventory, error) {
	inv := &inventory{single: o.command == cmdVolume}
	call := func(f func(ctx context.Context) error) error {
		ctx, cancel := context.WithTimeout(ctx, o.timeout)
		defer cancel()
		return f(ctx)
	}
	if o.command == cmdVolume {
		id, err := resolveVolume(ctx, api, o.volume, call)
		if err != nil {
			return nil, err
		}
		var vol v1alpha1.NBDVolume
		err = call(func(ctx context.Context) error { return api.Get(ctx, client.ObjectKey{Name: id}, &vol) })
		if apierrors.IsNotFound(err) {
			return nil, fmt.Errorf("NBDVolume %q not found", id)
		}
		if err != nil {
			return nil, apiError("reading NBDVolume "+id, err)
		}
		inv.volumes = []v1alpha1.NBDVolume{vol}
		inv.all = inv.volumes
	} else {
		var list v1alpha1.NBDVolumeList
		if err := call(func(ctx context.Context) error { return api.List(ctx, &list) }); err != nil {
			return nil, apiError("listing NBDVolumes", err)
		}
		inv.all = list.Items
		slices.SortFunc(inv.all, func(a, b v1alpha1.NBDVolume) int { return strings.Compare(a.Name, b.Name) })
		inv.volumes = filterVolumes(inv.all, o)
	}

	var pvs corev1.PersistentVolumeList
	if err := call(func(ctx context.Context) error { return api.List(ctx, &pvs) }); err != nil {
		inv.warn("PersistentVolumes not read, so no PV or claim is shown: %v", err)
	} else {
		inv.pvs = map[string]*corev1.PersistentVolume{}
		for i := range pvs.Items {
			if csi := pvs.Items[i].Spec.CSI; csi != nil && csi.Driver == driver.DriverName {
				inv.pvs[csi.VolumeHandle] = &pvs.Items[i]
			}
		}
	}

	if needNodeAddrs(o, inv.volumes) {
		var nodes corev1.NodeList
		if err := call(func(ctx context.Context) error { return api.List(ctx, &nodes) }); err != nil {
			inv.warn("Nodes not read, so their metrics cannot be found with --metrics-port: %v", err)
		} else {
			inv.nodeAddrs = map[string]string{}
			for _, n := range nodes.Items {
				if a := internalIP(&n); a != "" {
					inv.nodeAddrs[n.Name] = a
				}
			}
		}
	}

	if needNodePlugins(o, inv.volumes) {
		var pods corev1.PodList
		opts := []client.ListOption{client.MatchingLabels(nodePluginLabels)}
		if o.namespace != "" {
			opts = append(opts, client.InNamespace(o.namespace))
		}
		if err := call(func(ctx context.Context) error { return api.List(ctx, &pods, opts...) }); err != nil {
			inv.warn("Pods not read, so the node plugins' metrics cannot be read through the API server (list on pods is needed): %v", err)
		} else {
			inv.nodePlugins = map[string][]corev1.Pod{}
			slices.SortFunc(pods.Items, func(a, b corev1.Pod) int {
				return cmp.Or(strings.Compare(a.Namespace, b.Namespace), strings.Compare(a.Name, b.Name))
			})
			for _, p := range pods.Items {
				if p.Spec.NodeName != "" {
					inv.nodePlugins[p.Spec.NodeName] = append(inv.nodePlugins[p.Spec.NodeName], p)
				}
			}
		}
	}

	if o.command == cmdVolume {
		vol := &inv.volumes[0]
		if pv := inv.pvs[vol.Name]; pv != nil && pv.Spec.ClaimRef != nil {
			events, err := claimEvents(ctx, api, pv.Spec.ClaimRef, call)
			if err != nil {
				inv.warn("Events of claim %s/%s not read: %v", pv.Spec.ClaimRef.Namespace, pv.Spec.ClaimRef.Name, err)
			}
			inv.events = map[string][]corev1.Event{vol.Name: events}
		}
	}
	return inv, nil
}

// filterVolumes keeps the volumes with data on --storage-node (its
// primary, its only copy or a replica) and published to --node.
func filterVolumes(vols []v1alpha1.NBDVolume, o *options) []v1alpha1.NBDVolume {
	var out []v1alpha1.NBDVolume
	for _, v := range vols {
		if o.storageNode != "" && v.Spec.StorageNode != o.storageNode && !slices.Contains(v.Spec.ReplicaNodes, o.storageNode) {
			continue
		}
		if o.publishedTo != "" && !slices.ContainsFunc(v.Spec.Publications, func(p v1alpha1.Publication) bool { return p.NodeID == o.publishedTo }) {
			continue
		}
		out = append(out, v)
	}
	return out
}

func (inv *inventory) warn(format string, args ...any) {
	inv.warnings = append(inv.warnings, fmt.Sprintf(format, args...))
}

// apiError says what failed, and that the CRDs are missing when they are.
func apiError(what string, err error) error {
	if meta.IsNoMatchError(err) {
		return fmt.Errorf("%s: the mpnbd CRDs are not installed (%s): %w", what, v1alpha1.GroupVersion, err)
	}
	return fmt.Errorf("%s: %w", what, err)
}

// resolveVolume returns the volume ID name stands for: name itself, or
// for NAMESPACE/CLAIM the CSI handle of the PV the claim is bound to.
func resolveVolume(ctx context.Context, api client.Reader, name string, call func(func(context.Context) error) error) (string, error) {
	ns, claim, ok := strings.Cut(name, "/")
	if !ok {
		return name, nil
	}
	var pvc corev1.PersistentVolumeClaim
	if err := call(func(ctx context.Context) error {
		return api.Get(ctx, client.ObjectKey{Namespace: ns, Name: claim}, &pvc)
	}); err != nil {
		return "", fmt.Errorf("claim %s: %w", name, err)
	}
	if pvc.Spec.VolumeName == "" {
		return "", fmt.Errorf("claim %s is not bound to a PV yet", name)
	}
	var pv corev1.PersistentVolume
	if err := call(func(ctx context.Context) error {
		return api.Get(ctx, client.ObjectKey{Name: pvc.Spec.VolumeName}, &pv)
	}); err != nil {
		return "", fmt.Errorf("PV %s of claim %s: %w", pvc.Spec.VolumeName, name, err)
	}
	if pv.Spec.CSI == nil || pv.Spec.CSI.Driver != driver.DriverName {
		return "", fmt.Errorf("claim %s is bound to PV %s, which is not a %s volume", name, pv.Name, driver.DriverName)
	}
	return pv.Spec.CSI.VolumeHandle, nil
}

// claimEvents returns the Warning Events the node plugin recorded on a
// claim, newest first.
func claimEvents(ctx context.Context, api client.Reader, ref *corev1.ObjectReference, call func(func(context.Context) error) error) ([]corev1.Event, error) {
	var list corev1.EventList
	if err := call(func(ctx context.Context) error {
		return api.List(ctx, &list, client.InNamespace(ref.Namespace), client.MatchingFields{"involvedObject.name": ref.Name})
	}); err != nil {
		return nil, err
	}
	var out []corev1.Event
	for _, e := range list.Items {
		if e.InvolvedObject.Kind == "PersistentVolumeClaim" && e.InvolvedObject.Name == ref.Name &&
			e.Source.Component == nodePluginComponent && e.Type == corev1.EventTypeWarning {
			out = append(out, e)
		}
	}
	slices.SortStableFunc(out, func(a, b corev1.Event) int { return eventTime(&b).Compare(eventTime(&a)) })
	return out, nil
}

// eventTime is when an Event last happened.
func eventTime(e *corev1.Event) time.Time {
	switch {
	case !e.LastTimestamp.IsZero():
		return e.LastTimestamp.Time
	case !e.EventTime.IsZero():
		return e.EventTime.Time
	}
	return e.FirstTimestamp.Time
}

// needNodeAddrs reports whether some published node's metrics are to be
// found by its address.
func needNodeAddrs(o *options, vols []v1alpha1.NBDVolume) bool {
	return o.metricsPort != 0 && someWithoutURL(o, vols)
}

// needNodePlugins reports whether some published node's metrics are to be
// read through the API server.
func needNodePlugins(o *options, vols []v1alpha1.NBDVolume) bool {
	return o.metricsPort == 0 && someWithoutURL(o, vols)
}

// someWithoutURL reports whether a volume is published to a node without
// --metrics-url, and the command shows metrics (uninstall-check does not).
func someWithoutURL(o *options, vols []v1alpha1.NBDVolume) bool {
	if o.command == cmdUninstallCheck {
		return false
	}
	for _, v := range vols {
		for _, p := range v.Spec.Publications {
			if _, ok := o.metricsURLs[p.NodeID]; !ok {
				return true
			}
		}
	}
	return false
}

// nodePluginLabels select the node plugin pods (the chart's
// mpnbd.selectorLabels of the component node, whatever the release).
var nodePluginLabels = map[string]string{"app.kubernetes.io/name": "mpnbd", "app.kubernetes.io/component": "node"}

// metricsPortName is the node plugin container's port of /metrics.
const metricsPortName = "metrics"

// nodePluginPod picks the pod whose metrics to read among the node
// plugin pods on a node: a running one, not being deleted, else the
// first; nil when there is none.
func nodePluginPod(pods []corev1.Pod) *corev1.Pod {
	for i := range pods {
		if p := &pods[i]; p.Status.Phase == corev1.PodRunning && p.DeletionTimestamp == nil {
			return p
		}
	}
	for i := range pods {
		if p := &pods[i]; p.Status.Phase == corev1.PodRunning {
			return p
		}
	}
	if len(pods) > 0 {
		return &pods[0]
	}
	return nil
}

// metricsPort is the pod's container port named metrics; 0: none.
func metricsPort(p *corev1.Pod) int32 {
	for _, c := range p.Spec.Containers {
		for _, port := range c.Ports {
			if port.Name == metricsPortName {
				return port.ContainerPort
			}
		}
	}
	return 0
}

// internalIP is the node's first InternalIP, where a hostNetwork pod
// listens.
func internalIP(n *corev1.Node) string {
	for _, a := range n.Status.Addresses {
		if a.Type == corev1.NodeInternalIP && a.Address != "" {
			return a.Address
		}
	}
	return ""
}

// publishedNodes lists the nodes the volumes are published to, sorted.
func publishedNodes(vols []v1alpha1.NBDVolume) []string {
	var out []string
	for _, v := range vols {
		for _, p := range v.Spec.Publications {
			out = append(out, p.NodeID)
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// metricsTargets says, per published node, where its metrics are: its
// --metrics-url; else its InternalIP and --metrics-port; else, through
// proxy (the API server), its node plugin pod's metrics port. A node
// without the one it needs gets the status why.
func metricsTargets(o *options, inv *inventory, proxy *apiProxy) []NodeMetrics {
	var out []NodeMetrics
	for _, name := range publishedNodes(inv.volumes) {
		t := NodeMetrics{Node: name}
		switch addr, known := inv.nodeAddrs[name]; {
		case o.metricsURLs[name] != "":
			t.URL = o.metricsURLs[name]
		case o.metricsPort == 0:
			proxyTarget(&t, inv, proxy)
		case known:
			t.URL = "http://" + net.JoinHostPort(addr, strconv.Itoa(o.metricsPort)) + "/metrics"
		case inv.nodeAddrs == nil:
			t.Status, t.Error = MetricsNoAddress, "Nodes not readable"
		default:
			t.Status, t.Error = MetricsNoAddress, "no Node with an InternalIP by this name"
		}
		out = append(out, t)
	}
	return out
}

// proxyTarget sets t's URL to its node plugin pod's metrics through the
// API server, or its status to why there is none.
func proxyTarget(t *NodeMetrics, inv *inventory, proxy *apiProxy) {
	if inv.nodePlugins == nil {
		t.Status, t.Error = MetricsNoPod, "Pods not readable"
		return
	}
	pod := nodePluginPod(inv.nodePlugins[t.Node])
	if pod == nil {
		t.Status, t.Error = MetricsNoPod, "no node plugin pod on the node (labels "+labels.SelectorFromSet(nodePluginLabels).String()+")"
		return
	}
	t.Pod = pod.Namespace + "/" + pod.Name
	port := metricsPort(pod)
	switch {
	case pod.Status.Phase != corev1.PodRunning:
		t.Status, t.Error = MetricsNoPod, fmt.Sprintf("node plugin pod %s is %s, not Running", t.Pod, cmp.Or(string(pod.Status.Phase), "not started"))
	case port == 0:
		t.Status, t.Error = MetricsNoPort, fmt.Sprintf("node plugin pod %s declares no container port named %s (the chart's node.metricsPort is 0)", t.Pod, metricsPortName)
	case proxy == nil:
		t.Status, t.Error = MetricsError, "no API server to read it through"
	default:
		t.URL, t.viaAPI = proxy.podURL(pod.Namespace, pod.Name, port, "metrics"), true
	}
}
