"""An embedding model's record lists the daemon's adapters as ones it will load (no 'refused'):
LlamaRunner gives an embedding model no _Adapters, so described() falls back to the files. Clients
(loaded_adapters: known_adapters, _adapter_waits) and peers (Watcher.peer_models -> adapters_elsewhere)
then take the adapter as loaded: submit notes nothing, and another daemon's jobs naming it wait for this one."""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nrvna

files = object.__new__(nrvna._AdapterFiles)
files.files = {"tone": ("/a/tone.gguf", 1.0)}
model = nrvna._ServedModel("minilm.gguf", "/m/minilm.gguf", "embed", None)
listed = files.described(model)
print(listed, "-> loaded_adapters:", nrvna.loaded_adapters([listed]))
