#!/usr/bin/env bash
# Copies this repo to every host of a TPU VM slice, installs it with the TPU build of JAX and
# runs `dora-jax train` on all hosts at once (jax.distributed needs every host to join).
# Usage: run_on_tpu.sh NAME ZONE CONFIG [--config.x=y ...]
set -euo pipefail
name=${1:?TPU name}; zone=${2:?zone}; config=${3:?config file}; shift 3
repo=$(cd "$(dirname "$0")/.." && pwd)
gcloud compute tpus tpu-vm scp --recurse --worker=all --zone="$zone" "$repo" "$name":~/dora_jax
gcloud compute tpus tpu-vm ssh "$name" --worker=all --zone="$zone" --command="
  set -e; cd ~/dora_jax
  python3 -m venv .venv && .venv/bin/pip install -q -U pip
  .venv/bin/pip install -q -e . 'jax[tpu]'
  .venv/bin/dora-jax train --config=$config --workdir=\${WORKDIR:-runs/tpu} $*"
