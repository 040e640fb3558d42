#!/bin/bash
# D4: a daemon record whose model lists "adapters" not as a daemon writes them (DAEMON_MODEL_FIELDS has no
# row for "adapters"/"contexts"): submit --lora and status of a waiting job crash with a traceback.
cd /work/wt/h61; P=".venv/bin/python nrvna.py"; W=/tmp/h61/d4
review61/start_daemon.sh $W
R=$(ls $W/daemons/*.json | head -1)
for bad in '5' '[{"name": ["x"]}]'; do
  .venv/bin/python - "$R" "$bad" <<'PY'
import json, os, sys
path, bad = sys.argv[1], json.loads(sys.argv[2])
rec = json.load(open(path)); rec["models"][0]["adapters"] = bad
open(path + ".t", "w").write(json.dumps(rec)); os.replace(path + ".t", path)
PY
  echo "== adapters: $bad"
  $P submit $W hi --max-tokens 2 --lora nope 2>&1 | tail -2; echo "rc=${PIPESTATUS[0]}"
  id=$(ls $W/input/ready | head -1); [ -n "$id" ] && { $P status $W $id 2>&1 | tail -2; echo "rc=${PIPESTATUS[0]}"; }
done
kill $(cat $W.pid)
