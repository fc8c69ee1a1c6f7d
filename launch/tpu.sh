#!/usr/bin/env bash
# A Cloud TPU run: create a queued resource, wait until it is ACTIVE, install this checkout on
# every worker, and run the same training command on all of them (--worker=all).
#
#   launch/tpu.sh NAME ZONE ACCELERATOR [flags of stabledrl_jax.main ...]
#   launch/tpu.sh sdrl-llada us-east5-a v5p-8 --config=configs/llada.py:8b \
#       --config.model.checkpoint=/mnt/ckpt/LLaDA-8B-Instruct --workdir=gs://BUCKET/runs/llada8b
#
# The workdir must be on storage every worker sees (a gs:// path); so must the checkpoint (a gs://
# path too: each process reads only its own slices; docs/storage.md). JAX finds the coordinator and the worker ids itself on
# Cloud TPU. Rerunning the same command resumes (an existing queued resource is reused).
# Environment: RUNTIME (TPU software version, default v2-alpha-tpuv5 for v5p, v2-alpha-tpuv6e for
# v6e), SPOT=1 for spot capacity, DRY_RUN=1 to print the gcloud commands instead of running them.
set -euo pipefail
if [[ $# -lt 3 ]]; then
  sed -n '2,8p' "$0" >&2
  exit 2
fi
name="$1" zone="$2" accelerator="$3"
shift 3
case "${accelerator}" in
  v6e-*) runtime="${RUNTIME:-v2-alpha-tpuv6e}" ;;
  v5p-*) runtime="${RUNTIME:-v2-alpha-tpuv5}" ;;
  v5litepod-*) runtime="${RUNTIME:-v2-alpha-tpuv5-lite}" ;;
  *) runtime="${RUNTIME:?set RUNTIME, the TPU software version for ${accelerator}}" ;;
esac

run() {
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' "$@"; echo
  else
    "$@"
  fi
}
state() {
  gcloud compute tpus queued-resources describe "${name}" --zone="${zone}" \
    --format='value(state.state)' 2>/dev/null || true
}

if [[ "${DRY_RUN:-0}" == 1 || -z "$(state)" ]]; then
  run gcloud compute tpus queued-resources create "${name}" --node-id="${name}" --zone="${zone}" \
    --accelerator-type="${accelerator}" --runtime-version="${runtime}" ${SPOT:+--spot}
fi
if [[ "${DRY_RUN:-0}" != 1 ]]; then
  until [[ "$(state)" == ACTIVE ]]; do
    s="$(state)"
    case "${s}" in FAILED|SUSPENDED) echo "queued resource ${name}: ${s}" >&2; exit 1 ;; esac
    echo "queued resource ${name}: ${s:-creating}; waiting" >&2
    sleep 30
  done
fi

# The committed checkout (HEAD) on every worker, then the same command on every worker.
archive="/tmp/stabledrl_jax-$$.tar.gz"
run git -C "$(dirname "$0")/.." archive --format=tar.gz -o "${archive}" HEAD
run gcloud compute tpus tpu-vm scp "${archive}" "${name}:stabledrl_jax.tar.gz" --zone="${zone}" \
  --worker=all
setup='mkdir -p stabledrl_jax && tar -xzf stabledrl_jax.tar.gz -C stabledrl_jax && cd stabledrl_jax &&
  python3 -m venv .venv && .venv/bin/pip install -q -r requirements.txt "jax[tpu]"'
train="cd stabledrl_jax && .venv/bin/python -m stabledrl_jax.main --distributed $(printf '%q ' "$@")"
run gcloud compute tpus tpu-vm ssh "${name}" --zone="${zone}" --worker=all --command="${setup}"
run gcloud compute tpus tpu-vm ssh "${name}" --zone="${zone}" --worker=all --command="${train}"
