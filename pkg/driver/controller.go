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
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/access"
)

// Controller defaults.
const (
	DefaultWaitTimeout  = 60 * time.Second
	DefaultStaleAfter   = 2 * time.Minute
	DefaultVolumeSize   = int64(1) << 30
	DefaultPollInterval = 200 * time.Millisecond
	// DefaultResyncInterval is ControllerConfig.ResyncInterval's default.
	DefaultResyncInterval = 5 * time.Second
)

// ControllerConfig configures a Controller.
type ControllerConfig struct {
	// Client reads and writes NBDVolumes, NBDStorageNodes, publication
	// Secrets and (read only) Nodes.
	Client client.Client
	// Namespace is where publication Secrets live.
	Namespace string
	Logger    *slog.Logger
	// WaitTimeout bounds how long a call waits for the storage agent
	// (default 60s); the request's deadline bounds it too.
	WaitTimeout time.Duration
	// StaleAfter: a storage node whose heartbeat is older is not picked
	// for new volumes nor counted by GetCapacity (default 2m).
	StaleAfter time.Duration
	// DefaultSizeBytes is the size of a volume whose capacity range sets
	// neither bound (default 1 GiB).
	DefaultSizeBytes int64
	// DefaultEncryption is the encryption of a volume whose StorageClass
	// names none (default none). It lives here, not in the classes a
	// chart renders, so that a class stays what it was when the default
	// changes: StorageClass parameters cannot change.
	DefaultEncryption v1alpha1.Encryption
	// PollInterval is how often a wait re-reads the volume (default 200ms)
	// when Changes is nil.
	PollInterval time.Duration
	// Changes, if not nil, wakes a wait when its volume or snapshot
	// changes (a watch feeds it); the wait then re-reads only on a change
	// and every ResyncInterval, instead of every PollInterval.
	Changes *Changes
	// ResyncInterval bounds the time between reads of a wait fed by
	// Changes, in case an event is lost (default 5s).
	ResyncInterval time.Duration
}

// Controller serves the CSI Controller service. It never touches data:
// every RPC becomes a change of an NBDVolume (or of a publication
// Secret) and a wait until the volume's storage agent reports the change
// in effect (status.observedGeneration).
//
// Its RBAC: nbdvolumes get, list, watch, create, update, delete;
// nbdsnapshots get, list, watch, create, delete; nbdstoragenodes get, list; nodes get; secrets in Namespace get, create, update, delete,
// deletecollection; for Failover, leases in Namespace list, nbdvolumes/status and nbdstoragenodes/status patch, events create and patch.
//
// A wait for the agent that runs out (WaitTimeout or the request's
// deadline) is DeadlineExceeded: the change stays requested and a retry of
// the same call picks it up.
type Controller struct {
	csi.UnimplementedControllerServer

	cfg ControllerConfig
	c   client.Client
	log *slog.Logger

	// inFlight holds the volume IDs of running calls, for the per-volume
	// try-lock.
	inFlight sync.Map
}

var _ csi.ControllerServer = (*Controller)(nil)

// NewController returns a controller service.
func NewController(cfg ControllerConfig) (*Controller, error) {
	if cfg.Client == nil {
		return nil, fmt.Errorf("%w: controller: a Kubernetes client is required", ErrInvalidArgument)
	}
	if cfg.Namespace == "" {
		return nil, fmt.Errorf("%w: controller: the namespace of publication Secrets is required", ErrInvalidArgument)
	}
	if cfg.WaitTimeout < 0 || cfg.StaleAfter < 0 || cfg.DefaultSizeBytes < 0 || cfg.PollInterval < 0 || cfg.ResyncInterval < 0 {
		return nil, fmt.Errorf("%w: controller: negative timeout, interval or size", ErrInvalidArgument)
	}
	if cfg.WaitTimeout == 0 {
		cfg.WaitTimeout = DefaultWaitTimeout
	}
	if cfg.StaleAfter == 0 {
		cfg.StaleAfter = DefaultStaleAfter
	}
	if cfg.DefaultSizeBytes == 0 {
		cfg.DefaultSizeBytes = DefaultVolumeSize
	}
	switch cfg.DefaultEncryption {
	case "":
		cfg.DefaultEncryption = v1alpha1.EncryptionNone
	case v1alpha1.EncryptionNone, v1alpha1.EncryptionPreferred, v1alpha1.EncryptionRequired:
	default:
		return nil, fmt.Errorf("%w: controller: default encryption %q: want none, preferred or required", ErrInvalidArgument, cfg.DefaultEncryption)
	}
	if cfg.PollInterval == 0 {
		cfg.PollInterval = DefaultPollInterval
	}
	if cfg.ResyncInterval == 0 {
		cfg.ResyncInterval = DefaultResyncInterval
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	return &Controller{cfg: cfg, c: cfg.Client, log: log}, nil
}

// lock takes the try-lock of a volume; ok is false when a call holds it.
func (c *Controller) lock(id string) (unlock func(), ok bool) {
	if _, busy := c.inFlight.LoadOrStore(id, struct{}{}); busy {
		return nil, false
	}
	return func() { c.inFlight.Delete(id) }, true
}

func (c *Controller) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	var caps []*csi.ControllerServiceCapability
	for _, t := range []csi.ControllerServiceCapability_RPC_Type{
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
		csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME,
		csi.ControllerServiceCapability_RPC_LIST_VOLUMES,
		csi.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES,
		csi.ControllerServiceCapability_RPC_GET_CAPACITY,
		csi.ControllerServiceCapability_RPC_EXPAND_VOLUME,
		csi.ControllerServiceCapability_RPC_PUBLISH_READONLY,
		csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT,
		csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS,
		csi.ControllerServiceCapability_RPC_CLONE_VOLUME,
	} {
		caps = append(caps, &csi.ControllerServiceCapability{Type: &csi.ControllerServiceCapability_Rpc{
			Rpc: &csi.ControllerServiceCapability_RPC{Type: t},
		}})
	}
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: caps}, nil
}

func (c *Controller) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	v, err := c.createVolume(ctx, req)
	if err != nil {
		return nil, toStatus(err)
	}
	return &csi.CreateVolumeResponse{Volume: v}, nil
}

func (c *Controller) createVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.Volume, error) {
	name := req.GetName()
	if name == "" {
		return nil, invalid("name is required")
	}
	accessType, multiNode, err := capabilitiesAccess(req.GetVolumeCapabilities())
	if err != nil {
		return nil, err
	}
	classParams, err := c.withDefaults(req.GetParameters())
	if err != nil {
		return nil, err
	}
	p, err := ParseParams(classParams)
	if err != nil {
		return nil, err
	}
	size, err := volumeSize(req.GetCapacityRange(), c.cfg.DefaultSizeBytes, sizeUnit(p))
	if err != nil {
		return nil, err
	}
	// A volume made from a snapshot or a volume lands on the storage node
	// that holds its source, at least as large as the source: a smaller
	// size asked is raised to the source's (an xfs source may hold more
	// than its claim asked), as CreateVolume may return more than
	// required_bytes; a limit below the source's size is OutOfRange.
	var source *v1alpha1.ContentSource
	var sourceNode string
	if cs := req.GetVolumeContentSource(); cs != nil {
		var srcSize int64
		if source, sourceNode, srcSize, err = c.contentSource(ctx, cs); err != nil {
			return nil, err
		}
		r := req.GetCapacityRange()
		if r.GetLimitBytes() > 0 && r.GetLimitBytes() < srcSize {
			return nil, fmt.Errorf("%w: the source holds %d bytes, more than the capacity range's limit_bytes %d allows",
				ErrOutOfRange, srcSize, r.GetLimitBytes())
		}
		size = max(size, srcSize)
	}
	if accessType == v1alpha1.AccessFilesystem {
		fsType := volumeFSType(req.GetVolumeCapabilities(), p)
		if size, err = fitFSMinimum(size, req.GetCapacityRange(), sizeUnit(p), fsType); err != nil {
			return nil, err
		}
	}
	params := storedParams(classParams)
	id := VolumeIDForName(name)

	unlock, ok := c.lock(id)
	if !ok {
		return nil, aborted("CreateVolume", id)
	}
	defer unlock()

	var v v1alpha1.NBDVolume
	err = c.c.Get(ctx, client.ObjectKey{Name: id}, &v)
	switch {
	case err == nil:
		if err := sameVolume(&v, name, req.GetCapacityRange(), accessType, multiNode, params); err != nil {
			return nil, err
		}
		if !sameSource(v.Spec.ContentSource, source) {
			return nil, fmt.Errorf("%w: volume %s exists with another content source", ErrAlreadyExists, id)
		}
	case apierrors.IsNotFound(err):
		nodeName := sourceNode
		var replicaNodes []string
		if nodeName == "" {
			nodes, err := c.pickStorageNodes(ctx, p, req.GetAccessibilityRequirements(), size)
			if err != nil {
				return nil, err
			}
			nodeName = nodes[0].Name
			for _, n := range nodes[1:] {
				replicaNodes = append(replicaNodes, n.Name)
			}
		}
		v = v1alpha1.NBDVolume{
			ObjectMeta: metav1.ObjectMeta{
				Name:        id,
				Finalizers:  []string{v1alpha1.Finalizer},
				Annotations: claimAnnotations(req.GetParameters(), map[string]string{access.AnnotationCSIName: name}),
			},
			Spec: v1alpha1.NBDVolumeSpec{
				SizeBytes:     size,
				StorageNode:   nodeName,
				Encryption:    p.Encryption,
				AccessType:    accessType,
				MultiNode:     multiNode,
				Parameters:    params,
				ContentSource: source,
			},
		}
		if len(replicaNodes) > 0 {
			v.Spec.Replicas = int32(1 + len(replicaNodes))
			v.Spec.ReplicaNodes = replicaNodes
			// Each replica's agent watches the volumes labelled for
			// its node.
			v.Labels = map[string]string{}
			for _, n := range replicaNodes {
				v.Labels[v1alpha1.ReplicaLabel(n)] = ""
			}
		}
		if err := c.c.Create(ctx, &v); err != nil {
			return nil, kubeErr(err, "creating NBDVolume "+id)
		}
		c.log.Info("volume created", "volume_id", id, "csi_name", name, "storage_node", nodeName,
			"size_bytes", size, "access_type", accessType, "multi_node", multiNode)
	default:
		return nil, kubeErr(err, "reading NBDVolume "+id)
	}

	w, err := c.waitVolume(ctx, id, "create it", func(v *v1alpha1.NBDVolume) (bool, error) {
		if v == nil || v.DeletionTimestamp != nil {
			return false, fmt.Errorf("%w: volume %s was deleted while being created; retry", ErrAborted, id)
		}
		if v.Status.Phase == v1alpha1.VolumeFailed {
			return false, errAgentFailed
		}
		return applied(v, v.Generation), nil
	})
	if errors.Is(err, errAgentFailed) {
		// Delete the failed volume so that a retry may pick another
		// storage node; the finalizer keeps it until its agent cleaned up.
		return nil, c.dropFailed(ctx, w)
	}
	if err != nil {
		return nil, err
	}
	return c.csiVolume(ctx, w, nil), nil
}

// dropFailed deletes a volume its agent could not create and returns the
// agent's error.
func (c *Controller) dropFailed(ctx context.Context, v *v1alpha1.NBDVolume) error {
	failure := agentError(v)
	c.log.Warn("storage agent failed to create the volume; deleting it", "volume_id", v.Name,
		"storage_node", v.Spec.StorageNode, "code", v.Status.Code, "message", v.Status.Message)
	if err := c.c.Delete(ctx, v, client.Preconditions{UID: &v.UID}); err != nil && !apierrors.IsNotFound(err) {
		c.log.Error("deleting a failed volume", "volume_id", v.Name, "error", err)
	}
	return failure
}

// sameSource reports whether two content sources are the same (nil for
// none).
func sameSource(a, b *v1alpha1.ContentSource) bool {
	if a == nil || b == nil {
		return a == b
	}
	return *a == *b
}

// sameVolume checks that an existing volume is what a repeated
// CreateVolume asks for.
func sameVolume(v *v1alpha1.NBDVolume, name string, r *csi.CapacityRange, accessType v1alpha1.AccessType, multiNode bool, params map[string]string) error {
	id := v.Name
	if got := v.Annotations[access.AnnotationCSIName]; got != name {
		return fmt.Errorf("%w: volume ID %s belongs to CSI name %q, not %q", ErrAlreadyExists, id, got, name)
	}
	if v.DeletionTimestamp != nil {
		return fmt.Errorf("%w: volume %s is being deleted; retry once it is gone", ErrAborted, id)
	}
	size := max(v.Spec.SizeBytes, v.Status.CapacityBytes)
	if size < r.GetRequiredBytes() || (r.GetLimitBytes() > 0 && size > r.GetLimitBytes()) {
		return fmt.Errorf("%w: volume %s exists with %d bytes, outside the requested range (required %d, limit %d)",
			ErrAlreadyExists, id, size, r.GetRequiredBytes(), r.GetLimitBytes())
	}
	if v.Spec.AccessType != accessType {
		return fmt.Errorf("%w: volume %s exists with access type %s, not %s", ErrAlreadyExists, id, v.Spec.AccessType, accessType)
	}
	if v.Spec.MultiNode != multiNode {
		return fmt.Errorf("%w: volume %s exists with multi-node access %t, not %t", ErrAlreadyExists, id, v.Spec.MultiNode, multiNode)
	}
	if !maps.Equal(v.Spec.Parameters, params) {
		return fmt.Errorf("%w: volume %s exists with other parameters (%s)", ErrAlreadyExists, id, formatParams(v.Spec.Parameters))
	}
	return nil
}

func (c *Controller) DeleteVolume(ctx context.Context, req *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	if err := c.deleteVolume(ctx, req.GetVolumeId()); err != nil {
		return nil, toStatus(err)
	}
	return &csi.DeleteVolumeResponse{}, nil
}

// deleteVolume deletes a volume and waits until its storage agent removed
// the backing store (the finalizer). The object is marked with
// v1alpha1.DeleteDataAnnotation first: the agent deletes the backing file
// only of a volume so marked (one deleted by hand keeps its data). An
// object someone else deleted already is marked too, so that its data
// goes if its agent has not released it yet. When the agent does not
// finish in time the call fails with DeadlineExceeded, so the CO retries;
// a retry after the volume is gone succeeds.
func (c *Controller) deleteVolume(ctx context.Context, id string) error {
	if id == "" {
		return invalid("volume_id is required")
	}
	if !validVolumeID(id) {
		return nil // no volume can have this ID
	}
	unlock, ok := c.lock(id)
	if !ok {
		return aborted("DeleteVolume", id)
	}
	defer unlock()

	var v v1alpha1.NBDVolume
	if err := c.c.Get(ctx, client.ObjectKey{Name: id}, &v); err != nil {
		if apierrors.IsNotFound(err) {
			return c.deleteSecrets(ctx, id, "")
		}
		return kubeErr(err, "reading NBDVolume "+id)
	}
	if v.DeletionTimestamp == nil {
		if nodes := publishedNodes(&v); len(nodes) > 0 {
			return fmt.Errorf("%w: volume %s is still published to %s", ErrPrecondition, id, strings.Join(nodes, ", "))
		}
	}
	gone, err := c.markDeleteData(ctx, &v)
	if err != nil {
		return err
	}
	if !gone && v.DeletionTimestamp == nil {
		if err := c.c.Delete(ctx, &v, client.Preconditions{UID: &v.UID}); err != nil && !apierrors.IsNotFound(err) {
			return kubeErr(err, "deleting NBDVolume "+id)
		}
		c.log.Info("volume deleted", "volume_id", id, "storage_node", v.Spec.StorageNode)
	}
	if err := c.deleteSecrets(ctx, id, ""); err != nil {
		return err
	}
	_, err = c.waitVolume(ctx, id, "remove its backing store", func(v *v1alpha1.NBDVolume) (bool, error) {
		return v == nil, nil
	})
	return err
}

func (c *Controller) ControllerPublishVolume(ctx context.Context, req *csi.ControllerPublishVolumeRequest) (*csi.ControllerPublishVolumeResponse, error) {
	pc, err := c.publish(ctx, req)
	if err != nil {
		return nil, toStatus(err)
	}
	return &csi.ControllerPublishVolumeResponse{PublishContext: pc}, nil
}

func (c *Controller) publish(ctx context.Context, req *csi.ControllerPublishVolumeRequest) (map[string]string, error) {
	id, nodeID, vc := req.GetVolumeId(), req.GetNodeId(), req.GetVolumeCapability()
	switch {
	case id == "":
		return nil, invalid("volume_id is required")
	case nodeID == "":
		return nil, invalid("node_id is required")
	}
	if err := checkCapability(vc); err != nil {
		return nil, err
	}
	if !validVolumeID(id) {
		return nil, fmt.Errorf("%w: volume %q does not exist", ErrNotFound, id)
	}
	unlock, ok := c.lock(id)
	if !ok {
		return nil, aborted("ControllerPublishVolume", id)
	}
	defer unlock()

	v, err := c.getVolume(ctx, id)
	if err != nil {
		return nil, err
	}
	if why := capabilityMismatch(v, vc); why != "" {
		return nil, fmt.Errorf("%w: %s", ErrInvalidArgument, why)
	}
	var node corev1.Node
	if err := c.c.Get(ctx, client.ObjectKey{Name: nodeID}, &node); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, fmt.Errorf("%w: node %q does not exist", ErrNotFound, nodeID)
		}
		return nil, kubeErr(err, "reading Node "+nodeID)
	}
	readOnly := req.GetReadonly() || readOnlyMode(vc)

	// check decides, on a fresh copy of the volume, whether the
	// publication is new (add is true) or already there.
	check := func(v *v1alpha1.NBDVolume) (add bool, err error) {
		if v.DeletionTimestamp != nil {
			return false, fmt.Errorf("%w: volume %s is being deleted", ErrNotFound, id)
		}
		for _, p := range v.Spec.Publications {
			if p.NodeID == nodeID {
				if p.ReadOnly != readOnly {
					return false, fmt.Errorf("%w: volume %s is already published to node %s with readonly=%t",
						ErrAlreadyExists, id, nodeID, p.ReadOnly)
				}
				return false, nil
			}
		}
		if !v.Spec.MultiNode && len(v.Spec.Publications) > 0 {
			return false, fmt.Errorf("%w: volume %s is published to node %s and is single-node",
				ErrPrecondition, id, v.Spec.Publications[0].NodeID)
		}
		if v.Status.Phase != v1alpha1.VolumeAvailable {
			return false, fmt.Errorf("%w: volume %s is %s, not %s%s", ErrUnavailable, id,
				phaseOf(v), v1alpha1.VolumeAvailable, failureSuffix(v))
		}
		return true, nil
	}
	add, err := check(v)
	if err != nil {
		return nil, err
	}
	if add {
		if err := c.checkAttachLimit(ctx, nodeID); err != nil {
			return nil, err
		}
	}
	// A volume without encryption is opened with the node's own token,
	// whose hash (and the addresses it is good from) the node announced
	// on its Node: the token is handed to no one, so no credential
	// reaches the VolumeAttachment. An encrypted volume needs neither:
	// the node shows its node certificate.
	token, secretRef, hash := "", "", ""
	addrs := storageAddresses(&node)
	i := slices.IndexFunc(v.Spec.Publications, func(p v1alpha1.Publication) bool { return p.NodeID == nodeID })
	switch {
	case v.Spec.Encryption == v1alpha1.EncryptionRequired:
	case !add && i >= 0 && v.Spec.Publications[i].SecretRef != "":
		// Made by an earlier controller: its node was given a token of
		// the publication's own Secret in the export name, and its data
		// path keeps redialing with it. It stays as it is until the
		// volume is unpublished from the node.
		if token, err = c.ensureSecret(ctx, v, nodeID); err != nil {
			return nil, err
		}
		secretRef, hash = access.SecretName(id, nodeID), access.TokenHash(token)
	default:
		if hash = node.Annotations[access.AnnotationTokenSHA256]; !access.ValidTokenHash(hash) {
			return nil, fmt.Errorf("%w: node %s has not announced its token (annotation %s, set by the node plugin)",
				ErrUnavailable, nodeID, access.AnnotationTokenSHA256)
		}
		if len(addrs) == 0 {
			return nil, fmt.Errorf("%w: node %s has not announced its storage addresses (annotation %s, set by the node plugin): its token would be good from anywhere",
				ErrUnavailable, nodeID, access.AnnotationStorageAddresses)
		}
	}
	if add {
		pub := v1alpha1.Publication{
			NodeID:      nodeID,
			TokenSHA256: hash,
			Addresses:   addrs,
			ReadOnly:    readOnly,
		}
		v, err = c.updateVolume(ctx, id, func(v *v1alpha1.NBDVolume) (bool, error) {
			add, err := check(v)
			if add {
				// The generation before this update, which raises it:
				// greater than the epoch of every earlier publication of
				// the volume, each made by an update that raised it.
				p := pub
				p.Epoch = max(v.Generation, 1)
				v.Spec.Publications = append(v.Spec.Publications, p)
			}
			return add, err
		})
		if err != nil {
			return nil, err
		}
		c.log.Info("volume published", "volume_id", id, "node_id", nodeID, "read_only", readOnly,
			"node_addresses", strings.Join(pub.Addresses, ","))
	} else if i >= 0 && (v.Spec.Publications[i].TokenSHA256 != hash || v.Spec.Publications[i].SecretRef != secretRef) {
		// Made before publications carried the hash, its Secret was
		// renewed, or the node has a new token: the storage agent checks
		// the token against this.
		if v, err = c.setTokenHash(ctx, id, nodeID, secretRef, hash); err != nil {
			return nil, err
		}
	}
	w, err := c.waitApplied(ctx, v, "grant node "+nodeID+" access")
	if err != nil {
		return nil, err
	}
	return c.publishContext(ctx, w, nodeID, token)
}

func (c *Controller) ControllerUnpublishVolume(ctx context.Context, req *csi.ControllerUnpublishVolumeRequest) (*csi.ControllerUnpublishVolumeResponse, error) {
	if err := c.unpublish(ctx, req.GetVolumeId(), req.GetNodeId()); err != nil {
		return nil, toStatus(err)
	}
	return &csi.ControllerUnpublishVolumeResponse{}, nil
}

// unpublish removes the publication of a volume to nodeID (to every node
// when nodeID is empty), waits until the storage agent closed the node's
// connections, then deletes the publication's Secret.
func (c *Controller) unpublish(ctx context.Context, id, nodeID string) error {
	if id == "" {
		return invalid("volume_id is required")
	}
	if !validVolumeID(id) {
		return nil
	}
	unlock, ok := c.lock(id)
	if !ok {
		return aborted("ControllerUnpublishVolume", id)
	}
	defer unlock()

	var v v1alpha1.NBDVolume
	if err := c.c.Get(ctx, client.ObjectKey{Name: id}, &v); err != nil {
		if apierrors.IsNotFound(err) {
			return c.deleteSecrets(ctx, id, nodeID)
		}
		return kubeErr(err, "reading NBDVolume "+id)
	}
	if v.DeletionTimestamp == nil {
		var removed []string
		w, err := c.updateVolume(ctx, id, func(v *v1alpha1.NBDVolume) (bool, error) {
			removed = removed[:0]
			v.Spec.Publications = slices.DeleteFunc(v.Spec.Publications, func(p v1alpha1.Publication) bool {
				if nodeID == "" || p.NodeID == nodeID {
					removed = append(removed, p.NodeID)
					return true
				}
				return false
			})
			return len(removed) > 0, nil
		})
		if err != nil {
			return err
		}
		if len(removed) > 0 {
			c.log.Info("volume unpublished", "volume_id", id, "node_ids", strings.Join(removed, ","))
		}
		// Wait even when nothing was removed: an earlier call may have
		// removed the publication and timed out before the agent closed
		// the node's connections.
		// A storage node lost for good has no agent to wait for.
		released := false
		if _, err := c.waitVolume(ctx, id, "revoke access", func(v *v1alpha1.NBDVolume) (bool, error) {
			if v != nil && v.DeletionTimestamp == nil && v.Status.ObservedGeneration < w.Generation && storageNodeReleased(v) {
				released = true
				return true, nil
			}
			return v == nil || v.DeletionTimestamp != nil || v.Status.ObservedGeneration >= w.Generation, nil
		}); err != nil {
			return err
		}
		if released {
			c.log.Warn("volume unpublished without its storage agent: its storage node is lost for good", "volume_id", id, "storage_node", w.Spec.StorageNode)
		}
		// A node removes its status.attachments entry at unstage; one
		// that went away (the usual reason for an unpublish without an
		// unstage) cannot. Best effort: the entry only informs.
		nodes := removed
		if nodeID != "" {
			nodes = []string{nodeID}
		}
		for _, n := range nodes {
			if err := (&KubeAttachmentStatus{Client: c.c, NodeID: n}).Remove(ctx, id); err != nil {
				c.log.Warn("remove the unpublished node's status entry", "volume_id", id, "node_id", n, "error", err)
			}
		}
	}
	return c.deleteSecrets(ctx, id, nodeID)
}

func (c *Controller) ValidateVolumeCapabilities(ctx context.Context, req *csi.ValidateVolumeCapabilitiesRequest) (*csi.ValidateVolumeCapabilitiesResponse, error) {
	resp, err := c.validate(ctx, req)
	if err != nil {
		return nil, toStatus(err)
	}
	return resp, nil
}

// validate takes no lock: it only reads.
func (c *Controller) validate(ctx context.Context, req *csi.ValidateVolumeCapabilitiesRequest) (*csi.ValidateVolumeCapabilitiesResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, invalid("volume_id is required")
	}
	if len(req.GetVolumeCapabilities()) == 0 {
		return nil, invalid("volume_capabilities are required")
	}
	if !validVolumeID(id) {
		return nil, fmt.Errorf("%w: volume %q does not exist", ErrNotFound, id)
	}
	v, err := c.getVolume(ctx, id)
	if err != nil {
		return nil, err
	}
	unconfirmed := func(msg string) (*csi.ValidateVolumeCapabilitiesResponse, error) {
		return &csi.ValidateVolumeCapabilitiesResponse{Message: msg}, nil
	}
	for _, vc := range req.GetVolumeCapabilities() {
		if err := checkCapability(vc); err != nil {
			return unconfirmed(status.Convert(err).Message())
		}
		if why := capabilityMismatch(v, vc); why != "" {
			return unconfirmed(why)
		}
	}
	if len(req.GetParameters()) > 0 {
		classParams, err := c.withDefaults(req.GetParameters())
		if err == nil {
			_, err = ParseParams(classParams)
		}
		if err != nil {
			return unconfirmed(err.Error())
		}
		if !maps.Equal(storedParams(classParams), v.Spec.Parameters) {
			return unconfirmed(fmt.Sprintf("volume %s was created with other parameters (%s)", id, formatParams(v.Spec.Parameters)))
		}
	}
	return &csi.ValidateVolumeCapabilitiesResponse{Confirmed: &csi.ValidateVolumeCapabilitiesResponse_Confirmed{
		VolumeContext:      req.GetVolumeContext(),
		VolumeCapabilities: req.GetVolumeCapabilities(),
		Parameters:         req.GetParameters(),
	}}, nil
}

// listTokenPrefix starts every ListVolumes token; what follows is the ID
// of the first volume of the next page. A token stays good when that
// volume is deleted: the next page starts at the first ID after it.
const listTokenPrefix = "after:"

func (c *Controller) ListVolumes(ctx context.Context, req *csi.ListVolumesRequest) (*csi.ListVolumesResponse, error) {
	resp, err := c.listVolumes(ctx, req)
	if err != nil {
		return nil, toStatus(err)
	}
	return resp, nil
}

// listVolumes takes no lock: it only reads. Volumes being deleted are
// left out.
func (c *Controller) listVolumes(ctx context.Context, req *csi.ListVolumesRequest) (*csi.ListVolumesResponse, error) {
	start, err := listStart(req.GetMaxEntries(), req.GetStartingToken(), "ListVolumes")
	if err != nil {
		return nil, err
	}
	var list v1alpha1.NBDVolumeList
	if err := c.c.List(ctx, &list); err != nil {
		return nil, kubeErr(err, "listing NBDVolumes")
	}
	vols := slices.DeleteFunc(list.Items, func(v v1alpha1.NBDVolume) bool {
		return v.DeletionTimestamp != nil || v.Name < start
	})
	slices.SortFunc(vols, func(a, b v1alpha1.NBDVolume) int { return strings.Compare(a.Name, b.Name) })
	topo, err := c.topologies(ctx)
	if err != nil {
		return nil, err
	}
	vols, next := listPage(vols, req.GetMaxEntries(), func(v v1alpha1.NBDVolume) string { return v.Name })
	resp := &csi.ListVolumesResponse{NextToken: next}
	for i := range vols {
		v := &vols[i]
		resp.Entries = append(resp.Entries, &csi.ListVolumesResponse_Entry{
			Volume: c.csiVolume(ctx, v, topo),
			Status: &csi.ListVolumesResponse_VolumeStatus{PublishedNodeIds: publishedNodes(v)},
		})
	}
	return resp, nil
}

// listStart checks a List call's paging and returns the ID its page
// starts at ("" for the first page).
func listStart(maxEntries int32, token, rpc string) (string, error) {
	if maxEntries < 0 {
		return "", invalid("max_entries must not be negative")
	}
	if token == "" {
		return "", nil
	}
	id, ok := strings.CutPrefix(token, listTokenPrefix)
	if !ok || !validVolumeID(id) {
		return "", fmt.Errorf("%w: starting_token %q was not returned by %s", ErrAborted, token, rpc)
	}
	return id, nil
}

// listPage cuts items (sorted by ID) to maxEntries (0: all) and returns
// the token of the next page, if any.
func listPage[T any](items []T, maxEntries int32, id func(T) string) ([]T, string) {
	if maxEntries <= 0 || len(items) <= int(maxEntries) {
		return items, ""
	}
	return items[:maxEntries], listTokenPrefix + id(items[maxEntries])
}

func (c *Controller) GetCapacity(ctx context.Context, req *csi.GetCapacityRequest) (*csi.GetCapacityResponse, error) {
	resp, err := c.getCapacity(ctx, req)
	if err != nil {
		return nil, toStatus(err)
	}
	return resp, nil
}

// getCapacity sums what the fresh storage nodes matching the parameters
// and the topology may still take.
func (c *Controller) getCapacity(ctx context.Context, req *csi.GetCapacityRequest) (*csi.GetCapacityResponse, error) {
	for _, vc := range req.GetVolumeCapabilities() {
		if err := checkCapability(vc); err != nil {
			return nil, err
		}
	}
	p, err := ParseParams(req.GetParameters())
	if err != nil {
		return nil, err
	}
	nodes, err := c.storageNodes(ctx)
	if err != nil {
		return nil, err
	}
	var total, largest int64
	for i := range nodes {
		n := &nodes[i]
		if !paramsMatch(n, p) || !c.fresh(n) || !n.Schedulable() {
			continue
		}
		if t := req.GetAccessibleTopology(); t != nil && !topologyMatches(n.Status.Topology, t.GetSegments()) {
			continue
		}
		a := max(n.Status.AvailableBytes, 0)
		total += a
		largest = max(largest, a)
	}
	return &csi.GetCapacityResponse{AvailableCapacity: total, MaximumVolumeSize: wrapperspb.Int64(largest)}, nil
}

func (c *Controller) ControllerExpandVolume(ctx context.Context, req *csi.ControllerExpandVolumeRequest) (*csi.ControllerExpandVolumeResponse, error) {
	size, err := c.expand(ctx, req)
	if err != nil {
		return nil, toStatus(err)
	}
	return &csi.ControllerExpandVolumeResponse{CapacityBytes: size, NodeExpansionRequired: true}, nil
}

// expand grows spec.sizeBytes and waits until the agent grew the backing
// store. The node still has to resize its device (and file system).
func (c *Controller) expand(ctx context.Context, req *csi.ControllerExpandVolumeRequest) (int64, error) {
	id, r := req.GetVolumeId(), req.GetCapacityRange()
	if id == "" {
		return 0, invalid("volume_id is required")
	}
	if r == nil {
		return 0, invalid("capacity_range is required")
	}
	if req.GetVolumeCapability() != nil {
		if err := checkCapability(req.GetVolumeCapability()); err != nil {
			return 0, err
		}
	}
	if !validVolumeID(id) {
		return 0, fmt.Errorf("%w: volume %q does not exist", ErrNotFound, id)
	}
	unlock, ok := c.lock(id)
	if !ok {
		return 0, aborted("ControllerExpandVolume", id)
	}
	defer unlock()

	v, err := c.getVolume(ctx, id)
	if err != nil {
		return 0, err
	}
	if v.DeletionTimestamp != nil {
		return 0, fmt.Errorf("%w: volume %s is being deleted", ErrNotFound, id)
	}
	p, err := ParseParams(v.Spec.Parameters)
	if err != nil {
		p = Params{} // validated when created; fall back on the default unit
	}
	want, err := expandSize(r, sizeUnit(p))
	if err != nil {
		return 0, err
	}
	if want > v.Spec.SizeBytes {
		v, err = c.updateVolume(ctx, id, func(v *v1alpha1.NBDVolume) (bool, error) {
			if v.DeletionTimestamp != nil {
				return false, fmt.Errorf("%w: volume %s is being deleted", ErrNotFound, id)
			}
			if want <= v.Spec.SizeBytes {
				return false, nil
			}
			v.Spec.SizeBytes = want
			return true, nil
		})
		if err != nil {
			return 0, err
		}
		c.log.Info("volume expanding", "volume_id", id, "size_bytes", want)
	}
	w, err := c.waitApplied(ctx, v, "grow it to "+strconv.FormatInt(v.Spec.SizeBytes, 10)+" bytes")
	if err != nil {
		return 0, err
	}
	if w.Status.CapacityBytes < w.Spec.SizeBytes {
		// The agent could not grow it (it keeps serving the old size).
		if w.Status.Code != "" {
			return 0, agentError(w)
		}
		return 0, fmt.Errorf("%w: volume %s has %d bytes, %d requested", ErrUnavailable, id, w.Status.CapacityBytes, w.Spec.SizeBytes)
	}
	return w.Status.CapacityBytes, nil
}
