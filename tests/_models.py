"""Small GGUF files the behaviour tests need and no shared file provides.

- ``letters_llama(path, rope_freqs=...)``: a tiny random one-layer llama whose vocabulary is the 26
  lowercase letters (plus <unk>, <s>, </s>), so generated text maps back to token ids one character
  each, with or without Llama 3.1's ``rope_freqs.weight`` (per-frequency divisors). Its query/key
  weights are large, so attention is sharp and depends on positions: a wrong rotation changes the
  logits. Greedy decoding never picks <unk>, <s> or </s>: their output rows are zero (logit 0) while
  the rows of 'b' and 'a' are opposite, so one of those two always scores >= 0 (no end token, by
  construction rather than by luck).
- ``with_chat_template(src, dst, template)``: a byte-for-byte copy of a GGUF with one more key,
  ``tokenizer.chat_template`` (e.g. stories260K, a trained model, with a multi-turn template).

And the scaffolding of the per-architecture parity tests (tests/test_<arch>.py): ``converted_cases`` (a
module fixture's converted tiny checkpoints), ``logits_match_in_batches`` (one batch, cut batches, token by
token), ``sequences_match_transformers`` (several sequences at once), ``refuses_config`` (a config the
converter must refuse), ``shifted_keys`` (a context shift's keys per layer) and, for vision models,
``images_alone_and_together`` (two images in one batch vs each alone), all measured with ``scaled_error`` /
``error`` (the same, for arrays of one shape) against ``reference`` (transformers' logits).
"""

from __future__ import annotations

import json
import shutil
import string
import struct
from pathlib import Path

import gguf
import numpy as np

from pyggml.models import Input
from pyggml.runner import InputCache

LETTERS = string.ascii_lowercase
LETTER_IDS = {c: 3 + i for i, c in enumerate(LETTERS)}  # after <unk>, <s>, </s>
LETTER_VOCAB = 3 + len(LETTERS)
# head_dim 16: 8 rotation frequencies, each divided by its factor (1 = unchanged)
ROPE_FREQS = np.geomspace(1.0, 40.0, 8).astype(np.float32)


CONCAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def letters_llama(path: str | Path, *, rope_freqs: np.ndarray | None = None, seed: int = 7,
                  chat_template: str | None = None) -> Path:
    """Write the letters llama (1 layer, hidden 32, 2 heads of 16, 1 KV head)."""
    path = Path(path)
    hidden, n_heads, n_kv, head_dim, ffn, n_layers = 32, 2, 1, 16, 64, 1
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("letters llama (random weights, tests only)")
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(LETTER_VOCAB)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", *LETTERS])
    writer.add_token_scores([0.0] * LETTER_VOCAB)
    writer.add_token_types([2, 3, 3] + [1] * len(LETTERS))
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    def matrix(rows: int, cols: int, scale: float) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)

    writer.add_tensor("token_embd.weight", matrix(LETTER_VOCAB, hidden, 1.0))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
    for i in range(n_layers):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", norm())
        writer.add_tensor(p + "attn_q.weight", matrix(n_heads * head_dim, hidden, 0.5))
        writer.add_tensor(p + "attn_k.weight", matrix(n_kv * head_dim, hidden, 0.5))
        writer.add_tensor(p + "attn_v.weight", matrix(n_kv * head_dim, hidden, hidden ** -0.5))
        writer.add_tensor(p + "attn_output.weight", matrix(hidden, n_heads * head_dim, (n_heads * head_dim) ** -0.5))
        writer.add_tensor(p + "ffn_norm.weight", norm())
        writer.add_tensor(p + "ffn_gate.weight", matrix(ffn, hidden, hidden ** -0.5))
        writer.add_tensor(p + "ffn_up.weight", matrix(ffn, hidden, hidden ** -0.5))
        writer.add_tensor(p + "ffn_down.weight", matrix(hidden, ffn, ffn ** -0.5))
    writer.add_tensor("output_norm.weight", norm())
    output = matrix(LETTER_VOCAB, hidden, 1.0)
    output[:3] = 0.0
    output[LETTER_IDS["b"]] = -output[LETTER_IDS["a"]]
    writer.add_tensor("output.weight", output)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def letters_to_ids(text: str) -> list[int]:
    return [LETTER_IDS[c] for c in text]


def only_letters_bias() -> dict[int, float]:
    """A logit_bias that bans <unk>, <s> and </s> (so only letters are generated)."""
    return {0: -float("inf"), 1: -float("inf"), 2: -float("inf")}


# ---- what a shifting cache holds ------------------------------------------------------------------

def cache_states(prompt: list[int], generated: list[int], num_ctx: int, num_keep: int) -> tuple[list, int]:
    """For each generated token, the tokens in the cache (position order) its logits came from;
    and how many shifts happened."""
    planner = InputCache(num_ctx, 1)
    cache, states, shifts = list(prompt), [list(prompt)], 0
    for token in generated[:-1]:
        if len(cache) >= num_ctx:
            discard = planner.shift_discard([Input(token=t) for t in cache], num_keep)
            del cache[num_keep:num_keep + discard]
            shifts += 1
        cache.append(token)
        states.append(list(cache))
    return states, shifts


def log_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64)
    m = row.max()
    return row - m - np.log(np.exp(row - m).sum())


# ---- a GGUF with one more string key ----------------------------------------------------------------

def _skip_value(data: bytes, pos: int, vtype: int) -> int:
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    if vtype in sizes:
        return pos + sizes[vtype]
    if vtype == 8:  # string
        (n,) = struct.unpack_from("<Q", data, pos)
        return pos + 8 + n
    if vtype == 9:  # array
        etype, count = struct.unpack_from("<IQ", data, pos)
        pos += 12
        if etype in sizes:
            return pos + sizes[etype] * count
        for _ in range(count):
            pos = _skip_value(data, pos, etype)
        return pos
    raise ValueError(f"unknown GGUF value type {vtype}")


def with_chat_template(src: str | Path, dst: str | Path, template: str) -> Path:
    """Copy GGUF v3 ``src`` to ``dst`` adding ``tokenizer.chat_template`` (must not be there yet)."""
    data = Path(src).read_bytes()
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", data, 0)
    assert magic == b"GGUF" and version == 3, (magic, version)
    pos = 24
    alignment = 32
    for _ in range(n_kv):
        (n,) = struct.unpack_from("<Q", data, pos)
        key = data[pos + 8:pos + 8 + n].decode()
        pos += 8 + n
        (vtype,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", data, pos)
        assert key != "tokenizer.chat_template", f"{src} already has a chat template"
        pos = _skip_value(data, pos, vtype)
    kv_end = pos
    for _ in range(n_tensors):
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n
        (n_dims,) = struct.unpack_from("<I", data, pos)
        pos += 4 + 8 * n_dims + 4 + 8
    infos_end = pos
    data_start = infos_end + (-infos_end % alignment)
    key, value = b"tokenizer.chat_template", template.encode()
    extra = struct.pack("<Q", len(key)) + key + struct.pack("<I", 8) + struct.pack("<Q", len(value)) + value
    head = struct.pack("<4sIQQ", magic, version, n_tensors, n_kv + 1) + data[24:kv_end] + extra + \
        data[kv_end:infos_end]
    head += b"\0" * (-len(head) % alignment)
    Path(dst).write_bytes(head + data[data_start:])
    return Path(dst)


# ---- several sequence slots at once -------------------------------------------------------------------

def logits_in_slots(path: Path, prompts: list[list[int]], batch_size: int = 4) -> list[np.ndarray]:
    """Each prompt's logits (len(prompt), vocab), all scored at once by a Runner with one sequence slot
    per prompt: its batches hold several sequences, whose attention the cache serves in per-sequence
    groups (``serve`` runs four slots by default; ``LLM`` runs one)."""
    from pyggml import BackendParams, models
    from pyggml.runner import CompletionRequest, Runner

    model = models.load(path, BackendParams(n_threads=2))
    try:
        with Runner(model, parallel=len(prompts), num_ctx=64, batch_size=batch_size, cache_type="f32",
                    background=False) as runner:
            streams = [runner.completion(CompletionRequest(prompt=p, max_tokens=0, prompt_logits=True))
                       for p in prompts]
            return [list(stream)[-1].prompt_logits for stream in streams]
    finally:
        model.close()


def logits_from_threads(path: Path, prompts: list[list[int]], num_ctx: int = 64, batch_size: int = 8,
                        timeout: float = 120) -> list[np.ndarray | None]:
    """Each prompt's logits (len(prompt), vocab), scored by one background Runner with one slot per
    prompt while each request comes from its own thread (as a server's would): its batches mix the
    sequences as they arrive. A request that has not finished within ``timeout`` seconds gives None."""
    import threading

    from pyggml import BackendParams, models
    from pyggml.runner import CompletionRequest, Runner

    results: list[np.ndarray | None] = [None] * len(prompts)
    model = models.load(path, BackendParams(n_threads=2))
    try:
        with Runner(model, parallel=len(prompts), num_ctx=num_ctx, batch_size=batch_size,
                    cache_type="f32") as runner:
            def score(i: int) -> None:
                *_, last = runner.completion(CompletionRequest(prompts[i], max_tokens=0, prompt_logits=True))
                results[i] = last.prompt_logits

            threads = [threading.Thread(target=score, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout)
    finally:
        model.close()
    return results


def image_prompt_logits(llm, prompt: str, image: bytes) -> np.ndarray:
    """The prompt logits of ``prompt`` (with an ``[img-0]``) and ``image`` through the runner."""
    from pyggml.runner import CompletionRequest

    *_, last = llm.runner.completion(CompletionRequest(prompt=prompt, images=[image], max_tokens=0,
                                                       prompt_logits=True))
    return last.prompt_logits


def images_alone_and_together(model, cases: list[tuple[str, bytes]], num_ctx: int, batch_size: int,
                               logit_bias: dict[int, float] | None = None):
    """Each (prompt with an ``[img-0]``, image) of ``cases`` through one runner with a slot per case (3 greedy
    tokens, prompt logits), first alone, then all at once: ``(alone, together, batches, vision_built)``, where
    alone and together hold each case's (tokens, prompt logits), batches the runner's batches of the second run
    (``test_multimodal_runner.record_batches``) and vision_built how many vision graphs the runner built.
    ``model``: a loaded model, or the path of one to load (and close)."""
    from pyggml import BackendParams, models
    from pyggml.runner import CompletionRequest, Runner

    from .test_multimodal_runner import record_batches

    def request(prompt, data):
        return CompletionRequest(prompt=prompt, images=[data], max_tokens=3, temperature=0, prompt_logits=True,
                                 **({} if logit_bias is None else {"logit_bias": logit_bias}))

    def read(stream):
        chunks = list(stream)
        return [t for c in chunks for t in c.tokens], chunks[-1].prompt_logits

    loaded = models.load(model, BackendParams(n_threads=2)) if isinstance(model, str | Path) else model
    try:
        with Runner(loaded, parallel=len(cases), num_ctx=num_ctx, batch_size=batch_size, cache_type="f32",
                    background=False) as runner:
            alone = [read(runner.completion(request(*case))) for case in cases]
            batches = record_batches(runner)
            streams = [runner.completion(request(*case)) for case in cases]
            together = [read(stream) for stream in streams]
            return alone, together, batches, runner.engine.vision_built
    finally:
        if loaded is not model:
            loaded.close()


def check_mmproj_split(path: Path, tmp_path: Path, prompt: str, image: bytes, num_ctx: int = 128) -> None:
    """A vision model's file split into text + mmproj (``split_mmproj``, llama.cpp's layout): the text file
    alone takes no images, with the mmproj it gives the single file's image+text logits exactly, and a
    file that has a vision part refuses a second one."""
    import pytest

    import pyggml
    from pyggml.convert.gemma3_vision import split_mmproj

    text, mmproj = split_mmproj(path, tmp_path / "text.gguf", tmp_path / "mmproj.gguf")
    with pyggml.load(path, n_threads=2, num_ctx=num_ctx, cache_type="f32") as llm:
        single = image_prompt_logits(llm, prompt, image)
    with pyggml.load(text, n_threads=2, num_ctx=num_ctx) as llm:
        assert not llm.model.takes_images
    with pyggml.load(text, n_threads=2, num_ctx=num_ctx, cache_type="f32", mmproj=mmproj) as llm:
        assert llm.model.takes_images
        np.testing.assert_array_equal(image_prompt_logits(llm, prompt, image), single)
    with pytest.raises(ValueError, match="has a vision part already"):
        pyggml.load(path, n_threads=1, num_ctx=64, mmproj=mmproj)


def converted_cases(root: Path, make, cases: dict[str, dict]):
    """A module fixture's ``converted(case, out_type="f32")``: (path of the file our converter wrote, HF model,
    HF tokenizer) for ``make(root, **cases[case])`` (an ``hf_fixtures.make_tiny_*``), each made once;
    ``converted.hf_dirs[case]``: the checkpoint's folder."""
    import transformers

    from pyggml.convert import convert_hf

    done, hf = {}, {}

    def get(case: str, out_type: str = "f32"):
        if case not in hf:
            hf_dir, model = make(root, **cases[case])
            hf[case] = hf_dir, model, transformers.AutoTokenizer.from_pretrained(hf_dir)
            get.hf_dirs[case] = hf_dir
        if (case, out_type) not in done:
            done[case, out_type] = convert_hf(hf[case][0], root / f"{case}-{out_type}.gguf", out_type)
        return done[case, out_type], hf[case][1], hf[case][2]

    get.hf_dirs = {}
    return get


# ---- our logits against transformers' -------------------------------------------------------------------

def reference(model, tokens: list[int]) -> np.ndarray:
    """Transformers' logits (len(tokens), vocab) of one sequence."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def scaled_error(ours: np.ndarray, ref: np.ndarray) -> float:
    """max |ours - ref| / max |ref|: the relative error every parity test bounds."""
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def error(ours: np.ndarray, theirs: np.ndarray) -> float:
    """``scaled_error`` of two arrays of one shape."""
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    return scaled_error(ours, theirs)


def logits_match_in_batches(path: Path, model, tokens: list[int], tolerance: float,
                            batch_sizes: tuple[int, ...] = (512, 3, 1), num_ctx: int = 64,
                            text: str | None = None) -> None:
    """The file at ``path`` gives transformers' ``model``'s logits for ``tokens`` (error below ``tolerance``, F32
    cache) with the prompt cut into batches of each of ``batch_sizes`` (the whole prompt, batches that cut windows
    or chunks, token by token); ``text``: the prompt's text, which our tokenizer must encode as ``tokens``."""
    import pyggml

    expected = reference(model, tokens)
    for batch_size in batch_sizes:
        with pyggml.load(path, n_threads=2, num_ctx=num_ctx, batch_size=batch_size, cache_type="f32") as llm:
            if text is not None:
                assert llm.tokenize(text) == tokens
            assert error(llm.logits(tokens), expected) < tolerance, batch_size


def sequences_match_transformers(path: Path, model, prompts: list[list[int]], tolerance: float, **kwargs) -> None:
    """Each prompt's logits, all scored at once by one runner (``logits_from_threads``, ``kwargs`` passed on), equal
    transformers' for that prompt alone (error below ``tolerance``)."""
    results = logits_from_threads(path, prompts, **kwargs)
    for tokens, ours in zip(prompts, results, strict=True):
        assert error(ours, reference(model, tokens)) < tolerance


def refuses_config(hf_dir: Path, tmp_path: Path, change: dict, message: str) -> None:
    """A copy of the checkpoint ``hf_dir`` with ``change`` merged into its config.json is refused by the converter
    (a ValueError matching ``message``), which leaves no file behind."""
    import pytest

    from pyggml.convert import convert_hf

    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    config = json.loads((bad / "config.json").read_text()) | change
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        convert_hf(bad, tmp_path / "m.gguf", "f32")
    assert not (tmp_path / "m.gguf").exists()


def shifted_keys(tmp_path: Path, arch: str, n_layers: int = 4) -> tuple[np.ndarray, list[np.ndarray]]:
    """Random keys (3 tokens, 2 KV heads, 16) and, per layer, what the synthetic ``arch`` model's context shift
    makes of them when they move back 5 positions."""
    from pyggml import BackendParams, models, nn
    from pyggml.synthetic import write_model

    from .test_architectures import TINY

    model = models.load(write_model(tmp_path / "m.gguf", arch, TINY[arch], "f32", seed=3), BackendParams(n_threads=2))
    try:
        keys = np.random.default_rng(0).standard_normal((3, 2, 16)).astype(np.float32)  # (tokens, kv heads, dim)
        with model.backend.new_context() as ctx:
            key, delta = ctx.from_numpy(keys), nn.int32_input(ctx, [-5, -5, -5])
            shifted = [model.shift(ctx, layer, key, delta) for layer in range(n_layers)]
            ctx.compute(*shifted)
            return keys, [s.numpy() for s in shifted]
    finally:
        model.close()
