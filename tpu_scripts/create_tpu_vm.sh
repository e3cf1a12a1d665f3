#!/usr/bin/env bash
# Creates a TPU VM with a JAX-ready runtime image. Usage: create_tpu_vm.sh NAME ZONE TYPE
# Each TPU generation boots only its own runtime image, so the image follows TYPE (Cloud TPU's
# "TPU software versions" table); set RUNTIME_VERSION to pick another.
set -euo pipefail
name=${1:?TPU name}; zone=${2:?zone}; type=${3:?accelerator type, e.g. v5litepod-8}
case "$type" in
  v6e-*) default_version=v2-alpha-tpuv6e ;;
  v5p-*) default_version=v2-alpha-tpuv5 ;;
  v5litepod-* | v5e-*) default_version=v2-alpha-tpuv5-lite ;;
  v2-* | v3-* | v4-*) default_version=tpu-ubuntu2204-base ;;
  *) default_version= ;;
esac
version=${RUNTIME_VERSION:-$default_version}
if [[ -z "$version" ]]; then
  echo "create_tpu_vm.sh: no default runtime image for $type; set RUNTIME_VERSION" >&2
  exit 1
fi
gcloud compute tpus tpu-vm create "$name" --zone="$zone" --accelerator-type="$type" \
  --version="$version"
