#!/usr/bin/env bash
# The Slurm recipe on a real scheduler (issue 48): a one-node Slurm cluster from Debian's own
# packages (munge, slurmctld, slurmd) started on this machine, examples/slurm-array.sh run as an
# array of SHARDS tasks over a LINES-line batch file, examples/slurm-merge.sh after it, and the
# merged output compared line by line (custom_id, order, text, finish_reason) with a one-node run
# of the same file (submit --file, daemon --drain, export --format openai, no Slurm). Greedy, one
# sequence per context (NRVNA_SEQS=1 on both sides), so that a line's text depends on nothing
# but its prompt: see "Reproducibility across batch sizes" in bench/README.md.
#
# The node is this machine: each task gets TASK_CPUS cores (bound by task/affinity, so nrvna's
# defaults size its workers to them), and as many tasks run at once as the cores allow; the
# one-node run has every core. Reported: the one-node run's time, the array's from sbatch to the
# merge's end, and each task's own time from Slurm (what SHARDS nodes of TASK_CPUS cores each
# would take is about the longest task plus the merge).
#
#   usage: sudo bash bench/slurm.sh        (root: it installs packages and runs slurmd)
#   LINES, SHARDS, TOKENS, TASK_CPUS   the run's size (default 300, 3, 32, 1)
#   MODEL       the GGUF (default models/SmolLM2-135M-Instruct.Q4_1.gguf)
#   PYTHON      the interpreter with llama-cpp-python (default .venv/bin/python)
#   KEEP        1 keeps the run's folder (the cluster's logs, the parts, both outputs)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
LINES=${LINES:-300} SHARDS=${SHARDS:-3} TOKENS=${TOKENS:-32} TASK_CPUS=${TASK_CPUS:-1}
MODEL=$(realpath "${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}")
PYTHON=${PYTHON:-.venv/bin/python}
case $PYTHON in /*) ;; */*) PYTHON=$REPO/$PYTHON ;; esac  # not realpath: a venv's python is a symlink
[ "$(id -u)" -eq 0 ] || { echo "slurm.sh: run as root (it installs Slurm and starts its daemons)" >&2; exit 2; }

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
    || ! command -v sbatch >/dev/null; then
  echo "slurm.sh: installing Debian's slurmctld, slurmd, slurm-client and munge" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >&2
fi

RUN=$(mktemp -d "${BENCH_DIR:-$REPO}/nrvna-bench-slurm-XXXXXX")
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  [ "${KEEP:-0}" = 1 ] && echo "slurm.sh: kept $RUN" >&2 || rm -rf "$RUN"
}
trap cleanup EXIT
chmod 755 "$RUN"  # mktemp's 0700 would keep the munge user out
mkdir -p "$RUN"/{state,spool,log,bin,parts,munge}
printf '#!/bin/sh\nexec "%s" "%s/nrvna.py" "$@"\n' "$PYTHON" "$REPO" > "$RUN/bin/nrvna"
chmod +x "$RUN/bin/nrvna"
export PATH="$RUN/bin:$PATH"

# munge: its own socket, key and daemon, so a munged already running is left alone.
chown munge: "$RUN/munge"
runuser -u munge -- /usr/sbin/mungekey --create --keyfile="$RUN/munge/munge.key" 2>/dev/null \
  || runuser -u munge -- dd if=/dev/urandom of="$RUN/munge/munge.key" bs=1024 count=1 status=none
chmod 600 "$RUN/munge/munge.key"
runuser -u munge -- /usr/sbin/munged --key-file="$RUN/munge/munge.key" --socket="$RUN/munge/socket" \
  --pid-file="$RUN/munge/munged.pid" --log-file="$RUN/munge/munged.log" --seed-file="$RUN/munge/seed" --force
pids+=("$(cat "$RUN/munge/munged.pid")")

HOST=$(hostname -s)
CORES=$(nproc)
MEMORY=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
cat > "$RUN/slurm.conf" <<EOF
ClusterName=nrvna-bench
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$RUN/munge/socket
CredType=cred/munge
StateSaveLocation=$RUN/state
SlurmdSpoolDir=$RUN/spool
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$RUN/log/slurmctld.log
SlurmdLogFile=$RUN/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MinJobAge=3600
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CORES RealMemory=$MEMORY State=UNKNOWN
PartitionName=bench Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$RUN/slurm.conf
/usr/sbin/slurmctld -i
/usr/sbin/slurmd
for _ in $(seq 50); do [ -s "$RUN/slurmctld.pid" ] && [ -s "$RUN/slurmd.pid" ] && break; sleep 0.2; done
pids+=("$(cat "$RUN/slurmd.pid")" "$(cat "$RUN/slurmctld.pid")")
for _ in $(seq 100); do sinfo -h -o %t 2>/dev/null | grep -q idle && break; sleep 0.2; done
sinfo -h -o %t | grep -q idle || { echo "slurm.sh: the node never came up; $RUN/log:" >&2; tail -n 20 "$RUN"/log/*.log >&2; exit 1; }
echo "slurm.sh: $(sinfo -V), one node '$HOST' of $CORES CPUs; $SHARDS tasks of $TASK_CPUS CPUs; $LINES lines x $TOKENS tokens" >&2

# The batch: OpenAI Batch lines, greedy, each its own prompt.
"$PYTHON" - "$RUN/batch.jsonl" "$LINES" "$TOKENS" <<'PY'
import json, sys
subjects = ["rivers", "owls", "copper", "tea", "glaciers", "violins", "deserts", "bread", "comets", "moss"]
with open(sys.argv[1], "w") as out:
    for i in range(int(sys.argv[2])):
        ask = f"In one sentence, tell me fact number {i} about {subjects[i % len(subjects)]}."
        out.write(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                              "body": {"messages": [{"role": "user", "content": ask}],
                                       "max_tokens": int(sys.argv[3]), "temperature": 0}}) + "\n")
PY
export NRVNA_SEQS=1

now() { date +%s.%N; }
# One node, no Slurm: every core.
start=$(now)
nrvna submit "$RUN/one" --file "$RUN/batch.jsonl" --tag one > /dev/null
nrvna daemon --drain "$MODEL" "$RUN/one" 2> "$RUN/log/one-node.log" || { tail -n 5 "$RUN/log/one-node.log" >&2; exit 1; }
nrvna export "$RUN/one" --tag one --format openai -o "$RUN/one-node.jsonl"
one_node=$("$PYTHON" -c "print(f'{$(now) - $start:.1f}')")

# The array, then the merge after it; sbatch --wait returns when the merge has ended.
export MODEL BATCH="$RUN/batch.jsonl" PARTS="$RUN/parts" TAG=bench RESULTS="$RUN/merged.jsonl" TMPDIR="$RUN/nodes"
mkdir -p "$TMPDIR"
start=$(now)
array=$(sbatch --parsable --array=0-$((SHARDS - 1)) --cpus-per-task="$TASK_CPUS" \
  --output="$RUN/log/shard-%a.out" examples/slurm-array.sh)
set +e
merge=$(sbatch --wait --parsable --dependency=afterany:"$array" --output="$RUN/log/merge.out" examples/slurm-merge.sh)
merge_status=$?
set -e
cluster=$("$PYTHON" -c "print(f'{$(now) - $start:.1f}')")
cat "$RUN/log/merge.out" >&2
tasks=$( (scontrol show job -o "$array"; scontrol show job -o "$merge" | sed 's/JobId=/ArrayTaskId=merge /') | "$PYTHON" -c '
import sys, datetime
def when(field, line):
    return datetime.datetime.fromisoformat(line.split(field + "=")[1].split()[0])
rows = sorted((l.split("ArrayTaskId=")[1].split()[0], (when("EndTime", l) - when("StartTime", l)).total_seconds(),
               l.split("JobState=")[1].split()[0]) for l in sys.stdin if "ArrayTaskId=" in l)
print(" ".join(f"{i}:{s:.0f}s({state})" for i, s, state in rows))')

"$PYTHON" - "$RUN/one-node.jsonl" "$RUN/merged.jsonl" "$one_node" "$cluster" "$tasks" "$merge_status" "$SHARDS" <<'PY'
import json, os, sys
one_path, merged_path, one_node, cluster, tasks, merge_status, shards = sys.argv[1:]
def lines(path):
    rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    return [(r["custom_id"], r["response"]["body"]["choices"][0]["message"]["content"],
             r["response"]["body"]["choices"][0]["finish_reason"]) if r["response"] else (r["custom_id"], None, r["error"])
            for r in rows]
one, merged = lines(one_path), lines(merged_path)
same = sum(a == b for a, b in zip(one, merged))
print(f"one node (no Slurm, every core):        {float(one_node):7.1f} s, {len(one)} lines")
print(f"Slurm array of {shards} + merge (sbatch to end): {float(cluster):7.1f} s, merge exit {merge_status}, {len(merged)} lines")
print(f"each task, the merge (Slurm's start to end): {tasks}")
print(f"merged == one node, line for line:      {same} of {len(one)} lines equal"
      f" ({'identical' if merged == one and one else 'DIFFERENT'}; order and content)")
print(f"time ratio, array / one node:           {float(cluster) / float(one_node):.2f}")
sys.exit(0 if merged == one and one and merge_status == "0" else 1)
PY
