"""Make a random-weight GGUF with a real model's tokenizer and metadata, for benchmarks where the
weights' values do not matter, only their shape (every arm ignores end-of-generation).

Shapes (llama architecture, f16 weights, f32 norms, tied output):
  smol   SmolLM2-135M's own: 30 layers, width 576, FFN 1536, 9 heads, 3 KV heads
  1b     Llama-3.2-1B's: 16 layers, width 2048, FFN 8192, 32 heads, 8 KV heads
  host   1 layer of width 64: a decode nearly free, so the host's work per token decides

The vocabulary, merges, token types, special tokens and chat template come from SOURCE, a GGUF
(SmolLM2-135M-Instruct, say) or a tokenizer-only file that ``--vocab-only`` makes from one (1.5 MB:
it travels where the 98 MB model cannot). Needs numpy and llama.cpp's gguf-py (``--gguf-py DIR``,
or the ``gguf`` package).

    python bench/random_model.py SOURCE OUT.gguf --shape smol|1b|host [--gguf-py DIR]
    python bench/random_model.py SOURCE OUT.gguf --vocab-only
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

# name -> (layers, width, FFN width, heads, KV heads)
SHAPES = {"smol": (30, 576, 1536, 9, 3), "1b": (16, 2048, 8192, 32, 8), "host": (1, 64, 128, 1, 1)}
# Keys of the source that describe its weights, not its tokenizer: written anew (or not at all).
SHAPE_KEYS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
              "attention.head_count_kv", "rope.dimension_count", "vocab_size")


def copy_metadata(reader, writer, arch: str) -> None:  # noqa: ANN001 (gguf-py types)
    import gguf

    for field in reader.fields.values():
        name = field.name
        if (name.startswith("GGUF.")
            or name in ("general.architecture", "general.file_type", "general.alignment", "general.name")
                or (name.startswith(arch + ".") and name[len(arch) + 1:] in SHAPE_KEYS)):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)


def random_tensor(rng: np.random.Generator, block: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    # One random block tiled: the values only need to be finite and small, and drawing 1e9 of
    # them would take longer than the benchmark's model load.
    start = int(rng.integers(0, block.size))
    return np.resize(np.roll(block, start), shape)


def make(source: str, out: str, shape: str | None) -> None:
    import gguf

    reader = gguf.GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(out, "llama")
    copy_metadata(reader, writer, arch)
    if shape is None:
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        tensors: dict[str, np.ndarray] = {}
    else:
        layers, width, ffn, heads, kv_heads = SHAPES[shape]
        head = width // heads
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
        writer.add_name(f"random {shape}-shaped model with the vocabulary of {source.rsplit('/', 1)[-1]}")
        writer.add_block_count(layers)
        writer.add_embedding_length(width)
        writer.add_feed_forward_length(ffn)
        writer.add_head_count(heads)
        writer.add_head_count_kv(kv_heads)
        writer.add_rope_dimension_count(head)
        writer.add_vocab_size(vocab)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
        rng = np.random.default_rng(0)
        block = (rng.standard_normal(1 << 20, dtype=np.float32) * 0.02).astype(np.float16)
        ones = np.ones(width, dtype=np.float32)
        # The embedding is the output layer too (tied): drawn whole, not tiled, so no two tokens
        # share a row, hence a logit (tied logits would make every step a case of ties).
        embedding = (rng.standard_normal((vocab, width), dtype=np.float32) * 0.02).astype(np.float16)
        tensors = {"token_embd.weight": embedding, "output_norm.weight": ones}
        for i in range(layers):
            for name, dims in (("attn_q", (width, width)), ("attn_k", (kv_heads * head, width)),
                               ("attn_v", (kv_heads * head, width)), ("attn_output", (width, width)),
                               ("ffn_gate", (ffn, width)), ("ffn_up", (ffn, width)), ("ffn_down", (width, ffn))):
                tensors[f"blk.{i}.{name}.weight"] = random_tensor(rng, block, dims)
            tensors[f"blk.{i}.attn_norm.weight"] = ones
            tensors[f"blk.{i}.ffn_norm.weight"] = ones
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a GGUF whose tokenizer and metadata to copy")
    parser.add_argument("out")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--shape", choices=tuple(SHAPES))
    what.add_argument("--vocab-only", action="store_true", help="only the tokenizer and metadata, no tensors")
    parser.add_argument("--gguf-py", help="llama.cpp's gguf-py folder (default: the installed gguf package)")
    args = parser.parse_args()
    if args.gguf_py:
        sys.path.insert(0, args.gguf_py)
    make(args.source, args.out, args.shape)


if __name__ == "__main__":
    main()
