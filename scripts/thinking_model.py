"""Copy a GGUF model with another chat template: a "thinking" (or tool-calling) SmolLM2 for nrvna's tests.

    python scripts/thinking_model.py SRC.gguf DST.gguf [--style open|model|harmony|tools|none] [--template-file FILE]

Writes DST: SRC's header with ``tokenizer.chat_template`` replaced (added if SRC has none; removed
with ``--style none``), then
SRC's tensor infos and tensor data byte for byte: no weight changes. The data section starts at
the file's alignment (``general.alignment``, else 32), so it is realigned after the new header;
tensor offsets count from the data section's start and stay as they are.

Each template is SmolLM2's own ChatML, with Qwen3's thinking convention or Qwen2.5's tool calls:

- ``--style open`` (default): the assistant turn opens a ``<think>`` block in the prompt
  (``<|im_start|>assistant\\n<think>\\n``), as DeepSeek-R1's and Qwen3.5's templates do, unless
  ``enable_thinking`` is false, when the block is written closed and empty
  (``<think>\\n\\n</think>\\n\\n``), as Qwen3's template does;
- ``--style model``: Qwen3's original form: nothing is opened for the model (a thinking model
  writes ``<think>`` itself), and the closed empty block when ``enable_thinking`` is false;
- ``--style harmony``: gpt-oss's channels, reduced (``<|start|>assistant`` for the model to pick
  ``<|channel|>analysis<|message|>`` or ``<|channel|>final<|message|>``); SmolLM2 has none of
  these as tokens, so they are text to it, which is all the router needs;
- ``--style tools``: no thinking; SmolLM2's ChatML with Qwen2.5-Instruct's tool section. Given
  ``tools``, the system turn holds the system text (or SmolLM2's default) then a ``# Tools``
  section listing each tool as JSON between ``<tools></tools>`` and asking for calls as
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; an assistant message's
  ``tool_calls`` are written in that form after its content (None is empty; arguments already a
  string are written as they are); ``tool`` messages become ``<tool_response>`` blocks in a user
  turn, consecutive ones sharing it. Without ``tools`` it renders as SmolLM2's own template.
  llama-server ``--jinja`` recognises the form and parses the calls back.
- ``--style none``: no chat template at all (the key removed), as some published GGUFs come
  (Gemma 3 270M's): the model nrvna renders in its fallback form (ChatML, docs/models.md).

Earlier assistant turns keep only what follows their ``</think>`` (Qwen3's rule). SmolLM2 was
never trained to think (nor to call tools): what it writes inside the block is whatever it
writes, which is all a test of the engine's bookkeeping needs.

Standard library only (nrvna itself must not need the ``gguf`` package). The output is written
to a temporary file beside DST and renamed into place once whole.
"""

from __future__ import annotations

import argparse
import os
import shutil
import struct
import sys
from typing import BinaryIO, Optional

# GGUF value types (gguf-py's GGUFValueType): fixed sizes, then string (8) and array (9).
SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY, UINT32 = 8, 9, 4
TEMPLATE_KEY = "tokenizer.chat_template"
DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT
MAX_STRING = 1 << 26  # a header string longer than this is a damaged file, not a template

# SmolLM2's default system message, as its own template writes it.
_SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# SmolLM2's template (ChatML, its default system message) with Qwen3's thinking block.
_HISTORY = (
    "{%- for message in messages %}"
    "{%- if loop.first and messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\n" + _SMOL_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
)
# SmolLM2's ChatML (its default system message) with Qwen2.5-Instruct's tool section, no thinking.
# As Qwen2.5's template does: with ``tools``, one system turn holds the system text (or the
# default) then the "# Tools" section, each tool ``| tojson`` on a line of its own; an assistant
# message's ``tool_calls`` follow its content as <tool_call> blocks ({"name": ..., "arguments":
# ...}); ``tool`` messages are <tool_response> blocks inside a user turn, consecutive ones sharing
# it. Unlike Qwen2.5's: a content that is not a string (None for an assistant that only calls) is
# empty, and arguments already a string (OpenAI's form) are written as they are, not re-encoded.
_TOOLS = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- if messages[0]['content'] is string %}{{- messages[0]['content'] }}{%- endif %}"
    "{%- else %}"
    "{{- '" + _SMOL_SYSTEM + "' }}"
    "{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}"
    "{{- '\\n' }}{{- tool | tojson }}"
    "{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages and messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\n" + _SMOL_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set content = message['content'] %}"
    "{%- else %}{%- set content = '' %}{%- endif %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if content %}{{- '\\n' + content }}{%- endif %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if tool_call['function'] is defined %}{%- set tool_call = tool_call['function'] %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call['name'] }}{{- '\", \"arguments\": ' }}"
    "{%- if tool_call['arguments'] is string %}{{- tool_call['arguments'] }}"
    "{%- else %}{{- tool_call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TEMPLATES = {
    "open": _HISTORY + (
        "{%- if add_generation_prompt %}"
        "{{- '<|im_start|>assistant\\n' }}"
        "{%- if enable_thinking is defined and enable_thinking is false %}"
        "{{- '<think>\\n\\n</think>\\n\\n' }}"
        "{%- else %}"
        "{{- '<think>\\n' }}"
        "{%- endif %}"
        "{%- endif %}"),
    # gpt-oss's harmony format, reduced: a system message naming the reasoning effort, turns as
    # <|start|>ROLE<|message|>...<|end|>, an assistant's answer on the final channel, and a bare
    # <|start|>assistant for the model to pick its channel (analysis: thinking; final: the answer).
    "harmony": (
        "{{- '<|start|>system<|message|>You are SmolLM.\nReasoning: ' + (reasoning_effort or 'medium') + '<|end|>' }}"
        "{%- for message in messages %}"
        "{%- if message['role'] == 'assistant' %}"
        "{{- '<|start|>assistant<|channel|>final<|message|>' + message['content'] + '<|end|>' }}"
        "{%- else %}"
        "{{- '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"),
    "model": _HISTORY + (
        "{%- if add_generation_prompt %}"
        "{{- '<|im_start|>assistant\\n' }}"
        "{%- if enable_thinking is defined and enable_thinking is false %}"
        "{{- '<think>\\n\\n</think>\\n\\n' }}"
        "{%- endif %}"
        "{%- endif %}"),
    "tools": _TOOLS,
}


class Header:
    """A GGUF header read from a file: its key/value pairs kept as raw bytes (but the ones
    this script reads or replaces), the tensor infos as raw bytes, and where the data starts."""

    def __init__(self, handle: BinaryIO, size: int) -> None:
        self.handle, self.size = handle, size
        if handle.read(4) != b"GGUF":
            raise SystemExit("not a GGUF file (no GGUF magic)")
        self.version = self._unpack("<I")
        if self.version < 2:
            raise SystemExit(f"GGUF version {self.version}: only versions 2 and later are read")
        self.n_tensors = self._unpack("<Q")
        n_kv = self._unpack("<Q")
        self.pairs: list[tuple[str, bytes]] = []  # (key, its type and value as written)
        self.alignment = DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            key = self._string().decode("utf-8")
            start = handle.tell()
            kind = self._unpack("<I")
            if key == "general.alignment" and kind == UINT32:
                self.alignment = self._unpack("<I")
            else:
                self._skip_value(kind)
            end = handle.tell()
            handle.seek(start)
            self.pairs.append((key, handle.read(end - start)))
        start = handle.tell()
        for _ in range(self.n_tensors):
            self._string()
            n_dims = self._unpack("<I")
            handle.seek(8 * n_dims + 4 + 8, 1)  # dims, type, offset
        end = handle.tell()
        handle.seek(start)
        self.tensor_infos = handle.read(end - start)
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise SystemExit(f"general.alignment is {self.alignment}, not a power of two")
        self.data_start = _aligned(end, self.alignment)
        if self.data_start > size:
            raise SystemExit("the file ends inside its header")

    def _unpack(self, fmt: str) -> int:
        want = struct.calcsize(fmt)
        data = self.handle.read(want)
        if len(data) < want:
            raise SystemExit("the file ends inside its header")
        return struct.unpack(fmt, data)[0]

    def _string(self) -> bytes:
        length = self._unpack("<Q")
        if length > MAX_STRING or self.handle.tell() + length > self.size:
            raise SystemExit(f"a header string of {length} bytes runs past the file's end")
        return self.handle.read(length)

    def _skip_value(self, kind: int) -> None:
        if kind in SCALAR_SIZES:
            self.handle.seek(SCALAR_SIZES[kind], 1)
        elif kind == STRING:
            self.handle.seek(self._unpack("<Q"), 1)
        elif kind == ARRAY:
            item, count = self._unpack("<I"), self._unpack("<Q")
            if item in SCALAR_SIZES:
                self.handle.seek(SCALAR_SIZES[item] * count, 1)
            else:
                for _ in range(count):
                    self._skip_value(item)
        else:
            raise SystemExit(f"unknown GGUF value type {kind}")
        if self.handle.tell() > self.size:
            raise SystemExit("the file ends inside its header")


def _aligned(offset: int, alignment: int) -> int:
    return offset + (-offset) % alignment


def _string_bytes(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def copy_with_template(src: str, dst: str, template: Optional[str]) -> None:
    """Write ``dst``: ``src`` with ``tokenizer.chat_template`` set to ``template`` (None: removed)."""
    size = os.path.getsize(src)
    with open(src, "rb") as handle:
        header = Header(handle, size)
        value = None if template is None else struct.pack("<I", STRING) + _string_bytes(template)
        pairs = [(key, raw if key != TEMPLATE_KEY else value) for key, raw in header.pairs
                 if key != TEMPLATE_KEY or value is not None]
        if value is not None and not any(key == TEMPLATE_KEY for key, _ in pairs):
            pairs.append((TEMPLATE_KEY, value))
        out = bytearray(b"GGUF" + struct.pack("<IQQ", header.version, header.n_tensors, len(pairs)))
        for key, raw in pairs:
            out += _string_bytes(key) + raw
        out += header.tensor_infos
        out += bytes(_aligned(len(out), header.alignment) - len(out))
        temp = f"{dst}.{os.getpid()}.tmp"
        try:
            with open(temp, "wb") as sink:
                sink.write(out)
                handle.seek(header.data_start)
                shutil.copyfileobj(handle, sink, 1 << 22)
                sink.flush()
                os.fsync(sink.fileno())
            os.replace(temp, dst)
        except BaseException:
            if os.path.exists(temp):
                os.unlink(temp)
            raise


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", help="the GGUF to copy")
    parser.add_argument("dst", help="the copy to write")
    parser.add_argument("--style", choices=sorted(TEMPLATES) + ["none"], default="open",
                        help="open: the template opens <think> in the prompt (default); model: the model "
                             "writes <think> itself (Qwen3's original form); harmony: gpt-oss's channels, "
                             "reduced; tools: no thinking, Qwen2.5-Instruct's tool calls (<tools>, "
                             "<tool_call>, <tool_response>); none: no chat template (the key removed)")
    parser.add_argument("--template-file", metavar="FILE", help="write this template instead")
    args = parser.parse_args(argv)
    if os.path.abspath(args.src) == os.path.abspath(args.dst):
        parser.error("the copy must be a file of its own")
    if args.template_file:
        with open(args.template_file, encoding="utf-8") as handle:
            template = handle.read()
    else:
        template = TEMPLATES.get(args.style)  # none: no template
    copy_with_template(args.src, args.dst, template)
    print(args.dst)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
