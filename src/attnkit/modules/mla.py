"""Multi-head latent attention (MLA), DeepSeek-V2 / V3: one module, a naive and an absorbed path.

Notation: B batch, S new tokens, L cached (or total) key length, E hidden size, H heads,
r ``kv_lora_rank`` (the latent width), dn ``qk_nope_head_dim``, dr ``qk_rope_head_dim``,
dqk = dn + dr, dv ``v_head_dim``, rq ``q_lora_rank``.

Per token, MLA compresses keys and values into one normalised latent ``c_kv`` (r) plus one rope
key ``k_pe`` (dr) shared by every head; only those r + dr values are cached (576 at DeepSeek-V3
dimensions, against H * (dqk + dv) = 40,960 for per-head K and V)::

    q        = q_proj(x)  or  q_b_proj(rms(q_a_proj(x)))          (B, H, S, dqk) = [q_nope | q_pe]
    c_kv, kp = kv_a_proj_with_mqa(x); c_kv = rms(c_kv)            (B, 1, S, r), (B, 1, S, dr)
    q_pe, kp = rope(q_pe, kp, positions)                          decoupled RoPE on dr dims only
    W_UK, W_UV = kv_b_proj.weight.view(H, dn + dv, r).split       (H, dn, r), (H, dv, r)

* ``naive``: expand every cached latent per head, ``k = [c_kv @ W_UK^T | kp]`` (B, H, L, dqk),
  ``v = c_kv @ W_UV^T`` (B, H, L, dv), and run ordinary attention. Best when S is large (prefill,
  training): the expansion costs L * r * H * (dn + dv) once per call.
* ``absorb``: ``q_nope . k_nope = (q_nope @ W_UK) . c_kv``, so fold W_UK into the query,
  ``q_cat = [q_nope @ W_UK | q_pe]`` (B, H, S, r + dr), attend MQA-style over the single latent
  head ``[c_kv | kp]`` with V = ``c_kv`` (the cache's ``value_from_key`` layout), and fold W_UV
  into the output, ``out = out_latent @ W_UV^T``. Nothing per head is ever built over L: best
  for decode.
* ``auto``: absorbed when a cache is given and S is below the crossover where the absorbed
  attention's wider dot products (2r + dr per key instead of dqk + dv) outweigh the expansion it
  saves (:attr:`MultiHeadLatentAttention.absorb_max_len`; 170 at DeepSeek dimensions), naive
  otherwise.

Both paths compute the same function (in fp64 they agree to ~1e-15 relative), support backward, masks, dropout
and ragged batches, and call :func:`attnkit.attention` (or the cache's ``attend``) for the
attention itself. Parameter names are Hugging Face's / DeepSeek's, so a DeepSeek-V2/V3 attention
layer's state dict loads with ``strict=True``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from .._checks import shape_of
from ..caches import BoundCache, KVCache, new_cache
from ..functional import attention
from ..masks import as_mask
from ..rope import RopeConfig, RotaryEmbedding, yarn_get_mscale
from .._sysinfo import cpu_flags
from .linear import Linear, half_gemm_unit
from .norm import RMSNorm
from .options import and_masks, attention_kwargs, check_flag, check_variant_options, torch_key_padding, window_mask

__all__ = ["MLAConfig", "MultiHeadLatentAttention"]

_MODES = ("auto", "naive", "absorb")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class MLAConfig:
    """Dimensions and options of one multi-head latent attention layer (validated, immutable).

    Args:
        hidden_size: E, width of the layer's input and output.
        num_heads: H attention heads.
        kv_lora_rank: r, width of the cached latent ``c_kv`` (512 in DeepSeek-V2/V3).
        qk_nope_head_dim: dn, per-head query/key dims without position (128).
        qk_rope_head_dim: dr, dims of the shared rope key and of each head's rope query (64); even.
        v_head_dim: dv, per-head value dims (128).
        q_lora_rank: rq, width of the query bottleneck (1536 in V3), or None for a plain
            ``q_proj`` (DeepSeek-V2-Lite).
        rope_theta: RoPE base.
        rope_scaling: Hugging Face's ``rope_scaling`` / ``rope_parameters`` dict, or None.
            For YaRN with ``mscale_all_dim`` the softmax scale is multiplied by
            ``yarn_get_mscale(factor, mscale_all_dim) ** 2`` (DeepSeek's rule).
        rope_interleave: rope dims rotate in adjacent pairs (DeepSeek's checkpoints and official
            code) instead of rotate-half.
        max_position_embeddings: context length (the default of Hugging Face's
            ``DeepseekV3Config``); used by YaRN's ``original_max_position_embeddings`` fallback and
            dynamic NTK.
        attention_bias: biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``, as Hugging
            Face places them (never on ``q_proj``, ``q_b_proj`` or ``kv_b_proj``).
        attention_dropout: dropout on the attention probabilities, training mode only.
        rms_norm_eps: epsilon of ``q_a_layernorm`` and ``kv_a_layernorm`` (1e-6 in DeepSeek's and
            Hugging Face's attention, whatever the model's ``rms_norm_eps``).

    Derived (read-only): ``qk_head_dim`` (dn + dr), ``rope`` (the validated
    :class:`attnkit.rope.RopeConfig`), ``softmax_scale``, ``latent_dim`` (r + dr, values cached
    per token).
    """

    hidden_size: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    attention_dropout: float = 0.0
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(init=False, repr=False, compare=False)
    softmax_scale: float = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                     "v_head_dim"):
            val = getattr(self, name)
            if not _is_int(val) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if self.q_lora_rank is not None and (not _is_int(self.q_lora_rank) or self.q_lora_rank < 1):
            raise ValueError(f"q_lora_rank must be a positive int or None (no query compression), "
                             f"got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even: RoPE rotates "
                             f"pairs of dims")
        for name in ("rope_interleave", "attention_bias"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        p = self.attention_dropout
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
            raise ValueError(f"attention_dropout must be a float in [0, 1), got {p!r}")
        eps = self.rms_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (eps > 0 and math.isfinite(eps)):
            raise ValueError(f"rms_norm_eps must be a finite float > 0, got {eps!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Mapping):
            raise TypeError(f"rope_scaling must be a dict (Hugging Face rope_parameters) or None, "
                            f"got {type(self.rope_scaling).__name__}")
        scaling = None if self.rope_scaling is None else MappingProxyType(dict(self.rope_scaling))
        object.__setattr__(self, "rope_scaling", scaling)
        try:
            rope = RopeConfig(self.qk_rope_head_dim, base=self.rope_theta,
                              max_position_embeddings=self.max_position_embeddings,
                              scaling=None if scaling is None else dict(scaling), interleaved=self.rope_interleave)
        except (TypeError, ValueError) as e:
            raise type(e)(f"invalid RoPE settings (rope_theta / rope_scaling / max_position_embeddings): {e}") from None
        object.__setattr__(self, "rope", rope)
        # DeepSeek (official inference/model.py and Hugging Face's yarn_apply_mscale): YaRN's
        # mscale_all_dim multiplies the softmax scale by mscale**2, on top of cos/sin's factor.
        scale = self.qk_head_dim ** -0.5
        if rope.rope_type == "yarn" and rope.params["mscale_all_dim"]:
            m = yarn_get_mscale(rope.params["factor"], rope.params["mscale_all_dim"])
            scale = scale * m * m
        object.__setattr__(self, "softmax_scale", scale)

    def __hash__(self):  # the generated hash would fail on the read-only rope_scaling mapping
        scaling = self.rope_scaling
        scaling = None if scaling is None else tuple(sorted((k, repr(v)) for k, v in scaling.items()))
        return hash(tuple(getattr(self, f.name) for f in fields(self) if f.compare and f.name != "rope_scaling")
                    + (scaling,))

    def __reduce__(self):
        # rope_scaling is a read-only MappingProxyType, which cannot be pickled or deep-copied
        # (copy.deepcopy(model), torch.save(model)); rebuild from the constructor arguments.
        args = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        args["rope_scaling"] = None if self.rope_scaling is None else dict(self.rope_scaling)
        return (_rebuild_config, (args,))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf_config(cls, config) -> "MLAConfig":
        """The attention config of a Hugging Face ``DeepseekV3Config`` / ``DeepseekV2Config`` (or
        any object with the same attribute names, e.g. DeepSeek's ``config.json`` loaded as a
        ``PretrainedConfig``).

        Reads ``hidden_size, num_attention_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim,
        qk_rope_head_dim, v_head_dim, max_position_embeddings, attention_bias,
        attention_dropout``, the RoPE dict (``rope_parameters`` in transformers v5, else
        ``rope_scaling`` + ``rope_theta``) and ``rope_interleave`` (DeepSeek-V3; configs without it,
        such as DeepSeek-V2's, rotate interleaved pairs, as their modelling code does).
        ``num_key_value_heads`` is ignored: MLA has one latent. ``rms_norm_eps`` stays 1e-6, the
        epsilon the attention's norms use in Hugging Face and DeepSeek code.
        """
        for name in ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim"):
            if getattr(config, name, None) is None:
                raise ValueError(f"config has no {name}; is it a DeepSeek-V2/V3 config? ({type(config).__name__})")
        # RotaryEmbedding.from_hf_config holds the rope-dict rules (v4/v5 keys, defaults); it
        # reads head_dim, which for MLA's rope is qk_rope_head_dim.
        interleave = getattr(config, "rope_interleave", None)
        interleave = True if interleave is None else bool(interleave)
        rope = RotaryEmbedding.from_hf_config(_RopeView(config), interleaved=interleave).config
        return cls(
            hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
            kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
            q_lora_rank=getattr(config, "q_lora_rank", None), rope_theta=rope.base,
            rope_scaling=None if rope.rope_type == "default" else dict(rope.scaling),
            rope_interleave=interleave,
            max_position_embeddings=getattr(config, "max_position_embeddings", None) or 4096,
            attention_bias=bool(getattr(config, "attention_bias", False)),
            attention_dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0),
        )


def _rebuild_config(kwargs: dict) -> MLAConfig:
    return MLAConfig(**kwargs)


class _RopeView:
    """A config seen with ``head_dim = qk_rope_head_dim`` (what its rotary embedding rotates)."""

    def __init__(self, config):
        self._config = config
        self.head_dim = config.qk_rope_head_dim

    def __getattr__(self, name):
        return getattr(self._config, name)


# --------------------------------------------------------------------------- module


#: The 16-bit dtypes MLA's per-head matmuls widen to fp32 on this CPU: those without a
#: :func:`~attnkit.modules.linear.half_gemm_unit`, where torch's batched 16-bit GEMM is slower
#: than widening at every size; with one, widening the weights costs more than it saves
#: (benchmarks/NOTES.md). Read once at import.
_PER_HEAD_UPCAST = frozenset(dt for dt in (torch.float16, torch.bfloat16) if not half_gemm_unit(dt, cpu_flags()))


def _per_head_widens(x: Tensor) -> bool:
    """Whether :func:`_per_head_matmul` runs x's product in fp32: CPU tensors of a dtype in
    :data:`_PER_HEAD_UPCAST`; other devices (CUDA) never."""
    return x.device.type == "cpu" and x.dtype in _PER_HEAD_UPCAST


def _per_head_matmul(x: Tensor, w: Tensor, *, w_transposed: bool = False) -> Tensor:
    """x (B, H, S, i) @ w (H, i, o) -> (B, H, S, o), one GEMM per head with the batch folded in
    (``torch.matmul`` would broadcast w over B by copying it); with ``w_transposed``, w is
    (H, o, i) and x @ w^T is computed as (w @ x^T)^T, so each head's weights are read in their own
    row order (a transposed view sends torch's 16-bit GEMM to a slow path). CPU fp16/bf16 of
    :data:`_PER_HEAD_UPCAST` run in fp32 and round once to x's dtype (the same single rounding a
    16-bit GEMM with fp32 sums makes).
    """
    B, H, S, i = x.shape
    dt = x.dtype
    if _per_head_widens(x):
        x, w = x.float(), w.float()
    x2 = x.transpose(0, 1).reshape(H, B * S, i)
    out = torch.bmm(w, x2.transpose(1, 2)).transpose(1, 2) if w_transposed else torch.bmm(x2, w)  # (H, B*S, o)
    return out.reshape(H, B, S, -1).transpose(0, 1).to(dt)


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek-V2/V3 multi-head latent attention, causal self-attention with a latent KV cache.

    Args:
        config: an :class:`MLAConfig`.
        mode: "naive" (expand K/V per head), "absorb" (attend over the latent) or "auto"
            (absorbed for cached steps of at most :attr:`absorb_max_len` tokens). All three give
            the same result up to rounding.
        backend: the :func:`attnkit.attention` backend.
        scale: overrides the softmax scale (default ``config.softmax_scale``).
        softcap: scores become ``softcap * tanh(scores / softcap)`` after scaling.
        sinks: a learned ``sinks`` parameter (H,) of per-head logits joining the softmax
            denominator.
        window: a causal sliding window of ``window`` tokens (the query included), honoured with
            every latent cache.

    Parameters (Hugging Face / DeepSeek names): ``q_a_proj, q_a_layernorm, q_b_proj`` (or
    ``q_proj`` when ``q_lora_rank`` is None), ``kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
    o_proj``. ``rope`` holds no state-dict entries. The absorbed path splits ``kv_b_proj.weight``
    per head (:meth:`absorbed_weights`) instead of calling ``kv_b_proj``, so forward hooks or
    wrappers on that one Linear do not run there.

    Pieces, for custom decoders: :meth:`project` (x -> q_nope, q_pe, latent), :meth:`attend_latent`
    (-> per-head outputs before ``o_proj``), :meth:`expand_latent`, :meth:`new_cache`,
    :meth:`check_cache`, :meth:`resolve_mode`.
    """

    def __init__(self, config: MLAConfig, mode: str = "auto", backend: str = "auto", device=None, dtype=None, *,
                 scale: float | None = None, softcap: float | None = None, sinks: bool = False,
                 window: int | None = None):
        super().__init__()
        if not isinstance(config, MLAConfig):
            raise TypeError(f"config must be an MLAConfig, got {type(config).__name__}")
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        self.config, self.mode, self.backend = config, mode, backend
        c = config
        H, E, r = c.num_heads, c.hidden_size, c.kv_lora_rank
        scale, self.softcap, self.window = check_variant_options(scale, softcap, window)
        check_flag("sinks", sinks)
        self.scale = c.softmax_scale if scale is None else scale
        self.sinks = nn.Parameter(torch.zeros(H, device=device, dtype=dtype)) if sinks else None
        kw = {"device": device, "dtype": dtype}
        if c.q_lora_rank is None:
            self.q_proj = Linear(E, H * c.qk_head_dim, bias=False, **kw)
        else:
            self.q_a_proj = Linear(E, c.q_lora_rank, bias=c.attention_bias, **kw)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, **kw)
            self.q_b_proj = Linear(c.q_lora_rank, H * c.qk_head_dim, bias=False, **kw)
        self.kv_a_proj_with_mqa = Linear(E, r + c.qk_rope_head_dim, bias=c.attention_bias, **kw)
        self.kv_a_layernorm = RMSNorm(r, c.rms_norm_eps, **kw)
        self.kv_b_proj = Linear(r, H * (c.qk_nope_head_dim + c.v_head_dim), bias=False, **kw)
        self.o_proj = Linear(H * c.v_head_dim, E, bias=c.attention_bias, **kw)
        self.rope = RotaryEmbedding.from_config(c.rope)
        # Absorbed attention costs per (query, key) 2r + dr multiply-adds instead of dqk + dv, but
        # skips expanding each key (r * (dn + dv) per head); it wins while S * extra < that.
        extra = 2 * r + c.qk_rope_head_dim - c.qk_head_dim - c.v_head_dim
        expand = r * (c.qk_nope_head_dim + c.v_head_dim)
        self.absorb_max_len = (expand - 1) // extra if extra > 0 else 2 ** 62

    def extra_repr(self) -> str:
        c = self.config
        return (f"heads={c.num_heads}, kv_lora_rank={c.kv_lora_rank}, q_lora_rank={c.q_lora_rank}, "
                f"qk_nope={c.qk_nope_head_dim}, qk_rope={c.qk_rope_head_dim}, v={c.v_head_dim}, mode={self.mode!r}")

    # ................................................................. pieces

    def _queries(self, x: Tensor) -> Tensor:
        """(B, S, E) -> (B, H, S, dqk)."""
        q = self.q_proj(x) if self.config.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.unflatten(-1, (self.config.num_heads, self.config.qk_head_dim)).transpose(1, 2)

    def absorbed_weights(self) -> tuple[Tensor, Tensor]:
        """(W_UK (H, dn, r), W_UV (H, dv, r)): views of ``kv_b_proj.weight`` (gradients flow)."""
        c = self.config
        w = self.kv_b_proj.weight.view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, :c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]

    def expand_latent(self, latent: Tensor) -> tuple[Tensor, Tensor]:
        """Per-head keys and values from latents ``[c_kv | k_pe]`` (B, 1, L, r + dr):
        k (B, H, L, dqk) = ``[c_kv @ W_UK^T | k_pe]``, v (B, H, L, dv) = ``c_kv @ W_UV^T``."""
        c = self.config
        B, _, L, _ = latent.shape
        c_kv = latent[:, 0, :, :c.kv_lora_rank]
        kv = self.kv_b_proj(c_kv)  # (B, L, H * (dn + dv)); Linear widens 16-bit GEMMs where that pays
        kv = kv.view(B, L, c.num_heads, c.qk_nope_head_dim + c.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k_pe = latent[..., c.kv_lora_rank:].expand(B, c.num_heads, L, c.qk_rope_head_dim)
        return torch.cat((k_nope, k_pe), dim=-1), v

    def check_cache(self, cache, dtype: torch.dtype | None = None) -> None:
        """Raise a clear error unless ``cache`` is a latent cache built for this layer: one head of
        r + dr channels whose first r are read as V (``value_from_key``), in ``dtype``."""
        if not isinstance(cache, (KVCache, BoundCache)):
            raise TypeError(f"cache must be an attnkit KVCache (build one with new_cache()), got "
                            f"{type(cache).__name__}")
        c = self.config
        want = (1, c.latent_dim, c.kv_lora_rank, True)
        got = (cache.num_kv_heads, cache.head_dim, cache.v_head_dim, cache.value_from_key)
        if got != want:
            raise ValueError(
                f"cache does not fit this MLA layer: it has num_kv_heads={got[0]}, head_dim={got[1]}, "
                f"v_head_dim={got[2]}, value_from_key={got[3]}; the latent cache of this layer needs "
                f"num_kv_heads=1, head_dim=kv_lora_rank + qk_rope_head_dim = {c.kv_lora_rank} + "
                f"{c.qk_rope_head_dim} = {c.latent_dim}, v_head_dim=kv_lora_rank={c.kv_lora_rank}, "
                f"value_from_key=True (build it with new_cache())")
        if dtype is not None and cache.dtype != dtype:
            raise TypeError(f"cache holds {cache.dtype} but this layer computes its latent in {dtype}; "
                            f"build the cache with dtype={dtype}")

    def new_cache(self, kind: str = "dynamic", *, max_batch: int | None = None, max_len: int | None = None,
                  allocator=None, dtype: torch.dtype | None = None, device=None, kv_dtype=None,
                  k_channel_scale=None) -> KVCache:
        """An empty latent cache for this layer: one "head" of ``[c_kv | k_pe]`` (r + dr values per
        token), V read as its first r channels. ``kind``: "dynamic" (grows), "static" (needs
        ``max_batch`` and ``max_len``) or "paged" (needs the model's shared ``allocator``).
        Dtype and device default to the weights'. ``kv_dtype`` ("int8", "fp8_e4m3") stores the
        latent quantized, one fp32 scale per token (V is read from the same rows);
        ``k_channel_scale`` (None: on for int8; True / False; a (1, r + dr) tensor) divides the
        latent by a fixed per-channel scale first (V's channels carry it too;
        :class:`~attnkit.caches.KVCache`)."""
        if kind == "sliding":
            raise ValueError("kind must be 'dynamic', 'static' or 'paged' for an MLA layer, got 'sliding'")
        w = self.kv_b_proj.weight
        return new_cache(kind, (1, self.config.latent_dim, self.config.kv_lora_rank), value_from_key=True,
                         max_batch=max_batch, max_len=max_len, allocator=allocator,
                         dtype=dtype or w.dtype, device=device or w.device, kv_dtype=kv_dtype,
                         k_channel_scale=k_channel_scale)

    def resolve_mode(self, q_len: int, cached: bool) -> str:
        """The path ``forward`` takes for ``q_len`` new tokens, with or without a cache."""
        if self.mode != "auto":
            return self.mode
        return "absorb" if cached and q_len <= self.absorb_max_len else "naive"

    # ................................................................. forward

    def project(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The projections before attention: x (B, S, E), positions (B, S) or (1, S) ->
        q_nope (B, H, S, dn), q_pe (B, H, S, dr) rotated, latent ``[c_kv | k_pe]`` (B, 1, S, r + dr)
        with c_kv normalised and k_pe rotated (what the cache stores)."""
        c = self.config
        q_nope, q_pe = self._queries(x).split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe, k_pe = self.rope(q_pe, k_pe[:, None], positions)  # (B, H, S, dr), (B, 1, S, dr)
        return q_nope, q_pe, torch.cat((c_kv[:, None], k_pe), dim=-1)

    def attend_latent(self, q_nope: Tensor, q_pe: Tensor, latent: Tensor, mask=None, *,
                      cache: KVCache | None = None, need_weights: bool = False, mode: str | None = None):
        """Attention from :meth:`project`'s outputs to per-head outputs (B, H, S, dv), before
        ``o_proj``; with ``cache``, ``latent`` is appended and everything cached is attended.

        ``mask``: None or an attnkit mask / tensor over (B, H, S, L), ANDed with causality.
        ``mode``: "naive" / "absorb" (default: :meth:`resolve_mode`). Returns the output, or
        (output, weights (B, H, S, L) fp32) with ``need_weights``.
        """
        c = self.config
        r, S = c.kv_lora_rank, q_nope.shape[2]
        if cache is not None:
            self.check_cache(cache, latent.dtype)
        mode = self.resolve_mode(S, cache is not None) if mode is None else mode
        if mode not in ("naive", "absorb"):
            raise ValueError(f"mode must be 'naive', 'absorb' or None, got {mode!r}")
        user_mask = and_masks(as_mask(mask), window_mask(self.window, cache, q_nope.shape[0], q_nope.device))
        kw = dict(dropout_p=c.attention_dropout if self.training else 0.0, backend=self.backend,
                  return_weights=need_weights,
                  **attention_kwargs(scale=self.scale, softcap=self.softcap, sinks=self.sinks))
        if mode == "absorb":
            w_uk, w_uv = self.absorbed_weights()
            q_cat = torch.cat((_per_head_matmul(q_nope, w_uk), q_pe), dim=-1)  # (B, H, S, r + dr)
            if cache is None:
                res = attention(q_cat, latent, latent[..., :r], user_mask, causal=True, **kw)
            else:  # MQA over the single latent head; V is the cache's first r channels
                res = cache.attend(q_cat, latent, None, user_mask, **kw)
            out_latent, weights = res if need_weights else (res, None)  # (B, H, S, r)
            out = _per_head_matmul(out_latent, w_uv, w_transposed=True)  # (B, H, S, dv)
        else:
            q = torch.cat((q_nope, q_pe), dim=-1)
            if cache is None:
                k, v = self.expand_latent(latent)
                res = attention(q, k, v, user_mask, causal=True, **kw)
            else:  # the cache's own mask places each query after its sequence's past
                # One transaction: the latent is committed only once attention has returned, so a
                # call that raises (a bad mask, a refusing backend) leaves the cache unchanged.
                with cache.transaction(latent.shape[0], S) as step:
                    all_latent, _, cache_mask = step.update(latent, None)
                    k, v = self.expand_latent(all_latent)
                    res = attention(q, k, v, and_masks(cache_mask, user_mask), **kw)
            out, weights = res if need_weights else (res, None)
        return (out, weights) if need_weights else out

    def forward(self, x: Tensor, *, mask=None, key_padding_mask: Tensor | None = None,
                positions: Tensor | None = None, cache: KVCache | None = None, need_weights: bool = False):
        """Causal self-attention over ``x`` (and, with ``cache``, everything cached before it).

        Args:
            x: (B, S, E).
            mask: as in :func:`attnkit.attention` (True = attend), over (B, H, S, L), L = S without
                a cache, else the key length the cache returns; ANDed with causality.
            key_padding_mask: (B, L), ``nn.MultiheadAttention``'s meaning: True (or -inf) = padding.
            positions: (B, S) (or (1, S)) int RoPE positions, or the
                :class:`attnkit.rope.RotaryAngles` of ``self.rope.angles(positions)`` (a model
                computes them once for every layer); default the cache's next positions, or 0..S-1.
            cache: a latent cache (:meth:`new_cache`); this step's ``[c_kv | k_pe]`` is appended.
            need_weights: also return the attention weights (B, H, S, L) in fp32.

        Returns:
            out (B, S, E), and the weights with ``need_weights``.
        """
        c = self.config
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != c.hidden_size:
            raise ValueError(f"x must be (B, S, hidden_size={c.hidden_size}), got shape "
                             f"{shape_of(x)}")
        B, S, _ = x.shape
        if cache is not None:  # before any work: a wrong cache is the likeliest mistake
            self.check_cache(cache)
        if positions is None:
            positions = cache.positions(S) if cache is not None else torch.arange(S, device=x.device)[None]
        q_nope, q_pe, latent = self.project(x, positions)
        user_mask = as_mask(mask)
        if key_padding_mask is not None:
            user_mask = and_masks(user_mask, torch_key_padding(key_padding_mask, B, S if cache is None else None))
        res = self.attend_latent(q_nope, q_pe, latent, user_mask, cache=cache, need_weights=need_weights)
        out, weights = res if need_weights else (res, None)
        out = self.o_proj(out.transpose(1, 2).flatten(2))  # (B, S, H * dv) -> (B, S, E)
        return (out, weights) if need_weights else out
