"""attnkit.rope: parity with Hugging Face for every rope type, rotation properties, bad inputs."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from attnkit import native
from attnkit.rope import (
    ROPE_TYPES,
    RopeConfig,
    RotaryEmbedding,
    apply_rotary,
    yarn_get_mscale,
    yarn_softmax_scale_multiplier,
)

try:
    import transformers  # noqa: F401

    HAS_HF = True
except ImportError:  # pragma: no cover - transformers is a test extra
    HAS_HF = False

needs_hf = pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")

HEAD_DIM = 32
BASE = 10000.0

# id -> (scaling dict in Hugging Face's format, max_position_embeddings)
CASES = {
    "default": (None, 64),
    "linear": ({"rope_type": "linear", "factor": 4.0}, 64),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, 64),
    # factor * L / mpe - (factor - 1) is not exactly 1 in fp32 here: below the limit HF uses the
    # frequencies it built at init in Python floats, not the per-call fp32 formula.
    "dynamic-inexact": ({"rope_type": "dynamic", "factor": 1.3}, 4096),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}, 256),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, 128),
    # DeepSeek-V3: mscale == mscale_all_dim, so the cos/sin factor is 1 and the softmax scale grows.
    "yarn-deepseek": ({"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                       "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 32}, 1280),
    "yarn-mscale-ratio": ({"rope_type": "yarn", "factor": 8.0, "mscale": 0.707, "mscale_all_dim": 1.0,
                           "original_max_position_embeddings": 32}, 256),
    "yarn-attention-factor": ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.8, "beta_fast": 16,
                               "beta_slow": 2, "original_max_position_embeddings": 32}, 128),
    "yarn-no-truncate": ({"rope_type": "yarn", "factor": 4.0, "truncate": False,
                          "original_max_position_embeddings": 32}, 128),  # gpt-oss
    "yarn-legacy-type": ({"type": "yarn", "factor": 4.0}, 128),  # ompe falls back to max_position_embeddings
    "yarn-factor-none": ({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 32}, 128),
}
# One case per type for the (heavier) property grids.
TYPE_CASES = ["default", "linear", "dynamic", "llama3", "yarn"]


def make_positions(kind: str, B: int = 3, S: int = 7) -> torch.Tensor:
    """(B, S) int64 positions: contiguous from a per-sequence q_start, or scattered values."""
    if kind == "q_start":  # every max < 64: dynamic stays at the default frequencies
        return torch.tensor([0, 5, 40])[:B, None] + torch.arange(S)
    if kind == "q_start-long":  # beyond max_position_embeddings: dynamic grows, YaRN extrapolates
        return torch.tensor([3, 60, 211])[:B, None] + torch.arange(S)
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 300, (B, S), generator=g)


def ours(case: str, **kw) -> RotaryEmbedding:
    scaling, mpe = CASES[case]
    return RotaryEmbedding(HEAD_DIM, base=BASE, max_position_embeddings=mpe, scaling=copy.deepcopy(scaling), **kw)


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


# --------------------------------------------------------------------------- Hugging Face builders


def hf_config(case: str, model: str = "llama", partial: float | None = None):
    from transformers import DeepseekV3Config, GPTNeoXConfig, LlamaConfig

    scaling, mpe = CASES[case]
    params = copy.deepcopy(scaling) or {"rope_type": "default"}
    params["rope_theta"] = BASE
    legacy = "type" in params
    if partial is not None:
        params["partial_rotary_factor"] = partial
    kw = {"rope_scaling": params} if legacy else {"rope_parameters": params}
    if model == "llama":
        return LlamaConfig(hidden_size=2 * HEAD_DIM, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=HEAD_DIM, max_position_embeddings=mpe, **kw)
    if model == "gpt_neox":
        return GPTNeoXConfig(hidden_size=2 * HEAD_DIM, num_attention_heads=2, max_position_embeddings=mpe, **kw)
    assert model == "deepseek_v3"
    return DeepseekV3Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, qk_rope_head_dim=HEAD_DIM,
                            qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=32, q_lora_rank=32,
                            max_position_embeddings=mpe, **kw)


def hf_rotary(config, model: str = "llama"):
    if model == "llama":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding as cls
    elif model == "gpt_neox":
        from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding as cls
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding as cls
    return cls(config=config)


def hf_cos_sin(rotary, positions):
    return rotary(torch.zeros(1, dtype=torch.float32), positions)


def deinterleave_perm(r: int) -> torch.Tensor:
    """Index map from interleaved pairs (x0, x1), (x2, x3)... to rotate-half order (evens, odds)."""
    return torch.cat((torch.arange(0, r, 2), torch.arange(1, r, 2)))


# --------------------------------------------------------------------------- parity: Hugging Face


@needs_hf
@pytest.mark.parametrize("kind", ["q_start", "q_start-long", "scattered"])
@pytest.mark.parametrize("case", list(CASES))
def test_parity_llama(case, kind):
    """cos/sin and rotated q/k equal LlamaRotaryEmbedding + apply_rotary_pos_emb (fresh HF module per
    call, since HF's dynamic keeps state), for the direct constructor and from_hf_config."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg = hf_config(case)
    hf = hf_rotary(cfg)
    ropes = (ours(case), RotaryEmbedding.from_hf_config(cfg))
    for rope in ropes:  # the same expressions as modeling_rope_utils: bit for bit (before HF's dynamic update)
        assert torch.equal(rope.inv_freq, hf.inv_freq)
    pos = make_positions(kind)
    cos_h, sin_h = hf_cos_sin(hf, pos)
    q, k = rand(3, 4, 7, HEAD_DIM, seed=1), rand(3, 2, 7, HEAD_DIM, seed=2)
    q_h, k_h = apply_rotary_pos_emb(q, k, cos_h, sin_h)
    for rope in ropes:
        assert rope.attention_scaling == hf.attention_scaling
        cos, sin = rope.cos_sin(pos)
        assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (3, 7, HEAD_DIM)
        torch.testing.assert_close(cos, cos_h)
        torch.testing.assert_close(sin, sin_h)
        q_o, k_o = rope(q, k, pos)
        torch.testing.assert_close(q_o, q_h)
        torch.testing.assert_close(k_o, k_h)
        # int32 positions are as good as int64
        torch.testing.assert_close(rope(q, k, pos.int())[0], q_h)


@needs_hf
def test_from_hf_config_maps_fields():
    rope = RotaryEmbedding.from_hf_config(hf_config("llama3"))
    c = rope.config
    assert (c.head_dim, c.rotary_dim, c.base, c.rope_type, c.interleaved) == (HEAD_DIM, HEAD_DIM, BASE, "llama3", False)
    assert c.max_position_embeddings == 256 and c.params["original_max_position_embeddings"] == 32
    rope = RotaryEmbedding.from_hf_config(hf_config("yarn-legacy-type"))
    assert rope.rope_type == "yarn" and rope.config.params["original_max_position_embeddings"] == 128
    rope = RotaryEmbedding.from_hf_config(hf_config("yarn-factor-none"))
    assert rope.config.params["factor"] == 4.0  # max_position_embeddings / original
    ds = RotaryEmbedding.from_hf_config(hf_config("yarn-deepseek", "deepseek_v3"))
    assert ds.interleaved and ds.head_dim == HEAD_DIM  # rope_interleave, qk_rope_head_dim
    assert not RotaryEmbedding.from_hf_config(hf_config("yarn-deepseek", "deepseek_v3"), interleaved=False).interleaved


def test_from_hf_config_legacy_and_per_layer():
    """v4-style configs (rope_theta + rope_scaling attributes) and per-layer rope_parameters."""
    v4 = SimpleNamespace(hidden_size=64, num_attention_heads=2, rope_theta=500000.0, max_position_embeddings=64,
                         rope_scaling={"type": "linear", "factor": 2.0})
    rope = RotaryEmbedding.from_hf_config(v4)
    got = (rope.head_dim, rope.config.base, rope.rope_type, rope.config.params["factor"])
    assert got == (32, 500000.0, "linear", 2.0)
    per_layer = SimpleNamespace(
        head_dim=16, max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})
    full = RotaryEmbedding.from_hf_config(per_layer, layer_type="full_attention")
    assert (full.rope_type, full.config.base) == ("linear", 1e6)
    assert RotaryEmbedding.from_hf_config(per_layer, layer_type="sliding_attention").rope_type == "default"
    with pytest.raises(ValueError, match=r"for \['sliding_attention', 'full_attention'\]; pass layer_type=.*got None"):
        RotaryEmbedding.from_hf_config(per_layer)


@needs_hf
@pytest.mark.parametrize("case", TYPE_CASES + ["yarn-deepseek"])
def test_parity_partial_rotary_gpt_neox(case):
    """rotary_dim = head_dim // 2 (partial_rotary_factor 0.5) equals GPT-NeoX's rotary + apply."""
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb

    cfg = hf_config(case, "gpt_neox", partial=0.5)
    hf = hf_rotary(cfg, "gpt_neox")
    pos = make_positions("q_start-long")
    cos_h, sin_h = hf_cos_sin(hf, pos)
    q, k = rand(3, 4, 7, HEAD_DIM, seed=3), rand(3, 1, 7, HEAD_DIM, seed=4)
    q_h, k_h = apply_rotary_pos_emb(q, k, cos_h, sin_h)
    scaling, mpe = CASES[case]
    direct = RotaryEmbedding(HEAD_DIM, rotary_dim=HEAD_DIM // 2, base=BASE, max_position_embeddings=mpe,
                             scaling=copy.deepcopy(scaling))
    for rope in (direct, RotaryEmbedding.from_hf_config(cfg)):
        assert rope.rotary_dim == HEAD_DIM // 2
        cos, sin = rope.cos_sin(pos)
        torch.testing.assert_close(cos, cos_h)
        torch.testing.assert_close(sin, sin_h)
        q_o, k_o = rope(q, k, pos)
        torch.testing.assert_close(q_o, q_h)
        torch.testing.assert_close(k_o, k_h)
        assert torch.equal(q_o[..., HEAD_DIM // 2:], q[..., HEAD_DIM // 2:])  # pass-through untouched


@needs_hf
@pytest.mark.parametrize("case", ["yarn-deepseek", "yarn", "default"])
def test_parity_deepseek_v3_interleaved(case):
    """interleaved=True equals DeepSeek-V3's apply_rotary_pos_emb_interleave up to its de-interleaving
    (HF returns evens-then-odds); attention scores q.k are identical."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    cfg = hf_config(case, "deepseek_v3")
    hf = hf_rotary(cfg, "deepseek_v3")
    pos = make_positions("scattered")
    cos_h, sin_h = hf_cos_sin(hf, pos)
    q, k = rand(3, 2, 7, HEAD_DIM, seed=5), rand(3, 1, 7, HEAD_DIM, seed=6)
    q_h, k_h = apply_rotary_pos_emb_interleave(q, k, cos_h, sin_h)
    rope = RotaryEmbedding.from_hf_config(cfg)
    assert rope.interleaved and rope.attention_scaling == hf.attention_scaling
    q_o, k_o = rope(q, k, pos)
    perm = deinterleave_perm(HEAD_DIM)
    torch.testing.assert_close(q_o[..., perm], q_h)
    torch.testing.assert_close(k_o[..., perm], k_h)
    torch.testing.assert_close(q_o @ k_o.transpose(-1, -2), q_h @ k_h.transpose(-1, -2))
    # The rotate-half layout of the same config equals DeepseekV3RotaryEmbedding's cos/sin exactly.
    cos, sin = RotaryEmbedding.from_hf_config(cfg, interleaved=False).cos_sin(pos)
    torch.testing.assert_close(cos, cos_h)
    torch.testing.assert_close(sin, sin_h)


@needs_hf
@pytest.mark.parametrize("case", ["yarn-deepseek", "yarn-mscale-ratio", "yarn", "linear", "default"])
def test_softmax_scale_multiplier_matches_deepseek_v3(case):
    """qk_head_dim ** -0.5 * multiplier == DeepseekV3Attention.scaling (HF's yarn_apply_mscale)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, yarn_apply_mscale

    cfg = hf_config(case, "deepseek_v3")
    attn = DeepseekV3Attention(cfg, layer_idx=0)
    scale = cfg.qk_head_dim ** -0.5
    mult = yarn_softmax_scale_multiplier(cfg.rope_parameters)
    assert math.isclose(scale * mult, attn.scaling, rel_tol=1e-14)
    assert RotaryEmbedding.from_hf_config(cfg).softmax_scale_multiplier == mult
    for extra in ({"rope_type": "linear", "factor": 4.0, "mscale_all_dim": 0.5}, {"rope_type": "default"},
                  {"rope_type": "yarn", "factor": 0.5, "mscale_all_dim": 1.0}):
        ours_scale = scale * yarn_softmax_scale_multiplier(extra)
        assert math.isclose(ours_scale, yarn_apply_mscale(extra, scale), rel_tol=1e-14)
    if case == "yarn-deepseek":
        assert math.isclose(mult, (0.1 * math.log(40.0) + 1) ** 2)


@needs_hf
def test_dynamic_matches_stateful_hf_while_length_grows():
    """Prefill past max_position_embeddings then decode: one stateful HF module == our pure calls."""
    cfg = hf_config("dynamic")
    hf, rope = hf_rotary(cfg), RotaryEmbedding.from_hf_config(cfg)
    steps = [torch.arange(100)[None].expand(2, -1)] + [torch.full((2, 1), p) for p in (100, 101, 102)]
    for pos in steps:
        cos_h, sin_h = hf_cos_sin(hf, pos)
        cos, sin = rope.cos_sin(pos)
        torch.testing.assert_close(cos, cos_h)
        torch.testing.assert_close(sin, sin_h)


@needs_hf
def test_dynamic_is_pure_where_hf_keeps_state():
    """Documented divergence: after a long call HF keeps the grown base for a shorter call that still
    exceeds max_position_embeddings; attnkit gives what a fresh HF module gives, every time."""
    cfg = hf_config("dynamic")
    hf_stateful, rope = hf_rotary(cfg), RotaryEmbedding.from_hf_config(cfg)
    long, short = torch.arange(400)[None], torch.arange(80, 90)[None]
    hf_cos_sin(hf_stateful, long)
    stale_cos, _ = hf_cos_sin(hf_stateful, short)
    fresh_cos, _ = hf_cos_sin(hf_rotary(hf_config("dynamic")), short)
    assert not torch.allclose(stale_cos, fresh_cos)
    first, _ = rope.cos_sin(short)
    rope.cos_sin(long)
    again, _ = rope.cos_sin(short)
    assert torch.equal(first, again)
    torch.testing.assert_close(again, fresh_cos)


# --------------------------------------------------------------------------- properties


def test_dynamic_uses_the_batch_wide_max():
    rope = ours("dynamic")
    pos = torch.tensor([[0, 1, 2], [200, 201, 202]])
    alone, _ = rope.cos_sin(pos[:1])
    batched, _ = rope.cos_sin(pos)
    torch.testing.assert_close(alone, ours("default").cos_sin(pos[:1])[0])  # max 2 < 64: default RoPE
    assert not torch.allclose(alone, batched[:1])  # sequence 1 pushes L to 203 for the whole call


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("case", TYPE_CASES)
def test_norm_preserved_per_pair(case, interleaved):
    rope = ours(case, interleaved=interleaved, rotary_dim=HEAD_DIM // 2)
    R, F = HEAD_DIM // 2, HEAD_DIM // 4
    x = rand(2, 3, 7, HEAD_DIM, seed=8)
    pos = make_positions("q_start-long", B=2)
    y = rope.rotate(x, pos)

    def pair_norms(t):
        t = t[..., :R]
        a, b = (t[..., 0::2], t[..., 1::2]) if interleaved else (t[..., :F], t[..., F:])
        return torch.hypot(a, b)

    torch.testing.assert_close(pair_norms(y), pair_norms(x) * rope.attention_scaling)
    assert torch.equal(y[..., R:], x[..., R:])


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("case", TYPE_CASES)
def test_scores_depend_on_relative_position_only(case, interleaved):
    """<R(m) q, R(n) k> is the same for every (m, n) with the same m - n."""
    rope = ours(case, interleaved=interleaved)
    q, k = rand(1, 1, 1, HEAD_DIM, seed=9), rand(1, 1, 1, HEAD_DIM, seed=10)
    n = torch.tensor([0, 3, 11, 20, 37, 50])  # all < 64: one frequency set, also for dynamic
    S = n.numel()
    for d in (0, 2, 9):
        qr = rope.rotate(q.expand(1, 1, S, -1), (n + d)[None])
        kr = rope.rotate(k.expand(1, 1, S, -1), n[None])
        dots = (qr * kr).sum(-1).flatten()
        torch.testing.assert_close(dots, dots[:1].expand(S), rtol=1e-5, atol=1e-5)
    # and it does depend on m - n
    a = (rope.rotate(q, torch.tensor([[5]])) * rope.rotate(k, torch.tensor([[0]]))).sum()
    b = (rope.rotate(q, torch.tensor([[9]])) * rope.rotate(k, torch.tensor([[0]]))).sum()
    assert not torch.isclose(a, b)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("case", TYPE_CASES)
def test_per_sequence_q_start_equals_slices_of_a_longer_rotation(case, interleaved):
    rope = ours(case, interleaved=interleaved)
    B, S, q_start = 3, 5, torch.tensor([0, 7, 19])
    x = rand(B, 2, S, HEAD_DIM, seed=11)
    y = rope.rotate(x, q_start[:, None] + torch.arange(S))
    full_len = int(q_start.max()) + S  # 24 < 64: dynamic's frequency set does not change
    for b in range(B):
        long_x = rand(1, 2, full_len, HEAD_DIM, seed=12)
        long_x[..., q_start[b]:q_start[b] + S, :] = x[b:b + 1]
        long_y = rope.rotate(long_x, torch.arange(full_len)[None])
        assert torch.equal(y[b:b + 1], long_y[..., q_start[b]:q_start[b] + S, :])


@pytest.mark.parametrize("rotary_dim", [HEAD_DIM, HEAD_DIM // 2])
@pytest.mark.parametrize("case", TYPE_CASES)
def test_interleaved_is_rotate_half_up_to_a_permutation(case, rotary_dim):
    half = ours(case, rotary_dim=rotary_dim)
    inter = ours(case, rotary_dim=rotary_dim, interleaved=True)
    perm = torch.cat((deinterleave_perm(rotary_dim), torch.arange(rotary_dim, HEAD_DIM)))
    x = rand(2, 3, 7, HEAD_DIM, seed=13)
    pos = make_positions("q_start-long", B=2)
    assert torch.equal(half.rotate(x[..., perm], pos), inter.rotate(x, pos)[..., perm])
    # cos/sin hold the same angles, laid out per pair vs per half
    (ch, _), (ci, _) = half.cos_sin(pos), inter.cos_sin(pos)
    assert torch.equal(ch, ci[..., deinterleave_perm(rotary_dim)])


@pytest.mark.parametrize("case", ["default", "yarn"])
def test_interleaved_matches_complex_multiplication(case):
    """Meta's / DeepSeek's official code: view pairs as complex numbers, multiply by e^{i theta}."""
    rope = ours(case, interleaved=True)
    x = rand(2, 3, 7, HEAD_DIM, seed=14)
    pos = make_positions("scattered", B=2)
    angles = pos[..., None].double() * rope.inv_freq.double()  # (B, S, F)
    freqs_cis = torch.polar(torch.full_like(angles, rope.attention_scaling), angles)[:, None]
    ref = torch.view_as_real(torch.view_as_complex(x.double().unflatten(-1, (-1, 2))) * freqs_cis).flatten(-2)
    torch.testing.assert_close(rope.rotate(x, pos), ref.float(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_low_precision_inputs(dtype, interleaved):
    """bf16/fp16 in, same dtype out: the fp32 computation rounded once (within half an ulp)."""
    rope = ours("yarn", interleaved=interleaved, rotary_dim=24)
    q, k = rand(2, 4, 7, HEAD_DIM, seed=15, dtype=dtype), rand(2, 2, 7, HEAD_DIM, seed=16, dtype=dtype)
    pos = make_positions("q_start-long", B=2)
    q_o, k_o = rope(q, k, pos)
    assert q_o.dtype == k_o.dtype == dtype
    q_ref, k_ref = rope(q.float(), k.float(), pos)
    assert torch.equal(q_o, q_ref.to(dtype)) and torch.equal(k_o, k_ref.to(dtype))
    half_ulp = torch.finfo(dtype).eps / 2
    torch.testing.assert_close(q_o.float(), q_ref, rtol=half_ulp, atol=1e-6)
    torch.testing.assert_close(k_o.float(), k_ref, rtol=half_ulp, atol=1e-6)


def test_fp64_inputs_stay_fp64():
    rope = ours("llama3")
    x = rand(1, 2, 5, HEAD_DIM, seed=17, dtype=torch.float64)
    y = rope.rotate(x, torch.arange(5)[None])
    assert y.dtype == torch.float64
    torch.testing.assert_close(y.float(), rope.rotate(x.float(), torch.arange(5)[None]))


def test_module_state_and_casts():
    rope = ours("yarn")
    assert rope.state_dict() == {}
    assert [n for n, _ in rope.named_buffers()] == ["inv_freq", "cos_table", "sin_table"]
    cos, sin = rope.cos_sin(make_positions("scattered"))
    rope.to(torch.bfloat16)  # the buffer is rounded by the cast, cos/sin are not
    assert rope.inv_freq.dtype == torch.bfloat16
    cos_b, sin_b = rope.cos_sin(make_positions("scattered"))
    assert torch.equal(cos, cos_b) and torch.equal(sin, sin_b)
    m = torch.nn.Sequential(ours("default"))
    m.apply(lambda mod: None)  # nn.Module.apply still works (no `apply` override)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("case", TYPE_CASES)
def test_table_angles_equal_direct_computation(case, interleaved):
    """The cos/sin table (grown on demand) gives the bits of the direct computation; angles
    computed once serve every call; bshd layout rotates like bhsd; a cast rebuilds it in fp32."""
    rope = ours(case, interleaved=interleaved, rotary_dim=HEAD_DIM // 2)
    assert rope.cos_table.shape[0] == 0  # nothing until used
    pos = make_positions("q_start-long", B=2)
    q, k = rand(2, 4, 7, HEAD_DIM, seed=21), rand(2, 2, 7, HEAD_DIM, seed=22)
    cos, sin = rope.cos_sin(pos)
    a = rope.angles(pos)
    torch.testing.assert_close(a.cos, cos, rtol=0, atol=0)
    torch.testing.assert_close(a.sin_signed.abs(), sin.abs(), rtol=0, atol=0)
    want = (apply_rotary(q, cos, sin, interleaved=interleaved), apply_rotary(k, cos, sin, interleaved=interleaved))
    for got in (rope(q, k, pos), rope(q, k, a)):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if rope.uses_table:
        assert rope.cos_table.shape[0] >= int(pos.max()) + 1
    bshd = rope.rotate(q.transpose(1, 2), a, layout="bshd").transpose(1, 2)
    assert torch.equal(bshd, want[0])
    rope.to(torch.bfloat16)
    assert torch.equal(rope(q, k, pos)[0], want[0])
    assert rope.cos_table.dtype == torch.float32 or not rope.uses_table
    other = ours("linear" if case != "linear" else "default")
    with pytest.raises(ValueError, match="another rotary config"):
        other(q, k, a)
    with pytest.raises(ValueError, match=r"positions of shape \(2, 7\) do not match \(B, S\) = \(2, 3\)"):
        rope(q[:, :, :3], k[:, :, :3], a)


def test_shared_positions_broadcast_and_empty():
    rope = ours("dynamic")
    q, k = rand(3, 2, 4, HEAD_DIM, seed=18), rand(3, 1, 4, HEAD_DIM, seed=19)
    shared = torch.arange(4)[None]
    q1, k1 = rope(q, k, shared)
    q3, k3 = rope(q, k, shared.expand(3, -1))
    assert torch.equal(q1, q3) and torch.equal(k1, k3)
    q0, k0 = rope(q[:, :, :0], k[:, :, :0], torch.zeros(3, 0, dtype=torch.long))
    assert q0.shape == (3, 2, 0, HEAD_DIM) and k0.shape == (3, 1, 0, HEAD_DIM)


def test_config_resolution():
    c = RopeConfig(64, scaling={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                "partial_rotary_factor": 0.25}, max_position_embeddings=128)
    assert (c.base, c.rotary_dim, c.rope_type) == (1e6, 16, "yarn")
    assert c.params["original_max_position_embeddings"] == 128 and c.params["beta_fast"] == 32
    assert c.attention_scaling == yarn_get_mscale(4.0) == 0.1 * math.log(4.0) + 1
    with pytest.raises(Exception):
        c.base = 3.0  # frozen
    assert RopeConfig(8).rotary_dim == 8 and RopeConfig(8).base == 10000.0
    assert set(ROPE_TYPES) == {"default", "linear", "dynamic", "llama3", "yarn"}
    assert RotaryEmbedding.from_config(c).config == c


# --------------------------------------------------------------------------- bad input


def _q(B=2, H=2, S=3, D=HEAD_DIM):
    return torch.zeros(B, H, S, D)


BAD = [
    ("odd rotary_dim", lambda: RotaryEmbedding(32, rotary_dim=7), ValueError, r"rotary_dim \(7\) must be even"),
    ("rotary_dim > head_dim", lambda: RotaryEmbedding(32, rotary_dim=40), ValueError,
     r"rotary_dim \(40\) must be <= head_dim \(32\)"),
    ("odd head_dim", lambda: RotaryEmbedding(15), ValueError, r"rotary_dim \(15\) must be even.*head_dim=15"),
    ("head_dim", lambda: RotaryEmbedding(0), ValueError, r"head_dim must be a positive int, got 0"),
    ("unknown rope_type", lambda: RotaryEmbedding(32, scaling={"rope_type": "longrope"}), ValueError,
     r"'longrope' is not supported; known rope types: 'default', 'linear', 'dynamic', 'llama3', 'yarn'"),
    ("type disagrees", lambda: RotaryEmbedding(32, scaling={"rope_type": "linear", "type": "yarn", "factor": 2.0}),
     ValueError, r"rope_type='linear' and legacy type='yarn'"),
    ("linear without factor", lambda: RotaryEmbedding(32, scaling={"rope_type": "linear"}), ValueError,
     r"rope_type 'linear' is missing required keys \['factor'\]"),
    ("llama3 missing keys", lambda: RotaryEmbedding(32, scaling={"rope_type": "llama3", "factor": 8.0}), ValueError,
     r"'llama3' is missing required keys \['low_freq_factor', 'high_freq_factor', "
     r"'original_max_position_embeddings'\].*max_position_embeddings"),
    ("yarn without ompe", lambda: RotaryEmbedding(32, scaling={"rope_type": "yarn", "factor": 4.0}), ValueError,
     r"'yarn' is missing required keys \['original_max_position_embeddings'\]"),
    ("yarn factor None without mpe", lambda: RotaryEmbedding(
        32, scaling={"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 8}), ValueError,
     r"factor'\] is None.*max_position_embeddings is None"),
    ("dynamic without mpe", lambda: RotaryEmbedding(32, scaling={"rope_type": "dynamic", "factor": 2.0}), ValueError,
     r"'dynamic' needs max_position_embeddings"),
    ("dynamic rotary_dim 2", lambda: RotaryEmbedding(
        32, rotary_dim=2, max_position_embeddings=8, scaling={"rope_type": "dynamic", "factor": 2.0}),
     ValueError, r"rotary_dim > 2"),
    ("unknown key", lambda: RotaryEmbedding(32, scaling={"rope_type": "linear", "factr": 2.0}), ValueError,
     r"keys \['factr'\] that rope_type 'linear' does not use"),
    ("factor <= 0", lambda: RotaryEmbedding(32, scaling={"rope_type": "linear", "factor": 0}), ValueError,
     r"factor'\] must be a finite number > 0 for rope_type 'linear', got 0"),
    ("llama3 freq factors", lambda: RotaryEmbedding(32, scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
        "original_max_position_embeddings": 8}), ValueError, r"low_freq_factor=4.0, high_freq_factor=1.0"),
    ("truncate not bool", lambda: RotaryEmbedding(32, scaling={
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8, "truncate": "no"}),
     TypeError, r"truncate'\] must be a bool, got 'no'"),
    ("base vs rope_theta", lambda: RotaryEmbedding(32, base=10.0, scaling={"rope_theta": 500.0}), ValueError,
     r"base \(10.0\) and scaling\['rope_theta'\] \(500.0\) disagree"),
    ("rotary_dim vs partial", lambda: RotaryEmbedding(32, rotary_dim=8, scaling={"partial_rotary_factor": 0.5}),
     ValueError, r"rotary_dim \(8\) disagrees with int\(head_dim \* partial_rotary_factor\) = int\(32 \* 0.5\) = 16"),
    ("base <= 1", lambda: RotaryEmbedding(32, base=1.0), ValueError,
     r"base \(rope_theta\) must be a finite number > 1, got 1.0"),
    ("scaling not a dict", lambda: RotaryEmbedding(32, scaling=[("rope_type", "linear")]), TypeError,
     r"scaling must be a dict"),
    ("interleaved not bool", lambda: RotaryEmbedding(32, interleaved=1), TypeError, r"interleaved must be a bool"),
    ("float positions", lambda: RotaryEmbedding(32).cos_sin(torch.zeros(2, 3)), TypeError,
     r"positions must hold integers, got dtype torch.float32"),
    ("bool positions", lambda: RotaryEmbedding(32).cos_sin(torch.zeros(2, 3, dtype=torch.bool)), TypeError,
     r"positions must hold integers, got dtype torch.bool"),
    ("list positions", lambda: RotaryEmbedding(32).cos_sin([[0, 1]]), TypeError,
     r"positions must be an integer tensor \(B, S\), got list"),
    ("1-d positions", lambda: RotaryEmbedding(32).cos_sin(torch.arange(3)), ValueError,
     r"positions must be \(B, S\), got shape \(3,\)"),
    ("negative positions", lambda: RotaryEmbedding(32).cos_sin(torch.tensor([[0, -4, 2]])), ValueError,
     r"positions must be >= 0, got min -4"),
    ("positions S mismatch", lambda: RotaryEmbedding(32)(_q(), _q(H=1), torch.zeros(2, 4, dtype=torch.long)),
     ValueError, r"positions of shape \(2, 4\) do not match \(B, S\) = \(2, 3\) of q \(2, 2, 3, 32\)"),
    ("positions B mismatch", lambda: RotaryEmbedding(32)(_q(), _q(H=1), torch.zeros(3, 3, dtype=torch.long)),
     ValueError, r"positions of shape \(3, 3\) do not match \(B, S\) = \(2, 3\)"),
    ("q head dim", lambda: RotaryEmbedding(32)(_q(D=16), _q(D=16), torch.zeros(2, 3, dtype=torch.long)),
     ValueError, r"q has head dim 16 \(shape \(2, 2, 3, 16\)\), but this RotaryEmbedding has head_dim=32"),
    ("q 3-d", lambda: RotaryEmbedding(32)(torch.zeros(2, 3, 32), _q(), torch.zeros(2, 3, dtype=torch.long)),
     ValueError, r"q must be \(B, H, S, D\), got shape \(2, 3, 32\)"),
    ("int q", lambda: RotaryEmbedding(32)(_q().long(), _q(), torch.zeros(2, 3, dtype=torch.long)),
     TypeError, r"q must be a floating tensor, got torch.int64"),
    ("q/k S mismatch", lambda: RotaryEmbedding(32)(_q(), _q(S=5), torch.zeros(2, 3, dtype=torch.long)),
     ValueError, r"q \(2, 2, 3, 32\) and k \(2, 2, 5, 32\) must share B and S"),
    ("apply_rotary cos shape", lambda: apply_rotary(_q(), torch.zeros(2, 4, 32), torch.zeros(2, 4, 32)),
     ValueError, r"cos/sin must be \(B, S, R\) = \(2, 3, R\) or \(1, 3, R\).*got \(2, 4, 32\)"),
    ("apply_rotary odd R", lambda: apply_rotary(_q(), torch.zeros(2, 3, 5), torch.zeros(2, 3, 5)),
     ValueError, r"R \(5\) must be even and <= head dim D \(32\)"),
    ("apply_rotary cos/sin differ", lambda: apply_rotary(_q(), torch.zeros(2, 3, 8), torch.zeros(2, 3, 6)),
     ValueError, r"cos and sin must have the same shape, got \(2, 3, 8\) and \(2, 3, 6\)"),
    ("softmax multiplier factor", lambda: yarn_softmax_scale_multiplier({"rope_type": "yarn", "mscale_all_dim": 1.0}),
     ValueError, r"factor'\] must be a number when mscale_all_dim is set, got None"),
]


@pytest.mark.parametrize("call, exc, match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("rotary", [64, 24], ids=["full", "partial"])
def test_compiled_rotation_is_the_torch_rotation_bit_for_bit(monkeypatch, dtype, interleaved, rotary):
    """Inference on CPU rotates in one compiled pass; it must give the torch ops' floats exactly
    (products and sum rounded on their own: no fused multiply-add), in both layouts."""
    from attnkit.rope import rotate as R

    if native.load() is None:
        pytest.skip("no native kernel on this machine (no C++ compiler)")
    g = torch.Generator().manual_seed(rotary)
    x = torch.randn(2, 130, 6, 64, generator=g).to(dtype)
    cos = torch.randn(1, 130, 1, rotary, generator=g)
    sin = torch.randn(1, 130, 1, rotary, generator=g)
    for xs, c, s in ((x, cos, sin), (x.transpose(1, 2), cos.transpose(1, 2), sin.transpose(1, 2))):
        assert R._native_ok(xs, c, s)
        got = R.rotate_signed(xs, c, s, interleaved)
        with monkeypatch.context() as m:
            m.setattr(R, "_native_ok", lambda *a: False)
            want = R.rotate_signed(xs, c, s, interleaved)
        assert got.dtype == want.dtype and torch.equal(got, want)
    leaf = x.float().requires_grad_()  # autograd keeps the torch ops
    assert not R._native_ok(leaf, cos, sin)


# ---------------------------------------------------------------------------- module layout


def test_moved_mscale_helpers_keep_their_old_path_with_a_deprecation():
    """YaRN's mscale helpers live in attnkit.rope.mscale; attnkit.rope.frequencies still gives
    them, with a DeprecationWarning naming the new path."""
    from attnkit.rope import frequencies
    with pytest.warns(DeprecationWarning, match="attnkit.rope"):
        assert frequencies.yarn_get_mscale is yarn_get_mscale
    with pytest.warns(DeprecationWarning):
        assert frequencies.yarn_softmax_scale_multiplier is yarn_softmax_scale_multiplier
