"""How nrvna reads a model's thinking, from its vocabulary and chat template alone.

    python scripts/thinking_vocab.py MODEL.gguf

Loads only the model's vocabulary (llama.cpp's vocab_only: no weights are read, so a file whose
tensor data is missing but whose header is whole will do) and prints what the daemon would find:
the thinking block's tags and their tokens, what the daemon writes to close or open a block, and
where a chat prompt starts: before a block (the model may open one), inside one (the template
opened it), or past it, for a plain job, a job with a grammar and a job with a budget of 0. A
model whose template does not think prints so and exits 0.
"""

from __future__ import annotations

import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import nrvna  # noqa: E402

STATES = {nrvna._ThinkRouter.BEFORE: "before a block", nrvna._ThinkRouter.INSIDE: "inside a block",
          nrvna._ThinkRouter.AFTER: "past the block", nrvna._ThinkRouter.ANSWER: "at the answer"}


class VocabRunner:
    """What _Thinking asks of a LlamaRunner, answered by a vocab-only llama_cpp.Llama."""

    def __init__(self, model: object) -> None:
        import llama_cpp

        self.model, self.llama_cpp, self.pieces = model, llama_cpp, {}
        self.grammars = self  # (what _Thinking asks of a runner's _Grammars: constrained)

    def tokenize(self, text: str, add_special: bool, special: bool) -> list[int]:
        return self.model.tokenize(text.encode("utf-8"), add_bos=add_special, special=special)

    def text(self, token: int, special: bool) -> bytes:
        buf = (ctypes.c_char * 256)()
        count = self.llama_cpp.llama_token_to_piece(self.model._model.vocab, token, buf, 256, 0, special)
        return bytes(buf[:max(count, 0)])

    def piece(self, token: int) -> bytes:
        return self.pieces.get(token) or self.text(token, False)

    def give_text(self, token: int) -> None:
        self.pieces[token] = self.text(token, True)

    def constrained(self, params: dict) -> bool:
        return "grammar" in params


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    import llama_cpp
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    model = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
    template = model.metadata.get("tokenizer.chat_template") or ""
    runner = VocabRunner(model)
    thinking = nrvna._Thinking.find(runner, template, nrvna.setting_default("thinking_tags"))
    if thinking is None:
        print("no thinking block: the chat template names none of nrvna's tags (NRVNA_THINKING_TAGS sets a pair)")
        return 0
    # noqa: E731
    show = lambda tokens: f"{tokens} {b''.join(runner.piece(t) for t in tokens).decode('utf-8', 'replace')!r}"
    print(f"tags: {thinking.tags[0]!r} {thinking.tags[1]!r}" + (" (harmony)" if thinking.headers else ""))
    for tag in thinking.tags:
        print(f"  {tag!r} is {show(runner.tokenize(tag, False, True))}")
    print(f"the daemon closes a block with {show(list(thinking.closing))}")
    print(f"and opens one with {show(thinking.opening)}")
    special = lambda name: model.metadata.get(f"tokenizer.ggml.{name}_token_id")  # noqa: E731
    names = {name: runner.text(int(special(name)), True).decode("utf-8", "replace") if special(name) else ""
             for name in ("bos", "eos")}
    formatter = Jinja2ChatFormatter(template=template, eos_token=names["eos"], bos_token=names["bos"])
    text = formatter(messages=[{"role": "user", "content": "What is 2+2?"}]).prompt
    prompt = runner.tokenize(text, False, True)
    print(f"a chat prompt ends {text[-40:]!r}")
    for what, params in (("a plain job", {}), ("a job with a grammar", {"grammar": "root ::= \"x\""}),
                         ("a job with budget 0", {"thinking_budget_tokens": 0})):
        tokens, router = thinking.start(prompt, params, 2048, 4096)
        added = f", the daemon adds {show(tokens[len(prompt):])}" if len(tokens) > len(prompt) else ""
        print(f"  {what}: starts {STATES[router.state]}{added}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
