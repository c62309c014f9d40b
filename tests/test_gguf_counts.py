"""Count keys of every model part (issue 25, item 2): a gemma3 file whose vision part said
``clip.vision.block_count = 2**31`` made the loader walk 2**31 layers forever. This fuzz sets every
integer key of small files of each family (gemma3 and mllama with their vision parts, the expert models,
the encoders) to extreme values, loads each file and runs it, in a child process that the parent restarts
after a crash or a hang. A file must load and run, or be refused with a ValueError (GGUFError,
ModelError, ...) or MemoryError; any other exception counts as "wrong", a dead child as "crash", a case
running past its time limit as "hang"."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from pyggml import nn
from pyggml.backend.metadata import Config
from pyggml.synthetic import _add, defaults, metadata, write_model

ROOT = Path(__file__).resolve().parents[1]
VALUES = [0, 1, 255, 4097, 2**31, 2**32 - 1, 2**63, 2**64 - 1]
CASE_SECONDS = 20  # a case's load and run take well under a second

# vision keys as stored (mllama's under its architecture), and the tokens images need
GEMMA3_VISION = {"clip.vision.embedding_length": 32, "clip.vision.attention.head_count": 2,
                 "clip.vision.block_count": 2, "clip.vision.image_size": 16, "clip.vision.patch_size": 4,
                 "clip.vision.projector.scale_factor": 2, "clip.vision.feed_forward_length": 48,
                 "clip.vision.attention.layer_norm_epsilon": 1e-6}
MLLAMA_VISION = {f"mllama.vision.{k}": v for k, v in {
    "embedding_length": 32, "attention.head_count": 2, "block_count": 2, "global.block_count": 1, "image_size": 16,
    "patch_size": 8, "max_num_tiles": 2, "feed_forward_length": 48, "intermediate_layers_indices": [1]}.items()}
SPECIALS = {"gemma3": ["<start_of_image>", "<end_of_image>", "<image_soft_token>"], "mllama": ["<|image|>"]}


def vision_tensors(arch: str, meta: dict, text_hidden: int) -> list[nn.TensorDecl]:
    """The declared vision tensors of a gemma3 or mllama file with this metadata."""
    config = Config(meta)
    if arch == "gemma3":
        from pyggml.models import gemma3_vision as gv

        o = gv.VisionOptions.from_config(config, text_hidden)
        return [nn.TensorDecl(prefix + t.name, t.shape, t.module, t.required)
                for prefix, cls in (("v.", gv.VisionTower), ("mm.", gv.Projector)) for t in nn.declared(cls, o)]
    from pyggml.models import mllama_vision as mv

    o = mv.VisionOptions.from_config(config, text_hidden)
    decls = [t for cls, n in ((mv._TowerFile, 0), (mv._LocalFile, o.n_layers), (mv._GlobalFile, o.n_global))
             for t in nn.declared(cls, o, n_layers=n)]
    return decls + [nn.TensorDecl("mm.0.weight", (o.out_dim, text_hidden), nn.Linear, True),
                    nn.TensorDecl("mm.0.bias", (text_hidden,), nn.Linear, True)]


def write_vision_model(path: Path, arch: str, hparams: dict, vision: dict) -> Path:
    """A synthetic ``arch`` file (text part by pyggml.synthetic) with a random vision part added, and
    the tokens that place images."""
    text = write_model(path.with_suffix(".text.gguf"), arch, hparams)
    reader = gguf.GGUFReader(text)
    meta = {**metadata(arch, hparams), **vision}
    specials = SPECIALS[arch]
    meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"][:-len(specials)] + specials
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"][:-len(specials)] + [4] * len(specials)
    hidden = int(hparams["embedding_length"])
    writer = gguf.GGUFWriter(path, arch)
    for key, value in meta.items():
        if key != "general.architecture":
            _add(writer, key, value)
    rng = np.random.default_rng(0)
    arrays = [(t.name, np.array(t.data).reshape(tuple(int(d) for d in reversed(t.shape)))) for t in reader.tensors]
    arrays += [(t.name, (0.1 * rng.standard_normal(tuple(reversed(t.shape)))).astype(np.float32))
               for t in vision_tensors(arch, meta, hidden) if t.required]
    for name, data in arrays:
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    text.unlink()
    return path


FAMILIES = {  # name -> (architecture, text hyper-parameters, vision keys or None)
    "gemma3-vision": ("gemma3", defaults("gemma3"), GEMMA3_VISION),
    "mllama-vision": ("mllama", {**defaults("mllama"), "attention.cross_attention_layers": [1]}, MLLAMA_VISION),
    "qwen3moe": ("qwen3moe", defaults("qwen3moe"), None),
    "gpt-oss": ("gpt-oss", defaults("gpt-oss"), None),
    "bert": ("bert", defaults("bert"), None),
    "nomic-bert": ("nomic-bert", defaults("nomic-bert"), None),
}


def base_file(folder: Path, family: str) -> Path:
    arch, hparams, vision = FAMILIES[family]
    path = folder / f"{family}.gguf"
    return write_vision_model(path, arch, hparams, vision) if vision else write_model(path, arch, hparams)


def integer_keys(path: Path) -> list[str]:
    """The file's integer metadata (scalars and arrays), tokenizer ids and counts included."""
    ints = {gguf.GGUFValueType.UINT8, gguf.GGUFValueType.UINT16, gguf.GGUFValueType.UINT32,
            gguf.GGUFValueType.UINT64, gguf.GGUFValueType.INT8, gguf.GGUFValueType.INT16,
            gguf.GGUFValueType.INT32, gguf.GGUFValueType.INT64}
    out = []
    for field in gguf.GGUFReader(path).fields.values():
        kind = field.types[-1] if field.types else None
        if kind in ints and field.name not in ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count",
                                              "tokenizer.ggml.token_type"):
            out.append(field.name)
    return out


def write_variant(base: Path, out: Path, key: str, value: int | float) -> None:
    """``base`` with ``key`` set to ``value`` (an integer as uint32, uint64 when it needs to be; a float as
    float32; an array key becomes [value]); a key the file lacks is added."""
    reader = gguf.GGUFReader(base)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    V = gguf.GGUFValueType
    if key not in reader.fields:
        writer.add_key_value(key, value, V.FLOAT32 if isinstance(value, float) else V.UINT32)
    for field in reader.fields.values():
        name = field.name
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name != key:
            value_type = field.types[0]
            if value_type == V.ARRAY:
                writer.add_key_value(name, field.contents(), V.ARRAY, sub_type=field.types[-1])
            else:
                writer.add_key_value(name, field.contents(), value_type)
            continue
        kind = V.FLOAT32 if isinstance(value, float) else V.UINT64 if value >= 2**32 else V.UINT32
        if field.types[0] == V.ARRAY:
            writer.add_key_value(name, [value], V.ARRAY, sub_type=kind)
        else:
            writer.add_key_value(name, value, kind)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, tuple(int(d) for d in reversed(t.shape)), np.dtype(np.float32),
                               int(t.n_bytes), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(np.asarray(t.data).view(np.uint8).reshape(-1))
    writer.close()


# ---- the child: runs cases from a list, one line per case ----------------------------------------------
def run_case(path: Path, vision: bool) -> str:
    import pyggml

    try:
        llm = pyggml.load(path, n_threads=1, num_ctx=64, batch_size=32)
    except (ValueError, MemoryError, pyggml.backend.hardware.GGMLError):
        return "refused"
    try:
        if not llm.model.generates:
            out = llm.embed(["a b c"], pooling="mean")
        elif vision and llm.model.takes_images:
            from tests.hf_fixtures import png

            llm.generate("a", images=[png(0, (20, 18))], max_tokens=1, temperature=0)
            return "ran"
        else:
            out = llm.logits([1, 5, 9])
        # a file that loads must not answer with NaN or infinities (a silent wrong number)
        return "ran" if np.isfinite(np.asarray(out)).all() else "wrong: non-finite output"
    except (ValueError, MemoryError, pyggml.backend.hardware.GGMLError):
        return "refused"
    finally:
        llm.close()


def child_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    for i, (family, key, value, vision) in enumerate(spec["cases"]):
        print(f"start {i}", flush=True)
        out = Path(spec["folder"]) / f"case-{os.getpid()}.gguf"
        try:
            write_variant(Path(spec["folder"]) / f"{family}.gguf", out, key, value)
            outcome = run_case(out, vision)
        except Exception as e:  # noqa: BLE001 - any other exception is a validation bug
            outcome = f"wrong {type(e).__name__}: {str(e)[:200]}"
        print(json.dumps([i, outcome]), flush=True)


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def run_cases(folder: Path, cases: list[tuple]) -> list[str]:
    """Each case's outcome: ran, refused, wrong ..., crash (signal or exit code), hang."""
    outcomes: list[str | None] = [None] * len(cases)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    first = 0
    while first < len(cases):
        spec = folder / "spec.json"
        spec.write_text(json.dumps({"folder": str(folder), "cases": cases[first:]}))
        proc = subprocess.Popen([sys.executable, "-c", f"from tests.test_gguf_counts import child_main; "
                                 f"child_main({str(spec)!r})"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True, env=env, cwd=ROOT)
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        started, timeout = None, 60.0  # the first case waits for the imports too
        while True:
            try:
                line = lines.get(timeout=timeout)
            except queue.Empty:
                proc.kill()
                break
            if line is None:
                break
            if line.startswith("start "):
                started, timeout = first + int(line.split()[1]), CASE_SECONDS
            else:
                i, outcome = json.loads(line)
                outcomes[first + i] = outcome
        proc.wait()
        if started is None:
            raise AssertionError(f"the fuzz child failed before its first case (exit {proc.returncode})")
        if outcomes[started] is None:
            outcomes[started] = "hang" if proc.returncode == -9 else f"crash (exit {proc.returncode})"
        first = started + 1
    return outcomes


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_count_keys_of_every_part(tmp_path, family):
    pytest.importorskip("PIL", reason="the vision families encode an image (Pillow)")
    base = base_file(tmp_path, family)
    vision = FAMILIES[family][2] is not None
    keys = integer_keys(base)
    if vision:
        assert any(k.startswith(("clip.vision.", "mllama.vision.")) for k in keys)
    cases = [(family, key, value, vision) for key in keys for value in VALUES]
    outcomes = run_cases(tmp_path, cases)
    counts = {"tried": len(cases), "clean": sum(o in ("ran", "refused") for o in outcomes),
              "crash": sum(o.startswith("crash") for o in outcomes), "hang": outcomes.count("hang"),
              "wrong": sum(o.startswith("wrong") for o in outcomes)}
    print(family, json.dumps(counts))
    bad = [f"{key}={value}: {o}" for (_, key, value, _), o in zip(cases, outcomes, strict=True)
           if o not in ("ran", "refused")]
    assert not bad, "\n".join(bad[:30])
    # the base file itself runs (a fuzz where everything is refused would prove nothing)
    assert run_case(base, vision) == "ran"


# float hyper-parameters models read (each with the architecture's prefix): present in the synthetic file or
# added to it; NaN, infinity, a negative and zero must each be refused or give finite outputs
FLOAT_KEYS = ["rope.freq_base", "rope.freq_base_swa", "rope.scaling.factor", "rope.scaling.attn_factor",
              "rope.scaling.yarn_log_multiplier", "rope.scale_linear", "attention.layer_norm_rms_epsilon",
              "attention.layer_norm_epsilon", "attn_logit_softcapping", "final_logit_softcapping",
              "expert_weights_scale", "attention.temperature_scale", "logit_scale", "embedding_scale",
              "residual_scale", "attention_scale"]
FLOAT_VALUES = [float("nan"), float("inf"), -1.0, 0.0]
TEXT_FAMILIES = ["bert", "deepseek2", "gemma-embedding", "gemma2", "gemma3", "gemma4", "glm4moe", "gpt-oss",
                 "granitehybrid", "lfm2", "lfm2moe", "llama", "llama4", "mistral3", "nemotron_h", "nomic-bert", "olmo2",
                 "phi3", "qwen2", "qwen3", "qwen35", "qwen35moe", "qwen3moe", "qwen3next", "smollm3"]


def test_float_families_cover_the_registry():
    from pyggml.models import registry

    vision = {"mllama", "qwen25vl", "qwen2vl", "qwen3vl", "qwen3vlmoe"}  # their text keys are their families'
    assert set(TEXT_FAMILIES) == set(registry()) - vision


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_float_keys_never_crash_nor_give_nan(tmp_path, family):
    """A float key set to NaN, infinity, -1 or 0 (softcapping of inf made Gemma's logits NaN, a NaN local
    rope base Gemma 2/3's, a NaN LongRoPE attention factor Phi-3's): refused, or finite outputs."""
    path = write_model(tmp_path / f"{family}.gguf", family, defaults(family))
    cases = [(family, f"{family}.{key}", value, False) for key in FLOAT_KEYS for value in FLOAT_VALUES]
    outcomes = run_cases(tmp_path, cases)
    bad = [f"{key}={value}: {o}" for (_, key, value, _), o in zip(cases, outcomes, strict=True)
           if o not in ("ran", "refused")]
    assert not bad, "\n".join(bad[:30])
    assert run_case(path, False) == "ran"


def test_a_huge_vision_layer_count_is_refused_at_once(tmp_path):
    """The file of the report: ``clip.vision.block_count = 2**31`` in a gemma3 file with a vision part."""
    import pyggml
    from pyggml.backend.metadata import GGUFError

    base = base_file(tmp_path, "gemma3-vision")
    for value in (2**31, 4097, 10**6):
        bad = tmp_path / f"bad-{value}.gguf"
        write_variant(base, bad, "clip.vision.block_count", value)
        start = time.monotonic()
        with pytest.raises(GGUFError, match="clip.vision.block_count"):
            pyggml.load(bad, n_threads=1, num_ctx=64)
        assert time.monotonic() - start < 10


def test_vision_counts_are_bounded_by_config_alone():
    """Below the tensor count (so the load-time check passes), a vision count still meets the family bound."""
    from pyggml.backend.metadata import MAX_LAYERS, MAX_WIDTH, Config, GGUFError

    config = Config({"general.architecture": "gemma3", "clip.vision.block_count": MAX_LAYERS + 1,
                     "clip.vision.image_size": MAX_WIDTH + 1, "gemma3.expert_count": 2**31,
                     "general.parameter_count": 2**40})
    for key in ("clip.vision.block_count", "clip.vision.image_size", "expert_count"):
        with pytest.raises(GGUFError, match="out of range"):
            config.uint(key)
    assert config.uint("general.parameter_count") == 2**40  # not a hyper-parameter: as stored
    assert config.uint("clip.vision.block_count", max=MAX_LAYERS + 1) == MAX_LAYERS + 1  # a reader's own bound


def test_an_mmproj_files_counts_are_bounded_too(tmp_path):
    """A llama.cpp ``mmproj`` file (architecture ``clip``) beside a text gemma3 file: its counts meet the same
    bounds (the vision part's layer count against its own tensors, every size by its family)."""
    import pyggml
    from pyggml.backend.metadata import GGUFError

    text = write_model(tmp_path / "text.gguf", "gemma3", defaults("gemma3"))
    meta = {"general.architecture": "clip", "clip.projector_type": "gemma3", **GEMMA3_VISION}
    hidden = int(defaults("gemma3")["embedding_length"])
    writer = gguf.GGUFWriter(tmp_path / "mmproj.gguf", "clip")
    for key, value in meta.items():
        if key != "general.architecture":
            _add(writer, key, value)
    rng = np.random.default_rng(0)
    for t in vision_tensors("gemma3", meta, hidden):
        writer.add_tensor(t.name, (0.1 * rng.standard_normal(tuple(reversed(t.shape)))).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    llm = pyggml.load(text, mmproj=tmp_path / "mmproj.gguf", n_threads=1, num_ctx=64)
    assert llm.model.takes_images
    llm.close()
    for key, value in (("clip.vision.block_count", 2**31), ("clip.vision.image_size", 2**32 - 1),
                       ("clip.vision.embedding_length", 2**63)):
        write_variant(tmp_path / "mmproj.gguf", tmp_path / "bad.gguf", key, value)
        with pytest.raises(GGUFError, match=key.replace(".", r"\.")):
            pyggml.load(text, mmproj=tmp_path / "bad.gguf", n_threads=1, num_ctx=64)


def test_real_files_read_within_the_bounds(shared_models):
    """The bounds refuse nothing a real file holds (token ids of 0xFFFFFFFF for "none" included)."""
    from pyggml import Backend, BackendParams

    files = sorted(shared_models.glob("*.gguf")) + sorted((shared_models / "vocab").glob("*.gguf"))
    assert files
    for path in files:
        with Backend.load(path, BackendParams(n_threads=1)) as backend:
            c = backend.config
            for key, value in c.items():
                if isinstance(value, int) and not isinstance(value, bool):
                    assert (c.uint(key) if value >= 0 else c.int(key)) == value, (path.name, key)
