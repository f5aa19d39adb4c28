# Sourced by the scripts that build from k8s.io/kubernetes at a pinned
# version (hack/kube-binaries.sh, hack/kube-e2e.sh), in a build module of
# their own, never the driver's go.mod.

# kube_gomod VERSION prints the path of k8s.io/kubernetes@VERSION's go.mod
# (downloading it), or fails.
kube_gomod() {
  local gomod
  gomod=$(go mod download -json "k8s.io/kubernetes@$1" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
  [ -n "$gomod" ] || { echo "cannot download k8s.io/kubernetes@$1" >&2; return 1; }
  echo "$gomod"
}

# kube_replaces GOMOD VERSION prints the replace directives a consumer
# needs: kubernetes' own go.mod replaces its staging modules with local
# paths, and a consumer must pin each of them to the published version
# (v0.MINOR.PATCH for v1.MINOR.PATCH).
kube_replaces() {
  grep -E '^\s*k8s\.io/[a-z0-9-]+ => \./staging/' "$1" | awk -v v="v0.${2#v1.}" '{print "replace " $1 " => " $1 " " v}'
}

# kube_ldflags VERSION prints the linker flags that stamp VERSION into
# Kubernetes' programs.
kube_ldflags() {
  local minor=${1#v1.}
  echo "-s -w -X k8s.io/component-base/version.gitVersion=$1 -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=${minor%%.*}"
}
