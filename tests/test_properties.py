"""Hypothesis properties: random small shapes, dtypes, masks and backends.

* rule R holds against the fp64 oracle (forward; forward + backward on fewer examples),
* permuting the keys together with their values and mask columns changes the output by no more
  than rule R's tolerance (fp32: assert_close at 1e-5),
* changing another batch item (its q/k/v and its slice of the mask) leaves this batch item's
  output bitwise equal.

Every tensor comes from a ``torch.Generator`` seeded by a drawn integer, so a failure shrinks to
and replays from the printed example.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, assume, event, given, note, settings
from hypothesis import strategies as st

import attnkit
from attnkit import masks as M
from attnkit.backends import BackendNotSupported

from conftest import _err, base_attention, check_against_oracle, make_qkv

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BACKENDS = ["auto", "math", "sdpa", "decode"]
MASK_KINDS = ["none", "dense", "key_padding", "window", "causal_q_start", "additive"]

COMMON = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Case:
    B: int
    Hkv: int
    G: int
    Sq: int
    Sk: int
    D: int
    dtype: torch.dtype
    kind: str
    causal: bool
    backend: str
    seed: int

    @property
    def Hq(self):
        return self.Hkv * self.G


@st.composite
def cases(draw, min_batch=1, backends=BACKENDS):
    return Case(
        B=draw(st.integers(min_batch, 3)),
        Hkv=draw(st.integers(1, 3)),
        G=draw(st.integers(1, 3)),
        Sq=draw(st.integers(0, 20)),
        Sk=draw(st.integers(0, 20)),
        D=draw(st.integers(1, 16)),
        dtype=draw(st.sampled_from(DTYPES)),
        kind=draw(st.sampled_from(MASK_KINDS)),
        causal=draw(st.booleans()),
        backend=draw(st.sampled_from(backends)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def make_mask(c: Case, g: torch.Generator):
    """The drawn mask kind with its random parts from ``g``. Every kind is per batch item (or
    shared by the batch): none couples two batch items."""
    B, Hq, Sq, Sk = c.B, c.Hq, c.Sq, c.Sk
    if c.kind == "none":
        return None
    if c.kind == "dense":
        hdim = Hq if torch.randint(0, 2, (), generator=g) else 1
        density = torch.rand((), generator=g).item()
        m = torch.rand(B, hdim, Sq, Sk, generator=g) < density
        if Sq:  # at least one fully masked row (when there are rows)
            m[torch.randint(0, B, (), generator=g), :, torch.randint(0, Sq, (), generator=g)] = False
        return m
    if c.kind == "key_padding":
        side = "left" if torch.randint(0, 2, (), generator=g) else "right"
        return M.KeyPadding(torch.randint(0, Sk + 1, (B,), generator=g), side=side)
    if c.kind == "window":
        left = int(torch.randint(0, 6, (), generator=g))
        right = int(torch.randint(0, 4, (), generator=g))
        align = "top_left" if torch.randint(0, 2, (), generator=g) else "bottom_right"
        return M.SlidingWindow(left if left < 5 else None, right if right < 3 else None, align=align)
    if c.kind == "causal_q_start":
        return M.Causal(q_start=torch.randint(-Sq, Sk + 1, (B,), generator=g))
    if c.kind == "additive":  # a float bias of moderate size with some -inf (masked) entries
        bias = torch.randn(B, 1, Sq, Sk, generator=g)
        return bias.masked_fill(torch.rand(B, 1, Sq, Sk, generator=g) < 0.2, float("-inf"))
    raise AssertionError(c.kind)


def materialize(mask, causal, B, Sq, Sk) -> torch.Tensor:
    """The (B, 1|Hq, Sq, Sk) bool tensor that ``mask`` and ``causal`` describe, or for an additive
    mask the float bias with -inf where masked."""
    m = M.as_mask(mask, causal)
    if m is None:
        return torch.ones(B, 1, Sq, Sk, dtype=torch.bool)
    t = m.materialize(B, Sq, Sk)
    bias = m.bias(B, Sq, Sk)
    if bias is not None:
        t = bias.masked_fill(~t, float("-inf"))
    return t.expand(B, t.shape[1], Sq, Sk).clone()


def inputs(c: Case):
    g = torch.Generator().manual_seed(c.seed)
    dist = "rand" if c.seed % 2 else "randn"
    q, k, v = make_qkv(c.B, c.Hq, c.Hkv, c.Sq, c.Sk, c.D, dtype=c.dtype, dist=dist, seed=c.seed)
    return q, k, v, make_mask(c, g)


def runnable(c: Case, q, k, v, mask, **kw) -> None:
    """Skip (hypothesis.assume) drawn calls the forced backend refuses (decode: Sq > 16)."""
    try:
        name = attnkit.describe_call(q, k, v, mask, causal=c.causal, backend=c.backend, **kw)
    except BackendNotSupported:
        assume(False)
    note(f"runs on {name}")
    event(f"runs on {name}")
    event(f"{c.dtype}, mask {c.kind}, causal={c.causal}")
    event(f"Sq={c.Sq}" if c.Sq < 2 else "Sq>=2")
    event(f"Sk={c.Sk}" if c.Sk < 2 else "Sk>=2")


@settings(max_examples=400, **COMMON)
@given(cases())
def test_rule_r_forward(c: Case):
    q, k, v, mask = inputs(c)
    runnable(c, q, k, v, mask)
    check_against_oracle(q, k, v, mask, causal=c.causal, backend=c.backend, grad=False)


@settings(max_examples=100, **COMMON)
@given(cases())
def test_rule_r_forward_and_backward(c: Case):
    q, k, v, mask = inputs(c)
    runnable(c, q, k, v, mask)
    check_against_oracle(q, k, v, mask, causal=c.causal, backend=c.backend, grad=True)


def _rule_r_tolerance(q, k, v, mask, causal) -> float:
    """2 * E(base) + floor of rule R for this call (what one result may be off by)."""
    gold = attnkit.attention_reference(q.double(), k.double(), v.double(), mask, causal=causal)
    base = base_attention(q, k, v, mask, causal=causal)
    floor = max(2 * _err((gold.to(q.dtype) + 0.3) - 0.3, gold), 1e-6)
    return 2 * _err(base, gold) + floor


@settings(max_examples=200, **COMMON)
@given(cases(), st.data())
def test_permuting_keys_with_mask_columns_changes_nothing(c: Case, data):
    q, k, v, mask = inputs(c)
    runnable(c, q, k, v, mask)
    out = attnkit.attention(q, k, v, mask, causal=c.causal, backend=c.backend)
    perm = torch.tensor(data.draw(st.permutations(range(c.Sk)), label="perm"), dtype=torch.long)
    dense = materialize(mask, c.causal, c.B, c.Sq, c.Sk)
    kp, vp, mp = k[:, :, perm], v[:, :, perm], dense[..., perm]
    out_p = attnkit.attention(q, kp, vp, mp, backend=c.backend)
    assert torch.isfinite(out_p).all()
    if c.dtype == torch.float32:
        torch.testing.assert_close(out_p, out, atol=1e-5, rtol=1e-5)
    else:
        # Each result may sit up to rule R's bound from the oracle, which does not move.
        tol = _rule_r_tolerance(q, k, v, mask, c.causal)
        diff = _err(out_p, out.double())
        assert diff <= 2 * tol, f"permutation moved the output by {diff:.3e} > 2 * {tol:.3e}"


def _perturb_batch_item(c: Case, q, k, v, mask, j: int, g: torch.Generator):
    """New q, k, v and mask differing from the given ones only in batch item ``j``."""
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[j] = (torch.randn(x[j].shape, generator=g, dtype=torch.float64) * 3).to(x.dtype)
    if c.kind in ("dense", "additive"):
        m2 = mask.clone()
        if m2.shape[0] > 1:
            new = torch.rand(m2[j].shape, generator=g) < 0.5
            m2[j] = new if m2.dtype == torch.bool else m2[j].masked_fill(new, float("-inf"))
    elif c.kind == "key_padding":
        lens = mask.lengths.clone()
        lens[j] = torch.randint(0, c.Sk + 1, (), generator=g)
        m2 = M.KeyPadding(lens, side=mask.side)
    elif c.kind == "causal_q_start":
        starts = mask.q_start.clone()
        starts[j] = torch.randint(-c.Sq, c.Sk + 1, (), generator=g)
        m2 = M.Causal(q_start=starts)
    else:
        m2 = mask
    return q2, k2, v2, m2


@settings(max_examples=200, **COMMON)
@given(cases(min_batch=2, backends=BACKENDS), st.data())
def test_other_batch_items_do_not_change_this_one(c: Case, data):
    q, k, v, mask = inputs(c)
    runnable(c, q, k, v, mask)
    i = data.draw(st.integers(0, c.B - 1), label="this item")
    j = (i + data.draw(st.integers(1, c.B - 1), label="other item - this item")) % c.B
    q2, k2, v2, m2 = _perturb_batch_item(c, q, k, v, mask, j, torch.Generator().manual_seed(c.seed + 1))
    out = attnkit.attention(q, k, v, mask, causal=c.causal, backend=c.backend)
    out2 = attnkit.attention(q2, k2, v2, m2, causal=c.causal, backend=c.backend)
    assert torch.equal(out[i], out2[i]), (
        f"batch item {i} changed when item {j} did: max diff {_err(out2[i], out[i].double()):.3e}")
