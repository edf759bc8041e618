#!/bin/bash
# One pdserve node inside a SLURM step (run by pdserve.sbatch through srun): node i of its host
# (SLURM_LOCALID) listens on PDSERVE_NODE_PORT + i, PDSERVE_KV_PORT + i and PDSERVE_KV_LANE_PORT + i
# (a decode node's KV lanes), on its host's address.
#   pdserve-task.sh prefill|decode
# PDSERVE_DRY_RUN=1 prints the command instead of running it.
set -euo pipefail

ROLE=$1
LOCAL=${SLURM_LOCALID:-0}
PORT=$(( ${PDSERVE_NODE_PORT:-8100} + LOCAL ))
KV_PORT=$(( ${PDSERVE_KV_PORT:-8200} + LOCAL ))
KV_LANE_PORT=$(( ${PDSERVE_KV_LANE_PORT:-8300} + LOCAL ))

# The address the decode node advertises for KV must be reachable from the prefill hosts:
# the address of PDSERVE_IFACE (the fast network), else the host's first address.
if [[ -n "${PDSERVE_IFACE:-}" ]]; then
  ADDR=$(ip -4 -o addr show dev "$PDSERVE_IFACE" | awk '{split($4, a, "/"); print a[1]; exit}')
else
  ADDR=$(hostname -I | awk '{print $1}')
fi

# srun --gpus-per-task binds one GPU per task; without GPU binding, take GPU <local id>.
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-$LOCAL}

# shellcheck disable=SC2206  # PDSERVE_NODE_ARGS is a list of flags, split on spaces on purpose
EXTRA=(${PDSERVE_NODE_ARGS:-})
CMD=("${PDSERVE_PYTHON:-python3}" -m pdserve node --role "$ROLE"
  --host 0.0.0.0 --port "$PORT" --kv-host "$ADDR" --kv-port "$KV_PORT"
  --kv-lane-port "$KV_LANE_PORT" --node-id "$ROLE-$(hostname -s)-$LOCAL" --model "${PDSERVE_MODEL:-default}"
  --cluster-token "${PDSERVE_CLUSTER_TOKEN:-}" --redis-url "${PDSERVE_REDIS_URL:-}" "${EXTRA[@]}")
if [[ "${PDSERVE_DRY_RUN:-0}" == 1 ]]; then
  printf '%q ' "${CMD[@]}"
  echo
  exit 0
fi
exec "${CMD[@]}"
