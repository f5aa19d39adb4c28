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
	"errors"
	"fmt"
	"io"
	"runtime"
	"slices"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/pkg/buildinfo"
)

// driverLabels select the driver's workloads and pods (the chart's
// mpnbd.labels, and deploy/'s).
var driverLabels = map[string]string{"app.kubernetes.io/name": "mpnbd"}

// componentLabel names a workload's component: controller, node,
// datapath, storage-agent.
const componentLabel = "app.kubernetes.io/component"

// VersionReport is what `mpnbdctl version` prints.
type VersionReport struct {
	Client ClientVersion `json:"client"`
	// Components are the driver's Deployments and DaemonSets, sorted by
	// component, namespace and name; null when the API server did not
	// answer.
	Components []ComponentVersion `json:"components"`
	// Images are the distinct images of the components' main
	// containers, sorted.
	Images []string `json:"images"`
	// Agree: every component runs the same image (false with no
	// component).
	Agree    bool     `json:"agree"`
	Warnings []string `json:"warnings,omitempty"`
}

// ClientVersion is mpnbdctl's own build.
type ClientVersion struct {
	Version   string `json:"version"`
	Revision  string `json:"revision"`
	GoVersion string `json:"goVersion"`
}

// ComponentVersion is one of the driver's workloads and the image of its
// main container.
type ComponentVersion struct {
	Component string `json:"component"`
	Kind      string `json:"kind"`
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	Container string `json:"container"`
	Image     string `json:"image"`
}

// version prints mpnbdctl's version and, from the API server api, the
// driver's components and their images. connErr is why there is no api:
// after the client's version, version fails with it; so it does when the
// API server does not answer. An answer refusing a list (RBAC) is a
// warning.
func version(ctx context.Context, o *options, api client.Reader, connErr error, w io.Writer) error {
	rep := &VersionReport{
		Client:     ClientVersion{Version: buildinfo.Version, Revision: buildinfo.Revision(), GoVersion: runtime.Version()},
		Components: []ComponentVersion{},
		Images:     []string{},
	}
	err := connErr
	if err == nil {
		err = readComponents(ctx, o, api, rep)
	}
	if err != nil {
		// What is known, then the failure.
		rep.Components = nil
		if o.output == outputJSON {
			_ = writeJSON(w, rep)
		} else {
			writeClientVersion(w, rep.Client)
		}
		return err
	}
	for _, c := range rep.Components {
		if !slices.Contains(rep.Images, c.Image) {
			rep.Images = append(rep.Images, c.Image)
		}
	}
	slices.Sort(rep.Images)
	rep.Agree = len(rep.Images) == 1
	if o.output == outputJSON {
		return writeJSON(w, rep)
	}
	return writeVersion(w, o, rep)
}

// readComponents lists the driver's Deployments and DaemonSets into rep,
// each request within o.timeout.
func readComponents(ctx context.Context, o *options, api client.Reader, rep *VersionReport) error {
	opts := []client.ListOption{client.MatchingLabels(driverLabels)}
	if o.namespace != "" {
		opts = append(opts, client.InNamespace(o.namespace))
	}
	list := func(kind string, l client.ObjectList) (bool, error) {
		ctx, cancel := context.WithTimeout(ctx, o.timeout)
		defer cancel()
		err := api.List(ctx, l, opts...)
		var status apierrors.APIStatus
		if err != nil && errors.As(err, &status) {
			rep.Warnings = append(rep.Warnings, fmt.Sprintf("%s not read: %v", kind, err))
			return false, nil
		}
		if err != nil {
			return false, fmt.Errorf("listing %s: %w", kind, err)
		}
		return true, nil
	}
	var deps appsv1.DeploymentList
	ok, err := list("Deployments", &deps)
	if err != nil {
		return err
	}
	if ok {
		for _, d := range deps.Items {
			rep.Components = append(rep.Components, componentVersion("Deployment", d.Namespace, d.Name, d.Labels, &d.Spec.Template.Spec))
		}
	}
	var dss appsv1.DaemonSetList
	ok, err = list("DaemonSets", &dss)
	if err != nil {
		return err
	}
	if ok {
		for _, d := range dss.Items {
			rep.Components = append(rep.Components, componentVersion("DaemonSet", d.Namespace, d.Name, d.Labels, &d.Spec.Template.Spec))
		}
	}
	slices.SortFunc(rep.Components, func(a, b ComponentVersion) int {
		return cmp.Or(strings.Compare(a.Component, b.Component), strings.Compare(a.Namespace, b.Namespace), strings.Compare(a.Name, b.Name))
	})
	return nil
}

// componentVersion is a workload with the image of its main container:
// the one named after its component (the chart's controller, node,
// datapath and storage-agent), else its first.
func componentVersion(kind, ns, name string, l map[string]string, spec *corev1.PodSpec) ComponentVersion {
	cv := ComponentVersion{Component: l[componentLabel], Kind: kind, Namespace: ns, Name: name}
	for i, c := range spec.Containers {
		if i == 0 || c.Name == cv.Component {
			cv.Container, cv.Image = c.Name, c.Image
		}
		if c.Name == cv.Component {
			break
		}
	}
	return cv
}

func writeClientVersion(w io.Writer, c ClientVersion) {
	fmt.Fprintf(w, "mpnbdctl %s (revision %s, %s)\n", c.Version, c.Revision, c.GoVersion)
}

// writeVersion writes rep as a table, with whether the components agree.
func writeVersion(w io.Writer, o *options, rep *VersionReport) error {
	writeClientVersion(w, rep.Client)
	var notes []string
	if len(rep.Components) == 0 {
		where := "in any namespace"
		if o.namespace != "" {
			where = "in namespace " + o.namespace
		}
		notes = append(notes, fmt.Sprintf("No Deployment or DaemonSet labelled %s %s: the driver is not installed there, or not with the chart's labels.",
			labels.SelectorFromSet(driverLabels), where))
	} else {
		fmt.Fprintln(w)
		tw := newTabWriter(w)
		row(tw, "", "COMPONENT", "KIND", "NAMESPACE", "NAME", "CONTAINER", "IMAGE")
		for _, c := range rep.Components {
			row(tw, "", c.Component, c.Kind, c.Namespace, c.Name, c.Container, c.Image)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		if rep.Agree {
			notes = append(notes, "The components agree: they run "+rep.Images[0]+".")
		} else {
			var parts []string
			for _, img := range rep.Images {
				var who []string
				for _, c := range rep.Components {
					if c.Image == img {
						who = append(who, c.Name)
					}
				}
				parts = append(parts, fmt.Sprintf("%s (%s)", img, strings.Join(who, ", ")))
			}
			notes = append(notes, "The components do not agree (an upgrade under way, or a workload changed by hand): "+strings.Join(parts, "; ")+".")
		}
	}
	return printNotes(w, notes, rep.Warnings)
}
