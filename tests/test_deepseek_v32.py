"""DeepSeek-V3.2 (model_type "deepseek_v32"): MLA plus the lightning indexer's top-k key selection,
in attnkit's Decoder. A tiny random transformers checkpoint (index_topk 8 against 40-token
prompts, so the selection cuts keys) loads with Decoder.from_pretrained and gives transformers'
fp32 logits (eager attention) and greedy tokens with dynamic, static and paged caches; the
blockwise top-k equals a dense one; the selection really excludes keys; bad input raises before any
cache changes. Paged: the indexer's keys live in a second pool on the latent's block table, and
follow it through forks (copy-on-write), prefix caching, crop, and aborted steps.

The indexer's score is ``sum_h w_h * relu(q_h . k)``: a key whose every head is clipped scores
exactly 0, and torch.topk breaks such ties in no documented order. The checkpoint has 16 indexer
heads (a key scores exactly 0 for about 2**-16 of the queries), so transformers' selection has no
tie at the top-k boundary to break differently; attnkit breaks ties toward the lower key position.
"""

from __future__ import annotations

import json

import pytest
import torch

from attnkit.caches import BlockAllocator, OutOfBlocks, PagedKVCache
from attnkit.masks import Causal
from attnkit.models import Decoder, DecoderConfig, load_pretrained
from attnkit.models.indexer import (IndexedLatentAttention, IndexedLatentCache, IndexerConfig, rotate_half_cos_sin,
                                    select_topk)
from attnkit.rope import RotaryEmbedding
from attnkit.modules.mla import MLAConfig, MultiHeadLatentAttention

from test_families import _randomise  # weights of std 0.2 (norms around 1): decisive logits and indexer scores

transformers = pytest.importorskip("transformers")

HF = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
          vocab_size=128, max_position_embeddings=256, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=6,
          v_head_dim=10, q_lora_rank=16, first_k_dense_replace=2, n_routed_experts=4, moe_intermediate_size=8,
          n_group=1, topk_group=1, num_experts_per_tok=2, index_topk=8, index_head_dim=16, index_n_heads=16)
PROMPT = 40


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers' model, attnkit's Decoder loaded from its save_pretrained directory, the directory)."""
    hf = transformers.DeepseekV32ForCausalLM(
        transformers.DeepseekV32Config(**HF, attn_implementation="eager")).eval()
    _randomise(hf)
    path = tmp_path_factory.mktemp("dsv32")
    hf.save_pretrained(path)
    return hf, load_pretrained(path), path


def _ids(B=2, S=PROMPT, seed=1):
    return torch.randint(0, HF["vocab_size"], (B, S), generator=torch.Generator().manual_seed(seed))


def test_config_and_parameters(pair):
    _, m, _ = pair
    c = m.config
    assert (c.attention, c.index_topk, c.index_n_heads, c.index_head_dim, c.rope_interleave) == ("mla", 8, 16, 16, True)
    attn = m.model.layers[0].self_attn
    assert isinstance(attn, IndexedLatentAttention)
    assert attn.indexer.weights_proj.weight.dtype == torch.float32  # kept in fp32, as transformers does
    # the cache holds the latent (r + dr) and the indexer's key (Di) per token and layer
    assert m.kv_bytes_per_token() == 2 * (24 + 6 + 16) * 4
    assert DecoderConfig(**c.to_dict()) == c


def test_logits_match_transformers(pair):
    hf, m, _ = pair
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(m(ids), hf(ids).logits)


def test_yarn_logits_match_transformers(tmp_path):
    """YaRN with mscale_all_dim: the indexer's RoPE takes the same scaled cos / sin as MLA's."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}
    hf = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(
        **HF, rope_parameters=yarn, attn_implementation="eager")).eval()
    _randomise(hf, seed=3)
    hf.save_pretrained(tmp_path)
    m = load_pretrained(tmp_path)
    assert m.config.rope_scaling["rope_type"] == "yarn"
    ids = _ids(2, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(m(ids), hf(ids).logits)


@pytest.mark.parametrize("cache", ["dynamic", "static", "paged"])
def test_greedy_tokens_match_transformers(pair, cache):
    hf, m, _ = pair
    prompt = _ids(1)
    with torch.no_grad():
        out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, min_new_tokens=10,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    assert m.generate(prompt, 10, cache=cache).tokens[0] == out[0, PROMPT:].tolist()


@pytest.mark.parametrize("kind", ["dynamic", "static", "paged"])
def test_chunked_prefill_and_decode_equal_one_forward(pair, kind):
    """The indexer keys cached in a step are the ones later steps select from: prefill in chunks,
    then token by token, equals one forward over the whole sequence (ragged rows too)."""
    _, m, _ = pair
    ids = _ids(2, 30, seed=3)
    with torch.no_grad():
        full = m(ids)
        caches = m.new_caches(kind, max_batch=2, max_len=32)
        assert all(isinstance(c, IndexedLatentCache) for c in caches)
        parts = [m(ids[:, :11], caches=caches), m(ids[:, 11:26], caches=caches)]
        parts += [m(ids[:, t:t + 1], caches=caches) for t in range(26, 30)]
    assert (torch.cat(parts, 1) - full).abs().max() <= 1e-5
    assert caches[1].lengths.tolist() == [30, 30] and caches[1].index.lengths.tolist() == [30, 30]
    rows = [ids[0, :21].tolist(), ids[1, :9].tolist()]  # a ragged batch: each row as alone
    assert m.generate(rows, 6, cache=kind).tokens == [m.generate([r], 6, cache=kind).tokens[0] for r in rows]


def test_left_padding_is_never_selected(pair):
    """Padding keys (key_padding_mask) are out of the indexer's reach as of attention's."""
    _, m, _ = pair
    seq = _ids(1, 20, seed=4)
    with torch.no_grad():
        alone = m(seq)
        ids = torch.cat([torch.full((1, 5), 7), seq], 1)
        kpm = torch.tensor([[True] * 5 + [False] * 20])
        pos = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.arange(20)[None]], 1)
        assert (m(ids, positions=pos, key_padding_mask=kpm)[:, 5:] - alone).abs().max() <= 1e-5


def _layer_pair(topk, S_seed=0):
    mla = MLAConfig(hidden_size=32, num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                    v_head_dim=8, q_lora_rank=12)
    dsa = IndexedLatentAttention(mla, IndexerConfig(num_heads=8, head_dim=8, topk=topk)).eval()
    _randomise(dsa, S_seed)
    dense = MultiHeadLatentAttention(mla).eval()
    dense.load_state_dict({k: v for k, v in dsa.state_dict().items() if not k.startswith("indexer.")}, strict=True)
    return dsa, dense


def test_topk_excludes_keys():
    """With k >= every query's keys, DSA is dense MLA; with k = 6, queries that see at most 6
    keys still are, the later ones are not (their excluded keys are masked out); and those
    outputs equal dense MLA under the same selection as an explicit mask."""
    x = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dsa_all, dense = _layer_pair(topk=24)
        torch.testing.assert_close(dsa_all(x), dense(x))
        dsa, dense = _layer_pair(topk=6)
        out, w = dsa(x, need_weights=True)
        ref = dense(x)
        torch.testing.assert_close(out[:, :6], ref[:, :6])
        assert (out[:, 6:] - ref[:, 6:]).abs().amax(-1).min() > 1e-3  # every later query differs
        seen = (w > 0).sum(-1)  # (B, H, S): keys with weight, at most k per query
        assert int(seen.max()) == 6 and (seen[:, :, 6:] == 6).all()
        keep = w[:, :1] > 0  # the selection (shared by the heads) as a dense mask
        torch.testing.assert_close(out, dense(x, mask=keep))


@pytest.mark.parametrize("interleaved", [True, False])
def test_indexer_rope_is_rotate_half_whatever_mlas_layout(interleaved):
    """The indexer rotates half-split pairs with MLA's frequencies (and YaRN factor), from the
    angles the decoder computed once for MLA's rope, interleaved or not."""
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    mla = RotaryEmbedding(6, base=500.0, scaling=scaling, interleaved=interleaved)
    half = RotaryEmbedding(6, base=500.0, scaling=scaling, interleaved=False)
    pos = torch.tensor([[0, 3, 17, 40], [5, 6, 7, 90]])
    for got, want in zip(rotate_half_cos_sin(mla.angles(pos)), half.cos_sin(pos)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _dense_topk(q, w, keys, hi, topk, scale, key_bias=None):
    s = torch.relu(torch.einsum("bqhd,bkd->bqhk", q.float(), keys.float()) * scale)
    s = torch.einsum("bqh,bqhk->bqk", w.float(), s)
    L = keys.shape[1]
    s = s.masked_fill(torch.arange(L) >= hi[..., None], float("-inf"))
    if key_bias is not None:
        s = s + key_bias[:, None]
    v, i = torch.sort(s, dim=-1, descending=True, stable=True)
    k = min(topk, L)
    return i[..., :k].masked_fill(v[..., :k] == float("-inf"), -1)


@pytest.mark.parametrize("blocks", [(1, 1), (3, 5), (7, 64), (64, 1024)], ids=lambda b: f"bq{b[0]}-bk{b[1]}")
def test_blockwise_topk_equals_dense_topk(blocks):
    """Tiles of queries x keys with a running top-k pick exactly the set a dense stable sort of
    each row picks, ties included (keys repeated, weights zeroed: exact ties, broken toward the
    lower position), with ragged bounds, queries that see fewer than k keys and key padding."""
    g = torch.Generator().manual_seed(0)
    B, Sq, L, H, D, k = 2, 19, 37, 3, 8, 6
    q = torch.randn(B, Sq, H, D, generator=g)
    keys = torch.randn(B, L, D, generator=g)
    keys[:, 20:30] = keys[:, 5:6]  # ten copies of one key: exact ties
    w = torch.randn(B, Sq, H, generator=g)
    w[:, 4] = 0  # every score 0: ties everywhere
    hi = torch.stack([torch.arange(L - Sq + 1, L + 1), torch.arange(1, Sq + 1).clamp(max=15)])  # (B, Sq)
    bias = torch.zeros(B, L).masked_fill(torch.rand(B, L, generator=g) < 0.2, float("-inf"))
    for kb in (None, bias):
        got = select_topk(q, w, keys, hi, k, scale=D ** -0.5, key_bias=kb, block_q=blocks[0], block_k=blocks[1])
        want = _dense_topk(q, w, keys, hi, k, D ** -0.5, kb)
        assert got.dtype == torch.long and got.shape == (B, Sq, k)
        assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    assert (got[1, 0] >= 0).sum() == 1  # the first query of row 1 sees one key: one slot used


def _state(caches):
    """Lengths and contents of both caches of each layer (paged: both pools, the block tables,
    refcounts and free count of the shared allocator)."""
    if caches[0].paged:
        a = caches[0].latent.allocator
        book = [a.block_table(), torch.tensor([a.refcount(i) for i in range(a.num_blocks)]),
                torch.tensor([a.num_free, a.num_used])]
        return [(c.lengths.clone(), c.latent.k_pool.clone(), c.index.k_pool.clone(), *book) for c in caches]
    return [(c.lengths.clone(), c.latent.k_buf.clone(), c.index.k_buf.clone()) for c in caches]


def _same(a, b):
    return all(torch.equal(x, y) for sa, sb in zip(a, b) for x, y in zip(sa, sb))


@pytest.mark.parametrize("kind", ["dynamic", "static", "paged"])
def test_bad_input_leaves_caches_unchanged(pair, kind, monkeypatch):
    _, m, _ = pair
    ids = _ids(2, 12, seed=5)
    with torch.no_grad():
        caches, twin = (m.new_caches(kind, max_batch=2, max_len=16) for _ in range(2))
        m(ids, caches=caches)
        m(ids, caches=twin)
        before = _state(caches)
        tok = torch.tensor([[4], [5]])
        for kw in (dict(key_padding_mask=torch.zeros(2, 3, dtype=torch.bool)),
                   dict(key_padding_mask=torch.zeros(2, 13 if kind == "static" else 16, dtype=torch.long)),
                   dict(positions=torch.tensor([[-1], [3]]))):
            with pytest.raises((ValueError, TypeError)):
                m(tok, caches=caches, **kw)
            assert _same(_state(caches), before), kw
        # a failure inside the second layer's selection aborts the step in both layers' two caches
        import attnkit.models.indexer as indexer
        real, calls = indexer.select_topk, []

        def fail_second(*a, **kw):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("boom")
            return real(*a, **kw)
        monkeypatch.setattr(indexer, "select_topk", fail_second)
        with pytest.raises(RuntimeError, match="boom"):
            m(tok, caches=caches)
        monkeypatch.undo()
        assert _same(_state(caches), before)
        torch.testing.assert_close(m(tok, caches=caches), m(tok, caches=twin), rtol=0, atol=0)


def test_refusals(pair, tmp_path):
    _, m, path = pair
    attn = m.model.layers[0].self_attn
    with pytest.raises(ValueError, match="'sliding'"):
        attn.new_cache("sliding")
    with pytest.raises(TypeError, match="allocator= applies to paged caches"):
        attn.new_cache("dynamic", allocator=BlockAllocator(4))
    latent = MultiHeadLatentAttention.new_cache(attn, "paged", allocator=BlockAllocator(4))
    with pytest.raises(ValueError, match="share one BlockAllocator"):
        IndexedLatentCache(latent, PagedKVCache(1, 16, value_from_key=True, num_blocks=4))
    x = torch.randn(1, 3, 48)
    with pytest.raises(ValueError, match="mask= is not supported"):
        attn(x, mask=Causal())
    dense_cache = MultiHeadLatentAttention.new_cache(attn)  # a latent cache without the indexer's keys
    with pytest.raises(TypeError, match="IndexedLatentCache"):
        attn(x, cache=dense_cache)
    assert dense_cache.lengths.numel() == 0
    for kw, match in ((dict(attention="gqa", num_kv_heads=2), "index_topk"),
                      (dict(attention="mla"), "q_lora_rank"),
                      (dict(attention="mla", q_lora_rank=8, qk_rope_head_dim=8, index_head_dim=4), "index_head_dim"),
                      (dict(attention="mla", q_lora_rank=8, sliding_window=4), "full-attention")):
        with pytest.raises(ValueError, match=match):
            DecoderConfig(hidden_size=32, num_heads=4, index_topk=4, **kw)
    with pytest.raises(ValueError, match="needs index_topk"):
        DecoderConfig(hidden_size=32, num_heads=4, attention="mla", q_lora_rank=8, index_n_heads=2)
    c = json.loads((path / "config.json").read_text())
    c["mlp_layer_types"] = ["dense", "sparse"]
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match="mixture-of-experts layers \\[1\\]"):
        Decoder.from_pretrained(tmp_path)


@pytest.mark.parametrize("kind", ["dynamic", "static", "paged"])
def test_crop_reorder_and_quantized_cache(pair, kind):
    """Rolling back tokens (crop) and reordering rows act on both caches of a layer; kv_dtype
    quantizes the latent and keeps the indexer's keys (a top-k's input) unquantized."""
    import attnkit
    _, m, _ = pair
    ids = _ids(2, 24, seed=6)
    with torch.no_grad():
        full = m(ids)
        caches = m.new_caches(kind, max_batch=2, max_len=24)
        m(ids, caches=caches)
        attnkit.caches.crop(caches, -5)  # a speculative rollback
        assert [c.index.lengths.tolist() for c in caches] == [[19, 19]] * 2
        torch.testing.assert_close(m(ids[:, 19:], caches=caches), full[:, 19:], rtol=0, atol=1e-5)
        attnkit.caches.reorder(caches, torch.tensor([1, 0]))
        attnkit.caches.crop(caches, -1)
        swapped = m(ids.flip(0))
        torch.testing.assert_close(m(ids.flip(0)[:, 23:], caches=caches), swapped[:, 23:], rtol=0, atol=1e-5)
    q = m.new_caches(kind, max_batch=1, max_len=48, kv_dtype="int8")
    assert q[0].latent.kv_dtype == torch.int8 and q[0].index.kv_dtype is None
    assert q[0].bytes_per_token < caches[0].bytes_per_token
    prompt = _ids(1, 30, seed=7)
    assert m.generate(prompt, 4, cache=kind, kv_dtype="int8").tokens[0][:2] == m.generate(prompt, 2).tokens[0]


def _paged(m, num_blocks, block_size=4, prefix_caching=False):
    """One paged IndexedLatentCache per layer on one shared allocator of small blocks."""
    alloc = BlockAllocator(num_blocks, block_size, prefix_caching=prefix_caching)
    return [layer.self_attn.new_cache("paged", allocator=alloc) for layer in m.model.layers], alloc


def _held_state(caches):
    """The allocator's books and both pools' rows in the blocks sequences hold (an aborted
    copy-on-write leaves its copy in a block that went back to the pool, which no view reads)."""
    a = caches[0].latent.allocator
    held = sorted({b for s in a.sequences for b in a.blocks(s)})
    return ([(a.blocks(s), a.length(s)) for s in a.batch], [a.refcount(i) for i in range(a.num_blocks)],
            a.num_free, [(c.latent.k_pool[held].clone(), c.index.k_pool[held].clone()) for c in caches])


def _same_held(x, y):
    return x[:3] == y[:3] and all(torch.equal(p, q) for a, b in zip(x[3], y[3]) for p, q in zip(a, b))


def test_paged_fork_copies_both_pools_on_write(pair, monkeypatch):
    """A fork shares the latent's and the indexer's blocks; the first step after it copies the
    shared partial block in both pools (an aborted one leaves tables, refcounts and held rows as
    they were), and each row then decodes as it would alone."""
    import attnkit
    import attnkit.models.indexer as indexer
    _, m, _ = pair
    prompt = _ids(1, 10, seed=8)  # blocks of 4: the fork shares a partial third block
    steps = torch.randint(0, HF["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        caches, alloc = _paged(m, 12)
        m(prompt, caches=caches)
        attnkit.caches.reorder(caches, torch.tensor([0, 0]))
        a, b = alloc.batch
        assert alloc.blocks(a) == alloc.blocks(b) and {alloc.refcount(x) for x in alloc.blocks(a)} == {2}
        before = _held_state(caches)
        real, calls = indexer.select_topk, []

        def fail_second(*args, **kw):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("boom")
            return real(*args, **kw)
        monkeypatch.setattr(indexer, "select_topk", fail_second)
        with pytest.raises(RuntimeError, match="boom"):
            m(steps[:, :1], caches=caches)  # the first layer copied and wrote; the second raises
        monkeypatch.undo()
        assert _same_held(_held_state(caches), before)
        got = [m(steps[:, t:t + 1], caches=caches) for t in range(6)]
        assert alloc.blocks(a)[:2] == alloc.blocks(b)[:2] and alloc.blocks(a)[2] != alloc.blocks(b)[2]
        want = m(torch.cat([prompt.expand(2, -1), steps], 1))[:, 10:]
    assert (torch.cat(got, 1) - want).abs().max() <= 1e-5


def test_paged_prefix_caching_shares_the_indexer_keys(pair):
    """A second prompt starts from the first one's cached full blocks: its new tokens select
    among (and attend to) the indexer keys and latents the first prompt wrote there."""
    _, m, _ = pair
    first = _ids(1, 14, seed=10)
    second = torch.cat([first[:, :9], _ids(1, 6, seed=11)], 1)  # shares two full blocks of 4
    with torch.no_grad():
        caches, alloc = _paged(m, 16, prefix_caching=True)
        m(first, caches=caches)
        (a,) = alloc.batch
        alloc.confirm_tokens(a, first[0])
        b = alloc.add_sequence(token_ids=second[0])
        assert alloc.length(b) == 8 and alloc.blocks(b) == alloc.blocks(a)[:2]
        alloc.set_batch([b])
        alloc.free(a)
        out = m(second[:, 8:], caches=caches)
        want = m(second)[:, 8:]
    assert (out - want).abs().max() <= 1e-5


def test_paged_exhausted_pool_changes_nothing(pair):
    """A step the pool has no block for raises OutOfBlocks before any layer writes: both pools,
    the tables and the free count stay; after a crop frees a block the step runs as on a twin."""
    import attnkit
    _, m, _ = pair
    ids = _ids(2, 8, seed=12)
    with torch.no_grad():
        caches, alloc = _paged(m, 4)  # two rows of two full blocks: nothing left
        twin = m.new_caches("dynamic")
        m(ids, caches=caches)
        m(ids, caches=twin)
        before = _state(caches)
        with pytest.raises(OutOfBlocks):
            m(ids[:, :1], caches=caches)
        assert _same(_state(caches), before) and alloc.num_free == 0
        attnkit.caches.crop(caches, -1)
        attnkit.caches.crop(twin, -1)
        torch.testing.assert_close(m(ids[:, 7:], caches=caches), m(ids[:, 7:], caches=twin), rtol=0, atol=1e-5)
    assert caches[0].nbytes_used == alloc.num_used * 4 * caches[0].bytes_per_token
    assert caches[0].nbytes == alloc.num_blocks * 4 * caches[0].bytes_per_token  # both pools' capacity
    assert caches[0].bytes_per_token == (24 + 6 + 16) * 4  # the latent and the indexer's key


def test_paged_layer_alone_and_shared():
    """One DSA layer on its own allocator steps, crops, reorders and resets its two pools by
    itself; layers sharing an allocator step through attnkit.caches.step, and refuse a step, a
    crop or a reorder of one layer alone (it would act once per layer), changing nothing."""
    import attnkit
    dsa, _ = _layer_pair(topk=4)
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        full = dsa(x)
        c = dsa.new_cache("paged", allocator=BlockAllocator(8, 4))
        outs = [dsa(x[:, :5], cache=c)] + [dsa(x[:, t:t + 1], cache=c) for t in range(5, 9)]
        assert (torch.cat(outs, 1) - full).abs().max() <= 1e-5
        assert c.lengths.tolist() == [9, 9] and c.index.lengths.tolist() == [9, 9]
        c.crop(-2)
        c.reorder(torch.tensor([1, 1]))  # a fork: both pools' blocks shared
        alloc = c.latent.allocator
        assert c.lengths.tolist() == [7, 7] and alloc.num_used == 2
        torch.testing.assert_close(dsa(x[1:, 7:].expand(2, -1, -1), cache=c), full[1:, 7:].expand(2, -1, -1),
                                   rtol=0, atol=1e-5)
        c.reset()
        assert c.lengths.numel() == 0 and alloc.num_used == 0
        shared = BlockAllocator(8, 4)
        c1, c2 = dsa.new_cache("paged", allocator=shared), dsa.new_cache("paged", allocator=shared)
        for call in (lambda: dsa(x, cache=c1), lambda: c1.crop(1), lambda: c1.reorder([0])):
            with pytest.raises(RuntimeError, match="attnkit.caches"):
                call()
            assert shared.num_used == 0 and shared.open_step is None
        with attnkit.caches.step([c1, c2], batch=2, tokens=9) as bound:
            outs = [dsa(x, cache=b) for b in bound]
    assert all((o - full).abs().max() <= 1e-5 for o in outs) and c2.lengths.tolist() == [9, 9]
