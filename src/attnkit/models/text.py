"""Text in, text out: a checkpoint folder's tokenizer around :class:`attnkit.models.Decoder`.

    >>> gen = TextGenerator("path/to/folder")                     # doctest: +SKIP
    >>> for piece in gen.stream("The capital of France is", max_new_tokens=16):  # doctest: +SKIP
    ...     print(piece, end="", flush=True)

The tokenizer comes from the same folder, never from the network: transformers'
``AutoTokenizer.from_pretrained(folder, local_files_only=True)`` when transformers is installed,
else the ``tokenizers`` package's ``tokenizer.json`` (``pip install 'attnkit[text]'``).

Streaming never splits a character: after each token the whole generated id list is decoded and
only the new, stable suffix is emitted; a trailing U+FFFD (an incomplete UTF-8 sequence, e.g.
the first byte-token of an emoji) is held back until the next token completes it. The pieces
joined equal ``decode(all generated ids)``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from .decoder import Decoder

__all__ = ["TextGenerator", "TextStats", "IncrementalDecoder", "load_tokenizer", "TokenizerNotFound"]

_REPLACEMENT = "\ufffd"


class TokenizerNotFound(FileNotFoundError):
    """The checkpoint folder has no tokenizer attnkit can read (it never downloads one)."""


# ---------------------------------------------------------------------------- tokenizers


class _Tokenizer:
    """What TextGenerator needs of a tokenizer, over transformers' or the ``tokenizers`` package's."""

    def __init__(self, tok, kind: str, folder: Path):
        self.tok, self.kind, self.folder = tok, kind, folder
        self._config = _read_json(folder / "tokenizer_config.json")

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if self.kind == "transformers":
            return list(self.tok(text, add_special_tokens=add_special_tokens)["input_ids"])
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        if not token:
            return None
        if self.kind == "transformers":
            i = self.tok.convert_tokens_to_ids(token)
            return None if i == getattr(self.tok, "unk_token_id", None) and token != self.tok.unk_token else i
        return self.tok.token_to_id(token)

    def eos_ids(self) -> list[int]:
        if self.kind == "transformers":
            i = self.tok.eos_token_id
            return [] if i is None else [int(i)]
        eos = self._config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        i = self.token_id(eos)
        return [] if i is None else [i]

    def chat_template(self) -> str | None:
        if self.kind == "transformers" and getattr(self.tok, "chat_template", None):
            return self.tok.chat_template
        t = self._config.get("chat_template")
        if isinstance(t, str):
            return t
        f = self.folder / "chat_template.jinja"
        return f.read_text() if f.is_file() else None

    def render_chat(self, messages: list[dict]) -> str:
        """The folder's chat template applied to ``messages``, with the assistant's turn opened."""
        template = self.chat_template()
        if template is None:
            raise ValueError(f"{self.folder} has no chat template (tokenizer_config.json 'chat_template' or "
                             f"chat_template.jinja): --chat / chat=True needs one")
        if self.kind == "transformers":
            return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # torch depends on jinja2

        def raise_exception(message):
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
        special = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            v = self._config.get(name)
            special[name] = v.get("content") if isinstance(v, dict) else v
        return env.from_string(template).render(messages=messages, add_generation_prompt=True, **special)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def _module_available(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None


def load_tokenizer(folder) -> _Tokenizer:
    """The tokenizer saved in ``folder``: transformers' (tokenizer_config.json / tokenizer.json /
    vocabulary files) when transformers is installed, else ``tokenizer.json`` through the
    ``tokenizers`` package. Raises :class:`TokenizerNotFound` saying what is missing."""
    d = Path(folder)
    if not d.is_dir():
        what = "does not exist" if not d.exists() else "is not a directory"
        raise FileNotFoundError(f"{d} {what} (expected a save_pretrained checkpoint folder: config.json, weights and "
                                f"tokenizer files)")
    has_json = (d / "tokenizer.json").is_file()
    has_hf = (d / "tokenizer_config.json").is_file()
    if not (has_json or has_hf):
        raise TokenizerNotFound(
            f"{d} has no tokenizer: expected tokenizer.json (read with the `tokenizers` package, "
            f"pip install 'attnkit[text]') or a transformers tokenizer (tokenizer_config.json and its vocabulary "
            f"files). Save one into the folder with tokenizer.save_pretrained('{d}'); attnkit never downloads one.")
    if has_hf and _module_available("transformers"):
        from transformers import AutoTokenizer
        return _Tokenizer(AutoTokenizer.from_pretrained(str(d), local_files_only=True), "transformers", d)
    if has_json:
        if not _module_available("tokenizers"):
            raise ImportError(f"{d}/tokenizer.json needs the `tokenizers` package (pip install 'attnkit[text]') or "
                              f"transformers (pip install 'attnkit[hf]')")
        from tokenizers import Tokenizer
        return _Tokenizer(Tokenizer.from_file(str(d / "tokenizer.json")), "tokenizers", d)
    raise TokenizerNotFound(f"{d} has tokenizer_config.json but no tokenizer.json: reading it needs transformers "
                            f"(pip install 'attnkit[hf]')")


# ---------------------------------------------------------------------------- streaming


class IncrementalDecoder:
    """Text of a growing token list, one stable piece at a time.

    ``push(id)`` decodes every id so far and returns what is new since the last piece, holding
    back a trailing U+FFFD (bytes of a character still to come); ``flush()`` returns whatever is
    left once generation ends. The pieces joined equal ``decode(ids)``."""

    def __init__(self, decode):
        self._decode = decode
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        text = self._decode(self.ids)
        stable = text.rstrip(_REPLACEMENT)
        if not stable.startswith(self.emitted):  # the tokenizer rewrote earlier text: wait for it to settle
            return ""
        piece = stable[len(self.emitted):]
        self.emitted = stable
        return piece

    def flush(self) -> str:
        text = self._decode(self.ids)
        if not text.startswith(self.emitted):  # nothing emitted can be taken back
            return ""
        piece, self.emitted = text[len(self.emitted):], text
        return piece


@dataclass
class TextStats:
    """Numbers of the last :meth:`TextGenerator.stream` call."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    first_token_seconds: float = 0.0
    kv_cache_bytes: int = 0
    finish_reason: str = ""

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second after the first (decode speed)."""
        t = self.seconds - self.first_token_seconds
        return (self.new_tokens - 1) / t if self.new_tokens > 1 and t > 0 else float("nan")


class TextGenerator:
    """A checkpoint folder's decoder and tokenizer: prompts in, text out.

    Args:
        folder: a ``save_pretrained`` folder (config.json + weights + tokenizer files).
        dtype, device: as :meth:`attnkit.models.Decoder.from_pretrained`.

    Attributes:
        model: the :class:`Decoder`; tokenizer: the folder's tokenizer; eos: stop token ids
            (generation_config.json, else config.json, else the tokenizer's EOS);
        stats: :class:`TextStats` of the last call.
    """

    def __init__(self, folder, *, dtype: torch.dtype | None = None, device=None):
        self.folder = Path(folder)
        self.tokenizer = load_tokenizer(self.folder)  # first: a missing tokenizer fails before loading weights
        self.model = Decoder.from_pretrained(self.folder, dtype=dtype, device=device)
        self.eos = self._eos_ids()
        self.stats = TextStats()

    def _eos_ids(self) -> list[int]:
        for source in (_read_json(self.folder / "generation_config.json"), getattr(self.model, "hf_config", {}) or {}):
            e = source.get("eos_token_id")
            if e is not None:
                return [int(x) for x in (e if isinstance(e, list) else [e])]
        return self.tokenizer.eos_ids()

    def encode(self, prompt: str, *, chat: bool = False) -> list[int]:
        """Token ids of ``prompt`` (with ``chat``: the folder's chat template around one user turn)."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        if chat:
            return self.tokenizer.encode(self.tokenizer.render_chat([{"role": "user", "content": prompt}]),
                                         add_special_tokens=False)
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise ValueError("the prompt encodes to no tokens; give some text")
        return ids

    def stream(self, prompt: str, max_new_tokens: int = 64, *, chat: bool = False, temperature: float = 0.0,
               top_k: int | None = None, top_p: float | None = None, cache: str = "dynamic",
               seed: int | None = None, kv_dtype=None) -> Iterator[str]:
        """Yield the continuation of ``prompt`` piece by piece (never half a character), stopping
        at an EOS token or after ``max_new_tokens``. Sampling options and ``kv_dtype`` (a
        quantized KV cache: "int8", "fp8_e4m3") as :meth:`attnkit.models.Decoder.generate`.
        ``self.stats`` is filled when it ends."""
        ids = self.encode(prompt, chat=chat)
        steps = self.model.stream([ids], max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                  eos=self.eos or None, cache=cache, seed=seed, kv_dtype=kv_dtype)
        return self._pieces(ids, steps, kv_dtype)

    def _pieces(self, ids: list[int], steps, kv_dtype=None) -> Iterator[str]:
        dec = IncrementalDecoder(self.tokenizer.decode)
        eos = set(self.eos)
        self.stats = stats = TextStats(prompt_tokens=len(ids), finish_reason="length")
        t0 = time.perf_counter()
        for step in steps:
            tok = step[0]
            if tok is None:
                break
            stats.new_tokens += 1
            if stats.new_tokens == 1:
                stats.first_token_seconds = time.perf_counter() - t0
            if tok in eos:
                stats.finish_reason = "eos"
                break
            piece = dec.push(tok)
            if piece:
                yield piece
        rest = dec.flush()
        if rest:
            yield rest
        stats.seconds = time.perf_counter() - t0
        stats.kv_cache_bytes = (stats.prompt_tokens + stats.new_tokens) * self.model.kv_bytes_per_token(
            kv_dtype=kv_dtype)

    def generate(self, prompt: str, max_new_tokens: int = 64, **kwargs) -> str:
        """The whole continuation as one string (see :meth:`stream`)."""
        return "".join(self.stream(prompt, max_new_tokens, **kwargs))
