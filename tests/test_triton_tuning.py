"""The Triton kernel's tuned-parameter table (backends/triton/tuning.py): what an entry may set,
that a missing entry leaves the kernel's own choice, that a bad entry is an error naming it, and
that the committed table is well formed. Decisions only: no GPU needed."""

from __future__ import annotations

import json

import pytest
import torch

from attnkit.backends.triton import tuning


def test_a_table_entry_overrides_only_what_it_sets(tmp_path):
    table = tmp_path / "tuned.json"
    key = tuning.shape_key(torch.bfloat16, 128, 128, False, None)
    assert key == "bfloat16-d128-dv128"
    assert tuning.shape_key(torch.float16, 576, 512, True, torch.int8) == "float16-d576-dv512-vk-kv_int8"
    assert tuning.shape_key(torch.bfloat16, 128, 128, False, None, selection=True) == "bfloat16-d128-dv128-sel"
    tuning.record("sm_90", key, {"BLOCK_N": 128, "num_stages": 4}, table)
    cfg = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "BLOCK_M": 16}
    assert tuning.tuned(cfg, "sm_90", key, table) == {"BLOCK_N": 128, "num_warps": 4, "num_stages": 4, "BLOCK_M": 16}
    assert tuning.tuned(cfg, "sm_80", key, table) == cfg  # another GPU: the kernel's own choice
    assert tuning.tuned(cfg, "sm_90", "float32-d64-dv64", table) == cfg  # a shape never tuned
    assert tuning.tuned(cfg, None, key, table) == cfg  # the interpreter
    with tuning.forced({"num_warps": 8}):
        assert tuning.tuned(cfg, None, key, table)["num_warps"] == 8
    assert tuning.tuned(cfg, None, key, table) == cfg
    tuning.record("sm_90", "other", {"num_warps": 2}, table)
    assert set(json.loads(table.read_text())["sm_90"]) == {key, "other"}  # recording keeps the rest


@pytest.mark.parametrize("entry,text", [
    ({"BLOCK_M": 32}, "sets 'BLOCK_M'; it may set"),
    ({"BLOCK_N": 48}, r"BLOCK_N=48; allowed"),
    ({"num_warps": "4"}, "num_warps='4'"),
    ({}, "non-empty object"),
])
def test_a_bad_entry_is_an_error_that_names_it(tmp_path, entry, text):
    table = tmp_path / "tuned.json"
    table.write_text(json.dumps({"sm_90": {"k": entry}}))
    with pytest.raises(ValueError, match=text):
        tuning.tuned({"BLOCK_N": 64}, "sm_90", "k", table)
    with pytest.raises(ValueError, match=text):
        tuning.record("sm_90", "k", entry, tmp_path / "other.json")


def test_the_committed_table_is_well_formed():
    data = json.loads(tuning.TABLE.read_text())
    assert isinstance(data, dict)
    for arch, entries in data.items():
        assert arch.startswith("sm_")
        for key in entries:
            tuning.lookup(arch, key)


def test_the_kernel_launches_with_the_entry_it_is_given(monkeypatch):
    """A forced entry (what a table entry becomes on its GPU) reaches the launch: the split rule
    sees its keys per tile, and the output still equals the oracle (Triton's interpreter on CPU)."""
    ops = pytest.importorskip("attnkit.backends.triton.ops")
    if ops.available() is not None:
        pytest.skip(f"Triton kernels unavailable: {ops.available()}")
    import attnkit
    from attnkit.backends.triton import kernel

    seen = []
    real = kernel.split_plan
    monkeypatch.setattr(kernel, "split_plan", lambda *a, **kw: seen.append(a[-1]) or real(*a, **kw))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 1, 16, generator=g)
    k, v = torch.randn(1, 2, 70, 16, generator=g), torch.randn(1, 2, 70, 16, generator=g)
    want = attnkit.attention_reference(q, k, v, causal=True).float()
    for block_n in (16, 32):
        with tuning.forced({"BLOCK_N": block_n, "num_stages": 2}):
            got = ops.decode_attention(q, k, v)
        assert seen[-1] == block_n
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
