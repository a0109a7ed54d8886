#!/usr/bin/env bash
# The container engine and images the container tests (tests/containers) run, on a machine that reaches
# Debian's and Python's package registries but no container registry. Each step checks first and does
# nothing when what it makes is already there, so `make test` runs it every time.
#
# usage: tools/docker-setup.sh [engine|images|all]    (default: all)
#   engine  Docker Engine (Debian's docker.io) and Compose >= 2.26 as a CLI plugin (Debian 13's
#           docker-compose package, fetched with apt-get download from its own sources list: the
#           machine's sources stay as they are); starts dockerd when none answers
#   images  the local base (debootstrap, docker import), the draftline image from the project's
#           Dockerfile on that base with a CPU torch, and Redis and Prometheus from Debian's packages
#
# An image is rebuilt only when its inputs change: each carries the hash of its inputs as the label
# org.draftline.inputs, and a build whose hash matches the tagged image's is skipped.
#
# Environment (defaults in brackets):
#   DRAFTLINE_BASE_TAG [draftline-base:bookworm]   DRAFTLINE_IMAGE [draftline:cpu]
#   DRAFTLINE_REDIS_IMAGE [draftline-redis:bookworm]   DRAFTLINE_PROMETHEUS_IMAGE [draftline-prometheus:bookworm]
#   DEBIAN_MIRROR [http://deb.debian.org/debian]   the mirror debootstrap and the trixie sources list use
#   DRAFTLINE_TORCH_WHEELS   a folder holding torch-<version>+cpu-*.whl [pip's find-links, /opt/wheels];
#                            without one the image takes torch from PyTorch's CPU index
#   DRAFTLINE_WHEEL_PORT [8791]   loopback port that folder is served on while the image builds
#   DRAFTLINE_CA_BUNDLE [/etc/ssl/certs/ca-certificates.crt]   the CA bundle pip trusts in the build
#   DRAFTLINE_DOCKERD_LOG [/var/log/draftline-dockerd.log]
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
BASE_TAG=${DRAFTLINE_BASE_TAG:-draftline-base:bookworm}
DRAFTLINE_TAG=${DRAFTLINE_IMAGE:-draftline:cpu}
REDIS_TAG=${DRAFTLINE_REDIS_IMAGE:-draftline-redis:bookworm}
PROMETHEUS_TAG=${DRAFTLINE_PROMETHEUS_IMAGE:-draftline-prometheus:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
WHEEL_PORT=${DRAFTLINE_WHEEL_PORT:-8791}
CA_SOURCE=${DRAFTLINE_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
DOCKERD_LOG=${DRAFTLINE_DOCKERD_LOG:-/var/log/draftline-dockerd.log}
COMPOSE_MIN=2.26
# The base: Debian's python3 (3.11 on bookworm, the torch wheel's ABI) with venv, and CA certificates.
BASE_SUITE=bookworm
BASE_PACKAGES=python3,python3-venv,ca-certificates
LABEL=org.draftline.inputs
# The legacy builder: BuildKit would fetch its frontend image from a registry.
export DOCKER_BUILDKIT=0

log() { printf 'docker-setup: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

# ---- engine ------------------------------------------------------------------------------------------
apt_install() {
  # Debian's postinst would start dockerd through invoke-rc.d; policy-rc.d forbids it (we start our own).
  local policy=/usr/sbin/policy-rc.d own_policy=0 status=0
  if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod +x "$policy"; own_policy=1; fi
  { DEBIAN_FRONTEND=noninteractive apt-get update -q \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@"; } || status=$?
  if [ "$own_policy" = 1 ]; then rm -f "$policy"; fi
  return "$status"
}

need_root() {
  [ "$EUID" -eq 0 ] || die "$1 needs root: run it as root (sudo $0 ${2:-all}), or install it by hand (README, \"Containers without a registry\")"
}

install_engine() {
  local missing=()
  # docker.io brings both the daemon and a client (an existing newer client stays first on PATH).
  { command -v dockerd && command -v docker; } >/dev/null || missing+=(docker.io)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  command -v iptables >/dev/null || missing+=(iptables)
  [ "${#missing[@]}" -eq 0 ] && return 0
  need_root "installing ${missing[*]}" engine
  log "installing ${missing[*]} with apt-get"
  apt_install "${missing[@]}"
}

# Empty when the client has no compose plugin yet: `docker compose` then exits non-zero, which must not end
# the script (pipefail) before the plugin is installed.
compose_version() { { docker compose version --short 2>/dev/null || true; } | sed 's/^v//'; }

version_at_least() {  # version_at_least 2.26.1-4 2.26
  [ "$(printf '%s\n%s\n' "$2" "${1%%-*}" | sort -V | head -n1)" = "$2" ]
}

install_compose() {
  local version
  version=$(compose_version)
  if [ -n "$version" ] && version_at_least "$version" "$COMPOSE_MIN"; then return 0; fi
  need_root "installing Docker Compose >= $COMPOSE_MIN" engine
  log "Compose ${version:-missing}: fetching Debian 13's docker-compose package (its own sources list)"
  local work
  work=$(mktemp -d)
  mkdir -p "$work/lists/partial" "$work/cache/archives/partial"
  echo "deb $MIRROR trixie main" > "$work/sources.list"
  local apt_opts=(-q -o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/nonexistent
                  -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache"
                  -o APT::Sandbox::User=root)
  apt-get "${apt_opts[@]}" update >/dev/null
  (cd "$work" && apt-get "${apt_opts[@]}" download docker-compose >/dev/null)
  dpkg-deb -x "$work"/docker-compose_*.deb "$work/root"
  install -D -m 755 "$work/root/usr/libexec/docker/cli-plugins/docker-compose" \
    /usr/local/lib/docker/cli-plugins/docker-compose
  rm -rf "$work"
  version=$(compose_version)
  [ -n "$version" ] && version_at_least "$version" "$COMPOSE_MIN" \
    || die "Compose is ${version:-still missing} after the install; $COMPOSE_MIN or newer is needed"
  log "Compose $version installed"
}

start_dockerd() {
  docker info >/dev/null 2>&1 && return 0
  need_root "starting dockerd" engine
  log "starting dockerd (log: $DOCKERD_LOG)"
  setsid dockerd >>"$DOCKERD_LOG" 2>&1 < /dev/null &
  local waited=0
  until docker info >/dev/null 2>&1; do
    [ "$waited" -lt 60 ] || die "dockerd did not answer within 60 s; its log, $DOCKERD_LOG, ends with: $(tail -n 5 "$DOCKERD_LOG")"
    sleep 1; waited=$((waited + 1))
  done
}

engine() {
  install_engine
  install_compose
  start_dockerd
}

# ---- images ------------------------------------------------------------------------------------------
image_inputs() { docker image inspect -f "{{ index .Config.Labels \"$LABEL\" }}" "$1" 2>/dev/null || true; }
image_id() { docker image inspect -f '{{ .Id }}' "$1"; }
digest() { sha256sum | cut -d' ' -f1; }

# Hash of files (paths relative to the repository), caches left out as .dockerignore leaves them out.
files_digest() {
  (cd "$REPO" && find "$@" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' ! -path '*.egg-info/*' \
      ! -path '*/.pytest_cache/*' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum) | digest
}

build_base() {
  local inputs
  inputs=$(printf 'debootstrap minbase %s %s %s\n' "$BASE_SUITE" "$BASE_PACKAGES" "$MIRROR" | digest)
  if [ "$(image_inputs "$BASE_TAG")" = "$inputs" ]; then return 0; fi
  need_root "debootstrap" images
  log "building $BASE_TAG with debootstrap (about a minute)"
  local root
  root=$(mktemp -d)
  debootstrap --variant=minbase --include="$BASE_PACKAGES" "$BASE_SUITE" "$root" "$MIRROR" > "$root.log" 2>&1 \
    || die "debootstrap failed; its output ends with: $(tail -n 20 "$root.log")"
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change "LABEL $LABEL=$inputs" - "$BASE_TAG" >/dev/null
  rm -rf "$root" "$root.log"
}

# build TAG INPUTS CONTEXT [docker build arguments...]
build() {
  local tag=$1 inputs=$2 context=$3
  shift 3
  if [ "$(image_inputs "$tag")" = "$inputs" ]; then log "$tag is up to date"; return 0; fi
  log "building $tag"
  local output
  output=$(mktemp)
  docker build --network host --label "$LABEL=$inputs" -t "$tag" "$@" "$context" > "$output" 2>&1 \
    || { log "building $tag failed; the build's output ends with:"; tail -n 40 "$output" >&2; rm -f "$output"; return 1; }
  rm -f "$output"
  # Each rebuild leaves the image it replaced, untagged (the draftline image's venv layer is over 1 GB): remove
  # the untagged images this script built from other inputs, so the disk does not fill over many builds. The
  # build stage of these inputs stays, as the layer cache of the next build.
  docker image prune -f --filter "label=$LABEL" --filter "label!=$LABEL=$inputs" >/dev/null
}

build_debian_service() {  # redis or prometheus
  local tag=$1 folder=$2 inputs
  inputs=$({ image_id "$BASE_TAG"; files_digest "docker/$folder"; } | digest)
  build "$tag" "$inputs" "$REPO/docker/$folder" --build-arg "BASE_IMAGE=$BASE_TAG"
}

torch_version() { sed -n 's/^TORCH_SPEC ?= torch==//p' "$REPO/Makefile"; }

torch_wheel() {  # the local CPU wheel of that version, if any
  local folder version=$1
  for folder in ${DRAFTLINE_TORCH_WHEELS:-} ${PIP_FIND_LINKS:-} /opt/wheels; do
    compgen -G "$folder/torch-$version+cpu-cp311-*.whl" | head -n1 && return 0
  done
  return 0
}

serve_wheels() {  # a loopback HTTP server over the wheel's folder, for pip's --find-links in the build
  python3 -m http.server --bind 127.0.0.1 --directory "$1" "$WHEEL_PORT" >/dev/null 2>&1 &
  WHEEL_SERVER=$!
  local waited=0
  until python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" \
      "http://127.0.0.1:$WHEEL_PORT/" 2>/dev/null; do
    kill -0 "$WHEEL_SERVER" 2>/dev/null || die "the wheel server could not listen on 127.0.0.1:$WHEEL_PORT (DRAFTLINE_WHEEL_PORT)"
    [ "$waited" -lt 20 ] || die "the wheel server on 127.0.0.1:$WHEEL_PORT did not answer"
    sleep 0.5; waited=$((waited + 1))
  done
}

build_draftline() {
  local version wheel args=(--build-arg "PYTHON_IMAGE=$BASE_TAG" --build-arg TORCH_VARIANT=cpu)
  version=$(torch_version)
  [ -n "$version" ] || die "no TORCH_SPEC ?= torch==<version> line in the Makefile"
  wheel=$(torch_wheel "$version")
  if [ -n "$wheel" ]; then
    # The local CPU wheel; its dependencies from PyPI. "+cpu" rules out PyPI's CUDA build of the release.
    args+=(--build-arg TORCH_INDEX_URL=https://pypi.org/simple
           --build-arg "TORCH_FIND_LINKS=http://127.0.0.1:$WHEEL_PORT/" --build-arg "TORCH_VERSION=$version+cpu")
  else
    args+=(--build-arg "TORCH_VERSION=$version")
  fi
  if [ -r "$CA_SOURCE" ]; then
    cmp -s "$CA_SOURCE" "$REPO/docker/ca/host.pem" || cp "$CA_SOURCE" "$REPO/docker/ca/host.pem"
    args+=(--build-arg CA_BUNDLE=host.pem)
  fi
  local inputs
  inputs=$({ image_id "$BASE_TAG"; printf '%s\n' "${args[@]}" "${wheel##*/}";
             files_digest Dockerfile .dockerignore pyproject.toml README.md shared runtime modeling evaluation services docker/ca; } | digest)
  if [ "$(image_inputs "$DRAFTLINE_TAG")" = "$inputs" ]; then log "$DRAFTLINE_TAG is up to date"; return 0; fi
  WHEEL_SERVER=
  if [ -n "$wheel" ]; then serve_wheels "$(dirname "$wheel")"; fi
  local status=0
  build "$DRAFTLINE_TAG" "$inputs" "$REPO" "${args[@]}" || status=$?
  if [ -n "$WHEEL_SERVER" ]; then kill "$WHEEL_SERVER" 2>/dev/null || true; fi
  return "$status"
}

images() {
  docker info >/dev/null 2>&1 || die "no Docker engine answers: run $0 engine first"
  build_base
  build_debian_service "$REDIS_TAG" redis
  build_debian_service "$PROMETHEUS_TAG" prometheus
  build_draftline
}

main() {
  case "${1:-all}" in
    engine) engine ;;
    images) images ;;
    all) engine; images ;;
    *) echo "usage: $0 [engine|images|all]" >&2; return 2 ;;
  esac
}

main "$@"
