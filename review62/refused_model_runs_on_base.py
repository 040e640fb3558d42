"""A job whose model names an adapter the model refused runs on the base when the model loaded no
other adapter (_ContextAdapters.of skips job_set), and fails unsupported when it loaded one:
job_set's own docstring says the first must not happen."""
import os, sys, types
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nrvna

for loaded in ({}, {"terse": (object(), 1.0, "/t", [1, "x"])}):
    adapters = object.__new__(nrvna._Adapters)
    adapters.llama_cpp, adapters.loaded, adapters.refused, adapters.held_mib = None, loaded, {"tone": "why"}, 0.0
    job = types.SimpleNamespace(params={"model": "tone"})
    try:
        print(f"loaded {sorted(loaded)}: job model 'tone' (refused) runs with set", nrvna._ContextAdapters(adapters).of(job))
    except nrvna.JobError as err:
        print(f"loaded {sorted(loaded)}: fails:", err)
