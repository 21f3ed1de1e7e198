#!/usr/bin/env bash
# End-to-end check of docker/ with a container engine: build the image, run the
# demo against MinIO twice (the second run resumes), then list and verify every
# checkpoint in the bucket. Exits non-zero on any failure.
#
# The engine: docker (its compose plugin) where a Docker daemon answers, else
# podman (`podman compose` where it has one, else podman-compose from PyPI);
# CHECKPOINTD_ENGINE=docker or podman picks one. Needs MinIO's images (a registry).
set -euo pipefail
cd "$(dirname "$0")"
engine=${CHECKPOINTD_ENGINE:-}
if [ -z "$engine" ]; then
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
    engine=docker
  elif command -v podman >/dev/null; then
    engine=podman
  else
    echo "smoke.sh: no container engine: neither a Docker daemon nor podman" >&2
    exit 1
  fi
fi
case $engine in
  docker) compose=(docker compose) ;;
  podman)
    if podman compose version >/dev/null 2>&1; then
      compose=(podman compose)
    elif command -v podman-compose >/dev/null; then
      compose=(podman-compose)
    else
      echo "smoke.sh: podman has no compose here: pip install podman-compose" >&2
      exit 1
    fi
    ;;
  *)
    echo "smoke.sh: CHECKPOINTD_ENGINE is docker or podman, not '$engine'" >&2
    exit 1
    ;;
esac
echo "smoke.sh: ${compose[*]}"
compose+=(-f compose.yaml)
trap '"${compose[@]}" down -v --remove-orphans' EXIT

"${compose[@]}" build demo
"${compose[@]}" up --exit-code-from demo demo
second=$("${compose[@]}" run --rm demo demo s3://checkpoints/run --steps=100 \
  --storage-option=key=checkpointd --storage-option=secret=checkpointd-secret \
  --storage-option=client_kwargs.endpoint_url=http://minio:9000 \
  --storage-option=client_kwargs.region_name=us-east-1)
echo "$second"
grep -q "resumed from step 300" <<<"$second"
"${compose[@]}" run --rm ls
"${compose[@]}" run --rm verify
echo "smoke test ($engine): ok"
