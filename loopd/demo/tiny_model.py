"""
A tiny, hand-wired llama GGUF that a real llama.cpp server can load and serve.

No model is downloaded: `write_tiny_model` writes every tensor itself with the PyPI
`gguf` package, and the same arguments always give the same bytes.

The model is a script, not a trained network:

- Vocabulary: 256 byte-level tokens (GPT-2's byte to symbol map) plus a few BPE-merged
  words and the Qwen3 special tokens; eos is ``<|im_end|>``.  The chat template renders
  the Qwen3 format (ChatML, ``<tools>``, ``<tool_call>``, ``<tool_response>``,
  ``<think>``), so llama-server parses reasoning and tool calls from the output.
- A bigram chain in the embeddings and the output head makes it answer
  ``<think>Let me think about this...</think>\\n\\nHello from the tiny model!`` and end
  the turn.  With ``enable_thinking: false`` the prompt already ends in ``</think>``, so
  only the answer comes.  With ``ignore_eos`` the answer repeats (long streams).
- One attention head, read only at the ``\\n\\n`` position where the answer starts,
  averages the marker tokens of the whole context: ``<tools>`` counts up,
  ``<tool_call>`` and ``<tool_response>`` count down.  The Qwen3 tool prompt holds two
  of each of the first two, so a request that offers tools and has no call yet writes
  ``<tool_call>`` instead of ``Hello``; llama.cpp's tool grammar then forces a valid
  call, kept short by fixed preferences (close strings and objects early, free strings
  are ``"test"``).  After a call or a tool result the average is negative: it answers.
- ``think_forever=True`` replaces ``...`` -> ``</think>`` with ``...`` -> `` `` ->
  ``Let``: the reasoning never ends by itself, only when the server forces
  ``</think>`` (reasoning budget or the ``reasoning_end`` control); then it answers.
- ``ballast=Ballast(ff, layers)`` adds zero-weight compute: every feed-forward is
  ``ff`` wide and the model has ``layers`` layers.  The feed-forward weights (in every
  layer) and every weight of the extra layers are zero, so each adds nothing to the
  residual stream and the answers stay exactly the same, while the server still does
  the arithmetic: prompt processing and generation cost real CPU time.  With
  ``Ballast(4096, 6)`` (19 MB) llama.cpp on 2 threads processes ~800-1,300 prompt tokens/s
  of a 3,000-token prompt: a session switch costs seconds, as with a real model.

Run ``python -m loopd.demo.tiny_model OUT.gguf [--think-forever] [--ballast FF:LAYERS]``
to write one from a script; it prints the sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass

import gguf
import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]

# Sizes: 4 heads of 16 dims; RoPE pairs dims (2i, 2i+1) and turns pair 7 slowest.
N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
HEAD_DIM = N_EMBD // N_HEAD
N_FF = 128
# A coding agent's system prompt and tools run to 70,000 tokens of this small vocabulary
# (Claude Code's, 2026), and a llama.cpp slot never gets more than the trained context.
CONTEXT_LENGTH = 262144
# RoPE turns the tool head's pairs (dims 12-15) so slowly at this base that a marker
# 260,000 tokens back still scores as one next door: at 1e6, Claude Code's 60,000 tokens
# of tools turned pair 6 by ~2 radians and every position read the markers.
ROPE_BASE = 1e10


class BallastError(ValueError):
    """A ballast size the model cannot have (narrower or shallower than the plain model)."""


@dataclass(frozen=True)
class Ballast:
    """
    Zero-weight compute ballast: the feed-forward width and layer count of a model
    that answers like the plain one but costs real time to run.

    @ivar ff: the feed-forward width of every layer, at least `N_FF`.
    @ivar layers: the number of layers, at least `N_LAYER`.
    """

    ff: int
    layers: int

    def __post_init__(self) -> None:
        """Refuse sizes below the plain model's, which would drop its wiring."""
        if self.ff < N_FF:
            raise BallastError(f"ballast feed-forward width {self.ff} is below {N_FF}")
        if self.layers < N_LAYER:
            raise BallastError(f"ballast layer count {self.layers} is below {N_LAYER}")

    @classmethod
    def parse(cls, text: str) -> Ballast:
        """Parse ``FF:LAYERS`` (e.g. ``4096:6``); `BallastError` names what is wrong."""
        ff, sep, layers = text.partition(":")
        if not sep or not ff.isdecimal() or not layers.isdecimal():
            raise BallastError(f"ballast {text!r} is not FF:LAYERS (two whole numbers)")
        return cls(int(ff), int(layers))


# What the scripted model writes: reasoning, then content.
THOUGHT = "Let me think about this..."
ANSWER = "Hello from the tiny model!"

# The Qwen3 chat format, written for this model.  Reasoning of assistant turns after
# the last user message is kept (a multi-step tool turn), older reasoning is dropped.
CHAT_TEMPLATE = r"""
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
  {%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- if tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if messages[0].role == 'system' -%}
    {{- messages[0].content + '\n\n' -}}
  {%- endif -%}
  {{- '# Tools\n\nYou may call functions to answer. Their signatures are listed in ' -}}
  {{- '<tools></tools> tags:\n<tools>' -}}
  {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
  {{- '\n</tools>\n\nTo call a function, write a JSON object with its name and ' -}}
  {{- 'arguments in <tool_call></tool_call> tags:\n<tool_call>\n' -}}
  {{- '{"name": <function-name>, "arguments": <args-json-object>}\n' -}}
  {{- '</tool_call><|im_end|>\n' -}}
{%- elif messages[0].role == 'system' -%}
  {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
  {%- set content = message.content if message.content is string else '' -%}
  {%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}
    {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' -}}
  {%- elif message.role == 'assistant' -%}
    {%- set reasoning = '' -%}
    {%- if message.reasoning_content is string -%}
      {%- set reasoning = message.reasoning_content -%}
    {%- elif '</think>' in content -%}
      {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
      {%- set content = content.split('</think>')[-1] -%}
    {%- endif -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if loop.index0 > ns.last_user and (loop.last or reasoning) -%}
      {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' -}}
      {%- set content = content.lstrip('\n') -%}
    {%- endif -%}
    {{- content -}}
    {%- if message.tool_calls -%}
      {%- for call in message.tool_calls -%}
        {%- if content or not loop.first -%}{{- '\n' -}}{%- endif -%}
        {%- set fn = call.function if call.function is defined else call -%}
        {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' -}}
        {%- if fn.arguments is string -%}
          {{- fn.arguments -}}
        {%- else -%}
          {{- fn.arguments | tojson -}}
        {%- endif -%}
        {{- '}\n</tool_call>' -}}
      {%- endfor -%}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
  {%- elif message.role == 'tool' -%}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
      {{- '<|im_start|>user' -}}
    {%- endif -%}
    {{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
      {{- '<|im_end|>\n' -}}
    {%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
  {%- if enable_thinking is defined and enable_thinking is false -%}
    {{- '<think>\n\n</think>\n\n' -}}
  {%- endif -%}
{%- endif -%}
""".strip()

# Words that get one token each, so the scripted text is a short token chain.
WORDS = (
    "\n\n",
    "Hello",
    " Hello",
    " from",
    " the",
    " tiny",
    " model",
    "Let",
    " me",
    " think",
    " about",
    " this",
    "...",
    "test",
)
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TAG_TOKENS = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<tools>",
    "</tools>",
)

# Residual dims: 0 is 1 for every token, 1 carries the tool feature, then one private
# dim per token whose successor matters (a fixed order, so both variants agree).
D_ONE = 0
D_TOOLS = 1
STATEFUL = (
    "\n",
    "<think>",
    "Let",
    " me",
    " think",
    " about",
    " this",
    "...",
    "</think>",
    "\n\n",
    "Hello",
    " Hello",
    " from",
    " the",
    " tiny",
    " model",
    "!",
    " ",
    '"',
    "<tool_call>",
    "<tools>",
    "<tool_response>",
)

CHAIN_WEIGHT = 14.0
# Averaged at "\n\n": 2 x <tools> and 2 x <tool_call> in the tool prompt give +1; one
# more <tool_call> (a call was made) gives -0.8; any <tool_response> is far below 0.
MARKER_VALUES = {"<tools>": 10.0, "<tool_call>": -8.0, "<tool_response>": -40.0}
# Preferences everywhere (through D_ONE): end the turn; inside a JSON grammar close
# strings, objects and arrays as early as possible.  Never write template markup.
PREFERENCES = {
    "<|im_end|>": 9.0,
    '"': 7.0,
    "}": 5.0,
    "{": 4.5,
    "]": 4.0,
    "<tool_call>": 3.0,
    "</tool_call>": 2.5,
    "1": 2.0,
    ",": 1.0,
    ":": 1.0,
    "<|im_start|>": -20.0,
    "<|endoftext|>": -20.0,
    "<tools>": -20.0,
    "</tools>": -20.0,
    "<tool_response>": -20.0,
    "</tool_response>": -20.0,
}


def byte_symbols() -> tuple[str, ...]:
    """Return GPT-2's printable symbol for each byte value 0..255 (byte-level BPE)."""
    printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    symbols: list[str] = []
    spare = 256
    for value in range(256):
        if value in printable:
            symbols.append(chr(value))
        else:
            symbols.append(chr(spare))
            spare += 1
    return tuple(symbols)


@dataclass(frozen=True)
class Vocab:
    """The token list, token types, BPE merges and a text -> id lookup."""

    tokens: tuple[str, ...]
    types: tuple[int, ...]
    merges: tuple[str, ...]
    ids: dict[str, int]

    def id_of(self, text: str) -> int:
        """Return the id of the single token spelling `text` (plain or special)."""
        if text in CONTROL_TOKENS or text in TAG_TOKENS:
            return self.ids[text]
        return self.ids[encode_symbols(text)]


def encode_symbols(text: str) -> str:
    """Spell `text` in byte-level BPE symbols (how the vocabulary stores it)."""
    table = byte_symbols()
    return "".join(table[b] for b in text.encode("utf-8"))


def build_vocab() -> Vocab:
    """Build the vocabulary: bytes, merged words, control tokens, tag tokens."""
    tokens: list[str] = []
    types: list[int] = []
    merges: list[str] = []
    ids: dict[str, int] = {}

    def add(token: str, kind: gguf.TokenType) -> None:
        """Give `token` the next id, unless it has one already."""
        if token not in ids:
            ids[token] = len(tokens)
            tokens.append(token)
            types.append(int(kind))

    for symbol in byte_symbols():
        add(symbol, gguf.TokenType.NORMAL)
    for word in WORDS:
        spelled = encode_symbols(word)
        prefix = spelled[0]
        for symbol in spelled[1:]:
            merge = f"{prefix} {symbol}"
            if merge not in merges:
                merges.append(merge)
            prefix += symbol
            add(prefix, gguf.TokenType.NORMAL)
    for token in CONTROL_TOKENS:
        add(token, gguf.TokenType.CONTROL)
    for token in TAG_TOKENS:
        add(token, gguf.TokenType.USER_DEFINED)
    return Vocab(tuple(tokens), tuple(types), tuple(merges), ids)


def _chain(think_forever: bool) -> list[tuple[str, str]]:
    """Return the (token, next token) pairs the model follows."""
    pairs = [("\n", "<think>")]
    thought = ["<think>", "Let", " me", " think", " about", " this", "..."]
    pairs += list(zip(thought, thought[1:], strict=False))
    if think_forever:
        pairs += [("...", " "), (" ", "Let")]
    else:
        pairs.append(("...", "</think>"))
    answer = ["</think>", "\n\n", "Hello", " from", " the", " tiny", " model", "!"]
    pairs += list(zip(answer, answer[1:], strict=False))
    pairs += [
        (" Hello", " from"),  # the repeated answer under ignore_eos
        ("<tool_call>", "\n"),  # Qwen3 writes "<tool_call>\n{...}"
        ('"', "test"),  # a free JSON string is "test", then '"' closes it
    ]
    return pairs


def _sizes(ballast: Ballast | None) -> tuple[int, int]:
    """The feed-forward width and layer count of the model with `ballast` (or none)."""
    return (N_FF, N_LAYER) if ballast is None else (ballast.ff, ballast.layers)


def build_weights(
    vocab: Vocab, *, think_forever: bool = False, ballast: Ballast | None = None
) -> dict[str, F32]:
    """Return every tensor of the model by its GGUF name (numpy shape: out, in).

    With `ballast` the feed-forwards are wider and there are more layers, all zero.
    """
    n_ff, n_layer = _sizes(ballast)
    n_vocab = len(vocab.tokens)
    dims = {vocab.id_of(text): 2 + i for i, text in enumerate(STATEFUL)}
    assert max(dims.values()) < N_EMBD

    embed = np.zeros((n_vocab, N_EMBD), np.float32)
    embed[:, D_ONE] = 1.0
    for token, dim in dims.items():
        embed[token, dim] = 1.0

    head = np.zeros((n_vocab, N_EMBD), np.float32)
    for text, weight in PREFERENCES.items():
        head[vocab.id_of(text), D_ONE] = weight
    for before, after in _chain(think_forever):
        head[vocab.id_of(after), dims[vocab.id_of(before)]] += CHAIN_WEIGHT
    blank = dims[vocab.id_of("\n\n")]
    head[vocab.id_of(" Hello"), dims[vocab.id_of("!")]] = 8.0  # only if eos is banned
    head[vocab.id_of("<tool_call>"), blank] = 4.0
    head[vocab.id_of("<tool_call>"), D_TOOLS] = 8.0
    head[vocab.id_of("Hello"), D_TOOLS] = -4.0

    tensors: dict[str, F32] = {
        "token_embd.weight": embed,
        "output_norm.weight": np.ones(N_EMBD, np.float32),
        "output.weight": head,
    }
    for layer in range(n_layer):
        shapes = {
            "attn_q": (N_EMBD, N_EMBD),
            "attn_k": (N_EMBD, N_EMBD),
            "attn_v": (N_EMBD, N_EMBD),
            "attn_output": (N_EMBD, N_EMBD),
            "ffn_gate": (n_ff, N_EMBD),
            "ffn_up": (n_ff, N_EMBD),
            "ffn_down": (N_EMBD, n_ff),
        }
        for name, shape in shapes.items():
            tensors[f"blk.{layer}.{name}.weight"] = np.zeros(shape, np.float32)
        tensors[f"blk.{layer}.attn_norm.weight"] = np.ones(N_EMBD, np.float32)
        tensors[f"blk.{layer}.ffn_norm.weight"] = np.ones(N_EMBD, np.float32)
    _wire_tool_head(tensors, vocab, dims, blank)
    return tensors


def _wire_tool_head(
    tensors: dict[str, F32], vocab: Vocab, dims: dict[int, int], blank: int
) -> None:
    """Wire layer 0, head 0: at "\\n\\n", the mean marker value lands in D_TOOLS."""
    q = tensors["blk.0.attn_q.weight"]
    k = tensors["blk.0.attn_k.weight"]
    v = tensors["blk.0.attn_v.weight"]
    o = tensors["blk.0.attn_output.weight"]
    # A 2-hot embedding (D_ONE + own dim) is 1/sqrt(2/64) = sqrt(32) after RMSNorm.
    unit = float(np.sqrt(N_EMBD / 2.0))
    # Head dims 12-15 turn slowest under RoPE (ROPE_BASE): position hardly matters.
    # Query from "\n\n" meets marker keys with score 2*unit * 2*unit / 4 = 32.
    q[14, blank] = 2.0
    # Every other position pushes markers away on dims 12/13 (score <= -32), so it
    # averages only zero values and its D_TOOLS stays 0.
    q[12, D_ONE] = 2.0
    q[12, blank] = -2.0
    for text, value in MARKER_VALUES.items():
        marker = dims[vocab.id_of(text)]
        k[14, marker] = 2.0
        k[12, marker] = -2.0
        v[0, marker] = value / unit
    o[D_TOOLS, 0] = 1.0


def write_tiny_model(
    path: str, *, think_forever: bool = False, ballast: Ballast | None = None
) -> str:
    """
    Write the model to `path` (atomically) and return the file's sha256 in hex.

    The bytes depend only on `think_forever` and `ballast`; a server that has the old
    file mapped keeps its copy, because the new file replaces the name, not the contents.
    """
    vocab = build_vocab()
    tensors = build_weights(vocab, think_forever=think_forever, ballast=ballast)
    partial = f"{path}.partial-{os.getpid()}"
    writer = gguf.GGUFWriter(partial, "llama")
    name = "loopd-tiny-think" if think_forever else "loopd-tiny"
    if ballast is not None:
        name += f"-ballast-{ballast.ff}x{ballast.layers}"
    writer.add_name(name)
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(N_EMBD)
    n_ff, n_layer = _sizes(ballast)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(ROPE_BASE)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(vocab.tokens))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(list(vocab.tokens))
    writer.add_token_types(list(vocab.types))
    writer.add_token_merges(list(vocab.merges))
    writer.add_bos_token_id(vocab.ids["<|endoftext|>"])
    writer.add_eos_token_id(vocab.ids["<|im_end|>"])
    writer.add_pad_token_id(vocab.ids["<|endoftext|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except BaseException:
        writer.close()
        with suppress(FileNotFoundError):
            os.unlink(partial)
        raise
    writer.close()
    digest = _sha256(partial)
    os.replace(partial, path)
    return digest


def _sha256(path: str) -> str:
    """Return the sha256 hex digest of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 16), b""):
            digest.update(block)
    return digest.hexdigest()


def main(argv: Sequence[str] | None = None) -> int:
    """Write a model from the command line and print its sha256."""
    parser = argparse.ArgumentParser(description="Write loopd's tiny test model.")
    parser.add_argument("output", help="the .gguf file to write")
    parser.add_argument(
        "--think-forever",
        action="store_true",
        help="reasoning that only ends when the server forces </think>",
    )
    parser.add_argument(
        "--ballast",
        type=_ballast_option,
        metavar="FF:LAYERS",
        help="zero-weight compute ballast, same answers (e.g. 4096:6)",
    )
    args = parser.parse_args(argv)
    digest = write_tiny_model(args.output, think_forever=args.think_forever, ballast=args.ballast)
    print(digest)
    return 0


def _ballast_option(text: str) -> Ballast:
    """Parse the --ballast option; its error becomes argparse's usage error."""
    try:
        return Ballast.parse(text)
    except BallastError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


if __name__ == "__main__":
    sys.exit(main())
