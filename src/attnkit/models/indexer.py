"""DeepSeek-V3.2's sparse attention (DSA): multi-head latent attention whose every query attends
only to the keys a lightning indexer selects, with the indexer's key cache beside the latent one.

Notation: B batch, S new tokens, L keys attended to (cached + new), E hidden size, rq
``q_lora_rank``, Hi ``index_n_heads``, Di ``index_head_dim``, dr ``qk_rope_head_dim``, k
``index_topk``.

Per token the indexer has its own small projections (Hugging Face / DeepSeek names)::

    q_idx = rope(wq_b(q_resid))            (B, S, Hi, Di)  q_resid = q_a_layernorm(q_a_proj(x)), MLA's
    k_idx = rope(k_norm(wk(x)))            (B, S, Di)      one key per token, cached
    w     = weights_proj(x) * Hi ** -0.5   (B, S, Hi)      fp32 (the projection is kept in fp32)
    score[b, i, j] = sum_h w[b, i, h] * relu(q_idx[b, i, h] . k_idx[b, j] * Di ** -0.5)

RoPE rotates the first dr channels of each indexer head in the rotate-half layout (MLA's own
rope dims rotate in interleaved pairs), with MLA's frequencies. Query i keeps the k keys of
highest score among those it may see (causal, key padding); attention is then the one
:func:`attnkit.attention` call of the MLA module with ``mask = SelectedKeys(ids) & <its own
mask>``. The selection is computed without gradients, as in DeepSeek's and transformers' code.

:func:`select_topk` scores in tiles of ``block_q`` queries x ``block_k`` keys with a running
top-k, so no (S, L) score tensor is ever built (see its docstring for the bound). Ties go to the
lower key position, the same set a stable sort of the whole row picks.

The indexer's keys are cached next to the latent by :class:`IndexedLatentCache` (a dynamic or
static inner cache for each, the latent's step carrying the indexer's; or two paged pools on one
allocator's block table, stepped by its one step), so one decoder step commits or aborts both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._checks import positive_int, shape_of
from ..caches import BoundCache, CacheStep, KVCache, PagedKVCache, StaticCache, new_cache
from ..masks import SelectedKeys
from ..modules.linear import Linear
from ..modules.mla import MLAConfig, MultiHeadLatentAttention
from ..modules.options import and_masks, torch_key_padding
from ..rope import RotaryAngles, apply_rotary

__all__ = ["IndexerConfig", "LightningIndexer", "IndexedLatentCache", "IndexedLatentAttention", "select_topk",
           "rotate_half_cos_sin", "INDEXED_CACHE_KINDS", "BLOCK_Q", "BLOCK_K"]

#: Queries per tile of :func:`select_topk`.
BLOCK_Q = 64
#: Keys per tile of :func:`select_topk`.
BLOCK_K = 1024
#: The cache kinds that hold the indexer's keys beside the latent ("paged": a second pool on the
#: latent's block table, see :class:`IndexedLatentCache`).
INDEXED_CACHE_KINDS = ("dynamic", "static", "paged")


@dataclass(frozen=True)
class IndexerConfig:
    """The lightning indexer's sizes: ``num_heads`` (Hi, ``index_n_heads``), ``head_dim`` (Di,
    ``index_head_dim``; at least the rope dims it rotates), ``topk`` (k, ``index_topk``: keys
    each query keeps)."""

    num_heads: int
    head_dim: int
    topk: int

    def __post_init__(self):
        for name in ("num_heads", "head_dim", "topk"):
            positive_int(name, getattr(self, name))


def select_topk(q: Tensor, weights: Tensor, keys: Tensor, hi: Tensor, topk: int, *, scale: float,
                key_bias: Tensor | None = None, block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> Tensor:
    """The keys each query keeps: the ``topk`` highest indexer scores among the keys it sees.

    Args:
        q: (B, Sq, Hi, Di) rotated indexer queries.
        weights: (B, Sq, Hi) per-head weights (``weights_proj(x) * Hi ** -0.5``).
        keys: (B, L, Di) rotated indexer keys of every key position.
        hi: (B, Sq) integers: query i of row b sees keys ``j < hi[b, i]`` (causal and the
            cache's lengths in one bound).
        topk: k.
        scale: the score scale before the ReLU (``Di ** -0.5``).
        key_bias: None or (B, L) float added to every query's scores (key padding: -inf).
        block_q, block_k: the tile.

    Returns:
        (B, Sq, min(k, L)) int64 key positions, -1 in slots no visible key fills (a query that
        sees fewer than k keys). ``score = sum_h weights[h] * relu(scale * q[h] . key)`` in fp32.

    Memory: one tile of (B, block_q, Hi, block_k) fp32 per-head scores, their (B, block_q,
    block_k) sum, and the running (B, block_q, k + block_k) candidates; never (Sq, L). Key tiles
    past every query of a query tile are skipped. Ties go to the lower key position (the running
    set sits before the new tile, and a stable sort keeps that order), so the result is the set
    ``sort(scores, stable=True, descending=True)[:k]`` of the whole row gives.
    """
    B, Sq, H, D = q.shape
    L = keys.shape[1]
    k = min(topk, L)
    out = torch.full((B, Sq, k), -1, dtype=torch.long, device=q.device)
    if k == 0 or Sq == 0 or B == 0:
        return out
    qf, kt, wf = q.float(), keys.float().transpose(1, 2).unsqueeze(1), weights.float()  # kt: (B, 1, Di, L)
    hi = hi.to(device=q.device, dtype=torch.long)
    for i0 in range(0, Sq, block_q):
        i1 = min(i0 + block_q, Sq)
        bound = hi[:, i0:i1, None]  # (B, bq, 1)
        # key tiles past this are invisible to every query here (a traced step reads no values: all)
        reach = L if torch.compiler.is_compiling() else min(int(bound.max()), L)
        w = wf[:, i0:i1, None, :]  # (B, bq, 1, Hi)
        best_v = best_i = None
        for j0 in range(0, max(reach, 1), block_k):
            j1 = min(j0 + block_k, L)
            s = torch.matmul(qf[:, i0:i1], kt[..., j0:j1]) * scale  # (B, bq, Hi, bk)
            s = torch.matmul(w, s.relu_()).squeeze(-2)  # (B, bq, bk)
            pos = torch.arange(j0, j1, device=q.device)
            s = s.masked_fill(pos >= bound, float("-inf"))
            if key_bias is not None:
                s = s + key_bias[:, None, j0:j1].float()
            ids = pos.expand(s.shape)
            if best_v is not None:
                s, ids = torch.cat((best_v, s), -1), torch.cat((best_i, ids), -1)
            order = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :k]
            best_v, best_i = s.gather(-1, order), ids.gather(-1, order)
        best_i = best_i.masked_fill(best_v == float("-inf"), -1)
        out[:, i0:i1, :best_i.shape[-1]] = best_i
    return out


def rotate_half_cos_sin(angles: RotaryAngles) -> tuple[Tensor, Tensor]:
    """cos, sin (B|1, S, R) in the rotate-half layout (``cat(c, c)``, what :func:`attnkit.rope.apply_rotary`
    takes with ``interleaved=False``) from ``angles`` of either layout: interleaved angles hold
    each angle twice in a row, and ``sin_signed`` is -sin on the first of each pair (interleaved)
    or on the first half (rotate-half)."""
    R = angles.cos.shape[-1]
    if angles.config.interleaved:
        c, s = angles.cos[..., 0::2], angles.sin_signed[..., 1::2]
    else:
        c, s = angles.cos[..., :R // 2], angles.sin_signed[..., R // 2:]
    return torch.cat((c, c), -1), torch.cat((s, s), -1)


class LightningIndexer(nn.Module):
    """DeepSeek-V3.2's indexer (see the module docstring): parameters ``wq_b, wk, k_norm,
    weights_proj`` (Hugging Face's names; ``weights_proj`` is fp32 whatever the model's dtype, as
    transformers keeps it), and the scores' pieces, :meth:`keys`, :meth:`queries`,
    :meth:`head_weights`; :func:`select_topk` selects."""

    def __init__(self, hidden_size: int, q_lora_rank: int, config: IndexerConfig, rope_dim: int, *, device=None,
                 dtype=None):
        super().__init__()
        if not isinstance(config, IndexerConfig):
            raise TypeError(f"config must be an IndexerConfig, got {type(config).__name__}")
        if rope_dim > config.head_dim:
            raise ValueError(f"index_head_dim ({config.head_dim}) must be >= qk_rope_head_dim ({rope_dim}), the "
                             f"channels of each indexer head RoPE rotates")
        self.config, self.rope_dim = config, rope_dim
        H, D = config.num_heads, config.head_dim
        kw = {"device": device, "dtype": dtype}
        self.wq_b = Linear(q_lora_rank, H * D, bias=False, **kw)
        self.wk = Linear(hidden_size, D, bias=False, **kw)
        self.k_norm = nn.LayerNorm(D, eps=1e-6, **kw)
        self.weights_proj = Linear(hidden_size, H, bias=False, device=device, dtype=torch.float32)
        self.scale = D ** -0.5

    def extra_repr(self) -> str:
        c = self.config
        return f"heads={c.num_heads}, head_dim={c.head_dim}, topk={c.topk}"

    def keys(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x (B, S, E) -> rotated keys (B, 1, S, Di) (one head: what the cache stores)."""
        k = self.k_norm(self.wk(x))[:, None]
        return apply_rotary(k, cos, sin, interleaved=False)

    def queries(self, q_resid: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """q_resid (B, S, rq) -> rotated queries (B, S, Hi, Di)."""
        c = self.config
        q = self.wq_b(q_resid).unflatten(-1, (c.num_heads, c.head_dim)).transpose(1, 2)  # (B, Hi, S, Di)
        return apply_rotary(q, cos, sin, interleaved=False).transpose(1, 2)

    def head_weights(self, x: Tensor) -> Tensor:
        """x (B, S, E) -> (B, S, Hi) fp32 per-head weights."""
        w = self.weights_proj.weight
        return F.linear(x.to(w.dtype), w).float() * self.config.num_heads ** -0.5


class IndexedLatentCache(KVCache):
    """One DSA layer's cache: the MLA latent cache (``latent``; this cache is read as it: one head
    of r + dr channels, V = its first r) and the indexer's key cache (``index``: one head of Di
    channels), two caches of one kind ("dynamic", "static" or "paged") stepped together.

    :meth:`begin` begins both and hands out the latent's :class:`~attnkit.caches.CacheStep`
    (dynamic / static: with the indexer's own step as ``index_step``); ``write`` / ``view`` are
    the latent's; :meth:`write_index` stores the step's indexer keys and returns every key;
    ``commit`` / ``abort`` do both. ``reset``, ``crop`` and ``reorder`` apply to both.
    ``lengths`` are the latent's.

    Paged: the two are :class:`~attnkit.caches.PagedKVCache` pools attached to one
    :class:`~attnkit.caches.BlockAllocator` (the model's), so they follow one block table. One
    allocator step (:class:`~attnkit.caches.PagedStep`) reserves the blocks of both, and both
    write into its slots; its commit makes the copy-on-write copies in every attached pool and
    its abort erases what each pool wrote. Forks, prefix caching, crop and free are the
    allocator's, so the indexer's keys follow the latent's blocks through all of them. As with
    any paged cache, a forward over several layers sharing the allocator runs through
    :func:`attnkit.caches.step` (their ``step_group`` is the allocator's), and ``crop`` /
    ``reorder`` through :func:`attnkit.caches.crop` / :func:`~attnkit.caches.reorder`.
    """

    def __init__(self, latent: KVCache, index: KVCache):
        for name, c in (("latent", latent), ("index", index)):
            if not isinstance(c, KVCache) or isinstance(c, IndexedLatentCache):
                raise TypeError(f"{name} must be an attnkit KVCache, got {type(c).__name__}")
        if type(latent) is not type(index):
            raise TypeError(f"latent and index caches must be of one kind, got {type(latent).__name__} and "
                            f"{type(index).__name__}")
        if isinstance(latent, PagedKVCache) and index.allocator is not latent.allocator:
            raise ValueError("paged latent and index caches must share one BlockAllocator (one block table)")
        super().__init__(latent.num_kv_heads, latent.head_dim, latent.v_head_dim,
                         value_from_key=latent.value_from_key, dtype=latent.dtype, device=latent.lengths.device)
        del self._buffers["lengths"]  # the latent's (see the ``lengths`` property)
        self.latent, self.index = latent, index
        self.kv_dtype = latent.kv_dtype

    @property
    def lengths(self) -> Tensor:
        """(B,) tokens each row holds (the latent's; the index cache holds as many)."""
        latent = self._modules.get("latent")
        if latent is None:
            raise AttributeError("lengths")  # during __init__ (nn.Module probes attribute names)
        return latent.lengths

    def extra_repr(self) -> str:
        return f"index_head_dim={self.index.head_dim}"

    @property
    def paged(self) -> bool:
        """Whether both live in paged pools of one allocator."""
        return isinstance(self.latent, PagedKVCache)

    @property
    def step_group(self) -> int | None:
        """Caches with the same group share one step: paged, the allocator's (every layer's)."""
        return self.latent.step_group if self.paged else None

    @property
    def bytes_per_token(self) -> int:
        return self.latent.bytes_per_token + self.index.bytes_per_token

    @property
    def nbytes_used(self) -> int:
        """Paged: bytes of both pools in blocks held by some sequence."""
        if not self.paged:
            raise AttributeError(f"nbytes_used applies to paged caches, not to a {type(self.latent).__name__}")
        return self.latent.nbytes_used + self.index.nbytes_used

    def _index_step(self, step: CacheStep) -> CacheStep:
        return step if self.paged else step.index_step

    def _others(self) -> int:
        """Paged: how many pools of other layers share this cache's allocator."""
        return sum(1 for p in self.latent.allocator.attached if p is not self.latent and p is not self.index)

    def _not_shared(self, what: str) -> None:
        if self.paged and self._others():
            raise RuntimeError(f"{what}() on a cache whose allocator other layers' caches share would act once "
                               f"per layer; call attnkit.caches.{what}(caches, ...) (once per allocator)")

    def begin(self, batch, tokens, num_new=None, *, token_ids=None) -> CacheStep:
        st = self.latent.begin(batch, tokens, num_new, token_ids=token_ids)
        if self.paged:  # the allocator's step: one block table, one reservation for both pools
            return st
        try:
            st.index_step = self.index.begin(batch, tokens, num_new, token_ids=token_ids)
        except BaseException:
            self.latent.abort(st)
            raise
        return st

    def write(self, step, k, v):
        self.latent.write(step, k, v)

    def view(self, step, *, dense=False, held_only=False):
        return self.latent.view(step, dense=dense, held_only=held_only)

    def write_index(self, step: CacheStep, k: Tensor) -> Tensor:
        """Store this step's indexer keys k (B, 1, S, Di); every key the step sees, (B, L, Di),
        the same L as the latent's view."""
        st = self._index_step(step)
        self.index.write(st, k, None)
        return self.index.view(st, dense=True)[0][:, 0]

    def commit(self, step):
        self.latent.commit(step)  # paged: the allocator's commit, for both pools
        if not self.paged:
            self.index.commit(step.index_step)

    def abort(self, step):
        if not self.paged:  # paged: the allocator's abort erases what each pool wrote
            self.index.abort(step.index_step)
        self.latent.abort(step)

    def _transaction(self, batch, tokens, num_new):
        if self.paged and self._others():
            raise RuntimeError(f"this cache's allocator is shared by {self._others()} other layer pools: a forward "
                               f"appends to all of them at once; run it inside attnkit.caches.step(caches, ...)")
        return super()._transaction(batch, tokens, num_new)

    def reset(self) -> None:
        self.latent.reset()
        self.index.reset()  # paged: the allocator's batch is gone already (idempotent)

    def crop(self, n) -> None:
        self._not_shared("crop")
        self.crop_group(n)

    def crop_group(self, n) -> None:
        """:meth:`crop` (paged: once for every cache sharing the allocator; what
        :func:`attnkit.caches.crop` calls)."""
        if self.paged:
            self.latent.crop_group(n)  # the allocator's: both pools' block tables at once
            return
        self._kept_lengths(n)  # validates n before either cache changes
        self.latent.crop(n)
        self.index.crop(n)

    def reorder(self, indices) -> None:
        self._not_shared("reorder")
        self.reorder_group(indices)

    def reorder_group(self, indices) -> None:
        """:meth:`reorder` (paged: once for every cache sharing the allocator; what
        :func:`attnkit.caches.reorder` calls)."""
        if self.paged:
            self.latent.reorder_group(indices)  # forks share both pools' blocks
            return
        self.latent.reorder(indices)  # validates first; the index cache takes the same indices
        self.index.reorder(indices)


class IndexedLatentAttention(MultiHeadLatentAttention):
    """Multi-head latent attention restricted, per query, to the keys its lightning indexer
    selects (DeepSeek-V3.2's DSA; see the module docstring). Needs ``q_lora_rank`` (the indexer
    reads MLA's normalised query latent). Parameters: MLA's plus ``indexer.*``.

    ``forward`` takes what :class:`MultiHeadLatentAttention` takes except ``mask`` (the selection
    is the mask; key padding goes through ``key_padding_mask``) and needs an
    :class:`IndexedLatentCache` (:meth:`new_cache`) as its cache.
    """

    def __init__(self, config: MLAConfig, indexer: IndexerConfig, mode: str = "auto", backend: str = "auto",
                 device=None, dtype=None, *, scale: float | None = None, softcap: float | None = None,
                 sinks: bool = False):
        if not isinstance(config, MLAConfig):
            raise TypeError(f"config must be an MLAConfig, got {type(config).__name__}")
        if config.q_lora_rank is None:
            raise ValueError("the lightning indexer reads MLA's query latent: q_lora_rank must be set, got None")
        super().__init__(config, mode, backend, device, dtype, scale=scale, softcap=softcap, sinks=sinks)
        self.indexer = LightningIndexer(config.hidden_size, config.q_lora_rank, indexer, config.qk_rope_head_dim,
                                        device=device, dtype=dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", index_topk={self.indexer.config.topk}"

    def new_cache(self, kind: str = "dynamic", *, max_batch: int | None = None, max_len: int | None = None,
                  allocator=None, dtype: torch.dtype | None = None, device=None, kv_dtype=None,
                  k_channel_scale=None) -> IndexedLatentCache:
        """An empty :class:`IndexedLatentCache` of ``kind`` ("dynamic", "static" or "paged", which
        needs the model's shared ``allocator``; other kinds raise ValueError): MLA's latent cache
        (``kv_dtype`` and ``k_channel_scale`` as :meth:`MultiHeadLatentAttention.new_cache`) and
        the indexer's key cache (paged: a pool of its own on the same allocator), unquantized in
        the latent's compute dtype: a top-k is discontinuous, so rounding noise in the keys it
        ranks flips near-tied selections and moves the output far more than the same noise in the
        latent does (and the indexer's keys are the smaller part of the cache)."""
        if kind not in INDEXED_CACHE_KINDS:
            raise ValueError(f"a {kind!r} cache cannot hold DeepSeek-V3.2's indexer keys beside the latent; "
                             f"use one of {INDEXED_CACHE_KINDS}")
        if kind != "paged" and allocator is not None:
            raise TypeError(f"allocator= applies to paged caches, not to a {kind} cache")
        latent = super().new_cache(kind, max_batch=max_batch, max_len=max_len, allocator=allocator, dtype=dtype,
                                   device=device, kv_dtype=kv_dtype, k_channel_scale=k_channel_scale)
        D = self.indexer.config.head_dim
        index = new_cache(kind, (1, D, D), value_from_key=True, max_batch=max_batch, max_len=max_len,
                          allocator=allocator, dtype=latent.dtype, device=latent.lengths.device)
        return IndexedLatentCache(latent, index)

    def check_cache(self, cache, dtype: torch.dtype | None = None) -> None:
        super().check_cache(cache, dtype)
        base = cache.cache if isinstance(cache, BoundCache) else cache
        if not isinstance(base, IndexedLatentCache):
            raise TypeError(f"this DSA layer needs an IndexedLatentCache (the latent and the indexer's keys; "
                            f"build it with new_cache()), got {type(base).__name__}")
        if base.index.head_dim != self.indexer.config.head_dim:
            raise ValueError(f"the cache's indexer keys have {base.index.head_dim} channels, this layer's "
                             f"index_head_dim is {self.indexer.config.head_dim}")

    def forward(self, x: Tensor, *, mask=None, key_padding_mask: Tensor | None = None,
                positions: Tensor | None = None, cache: KVCache | None = None, need_weights: bool = False):
        """Causal self-attention over ``x`` limited to each query's selected keys.

        Args:
            x: (B, S, E).
            mask: must be None (not supported: the indexer's selection is the mask).
            key_padding_mask: (B, L) bool (True = padding) or float (added to the scores, and to
                the indexer's), over every key attended to.
            positions, cache, need_weights: as :meth:`MultiHeadLatentAttention.forward`
                (``cache`` an :class:`IndexedLatentCache`).

        Returns:
            out (B, S, E), and the weights (B, H, S, L) fp32 with ``need_weights``.
        """
        c = self.config
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != c.hidden_size:
            raise ValueError(f"x must be (B, S, hidden_size={c.hidden_size}), got shape {shape_of(x)}")
        if mask is not None:
            raise ValueError("mask= is not supported by IndexedLatentAttention: the indexer's selection is its mask "
                             "(pass key padding as key_padding_mask)")
        B, S, _ = x.shape
        if cache is not None:
            self.check_cache(cache)
        if positions is None:
            positions = cache.positions(S) if cache is not None else torch.arange(S, device=x.device)[None]
        angles = self.rope.angles(positions)  # validates the positions
        user_mask = None
        if key_padding_mask is not None:  # its width is checked against the step's view in _select (aborted on error)
            user_mask = torch_key_padding(key_padding_mask, B, S if cache is None else None)
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).unflatten(-1, (c.num_heads, c.qk_head_dim)).transpose(1, 2)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = self.rope(q_pe, k_pe[:, None], angles)  # (B, H, S, dr), (B, 1, S, dr)
        latent = torch.cat((self.kv_a_layernorm(c_kv)[:, None], k_pe), dim=-1)
        with torch.no_grad():
            cos, sin = rotate_half_cos_sin(angles)
            idx_q = self.indexer.queries(q_resid, cos, sin)
            idx_k = self.indexer.keys(x, cos, sin)  # (B, 1, S, Di)
            idx_w = self.indexer.head_weights(x)
        if cache is None:
            hi = torch.arange(1, S + 1, device=x.device).expand(B, S)
            ids = self._select(idx_q, idx_w, idx_k[:, 0], hi, key_padding_mask)
            res = self.attend_latent(q_nope, q_pe, latent, and_masks(SelectedKeys(ids), user_mask),
                                     need_weights=need_weights)
        else:
            with cache.transaction(B, S) as bound:
                step = bound.step
                keys = bound.cache.write_index(step, idx_k.to(bound.dtype))
                hi = torch.minimum(step.q_start[:, None] + torch.arange(1, S + 1, device=step.q_start.device),
                                   step.new[:, None])
                ids = self._select(idx_q, idx_w, keys, hi, key_padding_mask)
                res = self.attend_latent(q_nope, q_pe, latent, and_masks(SelectedKeys(ids), user_mask), cache=bound,
                                         need_weights=need_weights)
        out, weights = res if need_weights else (res, None)
        out = self.o_proj(out.transpose(1, 2).flatten(2))
        return (out, weights) if need_weights else out

    def _select(self, q: Tensor, w: Tensor, keys: Tensor, hi: Tensor, key_padding_mask: Tensor | None) -> Tensor:
        B, L = keys.shape[0], keys.shape[1]
        bias = None
        if key_padding_mask is not None:
            if key_padding_mask.shape != (B, L):
                raise ValueError(f"key_padding_mask must be (B, L) = ({B}, {L}) (every key this call attends "
                                 f"over), got shape {shape_of(key_padding_mask)}")
            if key_padding_mask.dtype == torch.bool:
                bias = torch.zeros(B, L, device=keys.device).masked_fill(key_padding_mask.to(keys.device),
                                                                         float("-inf"))
            else:
                bias = key_padding_mask.to(keys.device).float()
        with torch.no_grad():
            return select_topk(q, w, keys, hi, self.indexer.config.topk, scale=self.indexer.scale, key_bias=bias)
