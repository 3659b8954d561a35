"""The rotary embedding module, :class:`RotaryEmbedding` (its frequencies, cos/sin table and
rotation of q and k), and :class:`RotaryAngles`, one call's cos/sin shared by every layer. See
:mod:`attnkit.rope` for the notation, the rope types and an example."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor, nn

from .config import RopeConfig, rope_config_from_hf
from .frequencies import dynamic_inv_freq, rope_inv_freq
from .mscale import yarn_softmax_scale_multiplier
from .rotate import rotate_signed, rotation_sign

__all__ = ["RotaryAngles", "RotaryEmbedding"]


class RotaryAngles:
    """cos and sin of one call's positions for one rotary embedding, computed once per forward by
    :meth:`RotaryEmbedding.angles` and passed as ``positions`` to every layer that uses an
    embedding of the same config (the positions are then validated and looked up once).

    Attributes:
        cos: (B, S, R) or (1, S, R) fp32, the layout of :meth:`RotaryEmbedding.cos_sin`.
        sin_signed: the same shape: ``sin`` with the rotation's minus sign folded in (negated on
            the first half for rotate-half, on the first of each pair for interleaved), so that
            ``x_rot = x * cos + partner(x) * sin_signed``.
        config: the :class:`RopeConfig` they were computed for.
    """

    __slots__ = ("cos", "sin_signed", "config", "_views")

    def __init__(self, cos: Tensor, sin_signed: Tensor, config: "RopeConfig"):
        self.cos, self.sin_signed, self.config = cos, sin_signed, config
        self._views: dict = {}

    def broadcast(self, layout: str, device: torch.device) -> tuple[Tensor, Tensor]:
        """(cos, sin_signed) shaped to broadcast against x of ``layout`` ("bhsd": (B, 1, S, R),
        "bshd": (B, S, 1, R)) on ``device``; computed once per angles object and reused by every
        layer."""
        key = (layout, device)
        hit = self._views.get(key)
        if hit is None:
            dim = 1 if layout == "bhsd" else 2
            hit = tuple(t.to(device).unsqueeze(dim) for t in (self.cos, self.sin_signed))
            self._views[key] = hit
        return hit

    @property
    def shape(self) -> tuple[int, int]:
        """(B or 1, S) of the positions."""
        return tuple(self.cos.shape[:2])

    def __repr__(self) -> str:
        return f"RotaryAngles(shape={self.shape}, rope_type={self.config.rope_type!r})"


class RotaryEmbedding(nn.Module):
    """Rotary position embedding for q and k at explicit per-sequence positions.

    Args:
        head_dim, rotary_dim, base, max_position_embeddings, scaling, interleaved: see
            :class:`RopeConfig` (built and validated here, kept as ``self.config``).

    Buffers, all non-persistent (``.to()`` moves them; the state dict stays empty, so Hugging
    Face checkpoints load with ``strict=True``): ``inv_freq`` (F,) fp32, and the cos/sin table
    ``cos_table`` / ``sin_table`` (N, R) fp32 of positions ``0 .. N - 1`` (``sin_table`` holds
    :class:`RotaryAngles`' ``sin_signed``). The table starts empty and grows (doubling) to the
    largest position an eager call has used, so it costs what the work needs; every rope type
    reads it except ``"dynamic"``, whose frequencies depend on the call and are recomputed. A
    traced (``torch.compile``) call computes cos/sin from ``inv_freq`` instead (a graph cannot
    grow a table). If a cast such as ``model.to(torch.bfloat16)`` changes the buffers' dtype,
    they are rebuilt in fp32 from the config on next use, so cos/sin never lose precision.

    Use ``rope(q, k, positions)`` (``forward``) per layer; a model computes ``angles =
    rope.angles(positions)`` once per forward and passes ``angles`` as every layer's
    ``positions`` (the checks and the table lookup then run once). There is no ``apply`` method:
    ``nn.Module.apply(fn)`` is the recursive initialiser every parent module relies on.
    """

    inv_freq: Tensor
    cos_table: Tensor
    sin_table: Tensor

    def __init__(self, head_dim: int, *, rotary_dim: int | None = None, base: float | None = None,
                 max_position_embeddings: int | None = None, scaling: Mapping[str, Any] | None = None,
                 interleaved: bool = False):
        super().__init__()
        self.config = RopeConfig(head_dim, rotary_dim=rotary_dim, base=base,
                                 max_position_embeddings=max_position_embeddings, scaling=scaling,
                                 interleaved=interleaved)
        self.register_buffer("inv_freq", rope_inv_freq(self.config), persistent=False)
        R = self.config.rotary_dim
        self.register_buffer("cos_table", torch.zeros(0, R), persistent=False)
        self.register_buffer("sin_table", torch.zeros(0, R), persistent=False)

    # .................................................................. construction

    @classmethod
    def from_config(cls, config: RopeConfig) -> "RotaryEmbedding":
        """Build from a :class:`RopeConfig`."""
        if not isinstance(config, RopeConfig):
            raise TypeError(f"config must be a RopeConfig, got {type(config).__name__}")
        c = config
        return cls(c.head_dim, rotary_dim=c.rotary_dim, base=c.base, max_position_embeddings=c.max_position_embeddings,
                   scaling=None if c.scaling is None else dict(c.scaling), interleaved=c.interleaved)

    @classmethod
    def from_hf_config(cls, config, *, layer_type: str | None = None,
                       interleaved: bool | None = None) -> "RotaryEmbedding":
        """Build the embedding a Hugging Face model with ``config`` (a ``PretrainedConfig``) uses.

        Reads ``head_dim`` (else ``hidden_size // num_attention_heads``; DeepSeek-V3 sets it to
        ``qk_rope_head_dim``), ``rope_parameters`` (v5; or ``rope_scaling`` + ``rope_theta``, v4),
        ``partial_rotary_factor`` (rotary_dim = ``int(head_dim * factor)``) and
        ``max_position_embeddings``. For ``"llama3"``/``"yarn"`` the config attribute
        ``original_max_position_embeddings`` wins over the dict's (Phi-3's rule in Hugging Face),
        else the dict's, else ``max_position_embeddings``. Keys the rope type does not use are
        dropped (Hugging Face only warns about them). ``layer_type`` picks one entry of per-layer
        ``rope_parameters`` (Gemma-3 style). ``interleaved`` defaults to the config's
        ``rope_interleave`` (DeepSeek-V3), else False. The config is not modified.
        """
        return cls.from_config(rope_config_from_hf(config, layer_type=layer_type, interleaved=interleaved))

    # .................................................................. properties

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def rotary_dim(self) -> int:
        return self.config.rotary_dim

    @property
    def rope_type(self) -> str:
        return self.config.rope_type

    @property
    def interleaved(self) -> bool:
        return self.config.interleaved

    @property
    def attention_scaling(self) -> float:
        """Factor multiplied into cos/sin (YaRN's ``attention_factor``; 1.0 for other types)."""
        return self.config.attention_scaling

    @property
    def softmax_scale_multiplier(self) -> float:
        """DeepSeek-style softmax-scale multiplier, :func:`yarn_softmax_scale_multiplier`."""
        return yarn_softmax_scale_multiplier(self.config.scaling)

    def extra_repr(self) -> str:
        c = self.config
        return (f"head_dim={c.head_dim}, rotary_dim={c.rotary_dim}, base={c.base}, rope_type={c.rope_type!r}, "
                f"interleaved={c.interleaved}")

    # .................................................................. compute

    def _check_positions(self, positions) -> Tensor:
        self._positions_range(positions)
        return positions

    def _positions_range(self, positions) -> tuple[int, int] | None:
        """Validate ``positions``; their (min, max) (one host sync), None while compiling or empty."""
        if not isinstance(positions, Tensor):
            raise TypeError(f"positions must be an integer tensor (B, S), got {type(positions).__name__}")
        if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
            raise TypeError(f"positions must hold integers, got dtype {positions.dtype}")
        if positions.dim() != 2:
            raise ValueError(f"positions must be (B, S), got shape {tuple(positions.shape)}")
        # A data-dependent check (a host sync on GPU); skipped while compiling.
        if torch.compiler.is_compiling() or not positions.numel():
            return None
        lo, hi = (int(v) for v in positions.aminmax())
        if lo < 0:
            raise ValueError(f"positions must be >= 0, got min {lo}")
        return lo, hi

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin for ``positions``, each (B, S, R) fp32, ``attention_scaling`` multiplied in.

        Args:
            positions: (B, S) integer tensor, the position of every token of every sequence
                (ragged batches, left padding, tokens already cached: any non-negative values).

        Layout follows ``interleaved``: rotate-half gives ``cat(c, c)`` (Hugging Face's cos),
        interleaved gives each angle twice in a row.

        ``"dynamic"``: the frequencies are recomputed from ``L = max(positions) + 1`` over the whole
        call (all sequences), and are the default ones while ``L <= max_position_embeddings``. This
        is a pure function of ``positions``: the module holds no per-call state, so the same call
        always gives the same bits. Hugging Face's module instead keeps the largest ``L`` it has
        seen until a call drops below ``max_position_embeddings``; the two agree for a fresh
        module and whenever ``L`` never shrinks (prefill then decode), and differ when a long call
        is followed by a shorter one that still exceeds ``max_position_embeddings`` (here it
        uses its own ``L``). Keys already in a cache keep the frequencies they were rotated with,
        in both.
        """
        return self._cos_sin(self._check_positions(positions))

    def _fp32_inv_freq(self) -> Tensor:
        inv_freq = self.inv_freq
        if inv_freq.dtype != torch.float32:  # the module was cast (model.to(bf16)): rebuild exactly
            inv_freq = rope_inv_freq(self.config, inv_freq.device)
            if not torch.compiler.is_compiling():
                self.inv_freq = inv_freq
        return inv_freq

    def _cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        positions = positions.to(self.inv_freq.device)
        inv_freq = self._fp32_inv_freq()
        if self.config.rope_type == "dynamic" and positions.numel():
            seq_len = positions.max().long() + 1
            grown = dynamic_inv_freq(self.config, seq_len)
            inv_freq = torch.where(seq_len > self.config.max_position_embeddings, grown, inv_freq)
        freqs = positions[..., None].float() * inv_freq  # (B, S, F)
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        if self.config.interleaved:
            return cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

    @property
    def uses_table(self) -> bool:
        """Whether eager calls read cos/sin from the table (every rope type but "dynamic")."""
        return self.config.rope_type != "dynamic"

    def reserve(self, n: int) -> None:
        """Make the table cover positions ``0 .. n - 1`` now (it otherwise grows on demand;
        growth doubles, so it is amortised). A no-op for "dynamic"."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        if not self.uses_table:
            return
        table = self.cos_table
        have = table.shape[0] if table.dtype == torch.float32 and self.sin_table.dtype == torch.float32 else 0
        if n <= have:
            return
        n = max(n, 2 * have, 64)
        cos, sin = self._cos_sin(torch.arange(n, device=self.inv_freq.device)[None])
        self.cos_table = cos[0]
        self.sin_table = sin[0] * rotation_sign(self.rotary_dim, self.interleaved, sin.device)

    def angles(self, positions: Tensor) -> RotaryAngles:
        """Validate ``positions`` (B, S) (or (1, S)) and look up their cos / sin once, for every
        layer of a forward that rotates with this config (see :class:`RotaryAngles`)."""
        if isinstance(positions, RotaryAngles):
            self._check_angles(positions)
            return positions
        span = self._positions_range(positions)
        if not self.uses_table or torch.compiler.is_compiling():
            cos, sin = self._cos_sin(positions)
            return RotaryAngles(cos, sin * rotation_sign(self.rotary_dim, self.interleaved, sin.device), self.config)
        if span is not None and span[1] >= self.cos_table.shape[0]:
            self.reserve(span[1] + 1)
        elif self.cos_table.dtype != torch.float32 or self.sin_table.dtype != torch.float32:
            self.reserve(self.cos_table.shape[0])  # cast by model.to(dtype): rebuilt in fp32
        table = self.cos_table
        if positions.device != table.device:
            positions = positions.to(table.device)
        return RotaryAngles(table[positions], self.sin_table[positions], self.config)

    def _check_angles(self, angles: RotaryAngles) -> None:
        c = angles.config
        if c is not self.config and c != self.config:
            raise ValueError(f"these RotaryAngles were computed for another rotary config ({c}); this "
                             f"embedding is {self.config}")

    def _angles_for(self, name: str, x: Tensor, positions, seq_dim: int) -> RotaryAngles:
        """Validated angles matching x's batch and sequence dims."""
        a = self.angles(positions)
        B, S = x.shape[0], x.shape[seq_dim]
        if a.cos.shape[1] != S or a.cos.shape[0] not in (1, B):
            raise ValueError(f"positions of shape {a.shape} do not match (B, S) = ({B}, {S}) of {name} "
                             f"{tuple(x.shape)} (or (1, {S}) shared by the batch)")
        return a

    def _check_heads(self, name: str, x) -> None:
        if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating tensor, got {getattr(x, 'dtype', type(x).__name__)}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be (B, H, S, D), got shape {tuple(x.shape)}")
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"{name} has head dim {x.shape[-1]} (shape {tuple(x.shape)}), but this "
                             f"RotaryEmbedding has head_dim={self.head_dim}")

    def _check_match(self, name: str, x: Tensor, positions: Tensor) -> None:
        B, S = x.shape[0], x.shape[2]
        if positions.shape[1] != S or positions.shape[0] not in (1, B):
            raise ValueError(f"positions of shape {tuple(positions.shape)} do not match (B, S) = ({B}, {S}) "
                             f"of {name} {tuple(x.shape)} (or (1, {S}) shared by the batch)")

    def rotate(self, x: Tensor, positions, *, layout: str = "bhsd") -> Tensor:
        """Rotate one tensor at ``positions`` ((B, S) or (1, S) integers, or :class:`RotaryAngles`).

        ``layout="bhsd"``: x (B, H, S, D) (the attention layout); ``"bshd"``: x (B, S, H, D) (a
        projection's output before the head transpose; e.g. q and k heads side by side, rotated in
        one go). Returns x's shape and dtype, computed in fp32 and cast back."""
        if layout not in ("bhsd", "bshd"):
            raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
        self._check_heads("x", x)
        a = self._angles_for("x", x, positions, 1 if layout == "bshd" else 2)
        cos, sin = a.broadcast(layout, x.device)
        return rotate_signed(x, cos, sin, self.interleaved)

    def forward(self, q: Tensor, k: Tensor, positions) -> tuple[Tensor, Tensor]:
        """Rotate queries and keys that sit at the same positions.

        Args:
            q: (B, Hq, S, D).
            k: (B, Hkv, S, D).
            positions: (B, S) integer positions (or (1, S) shared by the batch), or the
                :class:`RotaryAngles` of :meth:`angles` (computed once for several layers).

        Returns:
            ``(q_rot, k_rot)``, the shapes and dtypes of q and k, computed in fp32 and cast back.
        """
        self._check_heads("q", q)
        self._check_heads("k", k)
        if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
            raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share B and S; rotate keys at "
                             "other positions with RotaryEmbedding.rotate(k, k_positions)")
        a = self._angles_for("q", q, positions, 2)
        return (rotate_signed(q, *a.broadcast("bhsd", q.device), self.interleaved),
                rotate_signed(k, *a.broadcast("bhsd", k.device), self.interleaved))
