#!/bin/bash
# One batch file over N nodes with a Slurm job array: task I of N queues shard I of the file in a
# workspace on its own node's disk, works it with one nrvna daemon, and exports its results to
# shared storage; examples/slurm-merge.sh then puts the N parts back together (docs/batches.md,
# "Shards"). Submit both, the merge after every task has ended:
#
#   jid=$(sbatch --parsable --array=0-2 examples/slurm-array.sh)
#   sbatch --dependency=afterany:$jid examples/slurm-merge.sh
#
# --array must run 0..N-1 (the shards are numbered from 0). Settings come from the environment
# sbatch passes on: MODEL (a GGUF on shared storage, read by every node), BATCH (the batch file,
# on shared storage), PARTS (a shared folder for the exports, one per batch: the merge reads
# every part-*.jsonl in it), TAG. `nrvna` must be on PATH on every node (docs/install.md).
#SBATCH --job-name=nrvna-shard
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=8
#SBATCH --output=nrvna-shard-%A_%a.out
# Slurm may requeue a task whose node failed; the same workspace path then resumes it.
#SBATCH --requeue

: "${SLURM_ARRAY_TASK_ID:?run this as an array: sbatch --array=0-2 examples/slurm-array.sh}"
set -euo pipefail
MODEL=${MODEL:-/shared/models/model.gguf}
BATCH=${BATCH:-/shared/batch.jsonl}
PARTS=${PARTS:-/shared/parts}
TAG=${TAG:-batch}
# On the node's own disk: a directory queue on NFS loses nrvna's guarantees (docs/guarantees.md).
WS=${SLURM_TMPDIR:-${TMPDIR:-/tmp}}/nrvna-$SLURM_ARRAY_JOB_ID-$SLURM_ARRAY_TASK_ID
# SHARDS, when set, is N: a failed task run again alone (SHARDS=3 sbatch --array=1 ...) is
# an array of one, whose SLURM_ARRAY_TASK_COUNT is 1.
SHARD=$SLURM_ARRAY_TASK_ID/${SHARDS:-$SLURM_ARRAY_TASK_COUNT}

# With --tag, a rerun of this task (a requeue, or sbatch again) queues only the lines that are
# not queued yet, and the daemon resumes what a dead one left running.
nrvna submit "$WS" --file "$BATCH" --shard "$SHARD" --tag "$TAG" > /dev/null
nrvna daemon --drain "$MODEL" "$WS"
mkdir -p "$PARTS"
nrvna export "$WS" --tag "$TAG" --format openai -o "$PARTS/part-$SLURM_ARRAY_TASK_ID.jsonl"
rm -rf "$WS"
