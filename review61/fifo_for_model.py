# for_model (multi-model daemon, Models thread at load and Watcher via described()) opens adapter files
# with a blocking open(): an adapter path replaced by a FIFO after start hangs the thread.
import os, shutil, threading, sys
sys.path.insert(0, "/work/wt/h61")
import nrvna
d = "/tmp/h61/fifo_case"; shutil.rmtree(d, ignore_errors=True); os.makedirs(d)
shutil.copy("/tmp/h61/tone.gguf", d + "/tone.gguf")
cfg = nrvna.Config.from_env(adapters=f"tone={d}/tone.gguf")
files = nrvna._AdapterFiles(cfg, [])
os.unlink(d + "/tone.gguf"); os.mkfifo(d + "/tone.gguf")   # swapped after start
t = threading.Thread(target=lambda: print("returned", files.for_model("/work/wt/h61/models/SmolLM2-135M-Instruct.Q4_1.gguf", False)), daemon=True)
t.start(); t.join(5)
print("HUNG (blocked in open of a FIFO)" if t.is_alive() else "ok")
