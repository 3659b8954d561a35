"""Text in, text out: attnkit.models.text.TextGenerator and `attnkit generate` on a random tiny
Llama saved with transformers plus a byte-level BPE tokenizer trained here (no downloads).
The printed text equals transformers' greedy continuation decoded by the same tokenizer."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from attnkit.cli import main  # noqa: E402
from attnkit.models import text as T  # noqa: E402
from attnkit.models.text import IncrementalDecoder, TextGenerator, TokenizerNotFound  # noqa: E402

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "attention is all you need, said the paper",
    "a cache of keys and values grows by one token per step",
    "héllo wörld, naïve café",  # two-byte characters
    "日本語のテキストも少し",  # three-byte characters
    "emoji 🙂 and 🚀 take four bytes",
]
CHAT = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(SENTENCES, trainer)
    return tok


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A save_pretrained folder: tiny random Llama (eos 2 = "</s>") + the trained tokenizer with a chat template."""
    d = tmp_path_factory.mktemp("tiny-llama")
    raw = _tokenizer()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")
    fast.chat_template = CHAT
    fast.save_pretrained(d)
    cfg = transformers.LlamaConfig(vocab_size=raw.get_vocab_size(), hidden_size=48, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                   initializer_range=0.3)  # peaky logits: greedy ties are unlikely
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(d)
    return d


def _hf_continuation(folder, ids, n):
    tok = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=0)
    return tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


PROMPT = "the quick brown"


def test_generate_equals_transformers_greedy(folder):
    gen = TextGenerator(folder)
    assert gen.tokenizer.kind == "transformers" and gen.eos == [2]
    ids = gen.encode(PROMPT)
    want = _hf_continuation(folder, ids, 20)
    assert gen.generate(PROMPT, 20) == want
    assert gen.stats.prompt_tokens == len(ids) and 1 <= gen.stats.new_tokens <= 20
    assert gen.stats.kv_cache_bytes == (len(ids) + gen.stats.new_tokens) * gen.model.kv_bytes_per_token()
    for cache in ("static", "paged"):
        assert gen.generate(PROMPT, 20, cache=cache) == want


def test_cli_prints_the_same_text_then_stats(folder, capsys):
    gen = TextGenerator(folder)
    want = _hf_continuation(folder, gen.encode(PROMPT), 16)
    assert main(["generate", str(folder), "--prompt", PROMPT, "--max-new-tokens", "16"]) == 0
    out, err = capsys.readouterr()
    assert out == want + "\n"
    assert "tokens/s" in err and "KV cache" in err and "bytes/token" in err


def test_quantized_kv_cache_in_text_and_cli(folder, capsys):
    """``kv_dtype`` / ``--kv-dtype``: the same greedy text as the Python API gives with that
    cache, and the bytes reported are the quantized cache's (data + fp32 scales)."""
    gen = TextGenerator(folder)
    text = gen.generate(PROMPT, 12, kv_dtype="int8")
    per = gen.model.kv_bytes_per_token(kv_dtype="int8")
    assert per < gen.model.kv_bytes_per_token()
    assert gen.stats.kv_cache_bytes == (gen.stats.prompt_tokens + gen.stats.new_tokens) * per
    assert main(["generate", str(folder), "--prompt", PROMPT, "--max-new-tokens", "12", "--kv-dtype", "int8"]) == 0
    out, err = capsys.readouterr()
    assert out == text + "\n"
    assert f"({per} bytes/token, cache=dynamic, kv_dtype=int8)" in err


def test_chat_template(folder, capsys):
    gen = TextGenerator(folder)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    messages = [{"role": "user", "content": "hello"}]
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert gen.encode("hello", chat=True) == list(ids)
    want = _hf_continuation(folder, list(ids), 12)
    assert main(["generate", str(folder), "--prompt", "hello", "--chat", "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out == want + "\n"


def test_tokenizers_package_alone(folder, tmp_path, monkeypatch):
    """Without transformers: tokenizer.json through `tokenizers`, the chat template through jinja2."""
    ref = TextGenerator(folder)
    monkeypatch.setattr(T, "_module_available", lambda name: name != "transformers")
    gen = TextGenerator(folder)
    assert gen.tokenizer.kind == "tokenizers"
    assert gen.encode(PROMPT) == ref.encode(PROMPT)
    assert gen.tokenizer.render_chat([{"role": "user", "content": "hi"}]) == \
        ref.tokenizer.render_chat([{"role": "user", "content": "hi"}])
    assert gen.generate(PROMPT, 12) == ref.generate(PROMPT, 12)


def test_sampling_is_reproducible_with_a_seed(folder):
    gen = TextGenerator(folder)
    a = gen.generate(PROMPT, 12, temperature=1.0, top_p=0.9, seed=3)
    assert a == gen.generate(PROMPT, 12, temperature=1.0, top_p=0.9, seed=3)


def test_multibyte_characters_never_split():
    tok = _tokenizer()
    text = "日本語 🙂 héllo 🚀"
    ids = tok.encode(text).ids
    dec = IncrementalDecoder(lambda x: tok.decode(x, skip_special_tokens=True))
    pieces, held = [], 0
    for i in ids:
        pieces.append(dec.push(i))
        held += tok.decode(dec.ids).endswith("\ufffd")
    pieces.append(dec.flush())
    assert held > 0  # the tokenizer does split characters across tokens here
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_truncated_character_is_flushed_at_the_end():
    tok = _tokenizer()
    ids = tok.encode("🙂").ids
    assert len(ids) > 1
    dec = IncrementalDecoder(lambda x: tok.decode(x))
    assert dec.push(ids[0]) == ""  # only the first byte(s): held back
    assert dec.flush() == tok.decode(ids[:1])  # generation ended there: what there is, is printed


def test_folder_without_tokenizer_says_what_is_missing(tmp_path, folder, capsys):
    for f in ("config.json", "model.safetensors"):
        (tmp_path / f).write_bytes((folder / f).read_bytes())
    with pytest.raises(TokenizerNotFound, match="no tokenizer: expected tokenizer.json"):
        TextGenerator(tmp_path)
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "attnkit generate: error:" in err and "save_pretrained" in err and "never downloads" in err


def test_chat_without_template_is_an_error(tmp_path, folder, capsys):
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = (tmp_path / "tokenizer_config.json")
    import json
    c = json.loads(cfg.read_text())
    c.pop("chat_template", None)
    cfg.write_text(json.dumps(c))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    assert main(["generate", str(tmp_path), "--prompt", "x", "--chat"]) == 2
    assert "no chat template" in capsys.readouterr().err
