#!/usr/bin/env bash
# Copies this repo to a single-host TPU VM, installs it with the TPU build of JAX and runs
# `dora-jax train` there. One controller drives every chip; a multi-host slice needs Pathways
# (see README.md), so this refuses one rather than start independent jobs on each host.
# Usage: [WORKDIR=DIR] run_on_tpu.sh NAME ZONE CONFIG [--config.x=y ...]
# WORKDIR (default runs/tpu) is a path on the VM, relative to the copied repo.
set -euo pipefail
name=${1:?TPU name}; zone=${2:?zone}; config=${3:?config file}; shift 3
workdir=${WORKDIR:-runs/tpu}
repo=$(cd "$(dirname "$0")/.." && pwd)
hosts=$(gcloud compute tpus tpu-vm describe "$name" --zone="$zone" \
  --format='value(networkEndpoints.len())')
if [[ "$hosts" != "1" ]]; then
  echo "run_on_tpu.sh: $name has $hosts hosts; multi-host slices need Pathways (tpu_scripts/README.md)" >&2
  exit 1
fi
# The working tree as git sees it, uncommitted edits included, less what .gitignore names: the
# local .venv and runs/ are large and of no use on the VM. Files deleted locally are left out.
tarball=$(mktemp)
trap 'rm -f "$tarball"' EXIT
comm -23 <(git -C "$repo" ls-files --cached --others --exclude-standard | sort) \
  <(git -C "$repo" ls-files --deleted | sort) | tar -C "$repo" -czf "$tarball" -T -
gcloud compute tpus tpu-vm scp --worker=0 --zone="$zone" "$tarball" "$name":~/dora_jax.tar.gz
# Quoted here, expanded locally: the remote shell sees each argument as one word.
train_args=$(printf ' %q' "--config=$config" "--workdir=$workdir" "$@")
gcloud compute tpus tpu-vm ssh "$name" --worker=0 --zone="$zone" --command="
  set -e; mkdir -p ~/dora_jax && tar -xzf ~/dora_jax.tar.gz -C ~/dora_jax && cd ~/dora_jax
  # dora_jax needs Python >= 3.11; the Ubuntu 22.04 TPU images ship 3.10 as python3.
  py=python3
  if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    sudo apt-get update -q && sudo apt-get install -y -q python3.11 python3.11-venv
    py=python3.11
  fi
  \$py -m venv .venv && .venv/bin/pip install -q -U pip
  .venv/bin/pip install -q -e . 'jax[tpu]'
  .venv/bin/dora-jax train$train_args"
