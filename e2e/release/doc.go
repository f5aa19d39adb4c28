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

// Package release tests `make release` (hack/release.sh) as a maintainer
// runs it on a fresh clone: both architectures' images in one OCI index,
// their SBOMs, the chart, and the signatures, all checked offline by
// hack/verify-release.sh, which is shown to refuse a changed file and a
// changed list of digests. The arm64 image is unpacked and its programs
// read: each must be an arm64 ELF whose Go build information says
// GOARCH=arm64 and the release's version, and each module it links must be
// in that image's SBOM.
//
// It needs root, buildah, debootstrap, qemu-user-static (the arm64 image's
// runtime stage runs emulated) and gpg: hack/install-deps.sh installs them.
// Without them it skips, unless MPNBD_RELEASE_REQUIRE=1 (hack/test.sh sets
// it as root), which makes a missing prerequisite a failure. A cold run
// (both Debian bases made, arm64's emulated) takes about 8 minutes on 2
// cores; a warm one about 3.
package release
