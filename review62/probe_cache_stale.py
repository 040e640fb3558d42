"""gguf_is_adapter's cache keyed by (dev, ino, size, mtime_ns) answers stale for a file rewritten
in place to the same size whose mtime is the same: `cp -p`, `touch -r`, tar/rsync -t --inplace keep
it, and on kernels before 6.13 (coarse timestamps) two writes in one tick do too (a probe that read a
preallocated file's zero header before its writer wrote it)."""
import os, struct, sys, tempfile
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nrvna

def header(kind: str) -> bytes:
    text = lambda v: struct.pack("<Q", len(v)) + v.encode()
    body = text("general.architecture") + struct.pack("<I", 8) + text("llama")
    body += text("general.type") + struct.pack("<I", 8) + text(kind)
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + body

with tempfile.TemporaryDirectory() as folder:
    path = os.path.join(folder, "tone.gguf")
    # 1. a preallocated file (aria2c --file-allocation, hf_transfer's set_len) probed before its header lands
    with open(path, "wb") as f:
        f.truncate(4096)
    before = os.stat(path)
    print("zeros:", nrvna.gguf_is_adapter(path))
    with open(path, "r+b") as f:  # the writer's header write, same tick (simulated: mtime as it was)
        f.write(header("adapter"))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    print("header written, same size and mtime: cached", nrvna.gguf_is_adapter(path), "- fresh read says",
          nrvna.gguf_is_adapter.__wrapped__(path) if hasattr(nrvna.gguf_is_adapter, "__wrapped__") else
          (nrvna._adapter_probes.clear() or nrvna.gguf_is_adapter(path)))
    # 2. cp -p other_same_size.gguf tone.gguf (in place, mtime copied from a file with the same mtime)
    nrvna._adapter_probes.clear()
    stamp = os.stat(path)
    print("adapter:", nrvna.gguf_is_adapter(path))
    with open(path, "r+b") as f:
        f.write(header("adapteR"))  # no adapter now, same size
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    print("rewritten to a model, mtime kept: cached", nrvna.gguf_is_adapter(path))
