#!/usr/bin/env bash
# End-to-end check of docker/ on a machine with a Docker engine (CI): build the
# image, run the demo against MinIO twice (the second run resumes), then list
# and verify every checkpoint in the bucket. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")"
compose=(docker compose -f compose.yaml)
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
echo "docker smoke test: ok"
