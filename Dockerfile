# syntax=docker/dockerfile:1
#
# One image holds the driver's commands:
#
#   /usr/local/bin/controller   CSI controller plugin (Deployment)
#   /usr/local/bin/node         CSI node plugin (DaemonSet on every node)
#   /usr/local/bin/nbd-server   storage agent with --cluster (DaemonSet on
#                               storage nodes), or a standalone NBD server
#   /usr/local/bin/mpnbdctl     the operator's view of the volumes (kubectl
#                               exec into any of the driver's pods, or copy out)
#
# One image rather than three: the binaries share almost all their code and
# the runtime tools, nodes pull and cache a single image, and the three
# components are always upgraded together. The manifests choose the
# component with the container's command; the image has no entrypoint.
#
# The default user is 65532 (non-root), what the controller runs as: it only
# talks to the API server and serves a socket in an emptyDir. The node plugin
# and the storage agent override it with runAsUser: 0 in their pod specs:
# the node plugin mounts filesystems, opens /dev/fuse and loop devices,
# talks to the kernel's nbd driver and sets MPTCP endpoints over netlink;
# the storage agent sets MPTCP signal endpoints (CAP_NET_ADMIN) and owns the
# volumes' backing files on the host. Both also run privileged.
#
# Build: docker buildx build --platform linux/amd64,linux/arm64 \
#          -t ghcr.io/mpnbd/mpnbd:VERSION --build-arg VERSION=VERSION .
# (hack/image.sh builds one architecture with buildah; hack/release.sh both,
# as one OCI index.) The Go stage runs on the building machine and
# cross-compiles for the target: only the runtime stage's apt-get runs on
# (or emulates) the target's architecture.

ARG GO_VERSION=1.26
ARG BASE_IMAGE=debian:bookworm-slim
ARG BUILDPLATFORM

# The runtime stage's base is named first: buildah (1.28, Debian 12) looks up
# every stage after a FROM --platform with that platform, so a base named
# after the build stage would be looked for as the building machine's.
FROM ${BASE_IMAGE} AS runtime

FROM --platform=$BUILDPLATFORM golang:${GO_VERSION}-bookworm AS build
ARG TARGETOS TARGETARCH
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
RUN CGO_ENABLED=0 GOOS=$TARGETOS GOARCH=$TARGETARCH go build -trimpath \
      -ldflags "-s -w -X github.com/mpnbd/mpnbd/pkg/buildinfo.Version=${VERSION}" \
      -o /out/ ./cmd/controller ./cmd/node ./cmd/nbd-server ./cmd/mpnbdctl

FROM runtime
# The node plugin formats, checks, grows and mounts filesystems through
# mount-utils, which runs mkfs.ext4/resize2fs (e2fsprogs; the node plugin
# also e2fsck and dumpe2fs to grow a restored ext4 before mounting it), mkfs.xfs/
# xfs_growfs (xfsprogs), blkid, mount and umount (util-linux, mount).
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates e2fsprogs xfsprogs util-linux mount \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/controller /out/node /out/nbd-server /out/mpnbdctl /usr/local/bin/
USER 65532:65532
