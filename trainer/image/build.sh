#!/usr/bin/env bash
# make image: build localhost/lockstep/trainer:<version> (and its base) with the local engine.
#   trainer/image/build.sh [ENGINE]     ENGINE: podman (default) or docker
# Rebuilt only when the trainer's code changed: the image carries a hash of it as a label.
set -euo pipefail
cd "$(dirname "$0")/../.."
ENGINE="${1:-${LOCKSTEP_ENGINE:-podman}}"
PY="${PY:-.venv/bin/python}"
VERSION="$("$PY" -c 'import tomllib;print(tomllib.load(open("pyproject.toml","rb"))["project"]["version"])')"
BASE=localhost/lockstep/base:bookworm
IMAGE="localhost/lockstep/trainer:${VERSION}"
HASH="$(find trainer -name '*.py' -not -path '*/__pycache__/*' -print0 | sort -z | xargs -0 cat trainer/image/Containerfile | sha256sum | cut -c1-16)"
CTX=var/image

have() { "$ENGINE" image inspect "$1" >/dev/null 2>&1; }

if have "$IMAGE" && [ "$("$ENGINE" image inspect --format '{{index .Labels "lockstep.source"}}' "$IMAGE")" = "$HASH" ]; then
  echo "$IMAGE is up to date"
  exit 0
fi

mkdir -p "$CTX"
if ! have "$BASE"; then
  echo "== base root file system (mmdebstrap, Debian bookworm)"
  mmdebstrap --quiet --variant=apt --include=python3,python3-venv,ca-certificates \
    bookworm "$CTX/base.tar"
  "$ENGINE" import "$CTX/base.tar" "$BASE"
  rm -f "$CTX/base.tar"
fi

echo "== wheels (torch==2.13.0 and numpy, from the host's pip: its local wheel directory)"
rm -rf "$CTX/wheels" "$CTX/trainer"
"$PY" -m pip download --quiet --disable-pip-version-check --dest "$CTX/wheels" \
  "torch==2.13.0" "numpy>=1.26"
mkdir -p "$CTX/trainer"
tar -C trainer --exclude=__pycache__ --exclude=image -cf - . | tar -C "$CTX/trainer" -xf -
cp trainer/image/Containerfile "$CTX/Containerfile"

echo "== $IMAGE"
"$ENGINE" build --quiet --tag "$IMAGE" --tag localhost/lockstep/trainer:latest \
  --label "lockstep.source=$HASH" "$CTX"
rm -rf "$CTX/wheels"
echo "built $IMAGE"
