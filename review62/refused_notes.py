"""What submit says of a job naming an adapter a live daemon refused, against what that daemon
does with the job (_Models._named/queue_of, _Adapters.job_set): prints each note."""
import json, os, struct, subprocess, sys, tempfile
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
import nrvna

def header(path, kind="adapter"):
    text = lambda v: struct.pack("<Q", len(v)) + v.encode()
    body = text("general.architecture") + struct.pack("<I", 8) + text("llama")
    body += text("general.type") + struct.pack("<I", 8) + text(kind)
    open(path, "wb").write(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + body)

with tempfile.TemporaryDirectory() as tmp:
    ws, folder = os.path.join(tmp, "ws"), os.path.join(tmp, "models")
    os.mkdir(folder)
    open(os.path.join(folder, "smol.gguf"), "wb").write(b"GGUF" + bytes(64))
    nrvna.ensure_workspace(ws)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); import nrvna; "
                               "fd, name = nrvna.register_daemon(sys.argv[2]); print(name, flush=True); "
                               "time.sleep(600)", HERE, ws], stdout=subprocess.PIPE)
    try:
        name = holder.stdout.readline().decode().strip()
        why = "adapter tone (/a/tone.gguf) does not apply to model /m/x.gguf: for architecture 'gemma3'"
        with open(os.path.join(ws, nrvna.DAEMONS, f"{name}.json"), "w") as f:
            json.dump({"pid": holder.pid, "models": [{"path": "/m/x.gguf", "name": "x.gguf", "kind": "chat",
                                                      "adapters": [{"name": "tone", "refused": why}]}]}, f)
        env = dict(os.environ, NRVNA_MODELS_DIR=folder)
        def submit(*args):
            done = subprocess.run([sys.executable, os.path.join(HERE, "nrvna.py"), "submit", ws, "hi", *args],
                                  env=env, capture_output=True)
            print(args, done.returncode, done.stderr.decode().strip() or "(no note)")
        print("-- tone refused by the only daemon (x.gguf, its default):")
        submit("--lora", "tone")            # right: fails there
        submit("--model", "tone")           # daemon: _named -> adapter tone -> job_set: unsupported; note?
        submit("--model", "foo:tone")       # daemon: (None, None) -> default x -> job_set named_adapter(refused): fails
        submit("--model", "tone", "--strict-models")
        print("-- the same, tone.gguf also in the models folder (daemon shelf/ ws refused it):")
        header(os.path.join(folder, "tone.gguf"))
        submit("--lora", "tone")
        submit("--lora", "tone", "--strict-models")
    finally:
        holder.kill(); holder.wait()
