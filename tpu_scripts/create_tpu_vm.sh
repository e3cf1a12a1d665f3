#!/usr/bin/env bash
# Creates a TPU VM with a JAX-ready runtime image. Usage: create_tpu_vm.sh NAME ZONE TYPE
set -euo pipefail
name=${1:?TPU name}; zone=${2:?zone}; type=${3:?accelerator type, e.g. v5litepod-8}
gcloud compute tpus tpu-vm create "$name" --zone="$zone" --accelerator-type="$type" \
  --version=v2-alpha-tpuv5-lite
