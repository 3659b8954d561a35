"""Batched generation for :class:`attnkit.models.Decoder`: greedy or sampled, ragged prompts,
per-sequence EOS, streaming, and a decode step that ``torch.compile`` runs without recompiles.

Every step is one :meth:`Decoder.forward` (the one path). Ragged batches are right-padded and
never store padding: the prefill tells the caches how many tokens of each row are real
(``num_new``), so sequence b's cache holds its ``n_b`` prompt tokens, and each decode step
appends one token per sequence at that sequence's own length (its own RoPE position and causal
``q_start``). Every sequence computes what it computes alone. Equal prompts keep every cache uniform
(one slice write per step, a plain causal mask).

Resources grow with the work done: the output and (with ``cache="dynamic"`` or ``None``) the
caches grow as tokens come, so ``max_new_tokens`` is a bound, not an allocation. ``"static"``
and ``"paged"`` caches are fixed-capacity by design (what ``torch.compile`` needs, or a block
pool): they are built for ``P + max_new_tokens`` positions up front, and a capacity beyond the
device's memory is refused with an error that says so.

Notation: B prompts, P longest prompt, T = max_new_tokens, V vocabulary.
"""

from __future__ import annotations

import itertools
import os
import time
import types
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor

from .. import native
from ..kvquant import kv_storage_dtype

#: What ``cache=`` takes. "dynamic" builds the decoder's "sliding" caches: they grow like dynamic
#: ones, and a sliding-window layer keeps just its window (same tokens, less memory).
CACHES = ("dynamic", "static", "paged")

__all__ = ["generate", "stream", "Generation", "sample_next", "GenerationMixin"]


class GenerationMixin:
    """:meth:`generate` and :meth:`stream` as methods of :class:`attnkit.models.Decoder`.

    The functions of this module run any model that inherits it and provides the decoder's
    interface: ``forward(ids, caches=, num_new=, logits_to_keep=)``, ``new_caches``,
    ``kv_bytes_per_token``, ``config`` (``vocab_size``, ``max_position_embeddings``), ``device``
    and ``dtype``."""

    def generate(self, prompts, max_new_tokens: int = 32, **kwargs) -> "Generation":
        """See :func:`attnkit.models.generate`."""
        return generate(self, prompts, max_new_tokens, **kwargs)

    def stream(self, prompts, max_new_tokens: int = 32, **kwargs) -> Iterator[list[int | None]]:
        """See :func:`attnkit.models.stream`."""
        return stream(self, prompts, max_new_tokens, **kwargs)


@dataclass
class Generation:
    """What :func:`generate` returns.

    Attributes:
        tokens: the new tokens of each prompt (through the EOS token when it stopped on one).
        prompts: the prompts, as lists of ints.
        finish_reasons: per prompt, "eos" or "length".
        prefill_seconds: wall time from the call to the first new token of every sequence.
        decode_seconds: wall time of the remaining decode steps (the timed ones).
        decode_steps: the timed forward passes after the prefill.
        compile_seconds: with ``compile``, the wall time of the first decode step of a
            configuration that had not run before (its compilation included); that step is
            not among the timed ones. 0 otherwise.
        decode_tokens: tokens the timed decode steps produced over the batch (None: every
            token after each sequence's first).
    """

    tokens: list[list[int]]
    prompts: list[list[int]]
    finish_reasons: list[str]
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    compile_seconds: float = 0.0
    decode_tokens: int | None = None

    @property
    def sequences(self) -> list[list[int]]:
        """Prompt followed by its new tokens, per prompt."""
        return [p + t for p, t in zip(self.prompts, self.tokens)]

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens produced by the decode steps per second, over the whole batch (each step
        produces one token per sequence still running)."""
        made = sum(max(len(t) - 1, 0) for t in self.tokens) if self.decode_tokens is None else self.decode_tokens
        return made / self.decode_seconds if self.decode_seconds > 0 else float("nan")


# ---------------------------------------------------------------------------- sampling


def sample_next(logits: Tensor, *, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> Tensor:
    """Next token (B,) from logits (B, V): argmax for ``temperature == 0``, else a sample of
    ``softmax(logits / temperature)`` restricted to the ``top_k`` largest logits and to the
    smallest set of tokens whose probability reaches ``top_p`` (nucleus). The most likely token
    always stays allowed.

    Raises FloatingPointError when a row's logits hold NaN or +inf (a diverged model: there is no
    meaningful next token), naming the rows."""
    bad = _nonfinite_rows(logits)
    if bad:
        raise FloatingPointError(f"logits of rows {bad[:8]} contain NaN or +inf: no next token can be chosen "
                                 "(the model's output is not finite)")
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if torch.isposinf(logits).any():
        raise ValueError(f"temperature={temperature!r} is too small for these logits: logits / temperature "
                         f"overflows fp32 (use temperature=0 for greedy decoding)")
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the strictly more likely tokens
        # Drop a token once the strictly more likely ones already reach top_p (the first never).
        sorted_logits = sorted_logits.masked_fill(before >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _nonfinite_rows(logits: Tensor, running: Tensor | None = None) -> list[int]:
    """Rows (of ``running`` ones) whose logits (B, V) hold NaN or +inf (-inf is a banned token)."""
    bad = (torch.isnan(logits) | torch.isposinf(logits)).any(-1)
    if running is not None:
        bad &= running
    return bad.nonzero().flatten().tolist() if bool(bad.any()) else []


# ---------------------------------------------------------------------------- arguments


def _as_prompts(prompts, vocab_size: int) -> list[list[int]]:
    if isinstance(prompts, Tensor):
        if prompts.dtype.is_floating_point or prompts.dim() not in (1, 2):
            raise ValueError(f"prompts must be a (P,) or (B, P) integer tensor, got {prompts.dtype} of "
                             f"shape {tuple(prompts.shape)}")
        rows = prompts.tolist()
        rows = [rows] if prompts.dim() == 1 else rows
    elif isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)):
        if len(prompts) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            rows = [list(prompts)]  # one prompt given as a list of ints
        else:
            rows = []
            for i, p in enumerate(prompts):
                if isinstance(p, Tensor):
                    if p.dim() != 1 or p.dtype.is_floating_point:
                        raise ValueError(f"prompt {i} must be a 1-D integer tensor, got {p.dtype} of "
                                         f"shape {tuple(p.shape)}")
                    p = p.tolist()
                if not isinstance(p, Sequence) or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                    raise TypeError(f"prompt {i} must be a sequence of ints or a 1-D tensor, got {p!r:.80}")
                rows.append(list(p))
    else:
        raise TypeError(f"prompts must be a tensor or a list of token-id lists, got {type(prompts).__name__}")
    if not rows:
        raise ValueError("prompts is empty: give at least one prompt")
    for i, r in enumerate(rows):
        if not r:
            raise ValueError(f"prompt {i} is empty; generation starts from at least one token")
        bad = [t for t in r if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    return rows


def _check_options(max_new_tokens, temperature, top_k, top_p, eos, cache, compile, vocab_size, kv_dtype=None):
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or a number in (0, 1], got {top_p!r}")
    if eos is None:
        eos_ids: list[int] = []
    elif isinstance(eos, int) and not isinstance(eos, bool):
        eos_ids = [eos]
    elif isinstance(eos, (list, tuple, set, frozenset)) and all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
        eos_ids = sorted(eos)
    else:
        raise TypeError(f"eos must be None, a token id or a collection of token ids, got {eos!r}")
    bad = [e for e in eos_ids if not 0 <= e < vocab_size]
    if bad:
        raise ValueError(f"eos ids {bad} are outside the vocabulary [0, {vocab_size})")
    if cache is not None and cache not in CACHES:
        raise ValueError(f"cache must be one of {CACHES} or None (recompute every step), got {cache!r}")
    if not isinstance(compile, (bool, str)):
        raise TypeError(f"compile must be a bool or a torch.compile backend name, got {compile!r}")
    if compile and cache != "static":
        raise ValueError(f"compile needs cache='static' (fixed shapes); cache={cache!r} changes shape every step")
    if kv_storage_dtype(kv_dtype) is not None and cache is None:
        raise ValueError(f"kv_dtype={kv_dtype!r} quantizes the KV cache, but cache=None recomputes every step "
                         f"without one; pick a cache")
    return eos_ids


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


#: The smallest capacity of a compiled step's static caches (:func:`compiled_capacity`).
MIN_COMPILED_CAPACITY = 256


def spare_capacity_is_free(device: torch.device) -> bool:
    """Whether a compiled decode step over a static cache on ``device`` reads each row's keys
    alone, so that capacity past them costs memory and no time: on CPU with the native split-K
    engine, which takes each row's length. Elsewhere the step reads the whole capacity under a
    key-padding mask (CUDA's SDPA for plain decode; torch's ops without a C++ compiler)."""
    return device.type == "cpu" and native.implementation(build=False) == "native"


def compiled_capacity(total: int, limit: int | None = None) -> int:
    """The capacity a new compiled decode step's static caches get for a call of ``total``
    positions (longest prompt + max_new_tokens) where spare capacity is free
    (:func:`spare_capacity_is_free`): the next power of two from :data:`MIN_COMPILED_CAPACITY`,
    and no more than ``limit`` (the model's ``max_position_embeddings``) rounded up to 64 when
    ``total`` fits in it. (Where spare capacity costs time, generation rounds ``total`` up to 64.)

    Later calls of any length up to that capacity reuse the step (:meth:`_CompiledSteps.fitting`)
    instead of compiling their own: a compile costs seconds (tens with inductor on a CPU)."""
    cap = max(MIN_COMPILED_CAPACITY, 1 << (total - 1).bit_length())
    if limit and total <= limit:
        cap = min(cap, _round_up(limit, 64))
    return max(cap, total)


def _device_memory(device: torch.device) -> int | None:
    """Bytes of memory of ``device`` (CPU: physical RAM), or None where unknown."""
    try:
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError, RuntimeError):  # pragma: no cover - platform dependent
        return None
    return None


def _check_capacity(model: GenerationMixin, kind: str, batch: int, capacity: int, kv_dtype=None) -> None:
    """Refuse a fixed-capacity cache larger than the device's memory, with the arithmetic."""
    per_token = model.kv_bytes_per_token(kv_dtype=kv_dtype)
    need = batch * capacity * per_token
    have = _device_memory(model.device)
    if have is not None and need > have:
        raise ValueError(
            f"cache={kind!r} preallocates its whole capacity: {batch} sequence(s) x {capacity} positions (longest "
            f"prompt + max_new_tokens{', rounded up for compile' if kind == 'static' else ''}) x "
            f"{per_token} bytes per token = {need / 2**30:.1f} GiB, more than the "
            f"{have / 2**30:.1f} GiB of {model.device}; lower max_new_tokens, or use cache='dynamic', which grows "
            f"with the tokens actually generated")


# ---------------------------------------------------------------------------- the session


#: Compiled decode steps kept per model (least recently used dropped first). Each holds static
#: caches of its batch size and capacity, so the bound is also one on their memory.
MAX_COMPILED_STEPS = 8

_step_names = itertools.count()


class _CompiledStep:
    """One configuration's static caches and its decode step compiled with ``fullgraph=True``.

    Dynamo keeps compiled graphs, and counts recompiles against ``torch._dynamo.config``'s
    ``recompile_limit``, per code object. Every step gets a code object of its own, so the
    configurations of every model in the process never add up against one limit and nothing
    recompiles when generation switches between them; dynamo's settings stay as they are. A step
    that cannot be compiled anyway (the limit, a graph break, a compiler failure) runs eagerly from
    then on, with a warning that says why: compiling never fails a generation eager would finish.
    Nothing here holds the model strongly (it is reached through a weakref)."""

    def __init__(self, model: GenerationMixin, caches: list, backend: str, what: str):
        self.model, self.caches, self.what = weakref.ref(model), caches, what
        self.backend = backend
        self.calls = 0  # the first compiles (generate times it apart from the decode steps)
        step = _own_code(_step_function(self.model, caches), f"decode_step_{next(_step_names)}")
        self.fn: Callable[[Tensor], Tensor] | None = torch.compile(
            step, backend=backend, fullgraph=True, **compile_settings(backend, model.device.type))

    def __call__(self, ids: Tensor) -> Tensor:
        self.calls += 1
        if self.fn is not None:
            try:
                return self.fn(ids)
            except Exception as e:  # noqa: BLE001 - only compilation's own refusals are caught
                if not _compile_refused(e):
                    raise
                self.fn = None
                reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
                warnings.warn(f"generate(compile={self.backend!r}): the decode step for {self.what} could not be "
                              f"compiled ({type(e).__name__}: {reason}); it runs eagerly from now on (the same "
                              f"tokens, without compilation's speed)", RuntimeWarning, stacklevel=2)
        return self.model()(ids, caches=self.caches, logits_to_keep=1)[:, -1]


def _step_function(model: "weakref.ref[GenerationMixin]", caches: list) -> Callable[[Tensor], Tensor]:
    def step(ids: Tensor) -> Tensor:
        return model()(ids, caches=caches, logits_to_keep=1)[:, -1]
    return step


def _own_code(fn: types.FunctionType, name: str) -> types.FunctionType:
    """``fn`` with a code object of its own named ``name`` (torch's eval_frame does the same to
    give functions separate recompilation caches)."""
    names = {"co_name": name, **({"co_qualname": name} if hasattr(fn.__code__, "co_qualname") else {})}
    out = types.FunctionType(fn.__code__.replace(**names), fn.__globals__, name, fn.__defaults__, fn.__closure__)
    out.__qualname__ = name
    return out


def _compile_refused(e: BaseException) -> bool:
    """Whether ``e`` is torch.compile declining a step before running it (the recompile limit, a
    graph break under ``fullgraph=True``, a failed backend compiler), not an error of the step
    itself or a recompile the caller asked to be an error (``error_on_recompile``)."""
    from torch._dynamo import exc
    return isinstance(e, (exc.FailOnRecompileLimitHit, exc.Unsupported, exc.BackendCompilerFailed))


class _CompiledSteps(OrderedDict):
    """One model's compiled steps: (B, capacity, dtype, device, kv_dtype, backend) -> _CompiledStep,
    the most recently used last, at most :data:`MAX_COMPILED_STEPS` of them.

    The same cache objects serve every call of a configuration, so its compiled step sees the
    same objects every call and its guards hold (nothing recompiles across :func:`generate` calls)."""

    def fitting(self, config: tuple, total: int) -> int | None:
        """The smallest capacity >= ``total`` of a step kept for ``config`` (the key without its
        capacity: (B, dtype, device, kv_dtype, backend)), or None."""
        caps = [key[1] for key in self if (key[0], *key[2:]) == config and key[1] >= total]
        return min(caps, default=None)

    def get_or_make(self, key: tuple, make: Callable[[], _CompiledStep]) -> _CompiledStep:
        if key in self:
            self.move_to_end(key)
            return self[key]
        while len(self) >= MAX_COMPILED_STEPS:
            self.popitem(last=False)
        self[key] = got = make()
        return got


#: Per-process helpers of each model, owned here so the model knows nothing of them. Weakly keyed:
#: they go with the model (never pickled or deep-copied with it: a copy is another key). Nothing
#: in a value may hold the model strongly (a compiled step reaches it through a weakref), or the
#: model would keep itself alive.
_COMPILED: "weakref.WeakKeyDictionary[GenerationMixin, _CompiledSteps]" = weakref.WeakKeyDictionary()


def _compiled_of(model: GenerationMixin) -> _CompiledSteps:
    got = _COMPILED.get(model)
    if got is None:
        got = _COMPILED[model] = _CompiledSteps()
    return got


class _Session:
    """State of one batched generation: right-padded prompts, caches, the step function.

    Every tensor computation runs inside ``torch.inference_mode`` here, never across a
    ``yield`` of :func:`stream` (the caller's code between tokens keeps its own grad mode).
    """

    def __init__(self, model: GenerationMixin, rows: list[list[int]], max_new_tokens: int, temperature: float,
                 top_k, top_p, eos_ids: list[int], cache, seed, compile, kv_dtype=None):
        self.model, self.rows, self.T = model, rows, max_new_tokens
        self.kv_dtype = kv_storage_dtype(kv_dtype)
        self.sampling = dict(temperature=float(temperature), top_k=top_k, top_p=top_p)
        self.cache_kind, self.compile = cache, compile
        dev = model.device
        self.device = dev
        self.generator = None
        if temperature > 0 and seed is not None:
            self.generator = torch.Generator(device=dev).manual_seed(int(seed))
        lens = [len(r) for r in rows]
        B, P = len(rows), max(lens)
        self.B, self.P = B, P
        total = P + max_new_tokens
        limit = model.config.max_position_embeddings
        if limit and total > limit:
            warnings.warn(f"prompt ({P} tokens) + max_new_tokens ({max_new_tokens}) = {total} positions exceeds the "
                          f"model's max_position_embeddings={limit}: RoPE extrapolates past what it was trained on "
                          f"(Hugging Face does the same, silently); expect degraded output", stacklevel=4)
        # Fixed-capacity caches hold every position up front (compiled steps reuse theirs across
        # calls that fit in them); dynamic caches and recomputation grow as tokens come.
        self.capacity = self._compiled_capacity(total, limit) if compile else total
        if cache in ("static", "paged"):
            _check_capacity(model, cache, B, self.capacity, self.kv_dtype)
        with torch.inference_mode():
            ids = torch.zeros(B, P, dtype=torch.long)  # right-padded with id 0 (never stored or attended)
            for b, r in enumerate(rows):
                ids[b, :len(r)] = torch.tensor(r, dtype=torch.long)
            self.ids = ids.to(dev)
            self.ragged = min(lens) != max(lens)
            self.num_new = torch.tensor(lens, device=dev) if self.ragged else None  # (B,) real prompt tokens
            self.eos = torch.tensor(eos_ids, dtype=torch.long, device=dev) if eos_ids else None
            self.finished = torch.zeros(B, dtype=torch.bool, device=dev)
            self.step = self._compiled_step() if compile else None
            if self.step is not None:
                self.caches = self.step.caches
                for c in self.caches:
                    c.reset()
            else:
                self.caches = self._caches() if cache is not None else None
            if cache is None:  # recompute: every sequence's tokens so far, right-padded; grows by doubling
                self.seq = self.ids.clone()
                self.lengths = torch.tensor(lens, device=dev)  # (B,) tokens of each sequence so far

    # ............................................................ caches and steps

    def _caches(self):
        m, kv = self.model, self.kv_dtype
        if self.cache_kind == "dynamic":  # sliding-window layers: a ring of their window (see CACHES)
            return m.new_caches("sliding", max_batch=self.B, kv_dtype=kv)
        return m.new_caches(self.cache_kind, max_batch=self.B, max_len=self.capacity, kv_dtype=kv)

    def _compile_backend(self) -> str:
        return "inductor" if self.compile is True else self.compile

    def _compiled_capacity(self, total: int, limit: int | None) -> int:
        """The capacity of this call's compiled step. Where spare capacity is free
        (:func:`spare_capacity_is_free`): a kept step's that fits ``total``, else
        :func:`compiled_capacity`'s while the device's memory holds it, else ``total`` rounded
        up to 64. Elsewhere ``total`` rounded up to 64, so only calls of that rounded size share
        a step. :func:`_check_capacity` checks the result."""
        m = self.model
        if not spare_capacity_is_free(m.device):
            return _round_up(total, 64)
        config = (self.B, m.dtype, m.device, self.kv_dtype, self._compile_backend())
        kept = _compiled_of(m).fitting(config, total)
        if kept is not None:
            return kept
        cap, have = compiled_capacity(total, limit), _device_memory(m.device)
        if have is not None and self.B * cap * m.kv_bytes_per_token(kv_dtype=self.kv_dtype) > have:
            return _round_up(total, 64)
        return cap

    def _compiled_step(self) -> _CompiledStep:
        """This configuration's compiled step and static caches, made on first use."""
        m, kv = self.model, self.kv_dtype
        backend = self._compile_backend()
        what = (f"batch {self.B}, capacity {self.capacity}, {str(m.dtype).removeprefix('torch.')}, "
                f"kv_dtype {kv if kv is None else str(kv).removeprefix('torch.')} on {m.device}")

        def make() -> _CompiledStep:
            caches = m.new_caches("static", max_batch=self.B, max_len=self.capacity, kv_dtype=kv)
            return _CompiledStep(m, caches, backend, what)

        return _compiled_of(m).get_or_make((self.B, self.capacity, m.dtype, m.device, kv, backend), make)

    def _sample(self, logits: Tensor, t: int) -> Tensor:
        """Token t (B,) from logits (B, V); a non-finite row that is still running is an error."""
        bad = _nonfinite_rows(logits, None if self.eos is None else ~self.finished)
        if bad:
            raise FloatingPointError(
                f"generation step {t} (new token {t + 1} of {self.T}): the logits of sequence(s) {bad[:8]} are NaN "
                f"or +inf, so no token can be chosen; the model's output is not finite (check the weights "
                f"and dtype: e.g. fp16 overflow)")
        if self.eos is not None:  # finished rows emit nothing; their logits no longer matter
            logits = logits.masked_fill(self.finished[:, None], 0.0)
        nxt = sample_next(logits, generator=self.generator, **self.sampling)
        if self.eos is not None:
            nxt = torch.where(self.finished, -1, nxt)  # finished sequences emit nothing
            self.finished |= torch.isin(nxt, self.eos)
        return nxt

    def first(self) -> Tensor:
        """Prefill every prompt and sample each sequence's first new token (B,)."""
        with torch.inference_mode():
            m = self.model
            logits = m(self.ids, caches=self.caches, num_new=self.num_new, logits_to_keep=1)[:, -1]
            return self._sample(logits, 0)

    def next(self, t: int, tok: Tensor) -> Tensor:
        """Feed token ``t`` (B,) (the t-th new one, t >= 0) and sample token ``t + 1``."""
        with torch.inference_mode():
            feed = (tok if self.eos is None else tok.clamp(min=0))[:, None]  # finished: a harmless id
            if self.caches is None:
                logits = self._recompute(feed)
            elif self.step is not None:
                logits = self.step(feed)
            else:
                logits = self.model(feed, caches=self.caches, logits_to_keep=1)[:, -1]
            return self._sample(logits, t + 1)

    def _recompute(self, feed: Tensor) -> Tensor:
        """Append ``feed`` (B, 1) after each sequence's tokens and run the whole batch again."""
        n = self.lengths
        if int(n.max()) >= self.seq.shape[1]:  # grow by doubling
            grown = self.seq.new_zeros(self.B, 2 * self.seq.shape[1])
            grown[:, :self.seq.shape[1]] = self.seq
            self.seq = grown
        self.seq.scatter_(1, n[:, None], feed)
        self.lengths = n = n + 1
        width = int(n.max())
        return self.model(self.seq[:, :width], num_new=n, logits_to_keep=1)[:, -1]

    def all_finished(self) -> bool:
        return self.eos is not None and bool(self.finished.all())


def compile_settings(backend: str, device_type: str) -> dict:
    """``torch.compile``'s mode or options for the decode step (a pure function of the backend and
    the device, so the CUDA decision is testable anywhere). With inductor:

    * CUDA: mode "reduce-overhead", the step replayed as a CUDA graph (a batch-1 step is dozens
      of small kernels whose launch overhead would otherwise dominate; the static caches' buffers
      keep fixed addresses, as CUDA graphs need);
    * CPU: option ``cpp_wrapper``, the compiled step's calls made from C++ instead of a Python
      wrapper (a batch-1 step is a few dozen calls, each a Python line otherwise).

    Other backends take neither (torch.compile accepts a mode or options, not both)."""
    if backend != "inductor":
        return {}
    return {"mode": "reduce-overhead"} if device_type == "cuda" else {"options": {"cpp_wrapper": True}}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _session(model, prompts, max_new_tokens, temperature, top_k, top_p, eos, cache, seed, compile,
             kv_dtype=None) -> _Session:
    if not isinstance(model, GenerationMixin):
        raise TypeError(f"model must be an attnkit.models.Decoder, got {type(model).__name__}")
    V = model.config.vocab_size
    eos_ids = _check_options(max_new_tokens, temperature, top_k, top_p, eos, cache, compile, V, kv_dtype)
    rows = _as_prompts(prompts, V)
    return _Session(model, rows, max_new_tokens, temperature, top_k, top_p, eos_ids, cache, seed, compile, kv_dtype)


def generate(model: GenerationMixin, prompts, max_new_tokens: int = 32, *, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, eos=None, cache: str | None = "dynamic",
             seed: int | None = None, compile: bool | str = False, kv_dtype=None) -> Generation:
    """Generate up to ``max_new_tokens`` tokens for each prompt.

    Args:
        model: a :class:`attnkit.models.Decoder`.
        prompts: a list of token-id lists (any lengths), a list of 1-D tensors, a (B, P)
            tensor, or one prompt as a list of ints / 1-D tensor.
        max_new_tokens: T, new tokens per sequence at most.
        temperature: 0 = greedy (argmax); > 0 samples ``softmax(logits / temperature)``.
        top_k, top_p: sampling filters (ignored by greedy decoding).
        eos: token id(s) that end a sequence (it is included in the output); the batch stops
            when every sequence has ended.
        cache: "dynamic" (grows with the tokens generated; a sliding-window layer keeps a
            ring of its window, :class:`~attnkit.caches.SlidingWindowCache`), "static" (preallocated for
            ``P + max_new_tokens`` positions; required by ``compile``), "paged" (blocks of a
            pool of that capacity), or None to recompute the whole sequence every step (the
            reference the cached paths are tested against). Every step is one
            :meth:`Decoder.forward`.
        seed: seeds a private ``torch.Generator`` for sampling (same seed, same samples);
            None uses torch's global RNG.
        compile: True (inductor) or a ``torch.compile`` backend name: the decode step runs
            compiled with ``fullgraph=True`` over a static cache; it compiles on the first call
            for a batch size and capacity and is reused by every later call that fits in it
            (on CPU with the native engine the capacity is ``P + T`` rounded up to a power of
            two from 256, :func:`compiled_capacity`; elsewhere to a multiple of 64). Each
            configuration (model, batch, capacity, dtype, ``kv_dtype``, backend) has a step of
            its own, so many models and shapes in one process never meet dynamo's recompile
            limit; a model keeps its :data:`MAX_COMPILED_STEPS` most recently used ones. A step
            torch.compile refuses runs eagerly instead, with a ``RuntimeWarning`` saying why.
        kv_dtype: None (the cache holds K/V in the model's dtype), "int8" or "fp8_e4m3": every
            layer's cache stores quantized rows with an fp32 scale per row
            (:mod:`attnkit.kvquant`), about half the bytes of bf16; works with every ``cache``
            kind and with ``compile``.

    Returns:
        a :class:`Generation` (``.tokens`` per prompt, ``.finish_reasons``, timings).

    Raises:
        FloatingPointError: a running sequence's logits are NaN or +inf (names the step and the
            sequences).
        ValueError: bad options, or a static / paged capacity beyond the device's memory.
    """
    s = _session(model, prompts, max_new_tokens, temperature, top_k, top_p, eos, cache, seed, compile, kv_dtype)
    t0 = time.perf_counter()
    out: list[Tensor] = []  # one (B,) tensor per step: grows with the tokens produced
    steps = 0
    compile_s, compiled = 0.0, False  # compiled: the first decode step compiled a new configuration
    if max_new_tokens:
        tok = s.first()
        out.append(tok)
        _sync(s.device)
        t_first = t1 = time.perf_counter()  # t1: where the timed decode steps begin
        compiling = s.step is not None and s.step.calls == 0
        for t in range(max_new_tokens - 1):
            if s.all_finished():
                break
            tok = s.next(t, tok)
            out.append(tok)
            if compiling:  # timed apart: a compile takes seconds, a step milliseconds
                _sync(s.device)
                t_c = time.perf_counter()
                compile_s, t1, compiling, compiled = t_c - t1, t_c, False, True
                continue
            steps += 1
        _sync(s.device)
    else:
        t_first = t1 = t0
    t2 = time.perf_counter()
    tokens, reasons = [], []
    eos_set = set() if s.eos is None else set(s.eos.tolist())
    table = torch.stack(out, 1).tolist() if out else [[] for _ in range(s.B)]
    for row in table:
        row = [t for t in row if t >= 0]
        tokens.append(row)
        reasons.append("eos" if row and row[-1] in eos_set else "length")
    decode_tokens = None
    if compiled:  # the compiling step's tokens (one per sequence still running) are not the timed steps'
        decode_tokens = sum(max(len(t) - 1, 0) for t in tokens) - int((out[1] >= 0).sum())
    return Generation(tokens, [list(r) for r in s.rows], reasons, prefill_seconds=t_first - t0,
                      decode_seconds=t2 - t1, decode_steps=steps, compile_seconds=compile_s,
                      decode_tokens=decode_tokens)


def stream(model: GenerationMixin, prompts, max_new_tokens: int = 32, *, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None, eos=None, cache: str | None = "dynamic",
           seed: int | None = None, compile: bool | str = False, kv_dtype=None) -> Iterator[list[int | None]]:
    """Like :func:`generate`, but yields each step's tokens as soon as they exist: a list with
    one entry per prompt, the new token id, or None for a sequence that has already ended.

    Example::

        for step in model.stream([[1, 2, 3]], max_new_tokens=8, eos=0):
            print(step[0], end=" ", flush=True)
    """
    s = _session(model, prompts, max_new_tokens, temperature, top_k, top_p, eos, cache, seed, compile, kv_dtype)
    return _stream(s, max_new_tokens)  # arguments are checked now, not at the first next()


def _stream(s: _Session, max_new_tokens: int) -> Iterator[list[int | None]]:
    if not max_new_tokens:
        return
    tok = s.first()
    yield [t if t >= 0 else None for t in tok.tolist()]
    for t in range(max_new_tokens - 1):
        if s.all_finished():
            return
        tok = s.next(t, tok)
        yield [t if t >= 0 else None for t in tok.tolist()]
