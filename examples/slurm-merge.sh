#!/bin/bash
# The merge after examples/slurm-array.sh: the N parts back in the batch file's order, each line
# once. Exit 0 when whole; 4 when lines are missing from every part (a shard that failed: run its
# task again, then this), 1 when two parts disagree; each such line is named in the log, and
# RESULTS is written only when the merge is whole. Same environment as the array (BATCH, PARTS),
# plus RESULTS. Needs no model and no llama-cpp-python: any node with Python will do.
#SBATCH --job-name=nrvna-merge
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=1
#SBATCH --output=nrvna-merge-%j.out

set -euo pipefail
BATCH=${BATCH:-/shared/batch.jsonl}
PARTS=${PARTS:-/shared/parts}
RESULTS=${RESULTS:-/shared/results.jsonl}

nrvna merge --input "$BATCH" "$PARTS"/part-*.jsonl -o "$RESULTS"
