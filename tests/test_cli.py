"""The `attnkit` command."""

from __future__ import annotations

import subprocess
import sys

from attnkit.cli import main


def test_info_lists_versions_and_backends(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    import attnkit
    import torch
    assert f"attnkit {attnkit.__version__}" in out and torch.__version__ in out
    for name in ("math", "sdpa", "decode", "flex"):
        assert f"  {name}" in out
    from attnkit.backends import auto_order
    assert "auto order: " + " > ".join(auto_order()) in out


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "info" in capsys.readouterr().out


def test_module_entry_point_runs():
    res = subprocess.run([sys.executable, "-m", "attnkit", "info", "--no-build"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and "backends" in res.stdout


# ---------------------------------------------------------------------------- subcommands

import importlib.util  # noqa: E402

import pytest  # noqa: E402

HAS_MPL = importlib.util.find_spec("matplotlib") is not None


@pytest.mark.parametrize("cmd", [["demo"], ["bench"], ["viz"], ["viz", "masks"], ["viz", "attention"], ["kv"], ["generate"]])
def test_every_subcommand_has_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([*cmd, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: attnkit " + " ".join(cmd))


def test_viz_without_what_prints_help(capsys):
    assert main(["viz"]) == 2
    assert "masks" in capsys.readouterr().out


def test_kv_prints_bytes_per_token(capsys):
    assert main(["kv", "deepseek-v3", "gqa:heads=32,num_kv_heads=8,head_dim=128,layers=32", "--context", "1k"]) == 0
    out = capsys.readouterr().out
    assert "1,152" in out  # DeepSeek-V3: (512 + 64) values x 2 bytes per token per layer
    assert "| 4,096 |" in out  # the GQA spec: 8 heads x (128 + 128) x 2 bytes
    assert main(["kv"]) == 0 and "llama" in capsys.readouterr().out.lower()


@pytest.mark.parametrize("argv,msg", [
    (["kv", "mla:heads=4"], "missing"),
    (["kv", "nosuchmodel"], "unknown preset"),
    (["kv", "deepseek-v3", "--batch", "0"], "--batch must be >= 1"),
])
def test_kv_bad_specs(argv, msg, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnkit kv: error:") and msg in err


def test_bench_lists_the_checkouts_suites(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    for suite in ("attention", "module", "generate"):
        assert suite in out


def test_bench_without_a_checkout_is_a_clear_error(tmp_path, capsys):
    assert main(["bench", "--dir", str(tmp_path)]) == 2
    assert "an installed wheel does not ship" in capsys.readouterr().err


def _fake_suites(tmp_path, ok=True):
    d = tmp_path / "benchmarks"
    d.mkdir()
    (d / "_common.py").write_text("")
    (d / "bench_fake.py").write_text(
        '"""A fake suite."""\nimport json, sys, pathlib\n'
        'out = pathlib.Path(sys.argv[sys.argv.index("--out") + 1]); out.mkdir(parents=True, exist_ok=True)\n'
        'stem = "fake_quick" if "--quick" in sys.argv else "fake"\n'
        'rows = [{"case": "a", "x_ms": 1.0, "y_ms": 2.0}, {"case": "b", "x_ms": 3.0, "y_ms": 1.0}]\n'
        '(out / (stem + ".json")).write_text(json.dumps({"rows": rows}))\n'
        '(out / (stem + ".md")).write_text("| table |")\n'
        + ("" if ok else "sys.exit(3)\n"))
    return d


def test_bench_runs_suites_and_plots_their_tables(tmp_path, capsys):
    d = _fake_suites(tmp_path)
    out = tmp_path / "out"
    assert main(["bench", "--dir", str(d), "--quick", "--out", str(out)]) == 0
    assert (out / "fake_quick.md").is_file() and (out / "fake_quick.json").is_file()
    assert (out / "fake_quick.png").is_file() == HAS_MPL
    assert main(["bench", "nosuch", "--dir", str(d)]) == 2
    assert "unknown suite" in capsys.readouterr().err


def test_bench_reports_a_suite_that_cannot_run_here_as_skipped(tmp_path, capsys):
    d = _fake_suites(tmp_path)
    (d / "bench_needsgpu.py").write_text('"""Needs a GPU."""\nimport sys\nsys.exit(77)\n')
    assert main(["bench", "--dir", str(d), "--out", str(tmp_path / "o"), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "needsgpu: skipped" in out and "fake: ok" in out


def test_bench_reports_a_failing_suite(tmp_path, capsys):
    d = _fake_suites(tmp_path, ok=False)
    assert main(["bench", "--dir", str(d), "--out", str(tmp_path / "o"), "--no-plots"]) == 1
    assert "failed suites: fake" in capsys.readouterr().err


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib is not installed")
def test_viz_masks_writes_the_gallery_and_each_kind(tmp_path, capsys):
    assert main(["viz", "masks", "--out", str(tmp_path), "--size", "10"]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "mask_gallery.png" in names and "mask_sliding_window.png" in names and len(names) == 9
    assert main(["viz", "masks", "--out", str(tmp_path / "one"), "--kind", "prefix_lm"]) == 0
    assert [p.name for p in (tmp_path / "one").iterdir()] == ["mask_prefix_lm.png"]
    assert main(["viz", "masks", "--kind", "diagonal", "--out", str(tmp_path)]) == 2
    assert "unknown mask kind" in capsys.readouterr().err


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib is not installed")
def test_viz_attention_of_a_checkpoint(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, vocab_size=50)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "ckpt")
    png = tmp_path / "a.png"
    assert main(["viz", "attention", str(tmp_path / "ckpt"), "--ids", "1 5 9 3", "--layer", "1", "--out", str(png)]) == 0
    assert png.read_bytes().startswith(b"\x89PNG")
    assert main(["viz", "attention", str(tmp_path / "ckpt"), "--ids", "1,99"]) == 2
    assert "outside the vocabulary" in capsys.readouterr().err
    assert main(["viz", "attention", str(tmp_path / "ckpt"), "--ids", "1 2", "--layer", "5"]) == 2
    assert main(["viz", "attention", str(tmp_path / "nope"), "--ids", "1"]) == 2
    assert "not a directory" in capsys.readouterr().err


# ---------------------------------------------------------------------------- first contact

import os  # noqa: E402
from pathlib import Path  # noqa: E402

import attnkit  # noqa: E402

SRC = Path(attnkit.__file__).resolve().parents[1]
BLOCKER = '''
import sys
BLOCKED = {names!r}

class _Blocker:  # behaves as if these packages were not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, _Blocker())
'''


def _env_without(tmp_path, *names) -> dict:
    """Environment whose Pythons (this one's children included) cannot import ``names``: a
    sitecustomize on PYTHONPATH puts a blocking finder first on sys.meta_path."""
    d = tmp_path / "blocker"
    d.mkdir()
    (d / "sitecustomize.py").write_text(BLOCKER.format(names=names))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(d), str(SRC)])}


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip().startswith(f"attnkit {attnkit.__version__}")


def test_bench_in_a_venv_without_transformers_or_triton(tmp_path):
    """`attnkit bench --quick` where transformers and triton are missing: the suites that need them
    say what to install and are skipped; the run exits 0 (no NameError / ModuleNotFoundError)."""
    env = _env_without(tmp_path, "transformers", "triton")
    check = subprocess.run([sys.executable, "-c", "import attnkit, attnkit.nn, attnkit.integrations"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr
    res = subprocess.run([sys.executable, "-m", "attnkit", "bench", "generate", "module", "integration", "gpu",
                          "--quick", "--no-plots", "--out", str(tmp_path / "out")],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    for suite in ("generate", "module", "integration"):
        assert f"== {suite}: skipped: needs transformers (pip install 'attnkit[bench]')" in res.stdout
    assert "== gpu: skipped: needs triton (pip install triton)" in res.stdout
    assert "Traceback" not in res.stderr and "NameError" not in res.stderr
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.json"))


def test_bench_skip_reason_reaches_the_summary(tmp_path, capsys):
    d = _fake_suites(tmp_path)
    (d / "bench_needs.py").write_text(
        '"""Needs a package."""\nimport os, sys, pathlib\n'
        'pathlib.Path(os.environ["ATTNKIT_BENCH_SKIP_FILE"]).write_text("needs frobnicate (pip install frob)")\n'
        'sys.exit(77)\n')
    assert main(["bench", "needs", "--dir", str(d), "--out", str(tmp_path / "o")]) == 0
    assert "== needs: skipped: needs frobnicate (pip install frob)" in capsys.readouterr().out


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib is not installed")
def test_bench_plots_only_redraws_from_result_files(tmp_path, capsys):
    d = _fake_suites(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "fake.json").write_text('{"rows": [{"case": "a", "x_ms": 1.0}]}')
    assert main(["bench", "--dir", str(d), "--out", str(out), "--plots-only"]) == 0
    assert (out / "fake.png").read_bytes().startswith(b"\x89PNG") and not (out / "fake.md").exists()
    assert main(["bench", "--dir", str(d), "--out", str(tmp_path / "empty"), "--plots-only"]) == 1


def test_generate_subcommand_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--prompt", "--max-new-tokens", "--temperature", "--top-p", "--top-k", "--cache", "--seed", "--chat"):
        assert opt in out


def test_generate_on_a_missing_folder_says_it_does_not_exist(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert main(["generate", str(missing), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert f"attnkit generate: error: {missing} does not exist" in err and "tokenizer:" not in err
    (tmp_path / "a-file").write_text("")
    assert main(["generate", str(tmp_path / "a-file"), "--prompt", "x"]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_generate_kv_dtype_lists_what_a_user_types(capsys):
    """A wrong --kv-dtype lists the spellings the option takes, not Python values; "none" is one."""
    with pytest.raises(SystemExit) as e:
        main(["generate", "folder", "--prompt", "x", "--kv-dtype", "int4"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-dtype: expected one of none, int8" in err and "'int4'" in err
    assert "torch." not in err and "None" not in err
    from attnkit.cli import build_parser
    for text, want in (("none", None), ("int8", "int8"), ("INT8", "int8")):
        assert build_parser().parse_args(["generate", "f", "--prompt", "x", "--kv-dtype", text]).kv_dtype == want


def test_info_says_on_which_devices_auto_picks_a_backend(capsys, monkeypatch):
    """flex is picked by auto on CUDA only: info says so instead of "(auto)" on a CPU machine;
    backends auto considers everywhere stay "(auto)", and the forced-only ones "(forced only)"."""
    import torch

    from attnkit.backends import get_backend
    from attnkit.cli import _auto_note
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["info", "--no-build"]) == 0
    out = capsys.readouterr().out
    assert "  flex    available (forced only on CPU)" in out
    assert "  sdpa    available (auto)" in out and "  math    available (auto)" in out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _auto_note("flex", get_backend("flex"), True) == "auto on CUDA; forced only on CPU"
    assert _auto_note("sdpa", get_backend("sdpa"), True) == "auto"
