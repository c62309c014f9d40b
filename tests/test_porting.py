"""The layer-by-layer parity tool (pyggml.porting, `pyggml compare`) and the taps it reads.

With torch and transformers: tiny random Hugging Face models converted by our converter agree layer
by layer, and a GGUF with one tensor perturbed (rewritten in place with the ``gguf`` package) is
reported as diverging exactly at the state that tensor feeds.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import sys

import numpy as np
import pytest

from pyggml import Backend, nn
from pyggml.porting import Comparison, LayerError, relative_error

HAVE_REFERENCE = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "gguf"))
needs_reference = pytest.mark.skipif(not HAVE_REFERENCE, reason="needs torch and transformers (the `reference` extra)")

PROMPT = "The sun was hot, and 42 people went to the school. Café?"
LLAMA_STATES = ["token_embd", "blk.0", "blk.1", "output_norm", "output"]


# ---- taps and the result object (no reference needed) ---------------------------------------------
def test_tap_records_only_inside_capture():
    backend = Backend.cpu(n_threads=1)
    with backend.new_context() as ctx:
        x = ctx.from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
        assert nn.tap("outside", x) is x
        with nn.capture_taps() as taps:
            y = nn.tap("blk.0", x.scale(2.0))
            z = nn.tap("blk.1", y + x)
            with pytest.raises(ValueError, match="tapped twice"):
                nn.tap("blk.0", z)
            for _ in range(2):  # code run once per block, not knowing its index
                nn.tap("blk.*.attn_out", y)
        assert list(taps) == ["blk.0", "blk.1", "blk.0.attn_out", "blk.1.attn_out"]
        assert nn.tap("after", z) is z  # the capture is over: nothing recorded
        assert len(taps) == 4
        ctx.compute(z.scale(0.5), *taps.values())  # an intermediate tapped state survives the compute
        np.testing.assert_allclose(taps["blk.0"].numpy(), 2 * np.arange(6).reshape(2, 3))
        np.testing.assert_allclose(taps["blk.1"].numpy(), 3 * np.arange(6).reshape(2, 3))
    backend.close()


def test_every_registered_architecture_taps_its_states(tmp_path):
    """What `pyggml compare` reads: every block's output, output_norm (generating models) and, where
    they match Hugging Face's modules, token_embd first and output last; from a tiny synthetic file of
    each architecture in the registry test."""
    try:
        from pyggml.synthetic import write_model

        from .test_architectures import TINY
    except ImportError:
        pytest.skip("needs the registry-wide test's tiny configs (tests/test_architectures.py)")
    from pyggml import models
    from pyggml.porting import _pyggml_states

    for arch in sorted(models.registry()):
        path = write_model(tmp_path / f"{arch}.gguf", arch, TINY[arch], "f32", seed=1)
        ours = _pyggml_states(path, "", [1, 2, 3, 4, 5], n_threads=1)
        names = [name for name in ours.states if name.count(".") < 2]  # not finer taps inside blocks
        assert [name for name in names if name.startswith("blk.")] == [f"blk.{i}" for i in range(ours.n_blocks)], arch
        assert "token_embd" not in names or names[0] == "token_embd", arch  # Gemma 2 scales outside HF's module
        if models.registry()[arch].generates:
            # the final norm is tapped under its GGUF tensor's name: LFM2's is token_embd_norm (llama.cpp's)
            final_norm = "token_embd_norm" if arch.startswith("lfm2") else "output_norm"
            assert final_norm in names and names[-1] in ("output", "logits"), arch
        assert all(state.shape[0] == 5 for state in ours.states.values()), arch


def test_comparison_names_the_first_state_past_the_tolerance():
    def layer(name: str, error: float, shape=(3, 4), ref_shape=(3, 4)) -> LayerError:
        return LayerError(name, shape, ref_shape, error, error, "m." + name)

    good = Comparison([1, 2, 3], 1e-3, [layer("token_embd", 0.0), layer("blk.0", 5e-4), layer("output", 1e-3)])
    assert good.ok and good.first_divergence is None
    assert "no state diverges beyond 1e-03" in good.table()
    assert good.error("blk.0") == 5e-4
    bad = Comparison([1, 2, 3], 1e-3, [layer("token_embd", 0.0), layer("blk.0", 2e-3), layer("blk.1", 0.5)])
    assert not bad.ok and bad.first_divergence.name == "blk.0"
    assert "first divergence: blk.0" in bad.table()
    assert Comparison([1], 1e-3, [layer("blk.0", math.nan)]).first_divergence.name == "blk.0"
    assert Comparison([1], 1e-3, [layer("blk.0", 0.0, ref_shape=(3, 5))]).first_divergence.name == "blk.0"
    assert not Comparison([1], 1e-3, []).ok  # nothing compared is not a pass
    data = Comparison([1], 1e-3, [layer("blk.0", math.inf, ref_shape=(3, 5))]).to_dict()
    assert data["first_divergence"] == "blk.0" and data["layers"][0]["error"] is None and not data["ok"]
    assert json.loads(json.dumps(bad.to_dict()))["layers"][1] == {
        "name": "blk.0", "shape": [3, 4], "reference_shape": [3, 4], "error": 2e-3, "max_error": 2e-3,
        "module": "m.blk.0", "diverges": True}


def test_compare_refuses_early(monkeypatch, tmp_path):
    from pyggml import porting

    with pytest.raises(ValueError, match="tolerance must be a positive number"):
        porting.compare(tmp_path, tmp_path / "x.gguf", tolerance=0)
    if HAVE_REFERENCE:
        with pytest.raises(ValueError, match="has no config.json"):
            porting.compare(tmp_path, tmp_path / "x.gguf")
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'pyggml\[reference\]'"):
        porting.compare(tmp_path, tmp_path / "x.gguf")


def test_relative_error():
    ref = np.array([[3.0, -4.0]])
    assert relative_error(ref, ref) == (0.0, 0.0)
    l2, top = relative_error(ref + [[0.0, 0.5]], ref)
    assert l2 == pytest.approx(0.1) and top == pytest.approx(0.125)
    assert relative_error(np.zeros(2), np.zeros(2)) == (0.0, 0.0)
    assert relative_error(np.ones(2), np.zeros(2)) == (math.inf, math.inf)


# ---- against transformers -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    if not HAVE_REFERENCE:
        pytest.skip("needs torch and transformers (the `reference` extra)")
    from pyggml.convert import convert_hf

    from .hf_fixtures import make_tiny_llama

    tmp = tmp_path_factory.mktemp("porting-llama")
    hf_dir, _ = make_tiny_llama(tmp, n_kv_heads=2)
    return hf_dir, convert_hf(hf_dir, tmp / "tiny-f32.gguf", out_type="f32")


def perturbed_copy(src, dst, tensor: str, seed: int = 0):
    """A copy of the GGUF ``src`` with ``tensor`` (an F32 weight) given noise as large as itself."""
    import gguf

    shutil.copyfile(src, dst)
    reader = gguf.GGUFReader(dst, "r+")
    (t,) = [t for t in reader.tensors if t.name == tensor]
    data = t.data
    assert data.dtype == np.float32
    data[...] = data + np.random.default_rng(seed).normal(0.0, float(np.abs(data).mean()), data.shape)
    reader.data.flush()
    del reader, data, t
    return dst


@needs_reference
def test_converted_llama_agrees_layer_by_layer(tiny_llama):
    from pyggml import porting

    hf_dir, gguf_path = tiny_llama
    result = porting.compare(hf_dir, gguf_path, PROMPT, n_threads=2)
    assert [x.name for x in result.layers] == LLAMA_STATES
    assert result.unmatched == [] and result.notes == []  # same token ids from both tokenizers
    assert result.ok, result.table()
    assert max(x.error for x in result.layers) < 1e-4, result.table()
    assert [x.module for x in result.layers] == ["model.embed_tokens", "model.layers.0", "model.layers.1",
                                                 "model.norm", "lm_head"]
    n = len(result.tokens)
    assert result.layers[0].shape == (n, 64) and result.layers[-1].shape[0] == n


# Other Hugging Face fixtures (tests/hf_fixtures.py): (GGUF architecture, fixture, its arguments, the
# largest error expected in F32). Each runs once pyggml registers the architecture. Gemma's floor is
# ggml's GELU, computed through an F16 table on the CPU (~3e-4 per MLP, measured with finer taps).
FIXTURES = {"mistral": ("llama", "make_tiny_llama", dict(arch="mistral", n_kv_heads=2), 1e-4),
            "qwen2": ("qwen2", "make_tiny_llama", dict(arch="qwen2", vocab="qwen", n_kv_heads=2), 1e-4),
            "qwen3": ("qwen3", "make_tiny_llama", dict(arch="qwen3", vocab="qwen", n_kv_heads=2), 1e-4),
            "qwen3moe": ("qwen3moe", "make_tiny_llama", dict(arch="qwen3moe", vocab="qwen", n_kv_heads=2), 1e-4),
            "gemma2": ("gemma2", "make_tiny_gemma", dict(arch="gemma2"), 1e-3),
            "gemma3": ("gemma3", "make_tiny_gemma", dict(arch="gemma3"), 1e-3)}


@needs_reference
@pytest.mark.parametrize("case", list(FIXTURES))
def test_other_converted_fixtures_agree_layer_by_layer(case, tmp_path):
    from pyggml import models, porting
    from pyggml.convert import convert_hf

    from . import hf_fixtures

    arch, fixture, kwargs, bound = FIXTURES[case]
    if arch not in models.registry() or not hasattr(hf_fixtures, fixture):
        pytest.skip(f"pyggml has no {arch} model (or tests/hf_fixtures.py no {fixture}) yet")
    hf_dir, _ = getattr(hf_fixtures, fixture)(tmp_path, **kwargs)
    gguf_path = convert_hf(hf_dir, tmp_path / "f32.gguf", out_type="f32")
    result = porting.compare(hf_dir, gguf_path, PROMPT, n_threads=2)
    names = [x.name for x in result.layers]
    blocks = [name for name in names if name.startswith("blk.")]
    assert len(blocks) >= 2 and blocks == [f"blk.{i}" for i in range(len(blocks))], result.table()
    assert "output_norm" in names and names[-1] in ("output", "logits"), result.table()
    assert not result.unmatched and result.ok and max(x.error for x in result.layers) < bound, result.table()


@needs_reference
def test_logits_compared_when_the_model_changes_them_after_its_output_tap(tiny_llama, monkeypatch):
    """A final soft-cap (Gemma 2) comes after the tapped output projection: the returned logits are then
    compared as "logits" with the reference model's final logits."""
    from pyggml import porting
    from pyggml.models import llama

    forward = llama.Llama.forward
    monkeypatch.setattr(llama.Llama, "forward", lambda self, ctx, batch: forward(self, ctx, batch).scale(1.0))
    result = porting.compare(*tiny_llama, PROMPT, n_threads=2)
    assert [x.name for x in result.layers] == [*LLAMA_STATES, "logits"]
    assert result.layers[-1].module == "(the model's logits)" and result.ok, result.table()


def test_reference_logits_cut_to_the_gguf_vocabulary():
    from pyggml.porting import _vocab_rows

    notes: list[str] = []
    ref = np.arange(12.0).reshape(2, 6)
    assert _vocab_rows("logits", np.zeros((2, 4)), ref, notes).shape == (2, 4)
    assert notes == ["logits: transformers has 6 vocabulary columns, the GGUF 4; compared the first 4"]
    assert _vocab_rows("blk.0", np.zeros((2, 4)), ref, notes) is ref  # hidden states: never cut
    assert _vocab_rows("output", np.zeros((3, 4)), ref, notes) is ref  # not the same tokens: a real mismatch


@needs_reference
def test_reference_modules_from_the_gguf_name_map(tiny_llama):
    import transformers

    from pyggml.porting import reference_modules

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama[0]))
    found = reference_modules(hf, "llama", 2)
    assert found["blk.1"] == "model.layers.1" and found["output"] == "lm_head"
    assert found["blk.0.attn_output"] == "model.layers.0.self_attn.o_proj"  # finer taps have references too
    assert found["blk.1.ffn_down"] == "model.layers.1.mlp.down_proj"
    # an architecture gguf knows no names for: the embeddings and the output by transformers' accessors
    assert reference_modules(hf, "no-such-arch", 2) == {"token_embd": "model.embed_tokens", "output": "lm_head"}


@needs_reference
def test_default_tolerance_follows_the_weight_type(tiny_llama, tmp_path):
    from pyggml import porting
    from pyggml.convert import convert_hf

    hf_dir, _ = tiny_llama
    f16 = convert_hf(hf_dir, tmp_path / "tiny-f16.gguf", out_type="f16")
    result = porting.compare(hf_dir, f16, PROMPT, n_threads=2)
    assert (result.weight_type, result.tolerance) == ("F16", 1e-2)
    assert result.ok and 1e-5 < result.error("output") < 5e-3, result.table()  # F16 rounding, well inside
    assert "F16 weights, tolerance 1e-02" in result.table()


@needs_reference
@pytest.mark.parametrize("tensor,state", [("blk.0.ffn_up.weight", "blk.0"), ("blk.1.attn_v.weight", "blk.1"),
                                          ("output_norm.weight", "output_norm")])
def test_perturbed_tensor_is_the_first_divergence(tiny_llama, tmp_path, tensor, state):
    from pyggml import porting

    hf_dir, gguf_path = tiny_llama
    broken = perturbed_copy(gguf_path, tmp_path / "broken.gguf", tensor)
    result = porting.compare(hf_dir, broken, PROMPT, n_threads=2)
    first = result.first_divergence
    assert first is not None and first.name == state, result.table()
    before = LLAMA_STATES[:LLAMA_STATES.index(state)]
    assert all(result.error(name) < 1e-4 for name in before), result.table()
    assert f"first divergence: {state}" in result.table()


@needs_reference
def test_compare_cli(tiny_llama, tmp_path, capsys):
    from pyggml.cli import main

    hf_dir, gguf_path = tiny_llama
    assert main(["compare", str(hf_dir), str(gguf_path), "--prompt", PROMPT, "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert "no state diverges" in out and "blk.1" in out and "lm_head" in out
    broken = perturbed_copy(gguf_path, tmp_path / "broken.gguf", "blk.1.ffn_down.weight")
    assert main(["compare", str(hf_dir), str(broken), "--prompt", PROMPT, "--tolerance", "1e-2"]) == 1
    assert "first divergence: blk.1" in capsys.readouterr().out
    assert main(["compare", str(hf_dir), str(broken), "--prompt", PROMPT, "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["first_divergence"] == "blk.1" and [x["name"] for x in data["layers"]] == LLAMA_STATES
    # a reference module given by hand: the final norm compared with the last block's output instead
    assert main(["compare", str(hf_dir), str(gguf_path), "--module", "output_norm=model.layers.1", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["first_divergence"] == "output_norm" and data["layers"][3]["module"] == "model.layers.1"
    with pytest.raises(SystemExit):
        main(["compare", str(hf_dir), str(gguf_path), "--module", "output_norm"])
    assert main(["compare", str(hf_dir), str(gguf_path), "--tokens", "1,17,42,99", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == [1, 17, 42, 99]
    for bad in (["--tokens", "1,x"], ["--tokens", "1", "--prompt", "hi"]):
        with pytest.raises(SystemExit):
            main(["compare", str(hf_dir), str(gguf_path), *bad])
    assert main(["compare", str(hf_dir), str(gguf_path), "--module", "output_norm=no.such.module"]) == 1
    assert "no module 'no.such.module'" in capsys.readouterr().err


@needs_reference
def test_compare_reports_progress_on_stderr(tiny_llama, capsys):
    """A comparison of a real model runs for minutes: each step is announced as it starts."""
    from pyggml import porting
    from pyggml.cli import main

    hf_dir, gguf_path = tiny_llama
    steps = []
    porting.compare(hf_dir, gguf_path, PROMPT, n_threads=2, progress=steps.append)
    assert steps == ["importing torch and transformers", f"running {gguf_path} in pyggml",
                     f"loading {hf_dir} in transformers and running it"]
    assert main(["compare", str(hf_dir), str(gguf_path), "--threads", "2", "--json"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert [line.split("] ", 1)[1] for line in err] == [f"{step}..." for step in steps]
    assert all(line.startswith("pyggml compare: [") for line in err)


@needs_reference
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="needs llama-cpp-python==0.3.36 (the `bench` extra)")
def test_llama_cpp_logits_of_the_same_file(tiny_llama, tmp_path, capsys):
    from pyggml import porting
    from pyggml.cli import main

    hf_dir, gguf_path = tiny_llama
    result = porting.compare(hf_dir, gguf_path, PROMPT, n_threads=2, llama_cpp=True)
    assert result.llama_cpp is not None and result.llama_cpp.shape == result.layers[-1].shape
    assert result.ok and result.llama_cpp.error < 1e-4, result.table()
    assert main(["compare", str(hf_dir), str(gguf_path), "--llama-cpp", "--threads", "2"]) == 0
    assert "llama.cpp's logits from the same file" in capsys.readouterr().out
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(RuntimeError, match="llama.cpp could not run"):
        porting.llama_cpp_logits(bad, [1, 2, 3], 2)


@needs_reference
def test_converted_bert_agrees_layer_by_layer(tmp_path):
    from pyggml import porting
    from pyggml.convert import convert_hf

    from .hf_fixtures import make_tiny_bert

    hf_dir, _ = make_tiny_bert(tmp_path)
    gguf_path = convert_hf(hf_dir, tmp_path / "bert-f32.gguf", out_type="f32")
    result = porting.compare(hf_dir, gguf_path, "the cat sat on the water", n_threads=2)
    assert [x.name for x in result.layers] == ["token_embd", "token_embd_norm", "blk.0", "blk.1"]
    assert result.ok and max(x.error for x in result.layers) < 1e-4, result.table()
    broken = perturbed_copy(gguf_path, tmp_path / "broken.gguf", "blk.1.attn_output_norm.weight")
    result = porting.compare(hf_dir, broken, "the cat sat on the water", llama_cpp=True)
    assert result.first_divergence.name == "blk.1"
    assert result.llama_cpp is None and "llama.cpp not compared" in result.notes[0]  # no logits to compare
