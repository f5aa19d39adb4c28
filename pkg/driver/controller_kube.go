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

// The Controller's dealings with the API server: waiting for the storage
// agent, optimistic updates, publication Secrets and error mapping.

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/access"
	"github.com/mpnbd/mpnbd/pkg/attach"
)

// errAgentFailed marks a wait that ended because the volume's phase is
// Failed; the caller turns the volume's status into the error.
var errAgentFailed = errors.New("storage agent reports the volume failed")

// waitApplied waits until the agent put the spec of v (its generation or
// a later one) in effect and the volume is Available. A Failed phase ends
// the wait with the agent's code and message.
func (c *Controller) waitApplied(ctx context.Context, v *v1alpha1.NBDVolume, what string) (*v1alpha1.NBDVolume, error) {
	gen := v.Generation
	w, err := c.waitVolume(ctx, v.Name, what, func(v *v1alpha1.NBDVolume) (bool, error) {
		if v == nil {
			return false, fmt.Errorf("%w: volume deleted while waiting for it", ErrNotFound)
		}
		if v.Status.Phase == v1alpha1.VolumeFailed {
			return false, errAgentFailed
		}
		return applied(v, gen), nil
	})
	if errors.Is(err, errAgentFailed) {
		return nil, agentError(w)
	}
	return w, err
}

// applied reports whether the agent put generation gen in effect.
func applied(v *v1alpha1.NBDVolume, gen int64) bool {
	return v.Status.ObservedGeneration >= gen && v.Status.Phase == v1alpha1.VolumeAvailable
}

// waitTicks returns what paces a wait for key: a channel that receives
// when the wait should read its object again, and the function that
// releases it. With Changes that is each change of the object and every
// ResyncInterval; without, every PollInterval.
func (c *Controller) waitTicks(key string) (<-chan struct{}, func()) {
	every := c.cfg.PollInterval
	var changed <-chan struct{}
	unsubscribe := func() {}
	if c.cfg.Changes != nil {
		every = c.cfg.ResyncInterval
		changed, unsubscribe = c.cfg.Changes.Subscribe(key)
	}
	out := make(chan struct{}, 1)
	stop := make(chan struct{})
	go func() {
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
			case <-changed:
			}
			select {
			case out <- struct{}{}:
			default:
			}
		}
	}()
	return out, func() { unsubscribe(); close(stop) }
}

// waitVolume reads volume id until done reports true (done gets nil once
// the volume is gone) or an error, for at most WaitTimeout: again after
// each change of the volume, or every PollInterval without Changes. On
// errAgentFailed it returns the volume with the error.
func (c *Controller) waitVolume(ctx context.Context, id, what string, done func(*v1alpha1.NBDVolume) (bool, error)) (*v1alpha1.NBDVolume, error) {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.WaitTimeout)
	defer cancel()
	tick, release := c.waitTicks(VolumeKey(id))
	defer release()
	var last *v1alpha1.NBDVolume
	var lastErr error
	for {
		v := &v1alpha1.NBDVolume{}
		err := c.c.Get(ctx, client.ObjectKey{Name: id}, v)
		if err == nil || apierrors.IsNotFound(err) {
			if err != nil {
				v = nil
			}
			ok, err := done(v)
			if errors.Is(err, errAgentFailed) {
				return v, err
			}
			if err != nil {
				return nil, err
			}
			if ok {
				return v, nil
			}
			last, lastErr = v, nil
		} else if ctx.Err() == nil {
			// A transient API error: try again until the deadline.
			lastErr = err
		}
		select {
		case <-ctx.Done():
			state := "gone"
			if last != nil {
				state = fmt.Sprintf("phase %s, observed generation %d of %d%s", phaseOf(last),
					last.Status.ObservedGeneration, last.Generation, failureSuffix(last))
			}
			if lastErr != nil {
				state += "; last API error: " + lastErr.Error()
			}
			return nil, fmt.Errorf("volume %s: the storage agent did not %s in time (%s): %w", id, what, state, ctx.Err())
		case <-tick:
		}
	}
}

// updateVolume applies mutate to the newest copy of a volume and writes
// it when mutate reports a change, retrying on conflicts (the agent
// writes the status concurrently). It returns the volume as written, or
// as read when nothing changed.
func (c *Controller) updateVolume(ctx context.Context, id string, mutate func(*v1alpha1.NBDVolume) (bool, error)) (*v1alpha1.NBDVolume, error) {
	var out *v1alpha1.NBDVolume
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		v := &v1alpha1.NBDVolume{}
		if err := c.c.Get(ctx, client.ObjectKey{Name: id}, v); err != nil {
			return err
		}
		changed, err := mutate(v)
		if err != nil {
			return err
		}
		if changed {
			if err := c.c.Update(ctx, v); err != nil {
				return err
			}
		}
		out = v
		return nil
	})
	if err != nil {
		if isAPIStatus(err) {
			return nil, kubeErr(err, "updating NBDVolume "+id)
		}
		return nil, err
	}
	return out, nil
}

// markDeleteData sets v1alpha1.DeleteDataAnnotation on v (as read, and
// updated to what was written), under an optimistic lock: a conflict (the
// agent writes the status meanwhile) reads the volume again and retries,
// as long as it is the same object (UID). gone reports that the volume no
// longer exists.
func (c *Controller) markDeleteData(ctx context.Context, v *v1alpha1.NBDVolume) (gone bool, err error) {
	uid := v.UID
	err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if v.DeletesData() {
			return nil
		}
		// An update (the controller's role may update volumes, not
		// patch them), of the version read: a conflict if it changed.
		metav1.SetMetaDataAnnotation(&v.ObjectMeta, v1alpha1.DeleteDataAnnotation, v1alpha1.DeleteDataTrue)
		err := c.c.Update(ctx, v)
		if err == nil {
			c.log.Info("volume marked to delete its data", "volume_id", v.Name, "storage_node", v.Spec.StorageNode,
				"annotation", v1alpha1.DeleteDataAnnotation, "already_deleting", v.DeletionTimestamp != nil)
			return nil
		}
		if !apierrors.IsConflict(err) {
			return err
		}
		var fresh v1alpha1.NBDVolume
		if err := c.c.Get(ctx, client.ObjectKeyFromObject(v), &fresh); err != nil {
			return err
		}
		if fresh.UID != uid {
			return fmt.Errorf("%w: volume %s was replaced by another object while being deleted; retry", ErrAborted, v.Name)
		}
		*v = fresh
		return err
	})
	switch {
	case apierrors.IsNotFound(err):
		return true, nil
	case err != nil && isAPIStatus(err):
		return false, kubeErr(err, "marking NBDVolume "+v.Name+" to delete its data")
	}
	return false, err
}

func isAPIStatus(err error) bool {
	var s apierrors.APIStatus
	return errors.As(err, &s)
}

// getVolume reads a volume; a missing one is ErrNotFound.
func (c *Controller) getVolume(ctx context.Context, id string) (*v1alpha1.NBDVolume, error) {
	v := &v1alpha1.NBDVolume{}
	if err := c.c.Get(ctx, client.ObjectKey{Name: id}, v); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, fmt.Errorf("%w: volume %q does not exist", ErrNotFound, id)
		}
		return nil, kubeErr(err, "reading NBDVolume "+id)
	}
	return v, nil
}

// setTokenHash writes the token hash (and Secret) of the publication of
// volume id to nodeID; no publication to nodeID, nothing is changed.
func (c *Controller) setTokenHash(ctx context.Context, id, nodeID, secretRef, hash string) (*v1alpha1.NBDVolume, error) {
	return c.updateVolume(ctx, id, func(v *v1alpha1.NBDVolume) (bool, error) {
		for i := range v.Spec.Publications {
			p := &v.Spec.Publications[i]
			if p.NodeID != nodeID || (p.SecretRef == secretRef && p.TokenSHA256 == hash) {
				continue
			}
			p.SecretRef, p.TokenSHA256 = secretRef, hash
			return true, nil
		}
		return false, nil
	})
}

// BackfillTokenHashes gives every publication that names a Secret but
// carries no token hash (made by a controller that did not write one) the
// hash of its Secret's token: storage agents grant a token only by its
// hash. It returns how many it filled in. A publication whose Secret is
// gone or damaged is left alone (it grants nothing; publishing the volume
// again renews both). Token publications made without their node's
// storage addresses (its plugin announced none then) get those the node
// announces now: storage agents grant a token only from them. It returns
// how many publications it changed.
func (c *Controller) BackfillTokenHashes(ctx context.Context) (int, error) {
	var l v1alpha1.NBDVolumeList
	if err := c.c.List(ctx, &l); err != nil {
		return 0, kubeErr(err, "listing NBDVolumes")
	}
	filled, err := c.backfillAddresses(ctx, l.Items)
	if err != nil {
		return filled, err
	}
	for _, v := range l.Items {
		for _, p := range v.Spec.Publications {
			if p.SecretRef == "" || p.TokenSHA256 != "" {
				continue
			}
			var s corev1.Secret
			if err := c.c.Get(ctx, client.ObjectKey{Namespace: c.cfg.Namespace, Name: p.SecretRef}, &s); err != nil {
				if apierrors.IsNotFound(err) {
					c.log.Warn("a publication's Secret is gone: it grants nothing until the volume is published again",
						"volume_id", v.Name, "node_id", p.NodeID, "secret", p.SecretRef)
					continue
				}
				return filled, kubeErr(err, "reading Secret "+p.SecretRef)
			}
			tok := string(s.Data[access.SecretKeyToken])
			if !access.ValidToken(tok) {
				c.log.Warn("a publication's Secret holds no valid token: it grants nothing until the volume is published again",
					"volume_id", v.Name, "node_id", p.NodeID, "secret", p.SecretRef)
				continue
			}
			hash, ref, node := access.TokenHash(tok), p.SecretRef, p.NodeID
			set := false
			_, err := c.updateVolume(ctx, v.Name, func(v *v1alpha1.NBDVolume) (bool, error) {
				set = false
				for i := range v.Spec.Publications {
					// Only a hash still missing: a publish may have
					// renewed the Secret and written its hash meanwhile.
					if q := &v.Spec.Publications[i]; q.NodeID == node && q.SecretRef == ref && q.TokenSHA256 == "" {
						q.TokenSHA256, set = hash, true
						return true, nil
					}
				}
				return false, nil
			})
			if err != nil && !errors.Is(err, ErrNotFound) {
				return filled, err
			}
			if err == nil && set {
				filled++
				c.log.Info("publication given its token hash", "volume_id", v.Name, "node_id", node)
			}
		}
	}
	return filled, nil
}

// backfillAddresses gives the token publications of vols that list no
// address the storage addresses their node announces (if it does yet).
func (c *Controller) backfillAddresses(ctx context.Context, vols []v1alpha1.NBDVolume) (int, error) {
	filled := 0
	for _, v := range vols {
		for _, p := range v.Spec.Publications {
			if (p.SecretRef == "" && p.TokenSHA256 == "") || len(p.Addresses) > 0 {
				continue
			}
			var n corev1.Node
			if err := c.c.Get(ctx, client.ObjectKey{Name: p.NodeID}, &n); err != nil {
				if apierrors.IsNotFound(err) {
					continue
				}
				return filled, kubeErr(err, "reading Node "+p.NodeID)
			}
			addrs, node := storageAddresses(&n), p.NodeID
			if len(addrs) == 0 {
				c.log.Warn("a token publication lists no storage address and its node announces none: it grants nothing",
					"volume_id", v.Name, "node_id", node)
				continue
			}
			set := false
			_, err := c.updateVolume(ctx, v.Name, func(v *v1alpha1.NBDVolume) (bool, error) {
				set = false
				for i := range v.Spec.Publications {
					if q := &v.Spec.Publications[i]; q.NodeID == node && len(q.Addresses) == 0 && (q.SecretRef != "" || q.TokenSHA256 != "") {
						q.Addresses, set = addrs, true
						return true, nil
					}
				}
				return false, nil
			})
			if err != nil && !errors.Is(err, ErrNotFound) {
				return filled, err
			}
			if err == nil && set {
				filled++
				c.log.Info("publication given its node's storage addresses", "volume_id", v.Name, "node_id", node,
					"node_addresses", strings.Join(addrs, ","))
			}
		}
	}
	return filled, nil
}

// ensureSecret returns the token of the publication Secret of volume v
// and nodeID, creating the Secret (or renewing a stale one) as needed.
func (c *Controller) ensureSecret(ctx context.Context, v *v1alpha1.NBDVolume, nodeID string) (string, error) {
	name := access.SecretName(v.Name, nodeID)
	owner := metav1.OwnerReference{
		APIVersion: v1alpha1.GroupVersion.String(),
		Kind:       "NBDVolume",
		Name:       v.Name,
		UID:        v.UID,
	}
	labels := map[string]string{access.LabelVolume: v.Name}
	// Node names may be longer than a label value may be; such a
	// Secret is found by its name only.
	if isLabelValue(nodeID) {
		labels[access.LabelNode] = nodeID
	}
	var s corev1.Secret
	err := c.c.Get(ctx, client.ObjectKey{Namespace: c.cfg.Namespace, Name: name}, &s)
	if err == nil {
		tok := string(s.Data[access.SecretKeyToken])
		if access.ValidToken(tok) && slices.ContainsFunc(s.OwnerReferences, func(o metav1.OwnerReference) bool { return o.UID == v.UID }) {
			return tok, nil
		}
		// Left over from an earlier volume of the same ID, or damaged:
		// give it a fresh token and the current owner.
		if tok, err = access.NewToken(); err != nil {
			return "", err
		}
		s.Labels, s.OwnerReferences = labels, []metav1.OwnerReference{owner}
		s.Data = map[string][]byte{access.SecretKeyToken: []byte(tok)}
		if err := c.c.Update(ctx, &s); err != nil {
			return "", kubeErr(err, "renewing Secret "+name)
		}
		return tok, nil
	}
	if !apierrors.IsNotFound(err) {
		return "", kubeErr(err, "reading Secret "+name)
	}
	tok, err := access.NewToken()
	if err != nil {
		return "", err
	}
	s = corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			Name:            name,
			Namespace:       c.cfg.Namespace,
			Labels:          labels,
			OwnerReferences: []metav1.OwnerReference{owner},
		},
		Type: corev1.SecretTypeOpaque,
		Data: map[string][]byte{access.SecretKeyToken: []byte(tok)},
	}
	if err := c.c.Create(ctx, &s); err != nil {
		return "", kubeErr(err, "creating Secret "+name)
	}
	return tok, nil
}

// deleteSecrets deletes the publication Secret of a volume and nodeID, or
// every publication Secret of the volume when nodeID is empty.
func (c *Controller) deleteSecrets(ctx context.Context, id, nodeID string) error {
	if nodeID != "" {
		s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: c.cfg.Namespace, Name: access.SecretName(id, nodeID)}}
		if err := c.c.Delete(ctx, s); err != nil && !apierrors.IsNotFound(err) {
			return kubeErr(err, "deleting Secret "+s.Name)
		}
		return nil
	}
	err := c.c.DeleteAllOf(ctx, &corev1.Secret{}, client.InNamespace(c.cfg.Namespace),
		client.MatchingLabels{access.LabelVolume: id})
	if err != nil && !apierrors.IsNotFound(err) {
		return kubeErr(err, "deleting the Secrets of volume "+id)
	}
	return nil
}

// publishContext is what the node plugin needs to open the export: the
// export's name (with the token of a publication made by an earlier
// controller, which had the node's token in a Secret), the epoch of the
// node's publication, the storage node's addresses and its name (which
// its certificate names). No credential: Kubernetes keeps the context
// in the VolumeAttachment.
func (c *Controller) publishContext(ctx context.Context, v *v1alpha1.NBDVolume, nodeID, token string) (map[string]string, error) {
	exportName := v.Name
	var addrs []string
	var port int32
	if e := v.Status.Export; e != nil {
		if e.Name != "" {
			exportName = e.Name
		}
		addrs, port = e.Addresses, e.Port
	}
	if len(addrs) == 0 || port == 0 {
		// The agent did not say where it serves the export: take what
		// its node reports.
		var n v1alpha1.NBDStorageNode
		if err := c.c.Get(ctx, client.ObjectKey{Name: v.Spec.StorageNode}, &n); err == nil {
			if len(addrs) == 0 {
				addrs = n.Status.Addresses
			}
			if port == 0 {
				port = n.Status.Port
			}
		}
	}
	if len(addrs) == 0 || port == 0 {
		return nil, fmt.Errorf("%w: storage node %s reports no storage address or port for volume %s",
			ErrUnavailable, v.Spec.StorageNode, v.Name)
	}
	hostports := joinPort(addrs, port)
	// A replicated volume's other replicas, where their nodes say they
	// serve: the node dials them all, and one of them takes over if the
	// primary goes. One that reports no address yet is left out.
	var replicas []attach.Server
	for _, r := range v.Spec.ReplicaNodes {
		var n v1alpha1.NBDStorageNode
		if err := c.c.Get(ctx, client.ObjectKey{Name: r}, &n); err != nil || len(n.Status.Addresses) == 0 || n.Status.Port == 0 {
			c.log.Warn("a replica's storage node is left out of the publication: no address known", "volume_id", v.Name, "storage_node", r, "error", err)
			continue
		}
		replicas = append(replicas, attach.Server{StorageNode: r, Addrs: joinPort(n.Status.Addresses, n.Status.Port)})
	}
	if token != "" {
		exportName = access.NodeExport(exportName, token)
	}
	pc := map[string]string{
		PublishContextExport:      exportName,
		PublishContextAddresses:   strings.Join(hostports, ","),
		PublishContextStorageNode: v.Spec.StorageNode,
	}
	for _, p := range v.Spec.Publications {
		if p.NodeID == nodeID && p.Epoch > 0 {
			pc[PublishContextEpoch] = strconv.FormatInt(p.Epoch, 10)
		}
	}
	if len(replicas) > 0 {
		pc[PublishContextReplicas] = formatReplicas(replicas)
	}
	return pc, nil
}

// joinPort makes host:port of each address.
func joinPort(addrs []string, port int32) []string {
	out := make([]string, len(addrs))
	for i, a := range addrs {
		out[i] = net.JoinHostPort(a, strconv.Itoa(int(port)))
	}
	return out
}

// csiVolume describes a volume for CreateVolume and ListVolumes. topo maps
// storage nodes to their topology; nil reads the volume's node.
func (c *Controller) csiVolume(ctx context.Context, v *v1alpha1.NBDVolume, topo map[string]map[string]string) *csi.Volume {
	out := &csi.Volume{
		VolumeId:      v.Name,
		CapacityBytes: v.Status.CapacityBytes,
		VolumeContext: maps.Clone(v.Spec.Parameters),
		ContentSource: csiContentSource(v.Spec.ContentSource),
	}
	// The claim, for the node's metrics.
	for _, k := range []string{VolumeContextPVCName, VolumeContextPVCNamespace} {
		if a := v.Annotations[k]; a != "" {
			if out.VolumeContext == nil {
				out.VolumeContext = map[string]string{}
			}
			out.VolumeContext[k] = a
		}
	}
	if out.CapacityBytes == 0 {
		out.CapacityBytes = v.Spec.SizeBytes
	}
	var t map[string]string
	if topo != nil {
		t = topo[v.Spec.StorageNode]
	} else {
		var n v1alpha1.NBDStorageNode
		if err := c.c.Get(ctx, client.ObjectKey{Name: v.Spec.StorageNode}, &n); err == nil {
			t = n.Status.Topology
		}
	}
	if len(t) > 0 {
		out.AccessibleTopology = []*csi.Topology{{Segments: maps.Clone(t)}}
	}
	return out
}

// agentError turns the status of a Failed volume into a gRPC error with
// the agent's code.
func agentError(v *v1alpha1.NBDVolume) error {
	code, ok := codeByName(v.Status.Code)
	if !ok || code == codes.OK {
		code = codes.Internal
	}
	msg := v.Status.Message
	if msg == "" {
		msg = "no message"
	}
	return status.Errorf(code, "storage agent on %s failed volume %s: %s", v.Spec.StorageNode, v.Name, msg)
}

// codeByName parses a gRPC code name, as codes.Code.String spells it
// (ResourceExhausted) or in the upper-case form (RESOURCE_EXHAUSTED).
func codeByName(name string) (codes.Code, bool) {
	if name == "" {
		return 0, false
	}
	for c := codes.OK; c <= codes.Unauthenticated; c++ {
		if c.String() == name {
			return c, true
		}
	}
	var c codes.Code
	if err := c.UnmarshalJSON([]byte(strconv.Quote(name))); err == nil {
		return c, true
	}
	return 0, false
}

func phaseOf(v *v1alpha1.NBDVolume) v1alpha1.VolumePhase {
	if v.Status.Phase == "" {
		return v1alpha1.VolumePending
	}
	return v.Status.Phase
}

func failureSuffix(v *v1alpha1.NBDVolume) string {
	if v.Status.Phase != v1alpha1.VolumeFailed {
		return ""
	}
	return fmt.Sprintf(" (%s: %s)", v.Status.Code, v.Status.Message)
}

// kubeErr wraps an API error with the driver sentinel that fits it.
func kubeErr(err error, what string) error {
	switch {
	case apierrors.IsNotFound(err):
		return fmt.Errorf("%w: %s: %v", ErrNotFound, what, err)
	case apierrors.IsConflict(err), apierrors.IsAlreadyExists(err):
		return fmt.Errorf("%w: %s: changed concurrently, retry: %v", ErrAborted, what, err)
	case apierrors.IsServerTimeout(err), apierrors.IsTimeout(err), apierrors.IsTooManyRequests(err),
		apierrors.IsServiceUnavailable(err):
		return fmt.Errorf("%w: %s: %v", ErrUnavailable, what, err)
	}
	return fmt.Errorf("%s: %w", what, err)
}

func publishedNodes(v *v1alpha1.NBDVolume) []string {
	var out []string
	for _, p := range v.Spec.Publications {
		out = append(out, p.NodeID)
	}
	return out
}

// storageAddresses are the IPs a node announces for storage traffic.
func storageAddresses(n *corev1.Node) []string {
	var out []string
	for _, a := range strings.Split(n.Annotations[access.AnnotationStorageAddresses], ",") {
		if a = strings.TrimSpace(a); a != "" {
			out = append(out, a)
		}
	}
	return out
}

// checkAttachLimit refuses a new publication to a node that already has
// as many volumes of this driver as its CSINode allows (the count the
// node plugin's NodeGetInfo reported to the kubelet). A node without a
// CSINode entry or a count has no limit.
func (c *Controller) checkAttachLimit(ctx context.Context, nodeID string) error {
	var cn storagev1.CSINode
	if err := c.c.Get(ctx, client.ObjectKey{Name: nodeID}, &cn); err != nil {
		if apierrors.IsNotFound(err) {
			return nil
		}
		return kubeErr(err, "reading CSINode "+nodeID)
	}
	limit := int32(-1)
	for _, d := range cn.Spec.Drivers {
		if d.Name == DriverName && d.Allocatable != nil && d.Allocatable.Count != nil {
			limit = *d.Allocatable.Count
		}
	}
	if limit < 0 {
		return nil
	}
	var vols v1alpha1.NBDVolumeList
	if err := c.c.List(ctx, &vols); err != nil {
		return kubeErr(err, "listing volumes")
	}
	n := int32(0)
	for _, v := range vols.Items {
		for _, p := range v.Spec.Publications {
			if p.NodeID == nodeID {
				n++
			}
		}
	}
	if n >= limit {
		return fmt.Errorf("%w: node %s has %d volumes of %s published, its limit", ErrExhausted, nodeID, n, DriverName)
	}
	return nil
}

// The provisioner's names of the claim a volume is made for
// (--extra-create-metadata).
const (
	paramPVCName      = reservedPrefix + "pvc/name"
	paramPVCNamespace = reservedPrefix + "pvc/namespace"
)

// claimAnnotations adds to annotations the claim CreateVolume's
// parameters name (VolumeContextPVCName, VolumeContextPVCNamespace), when
// they are valid names.
func claimAnnotations(params, annotations map[string]string) map[string]string {
	for k, p := range map[string]string{VolumeContextPVCName: paramPVCName, VolumeContextPVCNamespace: paramPVCNamespace} {
		if v := params[p]; v != "" && len(validation.IsDNS1123Subdomain(v)) == 0 {
			annotations[k] = v
		}
	}
	return annotations
}
