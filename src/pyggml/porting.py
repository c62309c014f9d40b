"""Layer-by-layer parity with Hugging Face transformers, for porting an architecture.

``compare(hf_dir, gguf_path, prompt)`` runs the GGUF file in pyggml and the Hugging Face checkpoint
in transformers (torch, CPU, float32) on the same token ids and measures, for every hidden state
both sides report, the relative error of pyggml's against the reference. The first state past the
tolerance is where a port goes wrong: everything before it agrees, so the bug is in that layer.

pyggml's side: the states that the model file names with ``nn.tap`` ("token_embd", "blk.N",
"output_norm", "output", ...), captured with ``nn.capture_taps`` and computed as graph outputs.
The reference side: forward hooks on the modules that ``gguf``'s Hugging Face -> GGUF tensor name
map ties to those names (``model.embed_tokens`` -> ``token_embd``, ``model.norm`` ->
``output_norm``, ``lm_head`` -> ``output``); a block ``blk.N`` is the innermost module holding every
module that maps to a ``blk.N.*`` tensor (``model.layers.N``). ``modules=`` adds or overrides a
mapping where the map has none.

Needs torch and transformers (the ``reference`` extra).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. 1, 2, 3: café!"
# Default tolerances by the file's main weight type: what rounding the weights alone costs, with
# room for a few dozen layers (measured on the tiny test models: F32 ~4e-7, F16 ~7e-4, Q8_0 ~2e-2).
TOLERANCES = {"F32": 1e-3, "F16": 1e-2, "BF16": 1e-2, "Q8_0": 5e-2, "Q6_K": 5e-2}
LOW_BIT_TOLERANCE = 0.2  # every other (4-5 bit and below) type
# The model's final logits, compared by that name when the model does not tap them as "output" (as when
# it soft-caps them after the output projection), and what llama.cpp's logits are compared with.
LOGITS = "logits"


@dataclass(frozen=True)
class LayerError:
    """One compared hidden state. ``error``: ||ours - ref|| / ||ref|| over the whole state;
    ``max_error``: max |ours - ref| / max |ref|. Shapes are (n_tokens, width)."""

    name: str
    shape: tuple[int, ...]
    reference_shape: tuple[int, ...]
    error: float
    max_error: float
    module: str  # the Hugging Face module the reference state came from


@dataclass
class Comparison:
    """The result of ``compare``: one ``LayerError`` per state both sides report, in graph order."""

    tokens: list[int]
    tolerance: float
    layers: list[LayerError]
    weight_type: str = ""  # the GGUF file's main weight type (F32, F16, Q8_0, ...)
    unmatched: list[str] = field(default_factory=list)  # pyggml taps with no reference module
    notes: list[str] = field(default_factory=list)
    llama_cpp: LayerError | None = None  # llama.cpp's logits for the same file against transformers

    def diverges(self, layer: LayerError) -> bool:
        return layer.shape != layer.reference_shape or not layer.error <= self.tolerance  # NaN diverges

    @property
    def first_divergence(self) -> LayerError | None:
        """The first state (in graph order) whose error exceeds the tolerance, or None."""
        return next((layer for layer in self.layers if self.diverges(layer)), None)

    @property
    def ok(self) -> bool:
        """Something was compared and nothing diverges (llama.cpp included, when it ran)."""
        return bool(self.layers) and self.first_divergence is None and \
            (self.llama_cpp is None or not self.diverges(self.llama_cpp))

    def error(self, name: str) -> float:
        """The relative error of the state named ``name``."""
        for layer in self.layers:
            if layer.name == name:
                return layer.error
        raise KeyError(f"no compared state named {name!r}; compared: {', '.join(x.name for x in self.layers)}")

    def table(self) -> str:
        """The per-layer report that ``pyggml compare`` prints."""
        first = self.first_divergence
        width = max([5, *(len(x.name) for x in self.layers)])
        weights = f"{self.weight_type} weights, " if self.weight_type else ""
        lines = [f"{len(self.tokens)} tokens, {weights}tolerance {_short(self.tolerance)}; "
                 "error = ||pyggml - transformers|| / ||transformers|| per state",
                 f"{'state':<{width}}  {'shape':<14} {'error':>9} {'max err':>9}  reference module"]
        for x in self.layers:
            shape = str(x.shape) if x.shape == x.reference_shape else f"{x.shape}!={x.reference_shape}"
            flag = "  <- first divergence" if x is first else ("  (over)" if self.diverges(x) else "")
            lines.append(f"{x.name:<{width}}  {shape:<14} {x.error:>9.2e} {x.max_error:>9.2e}  {x.module}{flag}")
        if self.llama_cpp is not None:
            x = self.llama_cpp
            over = "  (over)" if self.diverges(x) else ""
            lines.append(f"llama.cpp's logits from the same file: error {x.error:.2e}, max err {x.max_error:.2e} "
                         f"{x.shape}{over}")
        if self.unmatched:
            lines.append(f"not compared (no reference module found; give one with --module TAP=MODULE): "
                         f"{', '.join(self.unmatched)}")
        lines.extend(f"note: {n}" for n in self.notes)
        if not self.layers:
            lines.append("nothing compared: no tapped state has a reference module")
        elif first is None:
            lines.append(f"no state diverges beyond {_short(self.tolerance)}")
        else:
            lines.append(f"first divergence: {first.name} (error {first.error:.2e} > {_short(self.tolerance)})")
        return "\n".join(lines)

    __str__ = table

    def to_dict(self) -> dict[str, Any]:
        """The result as plain JSON-able values (``pyggml compare --json``); a non-finite error is None."""
        def layer(x: LayerError) -> dict[str, Any]:
            finite = {k: (v if math.isfinite(v) else None) for k, v in (("error", x.error), ("max_error", x.max_error))}
            return {"name": x.name, "shape": list(x.shape), "reference_shape": list(x.reference_shape), **finite,
                    "module": x.module, "diverges": self.diverges(x)}

        first = self.first_divergence
        return {"ok": self.ok, "first_divergence": first.name if first else None, "tolerance": self.tolerance,
                "weight_type": self.weight_type, "tokens": list(self.tokens),
                "layers": [layer(x) for x in self.layers], "unmatched": list(self.unmatched),
                "notes": list(self.notes), "llama_cpp": layer(self.llama_cpp) if self.llama_cpp else None}


def _short(value: float) -> str:
    """1e-03 rather than 1.00e-03, unless that would round."""
    short = f"{value:.0e}"
    return short if float(short) == value else f"{value:.2e}"


def compare(hf_dir: str | os.PathLike, gguf_path: str | os.PathLike, prompt: str = DEFAULT_PROMPT, *,
            tokens: Sequence[int] | None = None, tolerance: float | None = None, n_threads: int | None = None,
            modules: Mapping[str, str] | None = None, llama_cpp: bool = False,
            progress: Callable[[str], None] | None = None) -> Comparison:
    """Run both models on ``prompt`` (tokenized by the GGUF file's tokenizer, or the ids in
    ``tokens``) and compare every tapped hidden state. ``tolerance`` defaults by the file's main
    weight type (``TOLERANCES``). ``modules`` maps a tap name to the Hugging Face module whose
    output is its reference (``{"output_norm": "model.final_norm"}``), for names the ``gguf``
    tensor map does not know. ``llama_cpp``: also compare llama.cpp's logits for the same file and
    ids (llama-cpp-python, run in a subprocess) with transformers', for generating models. ``progress(step)``
    is told each step as it starts (a comparison takes minutes on a real model)."""
    step = progress or (lambda what: None)
    if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(tolerance, (int, float))
                                  or not tolerance > 0):
        raise ValueError(f"compare: tolerance must be a positive number, got {tolerance!r}")
    step("importing torch and transformers")
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"pyggml compare needs torch and transformers (pip install 'pyggml[reference]'): "
                          f"{exc}") from exc
    if os.path.isdir(hf_dir) and not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise ValueError(f"compare: {hf_dir} has no config.json (give a Hugging Face model directory)")
    step(f"running {os.fspath(gguf_path)} in pyggml")
    ours = _pyggml_states(gguf_path, prompt, tokens, n_threads)
    ids = ours.tokens
    notes = [] if tokens is not None else _tokenizer_notes(hf_dir, prompt, ids)
    step(f"loading {os.fspath(hf_dir)} in transformers and running it")
    refs, where = _reference_states(hf_dir, ids, ours.architecture, ours.n_blocks, ours.states, modules or {})
    layers, unmatched = [], []
    for name, state in ours.states.items():
        if name not in refs:
            unmatched.append(name)
            continue
        layers.append(_layer_error(name, state, _vocab_rows(name, state, refs[name], notes), where[name]))
    theirs = None
    if llama_cpp and LOGITS not in refs:
        notes.append("llama.cpp not compared: the reference model gives no logits (an embedding model)")
    elif llama_cpp:
        step("running the GGUF in llama.cpp")
        state = llama_cpp_logits(gguf_path, ids, n_threads)
        theirs = _layer_error(LOGITS, state, _vocab_rows(LOGITS, state, refs[LOGITS], []), where[LOGITS])
    if tolerance is None:
        tolerance = TOLERANCES.get(ours.weight_type, LOW_BIT_TOLERANCE)
    return Comparison(tokens=ids, tolerance=float(tolerance), layers=layers, weight_type=ours.weight_type,
                      unmatched=unmatched, notes=notes, llama_cpp=theirs)


def relative_error(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(||ours - ref|| / ||ref||, max |ours - ref| / max |ref|), in float64."""
    a, b = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    diff = a - b
    norm, peak = np.linalg.norm(b), np.abs(b).max(initial=0.0)
    l2 = np.linalg.norm(diff) / norm if norm else (0.0 if not diff.any() else math.inf)
    top = np.abs(diff).max(initial=0.0) / peak if peak else (0.0 if not diff.any() else math.inf)
    return float(l2), float(top)


def _layer_error(name: str, state: np.ndarray, ref: np.ndarray, module: str) -> LayerError:
    if state.shape != ref.shape:
        return LayerError(name, state.shape, ref.shape, math.inf, math.inf, module)
    error, max_error = relative_error(state, ref)
    return LayerError(name, state.shape, ref.shape, error, max_error, module)


def _vocab_rows(name: str, state: np.ndarray, ref: np.ndarray, notes: list[str]) -> np.ndarray:
    """The reference logits cut to the GGUF's vocabulary when the checkpoint pads its embedding
    matrix past the tokenizer (and the converter wrote only the real rows)."""
    if name in ("output", LOGITS) and state.ndim == ref.ndim == 2 and state.shape[0] == ref.shape[0] \
            and state.shape[1] < ref.shape[1]:
        notes.append(f"{name}: transformers has {ref.shape[1]} vocabulary columns, the GGUF {state.shape[1]}; "
                     f"compared the first {state.shape[1]}")
        return ref[:, :state.shape[1]]
    return ref


def _as_rows(array: np.ndarray, n_tokens: int) -> np.ndarray:
    """A state as (n_tokens, width) when it has one row per token, else as it is."""
    array = np.asarray(array)
    if array.ndim >= 1 and array.size and array.shape[0] == n_tokens:
        return array.reshape(n_tokens, -1)
    return array


# ---- pyggml's side ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _Ours:
    states: dict[str, np.ndarray]  # tap name -> (n_tokens, width), in graph order
    tokens: list[int]
    architecture: str
    n_blocks: int
    weight_type: str


def _pyggml_states(gguf_path: str | os.PathLike, prompt: str, tokens: Sequence[int] | None,
                   n_threads: int | None) -> _Ours:
    """The tapped states of one pass over the prompt, with what the reference side needs."""
    from pyggml import models, nn
    from pyggml.backend import BackendParams
    from pyggml.tensor import DType

    model = models.load(gguf_path, BackendParams(n_threads=n_threads))
    try:
        if tokens is None:
            if model.tokenizer is None:
                raise ValueError(f"{gguf_path}: the file has no tokenizer; pass tokens=[...]")
            ids = list(model.tokenizer.encode(prompt, add_special=True))
        else:
            ids = [int(t) for t in tokens]
        if not ids:
            raise ValueError("compare: no tokens to run (empty prompt)")
        n = len(ids)
        batch = models.Batch(inputs=ids, outputs=range(n), positions=range(n), sequences=[0] * n)
        with model.backend.new_context() as ctx:
            with nn.capture_taps() as taps:
                if model.generates:
                    if model.cache is not None:
                        model.cache.init(model.backend, DType.F32, max_sequences=1, capacity=n, max_batch=n)
                        model.cache.start_forward(ctx, batch)
                    out = model.forward(ctx, batch)
                else:
                    out = model.embed(ctx, batch, models.Pooling.NONE)
            if not taps:
                raise ValueError(f"compare: the {model.architecture} model taps no states; call nn.tap(name, "
                                 "tensor) in its forward (see docs/porting.md)")
            ctx.compute(out, *taps.values())
            states = {name: _as_rows(t.numpy(), n).copy() for name, t in taps.items()}
            if model.generates and taps.get("output") is not out:  # e.g. soft-capped after the projection
                states[LOGITS] = _as_rows(out.numpy(), n).copy()
        return _Ours(states, ids, model.architecture, model.backend.config.uint("block_count", 0) or 0,
                     _main_weight_type(model.backend))
    finally:
        model.close()


def _main_weight_type(backend: Any) -> str:
    """The type holding most elements of the file's matrices (what the tolerance depends on)."""
    counts: dict[str, int] = {}
    for t in backend.tensors().values():
        if len(t.shape) >= 2:
            counts[t.dtype.name] = counts.get(t.dtype.name, 0) + t.nelements
    return max(counts, key=counts.get) if counts else ""


# ---- llama.cpp -----------------------------------------------------------------------------------
_LLAMA_CPP = """
import json, sys
import llama_cpp
import numpy as np
path, out, tokens, threads = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
n = max(64, len(tokens))
defaults = llama_cpp.llama_cpp.llama_model_default_params
def plain_kernels():  # no extra buffer types: llama.cpp's AMX kernels die with SIGILL on some virtual Xeons
    params = defaults()
    params.use_extra_bufts = False
    return params
llama_cpp.llama_cpp.llama_model_default_params = plain_kernels
llm = llama_cpp.Llama(model_path=path, n_ctx=n, n_batch=n, n_ubatch=n, n_threads=threads, logits_all=True,
                      type_k=0, type_v=0, verbose=False)  # an F32 cache, as pyggml's side uses
llm.eval(tokens)
np.save(out, np.asarray(llm.scores[:len(tokens)], dtype=np.float32))
"""


def llama_cpp_logits(gguf_path: str | os.PathLike, tokens: Sequence[int], n_threads: int | None = None) -> np.ndarray:
    """llama.cpp's logits (n_tokens, vocab) for ``tokens`` from the GGUF file, through
    llama-cpp-python in a subprocess (llama.cpp aborts the process on some files it cannot run)."""
    import importlib.util
    import subprocess
    import sys
    import tempfile

    from pyggml.backend.hardware import physical_cores

    if importlib.util.find_spec("llama_cpp") is None:
        raise ImportError("the llama.cpp check needs llama-cpp-python (pip install 'pyggml[bench]')")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "logits.npy")
        args = [sys.executable, "-c", _LLAMA_CPP, os.fspath(gguf_path), out, json.dumps([int(t) for t in tokens]),
                str(n_threads or physical_cores())]
        done = subprocess.run(args, capture_output=True, text=True)
        if done.returncode != 0 or not os.path.exists(out):
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"llama.cpp could not run {gguf_path} (exit status {done.returncode}): "
                               + " | ".join(tail))
        return np.load(out)


# ---- the reference side ------------------------------------------------------------------------
def _tokenizer_notes(hf_dir: str | os.PathLike, prompt: str, ids: list[int]) -> list[str]:
    """A note when the Hugging Face tokenizer disagrees with the GGUF's (both models still run on
    the GGUF's ids)."""
    import transformers

    try:
        reference = list(transformers.AutoTokenizer.from_pretrained(str(hf_dir))(prompt)["input_ids"])
    except Exception as exc:  # no tokenizer files, or one transformers cannot load: not the model's fault
        return [f"the Hugging Face tokenizer could not be loaded ({type(exc).__name__}); not checked"]
    if reference == ids:
        return []
    at = len(os.path.commonprefix([ids, reference]))
    return [f"tokenizers differ from token {at}: pyggml {ids[at:at + 6]} vs transformers {reference[at:at + 6]} "
            "(both models ran on pyggml's ids)"]


def _reference_states(hf_dir: str | os.PathLike, ids: list[int], arch: str, n_blocks: int,
                      wanted: Mapping[str, Any], overrides: Mapping[str, str]
                      ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(states by tap name, module name by tap name) from one transformers forward pass."""
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    config = transformers.AutoConfig.from_pretrained(str(hf_dir))
    classes = [getattr(transformers, name, None) for name in getattr(config, "architectures", None) or ()]
    cls = next((c for c in classes if c is not None), transformers.AutoModel)
    progress = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Loading weights" bars would interleave with the table
    try:
        model = cls.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    finally:
        if progress:
            hf_logging.enable_progress_bar()
    where = {name: module for name, module in reference_modules(model, arch, n_blocks).items() if name in wanted}
    where.update({name: module for name, module in overrides.items() if name in wanted})
    named = dict(model.named_modules())
    unknown = sorted(set(where.values()) - set(named))
    if unknown:
        raise ValueError(f"compare: the Hugging Face model has no module {', '.join(map(repr, unknown))}")
    states: dict[str, np.ndarray] = {}

    def hook(name: str) -> Any:
        def record(module: Any, args: Any, output: Any) -> None:
            if isinstance(output, (tuple, list)):
                output = output[0]
            elif not isinstance(output, torch.Tensor):  # a ModelOutput
                output = output[0]
            if name not in states:  # a module run twice: its first output
                states[name] = output.detach().float().cpu().numpy()
        return record

    handles = [named[module].register_forward_hook(hook(name)) for name, module in where.items()]
    try:
        with torch.no_grad():
            result = model(input_ids=torch.tensor([ids], dtype=torch.long))
    finally:
        for handle in handles:
            handle.remove()
    if getattr(result, "logits", None) is not None:  # a language model's final logits (after any soft-cap)
        states[LOGITS], where[LOGITS] = result.logits.detach().float().cpu().numpy(), "(the model's logits)"
    n = len(ids)
    return {name: _as_rows(state[0] if state.ndim >= 3 and state.shape[0] == 1 else state, n)
            for name, state in states.items()}, where


def reference_modules(model: Any, arch: str, n_blocks: int) -> dict[str, str]:
    """Tap name -> Hugging Face module name for ``model`` (a torch module), from ``gguf``'s tensor
    name map for the GGUF architecture ``arch``: every module that maps to a GGUF tensor gives that
    tensor's name (``blk.0.attn_q_norm`` -> ``model.layers.0.self_attn.q_norm``); ``blk.N`` is the
    innermost module enclosing all that map into block N (``model.layers.N``); ``token_embd`` and
    ``output`` fall back on the model's ``get_input_embeddings`` / ``get_output_embeddings``."""
    import gguf

    archs = {name: value for value, name in gguf.MODEL_ARCH_NAMES.items()}
    tensor_map = gguf.get_tensor_name_map(archs[arch], max(n_blocks, 1)) if arch in archs else None
    found: dict[str, str] = {}
    blocks: dict[int, list[list[str]]] = {}
    for module_name, _ in model.named_modules():
        gguf_name = _gguf_name(tensor_map, module_name) if tensor_map is not None else None
        if gguf_name is None:
            continue
        found.setdefault(gguf_name, module_name)  # also inside blocks: finer taps (blk.0.attn_q_norm)
        match = re.fullmatch(r"blk\.(\d+)\..+", gguf_name)
        if match:
            blocks.setdefault(int(match[1]), []).append(module_name.split("."))
    for index, paths in sorted(blocks.items()):
        prefix = os.path.commonprefix(paths)  # element-wise: the common leading name components
        if prefix and len(paths) > 1 and prefix not in paths:
            found[f"blk.{index}"] = ".".join(prefix)
    # the embeddings and the output projection by transformers' own accessors, where the map has no
    # entry (gguf maps no output tensor for architectures whose llama.cpp files always tie it: Gemma)
    names = {id(module): name for name, module in model.named_modules()}
    for tap, accessor in (("token_embd", "get_input_embeddings"), ("output", "get_output_embeddings")):
        module = getattr(model, accessor, lambda: None)()
        if tap not in found and id(module) in names:
            found[tap] = names[id(module)]
    return found


def _gguf_name(tensor_map: Any, module_name: str) -> str | None:
    """The GGUF tensor name (without .weight) of a module, trying it without its first component
    (``bert.embeddings.LayerNorm`` as ``embeddings.LayerNorm``) when the full name is unknown."""
    parts = module_name.split(".")
    for start in range(min(2, len(parts))):
        name = tensor_map.get_name(".".join(parts[start:]))
        if name is not None:
            return name
    # transformers loads Mamba-family checkpoints' ``backbone.*`` as ``model.*`` (Nemotron-H); gguf maps the former
    return tensor_map.get_name(".".join(["backbone", *parts[1:]])) if parts[0] == "model" else None
