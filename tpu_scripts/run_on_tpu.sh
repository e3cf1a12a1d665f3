#!/usr/bin/env bash
# Copies this repo to a single-host TPU VM, installs it with the TPU build of JAX and runs
# `dora-jax train` there. One controller drives every chip; a multi-host slice needs Pathways
# (see README.md), so this refuses one rather than start independent jobs on each host.
# Usage: run_on_tpu.sh NAME ZONE CONFIG [--config.x=y ...]
set -euo pipefail
name=${1:?TPU name}; zone=${2:?zone}; config=${3:?config file}; shift 3
repo=$(cd "$(dirname "$0")/.." && pwd)
hosts=$(gcloud compute tpus tpu-vm describe "$name" --zone="$zone" \
  --format='value(networkEndpoints.len())')
if [[ "$hosts" != "1" ]]; then
  echo "run_on_tpu.sh: $name has $hosts hosts; multi-host slices need Pathways (tpu_scripts/README.md)" >&2
  exit 1
fi
gcloud compute tpus tpu-vm scp --recurse --worker=0 --zone="$zone" "$repo" "$name":~/dora_jax
gcloud compute tpus tpu-vm ssh "$name" --worker=0 --zone="$zone" --command="
  set -e; cd ~/dora_jax
  python3 -m venv .venv && .venv/bin/pip install -q -U pip
  .venv/bin/pip install -q -e . 'jax[tpu]'
  .venv/bin/dora-jax train --config=$config --workdir=\${WORKDIR:-runs/tpu} $*"
