"""A daemon started on a model FILE (not `daemon models/ ws`) loads no folder adapter; a job naming
the models folder's adapter 'tone' as its model (tone, foo:tone) is routed to its default model and
runs on the base, and submit notes nothing (tone) or says 'with adapter tone' (foo:tone)."""
import os, struct, sys, tempfile
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
import nrvna

def header(path):
    text = lambda v: struct.pack("<Q", len(v)) + v.encode()
    body = text("general.architecture") + struct.pack("<I", 8) + text("llama")
    body += text("general.type") + struct.pack("<I", 8) + text("adapter")
    open(path, "wb").write(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + body)

with tempfile.TemporaryDirectory() as folder:
    model = os.path.join(folder, "smol.gguf")
    os.symlink(os.path.join(HERE, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"), model)
    header(os.path.join(folder, "tone.gguf"))
    models = nrvna._Models([model], None, nrvna.Config(), folder, {})
    print("daemon's adapters:", models.adapters)
    for name in ("tone", "foo:tone", "smol:tone"):
        queue = models.queue_of(name, False, ())
        print(f"job model {name!r}: queue {queue}", "(runs on the base of smol)" if queue is not None else "(waits)")
