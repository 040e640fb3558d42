"""Make test LoRA adapters for a llama-architecture GGUF (SmolLM2), and float copies of the base to check them.

    python scripts/lora_model.py adapter BASE.gguf OUT.gguf --kind zero|delta [--rank 4] [--seed 61]
                                 [--sigma 0.02] [--alpha R] [--name NAME] [--base-name NAME] [--gguf-py DIR]
    python scripts/lora_model.py float BASE.gguf OUT.gguf [--type f32|f16] [--merge ADAPTER.gguf[:SCALE]]
                                 [--gguf-py DIR]

``adapter`` writes a LoRA adapter GGUF in the form llama.cpp's loader reads (src/llama-adapter.cpp,
``llama_adapter_lora_init_impl``): header ``general.type = adapter``, ``general.architecture`` the base's,
``adapter.type = lora``, ``adapter.lora.alpha`` (f32); for each adapted base weight ``W`` (GGUF name, e.g.
``blk.0.attn_q.weight``) two f32 tensors ``W.lora_a`` and ``W.lora_b``. In numpy's order (gguf-py's; ggml's
``ne`` reversed) ``W`` is (n_out, n_in), ``lora_a`` is (rank, n_in) and ``lora_b`` is (n_out, rank), and
llama.cpp adds ``scale * alpha / rank * B @ (A @ x)`` to ``W @ x`` (src/llama-graph.cpp, ``build_lora_mm``),
where ``scale`` is the one given to ``llama_set_adapters_lora``. Every layer's attention (``attn_q``,
``attn_k``, ``attn_v``, ``attn_output``) and feed-forward (``ffn_gate``, ``ffn_up``, ``ffn_down``) weights
are adapted; the shapes come from the base's header (gguf-py's GGUFReader), so an adapter made from one
base is refused by llama.cpp on a base of another shape ("tensor ... has incorrect shape").

- ``--kind zero``: A random, B = 0 (a LoRA as training starts it): the base model's outputs exactly.
- ``--kind delta``: a known rank-``--rank`` delta from ``--seed``: A ~ N(0, 1/n_in), B ~ N(0, sigma^2),
  both f32. With the default ``--alpha`` (= rank) llama.cpp's factor alpha/rank is 1, so at scale 1 the
  weight becomes ``W + B @ A``.

``--base-name`` writes ``general.base_model.count = 1`` and ``general.base_model.0.name`` (the keys
convert_lora_to_gguf.py fills from an adapter's model card); llama.cpp never reads them.

``float`` writes BASE with every tensor dequantized (gguf-py's quants.dequantize: Q4_0/Q4_1/Q8_0/K-quants
...) to f32 (or f16, norms staying f32), its metadata otherwise copied, ``general.file_type`` set anew:
a float copy whose matrix products llama.cpp computes in float, as it computes an adapter's path.
``--merge ADAPTER[:SCALE]`` (repeatable) adds ``SCALE * alpha / rank * B @ A`` of each adapter into the
weights it adapts (in f32, before any f16 rounding): the "merged model" an adapter's logits must match.
Writing the f32 copy of SmolLM2-135M takes ~540 MB of disk, f16 ~270 MB.

Needs numpy and llama.cpp's gguf-py (``--gguf-py DIR``: the ``gguf-py`` folder of a llama.cpp source tree,
or the installed ``gguf`` package); nrvna itself needs neither. Output goes to a temporary name beside OUT,
renamed into place once whole.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

# The base weights an adapter adapts, per layer (GGUF names, llama architecture).
ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_output")
FEED_FORWARD = ("ffn_gate", "ffn_up", "ffn_down")
TARGETS = ATTENTION + FEED_FORWARD
DEFAULT_SEED = 61
DEFAULT_SIGMA = 0.1  # B's standard deviation: SmolLM2's greedy text changes from its first token, still fluent


def load_gguf(gguf_py: Optional[str]) -> Any:
    """gguf-py, from DIR if given, else the installed package."""
    if gguf_py:
        sys.path.insert(0, gguf_py)
    try:
        import gguf
    except ImportError:
        sys.exit("error: gguf-py not found: pass --gguf-py LLAMA_CPP_SOURCE/gguf-py")
    return gguf


def targets(reader: Any) -> List[Tuple[str, int, int]]:
    """(name, n_out, n_in) of each base weight to adapt, from the base's tensor infos."""
    found = []
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in TARGETS and parts[3] == "weight":
            n_in, n_out = (int(n) for n in tensor.shape[:2])  # ggml's ne: ne[0] is the input width
            found.append((tensor.name, n_out, n_in))
    if not found:
        sys.exit("error: the base has no blk.N.{attn_q,...,ffn_down}.weight tensors to adapt")
    return found


def factors(shapes: List[Tuple[str, int, int]], kind: str, rank: int, seed: int,
            sigma: float) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
    """name -> (A (rank, n_in), B (n_out, rank)), f32, reproducible from the seed."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, n_out, n_in in shapes:
        a = (rng.standard_normal((rank, n_in)) / np.sqrt(n_in)).astype(np.float32)
        b = rng.standard_normal((n_out, rank)).astype(np.float32) * np.float32(sigma)
        out[name] = (a, np.zeros_like(b) if kind == "zero" else b)
    return out


def write_adapter(args: argparse.Namespace) -> None:
    gguf = load_gguf(args.gguf_py)
    reader = gguf.GGUFReader(args.base)
    arch = str(reader.fields["general.architecture"].contents())
    pairs = factors(targets(reader), args.kind, args.rank, args.seed, args.sigma)
    temp = args.out + ".part"
    writer = gguf.GGUFWriter(temp, arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(args.alpha if args.alpha is not None else args.rank))
    writer.add_name(args.name or "%s-lora-%s-r%d" % (arch, args.kind, args.rank))
    if args.base_name:
        writer.add_uint32("general.base_model.count", 1)
        writer.add_string("general.base_model.0.name", args.base_name)
    for name, (a, b) in pairs.items():
        writer.add_tensor(name + ".lora_a", a)
        writer.add_tensor(name + ".lora_b", b)
    finish(writer, temp, args.out)


def read_adapter(gguf: Any, spec: str) -> Tuple[Dict[str, np.ndarray], float, float]:
    """(name -> B @ A, alpha, scale) of ADAPTER[:SCALE]."""
    path, scale = spec, 1.0
    head, _, tail = spec.rpartition(":")
    if head:
        try:
            path, scale = head, float(tail)
        except ValueError:
            pass
    reader = gguf.GGUFReader(path)
    alpha = float(reader.fields[gguf.Keys.Adapter.LORA_ALPHA].contents())
    tensors = {t.name: np.array(t.data, dtype=np.float32) for t in reader.tensors}
    deltas = {}
    for name, a in tensors.items():
        if name.endswith(".lora_a"):
            base = name[:-len(".lora_a")]
            b = tensors[base + ".lora_b"]
            factor = scale * (alpha / b.shape[1] if alpha else 1.0)  # llama-adapter.h get_scale; rank = B's ne[0]
            deltas[base] = (b.astype(np.float64) @ a.astype(np.float64) * factor).astype(np.float32)
    return deltas, alpha, scale


def write_float(args: argparse.Namespace) -> None:
    gguf = load_gguf(args.gguf_py)
    reader = gguf.GGUFReader(args.base)
    arch = str(reader.fields["general.architecture"].contents())
    merged: Dict[str, np.ndarray] = {}
    for spec in args.merge or ():
        for name, delta in read_adapter(gguf, spec)[0].items():
            merged[name] = merged[name] + delta if name in merged else delta
    temp = args.out + ".part"
    writer = gguf.GGUFWriter(temp, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    f16 = args.type == "f16"
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)
    for tensor in reader.tensors:
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if tensor.name in merged:
            weights = weights + merged.pop(tensor.name)
        if f16 and weights.ndim > 1:
            weights = weights.astype(np.float16)
        writer.add_tensor(tensor.name, weights)
    if merged:
        sys.exit("error: the adapter adapts tensors the base lacks: " + ", ".join(sorted(merged)[:3]))
    finish(writer, temp, args.out)


def finish(writer: Any, temp: str, out: str) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with open(temp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(temp, out)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    adapter = sub.add_parser("adapter", help="write a LoRA adapter GGUF for BASE")
    adapter.add_argument("base")
    adapter.add_argument("out")
    adapter.add_argument("--kind", choices=("zero", "delta"), required=True)
    adapter.add_argument("--rank", type=int, default=4)
    adapter.add_argument("--seed", type=int, default=DEFAULT_SEED)
    adapter.add_argument("--sigma", type=float, default=DEFAULT_SIGMA, help="B's standard deviation (delta)")
    adapter.add_argument("--alpha", type=float, help="adapter.lora.alpha (default: the rank; 0: scale as given)")
    adapter.add_argument("--name", help="general.name")
    adapter.add_argument("--base-name", help="general.base_model.0.name (llama.cpp ignores it)")
    floats = sub.add_parser("float", help="write BASE dequantized to f32/f16, adapters optionally merged")
    floats.add_argument("base")
    floats.add_argument("out")
    floats.add_argument("--type", choices=("f32", "f16"), default="f32")
    floats.add_argument("--merge", action="append", metavar="ADAPTER[:SCALE]")
    for each in (adapter, floats):
        each.add_argument("--gguf-py", help="llama.cpp's gguf-py folder (default: the installed gguf package)")
    args = parser.parse_args(argv)
    if args.command == "adapter":
        if args.rank < 1:
            parser.error("--rank must be at least 1")
        write_adapter(args)
    else:
        write_float(args)


if __name__ == "__main__":
    main()
