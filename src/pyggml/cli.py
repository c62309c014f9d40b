"""The ``pyggml`` command: run, embed, show, convert and compare models.

``pyggml run demo "Once upon a time"`` uses the built-in demo model (tiny, random weights, made
on first use): it shows the whole pipeline working on a fresh machine, not sensible text.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

DEMO = "demo"
# convert --type: pyggml.convert.tensors' OUT_TYPES and QUANTIZED_TYPES (not imported: the converter loads slowly)
CONVERT_TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m",
                 "q6_k", "iq4_nl"]


class ProgressBar:
    """A one-line progress bar on stderr, drawn only for a terminal and work worth watching."""

    def __init__(self, label: str, min_total: int = 64 << 20):
        self.label = label
        self.min_total = min_total
        self.enabled = sys.stderr.isatty()
        self._last = 0.0

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total < self.min_total:
            return
        now = time.monotonic()
        if done < total and now - self._last < 0.1:
            return
        self._last = now
        width = 30
        filled = int(width * done / total) if total else width
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] "
                         f"{done / 2**20:,.0f}/{total / 2**20:,.0f} MiB")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _resolve(name: str) -> Any:
    """The ``pyggml.store.ModelRef`` a model argument names (a file, 'demo', or a stored model)."""
    from pyggml.store import ModelNotFoundError, resolve

    if name == DEMO and not Path(name).exists():
        from pyggml.tiny import TINY_VERSION, cache_dir

        if not (cache_dir() / f"pyggml-tiny-random-v{TINY_VERSION}.gguf").exists():
            print(f"pyggml: building the demo model in {cache_dir()} (first use, about a second)...",
                  file=sys.stderr, flush=True)
    try:
        return resolve(name)
    except ModelNotFoundError as exc:
        raise SystemExit(f"pyggml: {exc}") from None


def _model_path(name: str) -> Path:
    return _resolve(name).path


def _load(args: argparse.Namespace, ref: str | None = None, num_ctx: int | None = None) -> Any:
    from pyggml.llm import LLM
    from pyggml.store import check_has_weights

    if num_ctx is not None:  # the REPL's /set parameter num_ctx, or a stored model's num_ctx
        args = argparse.Namespace(**{**vars(args), "ctx": num_ctx})
    ref = args.model if ref is None else ref
    path = _resolve(ref).path
    if ref == DEMO:
        print("pyggml: using the built-in demo model (random weights: the text will be gibberish)",
              file=sys.stderr)
    check_has_weights(path)
    config = _engine_config(args, path, _mmproj(args, ref))
    llm = LLM.open(config, progress=ProgressBar("loading"))
    if config.backend.rpc:
        _print_placement(llm.model.backend, sys.stderr)
    trained = llm.model.context_length
    if args.ctx and trained and args.ctx > trained:
        print(f"pyggml: warning: --ctx {args.ctx} is above the {trained} tokens the model was trained on; "
              "text past that point is likely to degrade", file=sys.stderr)
    return llm


def _engine_config(args: argparse.Namespace, path: Path | None, mmproj: Any = None) -> Any:
    """The ``EngineConfig`` of a command's flags (run, embed and serve each have some of them; the
    others keep the defaults)."""
    from pyggml.runner.config import EngineConfig

    draft = getattr(args, "draft", None)
    flags = {"num_ctx": args.ctx, "n_threads": args.threads, "parallel": getattr(args, "parallel", None),
             "batch_size": getattr(args, "batch_size", None), "poll": getattr(args, "poll", None),
             "draft": _model_path(draft) if draft is not None else None,
             "draft_max": getattr(args, "draft_max", None), "mmproj": mmproj,
             **_device_options(args), **_rpc_options(args)}
    if getattr(args, "fixed_threads", False):
        flags["adapt_threads"] = False
    return EngineConfig.from_options(path, **{k: v for k, v in flags.items() if v is not None})


def _mmproj(args: argparse.Namespace, ref: str) -> Any:
    """--mmproj, else an Ollama model's projector layer when --image asks for the vision part."""
    if getattr(args, "mmproj", None):
        return args.mmproj
    if getattr(args, "image", None):
        return _resolve(ref).projector
    return None


def _rpc_options(args: argparse.Namespace) -> dict[str, Any]:
    """BackendParams fields from --rpc and --tensor-split."""
    rpc = getattr(args, "rpc", None)
    split = getattr(args, "tensor_split", None)
    if split and not rpc:
        raise ValueError("--tensor-split splits layers over the local CPU and --rpc servers: give --rpc too")
    return {"rpc": rpc, "tensor_split": split} if rpc else {}


def _print_placement(backend: Any, out: Any) -> None:
    from pyggml.bench import layer_ranges

    for device, layers in backend.placement().items():
        print(f"pyggml: layers {layer_ranges(layers)} on {device}", file=out)


def add_rpc_arguments(parser: argparse.ArgumentParser) -> None:
    """--rpc and --tensor-split, shared by run, serve, bench and show."""
    parser.add_argument("--rpc", metavar="HOST:PORT,...", default=None,
                        help="also compute layers on these `pyggml rpc-server`s (trusted network only)")
    parser.add_argument("--tensor-split", metavar="W,W,...", default=None,
                        help="share of the layers for the local CPU and each remote device, in that order "
                             "(default: in proportion to free memory)")


# ---- run: options, one-shot generation; the interactive chat is pyggml/repl.py ------------------

def _device_options(args: argparse.Namespace) -> dict[str, Any]:
    """``pyggml.load`` options from run's device flags (absent on the other commands)."""
    out: dict[str, Any] = {}
    gpu_layers = getattr(args, "gpu_layers", None)
    if gpu_layers is not None:
        out["gpu_layers"] = "all" if gpu_layers == "all" else int(gpu_layers)
    flash = getattr(args, "flash_attn", None)
    if flash is not None:
        out["flash_attention"] = {"on": True, "off": False}.get(flash)
    if getattr(args, "cache_type", None):
        out["cache_type"] = args.cache_type
    return out


def _sampling_options(args: argparse.Namespace, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """``LLM.generate``/``LLM.chat`` keyword arguments: ``defaults`` (an Ollama params layer), then
    run's sampling flags, prompt lookup and structured output (--format, --grammar, --regex)."""
    from pyggml.repl import params_to_options

    out: dict[str, Any] = {"max_tokens": 128, "temperature": 0.8, "seed": None}
    out.update(params_to_options(defaults or {}))
    for key in ("max_tokens", "temperature", "seed", "top_k", "top_p", "min_p", "repeat_penalty"):
        if getattr(args, key) is not None:
            out[key] = getattr(args, key)
    if args.stop:
        out["stop"] = list(args.stop)
    if args.logit_bias:
        out["logit_bias"] = dict(args.logit_bias)
    if args.lookup:
        out["prompt_lookup"] = args.lookup
    out.update(_structured(args))
    return out


def _logit_bias(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS (e.g. 2=-inf to ban token 2), got {text!r}") from None


def _has_template(llm: Any) -> bool:
    return bool(llm.model.config.get("tokenizer.chat_template"))


def cmd_run(args: argparse.Namespace) -> int:
    from pyggml.repl import Session, parse_duration

    ref = _resolve(args.model)
    options = _sampling_options(args, ref.params)
    args.system = args.system if args.system is not None else ref.system
    stored_ctx = ref.params.get("num_ctx")
    if args.ctx is None and isinstance(stored_ctx, int) and stored_ctx > 1:  # a stored model's PARAMETER num_ctx
        args.ctx = stored_ctx
    keep_alive = parse_duration(args.keep_alive) if args.keep_alive is not None else None
    prompt = args.prompt
    if prompt is None and not sys.stdin.isatty():
        prompt = sys.stdin.read()
    if prompt is None:
        session = Session(load=lambda ref, num_ctx=None: _load(args, ref, num_ctx), model_ref=args.model,
                          options=options, system=args.system, raw=args.raw, verbose=args.verbose,
                          keep_alive=keep_alive, images=[Path(p) for p in args.image], think=args.think,
                          hide_thinking=args.hidethinking, lookup=_resolve,
                          defaults=lambda params: _sampling_options(args, params), ref=ref,
                          messages=[dict(m) for m in ref.messages])
        return session.run()
    args.stored_messages = [dict(m) for m in ref.messages]  # a stored model's MESSAGE turns come first
    llm = _load(args)
    try:
        _once(llm, prompt, options, args)
    finally:
        llm.close()
    return 0


def _once(llm: Any, prompt: str, options: dict, args: argparse.Namespace) -> None:
    from pyggml.chat import ChatTemplate, encode_prompt
    from pyggml.repl import image_content, print_stats, shown
    from pyggml.thinking import splitter_for, template_thinks, template_variables

    start = time.perf_counter()
    images = [Path(p) for p in args.image]  # read (and checked) by generate
    if _has_template(llm) and not args.raw:
        user = {"role": "user", "content": image_content(prompt, images) if images else prompt}
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
            getattr(args, "stored_messages", []) + [user]
        template = ChatTemplate.from_model(llm.model)
        if template_thinks(template.source) and not images:  # the thinking is shown apart
            variables = template_variables(template.source, args.think)
            text = template.render(messages, add_generation_prompt=True, **variables)
            pieces = llm.generate(encode_prompt(llm.tokenizer, text), stream=True, **options)
            pieces = shown(pieces, splitter_for(template.source, text),
                           show_thinking=args.think is not False and not args.hidethinking)
        else:
            if args.think:
                raise ValueError("--think: the model does not think (its chat template has no <think> block or "
                                 "harmony channels)")
            pieces = llm.chat(messages, stream=True, **options)
    else:
        text = f"{args.system}\n\n{prompt}" if args.system else prompt
        pieces = llm.generate(text, stream=True, images=images, **options)
    stopped = _write_until_interrupted(pieces)
    sys.stdout.write("\n")
    if stopped:
        raise KeyboardInterrupt
    if args.verbose:
        print_stats(llm.stats, time.perf_counter() - start, sys.stderr)
        if llm.model.backend.cpu_fallback:
            print(f"note: {llm.model.backend.cpu_fallback}", file=sys.stderr)


def _structured(args: argparse.Namespace) -> dict:
    """``--format json`` / ``--format SCHEMA.json`` / ``--grammar FILE`` (Lark or GBNF) / ``--regex RE``."""
    import json

    from pyggml.constrain import Grammar

    out: dict = {}
    if args.format:
        if args.format == "json":
            out["format"] = "json"
        else:
            try:
                out["format"] = json.loads(_read_flag_file("--format", args.format))
            except json.JSONDecodeError as exc:
                raise ValueError(f"--format {args.format}: not a JSON schema ({exc}); --format takes json or "
                                 "a file holding a JSON schema") from None
    if args.grammar:
        out["grammar"] = _read_flag_file("--grammar", args.grammar)
    if args.regex:
        if "grammar" in out:
            raise ValueError("give --grammar or --regex, not both")
        out["grammar"] = Grammar.regex(args.regex)
    return out


def _read_flag_file(flag: str, path: str) -> str:
    """The text of the file a flag names; ValueError naming the flag when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"{flag} {path}: cannot read it ({reason})") from None


def cmd_embed(args: argparse.Namespace) -> int:
    """One JSON array per text on stdout (texts from the arguments, else one per line of stdin)."""
    import json

    texts = args.texts or [line for line in sys.stdin.read().splitlines() if line.strip()]
    if not texts:
        raise SystemExit("pyggml embed: no texts (give them as arguments or on stdin, one per line)")
    llm = _load(args)
    try:
        pooling = getattr(llm.model, "pooling", None)
        if args.pooling is None and pooling is not None and pooling.name in ("NONE", "RANK"):
            raise SystemExit(f"pyggml embed: the model's pooling is {pooling.name.lower()}, which gives no single "
                             "vector per text; choose one with --pooling mean, cls or last")
        vectors = llm.embed(texts, normalize=not args.no_normalize, truncate=args.truncate, pooling=args.pooling)
    finally:
        llm.close()
    for vector in vectors:
        print(json.dumps([round(float(x), 7) for x in vector]))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from pyggml.backend import Backend, BackendParams
    from pyggml.store import human_count

    parts = [part for part in ("modelfile", "parameters", "system", "template", "license") if getattr(args, part)]
    if parts:  # `ollama show --modelfile` and the like: the stored model's parts, nothing loaded
        from pyggml.cli_models import show_parts

        return show_parts(_resolve(args.model), args.model, parts)
    backend = Backend.load(_model_path(args.model), BackendParams(repack=False, **_rpc_options(args)))
    try:
        c = backend.config
        tensors = backend.tensors()
        n_params = sum(t.nelements for t in tensors.values())
        types: dict[str, int] = {}
        for t in tensors.values():
            types[t.dtype.name] = types.get(t.dtype.name, 0) + t.nelements
        main_type = max(types, key=types.get) if types else "-"
        rows = [
            ("architecture", c.architecture or "-"),
            ("name", c.string("general.name", "") or "-"),
            ("parameters", f"{n_params:,} ({human_count(n_params)})" if n_params else "none (vocabulary only)"),
            ("quantization", f"{main_type} (" + ", ".join(f"{k} {v / max(n_params, 1):.0%}" for k, v in
                                                          sorted(types.items(), key=lambda kv: -kv[1])) + ")"),
            ("context length", c.uint("context_length", 0) or "-"),
            ("embedding length", c.uint("embedding_length", 0) or "-"),
            ("layers", c.uint("block_count", 0) or "-"),
            ("heads / kv heads", f"{c.uint('attention.head_count', 0)} / {c.uint('attention.head_count_kv', 0)}"),
            *([("vision", f"{c.string('clip.projector_type', '') or c.architecture} projector, "
                          f"{c.uint('clip.vision.block_count', 0) or c.uint('vision.block_count', 0)} layers, "
                          f"{c.uint('clip.vision.embedding_length', 0) or c.uint('vision.embedding_length', 0)}"
                          f" wide, {c.uint('clip.vision.image_size', 0) or c.uint('vision.image_size', 0)} px images "
                          f"in {c.uint('clip.vision.patch_size', 0) or c.uint('vision.patch_size', 0)} px patches")]
              if "v.patch_embd.weight" in tensors else []),
            ("tokenizer", f"{c.string('tokenizer.ggml.model', '') or '-'} "
                          f"({len(c.get('tokenizer.ggml.tokens', ()))} tokens)"),
            ("file", f"{backend.path} ({os.path.getsize(backend.path) / 2**20:,.1f} MiB)"),
        ]
        for key, value in rows:
            print(f"{key:>18}  {value}")
        if args.rpc:
            from pyggml.bench import layer_ranges

            for device, layers in backend.placement().items():
                print(f"{'layers ' + layer_ranges(layers):>18}  {device}")
        if args.verbose:
            print("\nmetadata:")
            for key, value in c.items():
                text = repr(value)
                print(f"  {key} = {text if len(text) < 100 else text[:97] + '...'}")
        print(f"\n{'tensor':<40} {'shape':<24} {'type':<8} {'MiB':>9}")
        for name, t in tensors.items():
            print(f"{name:<40} {str(t.shape):<24} {t.dtype.name:<8} {t.nbytes / 2**20:>9.2f}")
    finally:
        backend.close()
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from pyggml.convert import convert_hf

    bar = ProgressBar("converting", min_total=0)  # called with bytes written
    out = convert_hf(args.hf_dir, args.out, out_type=args.type, progress=bar, pooling=args.pooling)
    if args.mmproj:  # llama.cpp's layout: the text model in OUT, the vision part in the mmproj file
        from pyggml.convert.gemma3_vision import split_mmproj

        single = out.with_name(out.name + ".single")
        os.replace(out, single)
        try:
            split_mmproj(single, out, args.mmproj)
        finally:
            single.unlink()
        print(f"wrote {out} and {args.mmproj}")
        return 0
    print(f"wrote {out}")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from collections import Counter

    from pyggml.quantize import parse_file_type, quantize_gguf

    file_type = parse_file_type(args.type)  # before reading the input: a typo costs nothing
    source = _resolve(args.model).path
    types = quantize_gguf(source, args.out, file_type, progress=ProgressBar("quantizing", min_total=0),
                          n_threads=args.threads)
    counts = ", ".join(f"{n} {name}" for name, n in Counter(t.name for t in types.values()).most_common())
    size = os.path.getsize(args.out)
    print(f"wrote {args.out} ({file_type}, {size / 2**20:,.1f} MiB; tensors: {counts})")
    return 0


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("no token ids given")
    return ids


def _tap_module(text: str) -> tuple[str, str]:
    tap, sep, module = text.partition("=")
    if not sep or not tap or not module:
        raise argparse.ArgumentTypeError(f"expected TAP=MODULE (e.g. output_norm=model.norm), got {text!r}")
    return tap, module


def cmd_compare(args: argparse.Namespace) -> int:
    """Print the per-layer table; exit status 1 when a layer diverges beyond the tolerance."""
    from pyggml import porting

    if args.prompt is not None and args.tokens is not None:
        raise SystemExit("pyggml compare: give --prompt or --tokens, not both")
    options = {"prompt": args.prompt, "tokens": args.tokens, "tolerance": args.tolerance, "n_threads": args.threads,
               "llama_cpp": args.llama_cpp, "modules": dict(args.module) or None}
    start = time.perf_counter()

    def progress(step: str) -> None:  # a comparison runs for minutes: say what it is doing
        print(f"pyggml compare: [{time.perf_counter() - start:5.1f} s] {step}...", file=sys.stderr, flush=True)

    try:
        result = porting.compare(args.hf_dir, _model_path(args.gguf), progress=progress,
                                 **{k: v for k, v in options.items() if v is not None})
    except (ImportError, RuntimeError) as exc:  # torch/transformers/llama-cpp-python absent; llama.cpp failed
        raise SystemExit(f"pyggml: {exc}") from exc
    if args.json:
        import json

        print(json.dumps(result.to_dict()))
    else:
        print(result.table())
    return 0 if result.ok else 1


def _add_run_parser(sub: Any) -> None:
    run = sub.add_parser("run", help="chat with a model (one reply when a prompt is given; plain completion for a "
                                     "model without a chat template, or with --raw)")
    run.add_argument("model", help=f"GGUF file or model name (see `pyggml list`), or '{DEMO}' for the demo model")
    run.add_argument("prompt", nargs="?", help="prompt (default: stdin, or an interactive chat on a terminal)")
    run.add_argument("--threads", type=_positive("--threads"), default=None,
                     help="CPU threads (default: physical cores)")
    run.add_argument("--ctx", type=_positive("--ctx", 2), default=None,
                     help="context length (default: $OLLAMA_CONTEXT_LENGTH, else min(4096, trained))")
    run.add_argument("--temperature", type=_temperature, default=None, help="0 for greedy decoding (default: 0.8)")
    run.add_argument("--max-tokens", type=_positive("--max-tokens", 0), default=None,
                     help="most tokens per reply (default: 128)")
    run.add_argument("--top-k", type=int, default=None, help="keep the K most likely tokens (0: off; default 40)")
    run.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold (1: off; default 0.9)")
    run.add_argument("--min-p", type=float, default=None, help="drop tokens below MIN_P x the best (default 0)")
    run.add_argument("--repeat-penalty", type=float, default=None, help="penalise repeated tokens (1: off)")
    run.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop before TEXT (repeatable)")
    run.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS", type=_logit_bias,
                     help="add BIAS to token ID's logit (-inf bans it; repeatable)")
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--system", default=None, help="system message")
    run.add_argument("--raw", action="store_true", help="plain completion: no chat template, no history")
    run.add_argument("--think", nargs="?", const=True, type=_think, default=None, metavar="true|false|LEVEL",
                     help="ask a model that thinks to think, or not (gpt-oss: low, medium, high); its thinking is "
                          "shown apart (write --think=high before a prompt)")
    run.add_argument("--hidethinking", action="store_true", help="think, but do not show the thinking")
    run.add_argument("--keep-alive", default=None, metavar="DURATION",
                     help="unload the model after this long idle at the prompt (e.g. 5m, 30s; default: "
                          "$OLLAMA_KEEP_ALIVE, else never)")
    run.add_argument("--gpu-layers", type=_gpu_layers, default=None, metavar="N|all",
                     help="layers placed on the GPU (default: 0)")
    run.add_argument("--flash-attn", choices=["on", "off", "auto"], default=None,
                     help="ggml's fused flash attention (default auto: on GPUs only)")
    run.add_argument("--cache-type", choices=["f32", "f16", "q8_0", "q4_0"], default=None,
                     help="KV cache type (default: f16)")
    run.add_argument("--format", default=None, metavar="json|SCHEMA.json",
                     help="constrain the output to JSON, or to a JSON schema read from a file")
    run.add_argument("--grammar", default=None, metavar="FILE", help="constrain the output to a Lark or GBNF grammar")
    run.add_argument("--regex", default=None, help="constrain the output to a regular expression")
    run.add_argument("--draft", default=None, metavar="MODEL",
                     help="speculative decoding: a smaller model with the same vocabulary drafts tokens")
    run.add_argument("--draft-max", type=_positive("--draft-max"), default=None,
                     help="most tokens drafted per step (default: 8)")
    run.add_argument("--lookup", type=_non_negative("--lookup"), default=0, metavar="N",
                     help="speculative decoding by prompt lookup: draft up to N tokens from n-gram matches")
    run.add_argument("--image", action="append", default=[], metavar="PATH",
                     help="an image for a vision model (repeat for several; [img-N] in the prompt places image N)")
    run.add_argument("--mmproj", default=None, metavar="PATH", help="llama.cpp mmproj file: the vision part")
    add_rpc_arguments(run)
    run.add_argument("--verbose", action="store_true", help="print timings after each reply (as ollama run does)")
    run.set_defaults(func=cmd_run)


def _write_until_interrupted(pieces: Any) -> bool:
    """Stream ``pieces`` to stdout; Ctrl-C stops between two pieces (never inside an engine step).
    Returns whether it was interrupted."""
    import signal
    import threading

    stop = []
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.append(True)) if main_thread else None
    try:
        for piece in pieces:
            if stop:
                break
            sys.stdout.write(piece)
            sys.stdout.flush()
    finally:
        pieces.close()
        if main_thread:
            signal.signal(signal.SIGINT, previous)
    return bool(stop)


def cmd_list(args: argparse.Namespace) -> int:
    """Every model found on this machine: pyggml's directory, Ollama's store, the Hugging Face cache."""
    from pyggml.store import file_facts, hf_cache_dir, human_bytes, list_models, models_dir, ollama_dir

    found = list_models()
    if args.json:
        import json

        for m in found:
            arch, quant = file_facts(m.path)
            print(json.dumps({"name": m.name, "path": str(m.path), "size": m.size, "architecture": arch,
                              "quantization": quant, "source": m.source}))
        return 0
    if not found:
        print(f"no models found in {models_dir()}, {ollama_dir()} or {hf_cache_dir()}", file=sys.stderr)
        return 0
    rows = [(m.name, human_bytes(m.size), *file_facts(m.path), m.source, str(m.path)) for m in found]
    head = ("NAME", "SIZE", "ARCH", "QUANT", "SOURCE", "PATH")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(5)]
    for row in [head, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:5], widths, strict=True)) + "  " + row[5])
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pyggml", description="Run GGUF language models with ggml from Python.")
    sub = parser.add_subparsers(dest="command", required=True)

    _add_run_parser(sub)

    listing = sub.add_parser("list", help="models found on this machine (pyggml's model directory, Ollama's store, "
                                          "the Hugging Face cache), usable by name")
    listing.add_argument("--json", action="store_true", help="one JSON object per model")
    listing.set_defaults(func=cmd_list)

    embed = sub.add_parser("embed", help="embed texts with an embedding model (BERT); one JSON array per text")
    embed.add_argument("model", help="GGUF file of an embedding model")
    embed.add_argument("texts", nargs="*", help="texts to embed (default: one per line of stdin)")
    embed.add_argument("--threads", type=_positive("--threads"), default=None,
                       help="CPU threads (default: physical cores)")
    embed.add_argument("--ctx", type=_positive("--ctx", 2), default=None,
                       help="most tokens per text (default: the model's)")
    embed.add_argument("--pooling", choices=["mean", "cls", "last"], default=None,
                       help="override the model's pooling")
    embed.add_argument("--truncate", action="store_true", help="cut texts longer than the context")
    embed.add_argument("--no-normalize", action="store_true", help="do not L2-normalise the vectors")
    embed.set_defaults(func=cmd_embed)

    show = sub.add_parser("show", help="architecture, parameters, quantization and tensor table")
    show.add_argument("model")
    show.add_argument("--verbose", action="store_true", help="also print all metadata")
    for part in ("modelfile", "parameters", "system", "template", "license"):
        show.add_argument(f"--{part}", action="store_true", help=f"only the model's {part} (as ollama show)")
    add_rpc_arguments(show)
    show.set_defaults(func=cmd_show)

    convert = sub.add_parser("convert", help="convert a Hugging Face model directory (Llama, Mistral, BERT, ...) "
                                             "to GGUF; an unsupported one lists the supported architectures")
    convert.add_argument("hf_dir")
    convert.add_argument("out")
    convert.add_argument("--type", choices=CONVERT_TYPES,
                         default="f16", help="type of the weight matrices (norms and vectors stay f32; the "
                                             "k-quant mixes as `pyggml quantize` makes them; default: f16)")
    convert.add_argument("--pooling", choices=["mean", "cls", "last", "none", "rank"], default=None,
                         help="BERT: how embeddings are pooled (default: the sentence-transformers config, else mean); "
                              "rank: a Qwen3 checkpoint is Qwen3-Reranker")
    convert.add_argument("--mmproj", default=None, metavar="PATH",
                         help="vision models: write the vision part to this llama.cpp mmproj file (default: in OUT)")
    convert.set_defaults(func=cmd_convert)

    quant = sub.add_parser("quantize", help="re-encode a GGUF's weight matrices (like llama-quantize): "
                                            "Q4_0, Q4_K_M, Q5_K_M, Q6_K, Q8_0, IQ4_NL, ...")
    quant.add_argument("model", help="input GGUF (a file or a stored model's name)")
    quant.add_argument("out", help="output GGUF file")
    quant.add_argument("type", metavar="TYPE", help="Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K_S, Q4_K_M, Q5_K_S, Q5_K_M, "
                                                   "Q6_K, IQ4_NL, F16, BF16 or F32 (case does not matter)")
    quant.add_argument("--threads", type=_positive("--threads"), default=None,
                       help="quantizing threads (default: all CPUs)")
    quant.set_defaults(func=cmd_quantize)

    compare = sub.add_parser("compare", help="per-layer error of a GGUF against its Hugging Face checkpoint "
                                             "(needs torch and transformers)")
    compare.add_argument("hf_dir", help="Hugging Face model directory (config.json + weights)")
    compare.add_argument("gguf", help="the GGUF file converted from it")
    compare.add_argument("--prompt", default=None, help="text to run (tokenized by the GGUF's tokenizer)")
    compare.add_argument("--tokens", default=None, type=_token_ids, metavar="ID,ID,...",
                         help="token ids to run instead of a prompt (e.g. 1,17,42)")
    compare.add_argument("--tolerance", type=float, default=None,
                         help="relative error beyond which a state diverges (default by the weight type: 1e-3 "
                              "for F32, 1e-2 for F16/BF16, 5e-2 for Q8_0/Q6_K, 0.2 below)")
    compare.add_argument("--threads", type=_positive("--threads"), default=None,
                         help="CPU threads (default: physical cores)")
    compare.add_argument("--llama-cpp", action="store_true",
                         help="also compare llama.cpp's logits for the file (needs llama-cpp-python)")
    compare.add_argument("--json", action="store_true", help="print the result as one JSON object instead of a table")
    compare.add_argument("--module", action="append", default=[], metavar="TAP=MODULE", type=_tap_module,
                         help="the Hugging Face module whose output is a tap's reference, where gguf's tensor map "
                              "has none (e.g. output_norm=model.final_layernorm; repeatable)")
    compare.set_defaults(func=cmd_compare)

    # ---- bench, make-model: defined in pyggml/bench.py (imports only the standard library at load) ----
    from pyggml.bench import add_parsers as add_bench_parsers

    add_bench_parsers(sub)
    # ---- end bench ----
    from pyggml.cli_models import add_parsers as add_model_parsers  # create, cp, rm, ps, stop, pull, push

    add_model_parsers(sub)
    serve = sub.add_parser("serve", help="serve models over HTTP: Ollama's API (/api) and OpenAI's (/v1)")
    serve.add_argument("model", nargs="?", default=None,
                       help=f"GGUF file or model name, or '{DEMO}'; none: every model `pyggml list` finds, "
                            "loaded on demand by the requests' model names")
    serve.add_argument("--host", default=None,
                       help="address to listen on, or HOST:PORT (default: $PYGGML_HOST, else $OLLAMA_HOST, else "
                            "127.0.0.1: this machine only)")
    serve.add_argument("--port", type=_port, default=None, help="default: 11434, Ollama's")
    serve.add_argument("--mmproj", default=None, metavar="PATH", help="llama.cpp mmproj file: the vision part")
    serve.add_argument("--parallel", type=_positive("--parallel"), default=None,
                       help="sequences generated at once per model (default: $OLLAMA_NUM_PARALLEL, else 4)")
    serve.add_argument("--queue", type=_non_negative("--queue"), default=None,
                       help="requests that may wait for a free sequence (default: 512, as Ollama); more get 503")
    serve.add_argument("--ctx", type=_positive("--ctx", 2), default=None,
                       help="context per sequence (default: $OLLAMA_CONTEXT_LENGTH, else min(4096, trained))")
    serve.add_argument("--threads", type=_positive("--threads"), default=None,
                       help="CPU threads (default: physical cores); while other processes keep cores busy, a "
                            "thread fewer per busy core is used (see --fixed-threads and docs/server.md)")
    serve.add_argument("--fixed-threads", action="store_true",
                       help="always compute with all --threads threads, even while other processes keep cores busy")
    serve.add_argument("--poll", type=_positive("--poll", 0, 100), default=None,
                       help="how long idle CPU workers spin for the next step before sleeping, 0-100 (default 1, "
                            "~2 ms; 0: at once, kindest to other busy processes; 50: ggml's default; see "
                            "docs/server.md)")
    serve.add_argument("--batch-size", type=_positive("--batch-size"), default=512,
                       help="most tokens per forward pass (default: 512)")
    serve.add_argument("--flash-attn", choices=["on", "off", "auto"], default="auto",
                       help="ggml's fused flash attention (default auto: on GPUs only)")
    serve.add_argument("--max-predict", type=_positive("--max-predict"), default=None,
                       help="most tokens one request may generate (default: 10 x the context, as Ollama)")
    serve.add_argument("--queue-timeout", type=_seconds("--queue-timeout"), default=60.0,
                       help="seconds a request may wait for a free sequence before a 503 (default: 60)")
    serve.add_argument("--max-loaded", type=_positive("--max-loaded"), default=None,
                       help="without a model argument: most models loaded at once (default: "
                            "$OLLAMA_MAX_LOADED_MODELS, else 1 on CPU, 3 with a GPU)")
    serve.add_argument("--keep-alive", default=None, metavar="DURATION",
                       help="unload a model idle this long (default: $OLLAMA_KEEP_ALIVE, else 5m; a named model: "
                            "never; 0: at once, -1: never); a request's keep_alive overrides it (a model unloaded "
                            "loads again on the next request)")
    serve.add_argument("--allowed-hosts", default=None,
                       help="comma-separated Host names to answer besides local ones ('*': any; default: "
                            "$PYGGML_ALLOWED_HOSTS; a server bound to a non-loopback address answers any)")
    serve.add_argument("--origins", default=None,
                       help="comma-separated extra browser Origins allowed, '*' wildcards as OLLAMA_ORIGINS "
                            "(default: $PYGGML_ORIGINS, else $OLLAMA_ORIGINS; local origins are always allowed)")
    add_rpc_arguments(serve)
    serve.add_argument("--draft", default=None, metavar="GGUF",
                       help="speculative decoding: a smaller model with the same vocabulary drafts tokens")
    serve.add_argument("--draft-max", type=_positive("--draft-max"), default=8,
                       help="most tokens drafted per step (default: 8)")
    serve.set_defaults(func=cmd_serve)

    rpc = sub.add_parser("rpc-server", help="lend this machine's devices to other pyggml/llama.cpp clients (ggml RPC)",
                         description="Run ggml's RPC server in the foreground until SIGINT/SIGTERM, behind a guard "
                                     "that checks every message first and gives each client its own worker process. "
                                     "The protocol has no authentication or encryption: whoever can connect can use "
                                     "this machine's memory and compute. Listens on 127.0.0.1 unless --allow-remote.")
    rpc.add_argument("--host", default="127.0.0.1", help="IPv4 address to listen on (default: 127.0.0.1)")
    rpc.add_argument("--port", type=int, default=50052, help="default: 50052")
    rpc.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    rpc.add_argument("--cache", metavar="DIR", default=None,
                     help="keep large tensors sent by clients here, so a reload of the same model skips sending them")
    rpc.add_argument("--allow-remote", action="store_true",
                     help="allow listening on a non-loopback address (trusted private networks only)")
    rpc.add_argument("--max-memory", metavar="SIZE", type=_memory_size, default=None,
                     help="device buffers all clients together may allocate, e.g. 8G or 512M (default: the "
                          "devices' total memory); a larger allocation fails on the client")
    rpc.add_argument("--max-clients", type=_positive("--max-clients", 1, 256), default=8,
                     help="clients served at once, each by its own worker process (default: 8)")
    rpc.add_argument("--idle-timeout", metavar="SECONDS", type=float, default=0.0,
                     help="close a connection idle this long between commands (default: 0, never: an idle client "
                          "holds only its own worker)")
    rpc.set_defaults(func=cmd_rpc_server)
    return parser


def cmd_rpc_server(args: argparse.Namespace) -> int:
    import signal
    import socket
    import threading

    from pyggml import rpc

    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port must be 1..65535, got {args.port}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    try:
        address = socket.gethostbyname(args.host)  # ggml binds IPv4 literals only
    except OSError as exc:
        raise ValueError(f"cannot resolve --host {args.host!r}: {exc}") from None
    if not rpc.is_loopback(address):
        if not args.allow_remote:
            print(f"pyggml rpc-server: refusing to listen on {args.host} ({address}): the RPC protocol has no "
                  "authentication, so anyone who can reach the port can use this machine's memory and CPU and send "
                  "it data to process. Use it only on a trusted private network, and pass --allow-remote to say so.",
                  file=sys.stderr)
            return 2
        print(f"pyggml rpc-server: WARNING: listening on {address}:{args.port} without authentication or encryption; "
              "anyone who can reach this port can allocate memory here, read and write what clients sent, and run "
              "computations. Firewall it to trusted hosts.", file=sys.stderr)
    cache = None
    if args.cache:
        cache = Path(args.cache).expanduser()
        cache.mkdir(parents=True, exist_ok=True)
    from pyggml.backend.hardware import devices, lib, physical_cores, rpc_version
    from pyggml.rpc_server import Guard, Limits

    if not lib.PYGGML_HAS_RPC:
        raise rpc.RPCError("this pyggml was built without ggml's RPC backend (CMake option PYGGML_RPC=OFF)")
    if args.idle_timeout < 0:
        raise ValueError(f"--idle-timeout must be >= 0 seconds, got {args.idle_timeout}")
    threads = args.threads or physical_cores()
    local = [d for d in devices() if d.kind != "rpc"]
    max_memory = args.max_memory or sum(d.memory_total for d in local) or 1 << 30
    limits = Limits(max_memory=max_memory, max_clients=args.max_clients, idle_timeout=args.idle_timeout or None)
    # clients connect to the guard, which checks every message before a ggml worker sees it (pyggml.rpc_server)
    guard = Guard(address, args.port, limits, threads, str(cache) if cache else None, rpc_version())
    try:
        guard.listen()
    except OSError as exc:
        raise OSError(f"cannot listen on {address}:{args.port}: {exc.strerror or exc}") from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server = threading.Thread(target=guard.serve_forever, name="rpc guard", daemon=True)
    server.start()
    endpoint = f"{address}:{args.port}"
    print(f"pyggml rpc-server: listening on {endpoint} (RPC protocol {'.'.join(map(str, rpc_version()))}, "
          f"{threads} threads, at most {max_memory / 2**30:.2f} GiB and {args.max_clients} clients"
          f"{f', cache {cache}' if cache else ''}); Ctrl-C stops", file=sys.stderr, flush=True)
    for d in local:
        print(f"  {d.name}: {d.description} ({d.memory_total / 2**20:.0f} MiB)", file=sys.stderr, flush=True)
    while not stop.is_set() and server.is_alive():
        stop.wait(0.5)
    guard.stop()
    if not server.is_alive():
        print("pyggml rpc-server: the server stopped (see the messages above)", file=sys.stderr, flush=True)
        return 1
    # leaving the process closes every socket: connected clients see the connection drop (a pyggml client
    # raises RPCError)
    print("pyggml rpc-server: stopped", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(0)


def cmd_serve(args: argparse.Namespace) -> int:
    try:  # the HTTP stack loads only for this command
        from pyggml.server import serve
        from pyggml.server.guard import split_list
    except ImportError as exc:
        raise SystemExit(f"pyggml serve needs the server extra: pip install \"pyggml[server]\" ({exc})") from exc
    from pyggml.repl import parse_duration
    from pyggml.server.app import ServerConfig
    from pyggml.server.models import DEFAULT_KEEP_ALIVE

    try:
        keep_alive = DEFAULT_KEEP_ALIVE if args.keep_alive is None else parse_duration(args.keep_alive)
    except ValueError as exc:
        raise SystemExit(f"pyggml serve: --keep-alive: {exc}") from None
    try:  # a value from the environment was checked already: a bad one here is the flag's
        host, port = _listen_address(args.host, args.port)
    except ValueError as exc:
        raise SystemExit(f"pyggml serve: --host: {exc}") from None
    try:
        origins = _origin_list(args.origins or "")
    except ValueError as exc:
        raise SystemExit(f"pyggml serve: --origins: {exc}") from None
    allowed = args.allowed_hosts
    ref = _resolve(args.model) if args.model is not None else None
    name = args.model if ref is not None and not Path(args.model).is_file() else None
    server = ServerConfig(host=host, port=port, name=name, model_ref=ref, queue=args.queue,
                          queue_timeout=args.queue_timeout, max_predict=args.max_predict,
                          allowed_hosts=split_list(allowed) if allowed else None, origins=origins,
                          max_loaded=args.max_loaded, keep_alive=keep_alive,
                          model_keep_alive=keep_alive if args.keep_alive is not None else None)
    try:
        return serve(_engine_config(args, ref.path if ref is not None else None, args.mmproj), server)
    except KeyboardInterrupt:  # uvicorn shut down cleanly, then re-raised the Ctrl-C it caught
        return 0


def _origin_list(text: str) -> list[str]:
    """Comma-separated browser origins (``scheme://host[:port]``, ``*`` wildcards; ``*`` alone: any)."""
    origins = [item.strip() for item in text.split(",") if item.strip()]
    for origin in origins:
        if origin not in ("*", "null") and "://" not in origin:  # null: what a file:// page sends
            raise ValueError(f"{origin!r} is not an origin: write scheme://host[:port], e.g. https://app.example "
                             "or http://localhost:*")
    return origins


def _listen_address(value: str, port: int | None) -> tuple[str, int]:
    """``host``, ``host:port``, ``[v6]:port`` or ``http://host:port`` (PYGGML_HOST, as OLLAMA_HOST)."""
    value = value.split("://", 1)[-1].rstrip("/")
    host, tail = value, ""
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        tail = rest[1:] if rest.startswith(":") else ""
    elif value.count(":") == 1:
        host, tail = value.split(":")
    if tail and not (tail.isdigit() and int(tail) <= 65535):
        raise ValueError(f"bad port in {value!r} (a port is a number from 0 to 65535)")
    return host or "127.0.0.1", (int(tail) if tail else 11434) if port is None else port


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a number from 0 to 65535 (0: any free port), got {text!r}")
    return port


def _memory_size(text: str) -> int:
    """An argparse type: bytes, or a number with K/M/G/T (powers of 1024)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    number, unit = text.strip().upper().rstrip("IB"), ""
    if number and number[-1] in units:
        number, unit = number[:-1], number[-1]
    try:
        value = int(float(number) * units[unit])
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--max-memory must be a size such as 8G, 512M or 1000000, got {text!r}")
    return value


def _positive(flag: str, low: int = 1, high: int | None = None) -> Any:
    """An argparse type: an integer >= ``low`` (and <= ``high``), the error naming ``flag``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"{flag} must be an integer {bound}, got {text!r}")
        return value

    return parse


def _seconds(flag: str) -> Any:
    def parse(text: str) -> float:
        import math

        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"{flag} must be a number of seconds > 0, got {text!r}")
        return value

    return parse


def _think(text: str) -> bool | str:
    value = {"true": True, "false": False}.get(text.lower(), text.lower())
    if value not in (True, False, "low", "medium", "high"):
        raise argparse.ArgumentTypeError(f"--think takes true, false, low, medium or high, got {text!r}")
    return value


def _temperature(text: str) -> float:
    from pyggml.repl import check_temperature

    try:
        return check_temperature(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--temperature must be a number >= 0 (0: greedy), got {text!r}") from None


def _gpu_layers(text: str) -> str | int:
    if text == "all":
        return text
    return _non_negative("--gpu-layers")(text)


def _non_negative(flag: str) -> Any:
    return _positive(flag, 0)


# ---- settings from the environment --------------------------------------------------------------
#
# A flag left out takes its value from the environment: pyggml's variable first, then Ollama's of the same
# meaning (a machine set up for Ollama serves alike), then the built-in default. A bad value is an error
# naming the variable. (PYGGML_MODELS and OLLAMA_MODELS name two stores, both searched: pyggml.store.)

def _checked(check: Any) -> Any:
    """An environment parser: ``check(text)`` raises ValueError for a bad value; the text is kept."""
    def parse(name: str) -> Any:
        def run(text: str) -> str:
            check(text)
            return text
        return run
    return parse


def _keep_alive_text(text: str) -> None:
    from pyggml.repl import parse_duration

    parse_duration(text)


def _max_loaded(name: str) -> Any:
    """Ollama's OLLAMA_MAX_LOADED_MODELS: 0 leaves the choice to the server (None)."""
    def parse(text: str) -> int | None:
        return _positive(name, 0)(text) or None
    return parse


# flag's dest: (commands, variables in order of precedence, parser factory taking the variable's name)
ENVIRONMENT: dict[str, tuple[tuple[str, ...], tuple[str, ...], Any]] = {
    "host": (("serve", "ps", "stop"), ("PYGGML_HOST", "OLLAMA_HOST"),
             _checked(lambda text: _listen_address(text, None))),
    "ctx": (("run", "serve"), ("OLLAMA_CONTEXT_LENGTH",), lambda name: _positive(name, 2)),
    "keep_alive": (("run", "serve"), ("OLLAMA_KEEP_ALIVE",), _checked(_keep_alive_text)),
    "parallel": (("serve",), ("OLLAMA_NUM_PARALLEL",), _positive),
    "max_loaded": (("serve",), ("OLLAMA_MAX_LOADED_MODELS",), _max_loaded),
    "allowed_hosts": (("serve",), ("PYGGML_ALLOWED_HOSTS",), _checked(str)),
    "origins": (("serve",), ("PYGGML_ORIGINS", "OLLAMA_ORIGINS"), _checked(_origin_list)),
}
_BUILT_IN = {"host": "127.0.0.1"}  # the other flags stay None: the engine's, server's or REPL's own default


def environment_defaults(args: argparse.Namespace, environ: Any = None) -> None:
    """Fill ``args``' flags that were left out (None) from the environment (``ENVIRONMENT``), else the
    built-in default. ValueError names the variable of a bad value."""
    environ = os.environ if environ is None else environ
    command = getattr(args, "command", None)
    for dest, (commands, names, parser) in ENVIRONMENT.items():
        if command not in commands or getattr(args, dest, None) is not None:
            continue
        name = next((n for n in names if environ.get(n, "").strip()), None)
        if name is not None:
            try:
                setattr(args, dest, parser(name)(environ[name].strip()))
            except (ValueError, argparse.ArgumentTypeError) as exc:
                raise ValueError(str(exc) if name in str(exc) else f"{name}={environ[name]!r}: {exc}") from None
        else:
            setattr(args, dest, _BUILT_IN.get(dest))
    for name in ("PYGGML_MODELS", "OLLAMA_MODELS"):
        folder = environ.get(name, "").strip()
        if folder and os.path.exists(os.path.expanduser(folder)) and not os.path.isdir(os.path.expanduser(folder)):
            raise ValueError(f"{name}={folder!r} is not a directory (it names a model store)")


class _Parser(argparse.ArgumentParser):
    """Parses the command line, then fills what it left out from the environment (``environment_defaults``);
    a mistyped command or choice gets a suggestion."""

    def error(self, message: str) -> Any:
        import difflib
        import re

        typo = re.search(r"invalid choice: '?([^',]*)'? \(choose from (.*)\)", message)
        if typo:
            choices = [c.strip().strip("'") for c in typo.group(2).split(",")]
            close = difflib.get_close_matches(typo.group(1), choices, n=1, cutoff=0.6)
            message += f" (did you mean {close[0]}?)" if close else ""
        super().error(message)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, extra = super().parse_known_args(args, namespace)
        if self._subparsers is not None and getattr(parsed, "command", None) is not None:  # the top level only
            try:
                environment_defaults(parsed)
            except ValueError as exc:
                self.exit(2, f"pyggml {parsed.command}: error: {exc}\n")
        return parsed, extra


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse leaves a positional that follows an option unparsed: `run MODEL --image PATH "prompt"`,
    # `embed MODEL --pooling mean "text" ...`; give it to the command's trailing positional
    if extra and getattr(args, "prompt", "") is None and len(extra) == 1 and not extra[0].startswith("-"):
        args.prompt = extra.pop()
    elif extra and isinstance(getattr(args, "texts", None), list) and not any(e.startswith("-") for e in extra):
        args.texts += extra
        extra = []
    if extra:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
        sub.error(f"unrecognized arguments: {' '.join(extra)}{_did_you_mean(sub, extra)}")
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C while loading or generating: stop quietly
        print("\npyggml: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `pyggml show model.gguf | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, OSError, TypeError, NotImplementedError, MemoryError) as e:
        print(f"pyggml: error: {cli_hint(str(e), args.command)}", file=sys.stderr)
        return 1


def _did_you_mean(command: argparse.ArgumentParser, extra: list[str]) -> str:
    """" (did you mean --temperature?)" for the first unknown flag close to one of the command's."""
    import difflib

    flags = [flag for action in command._actions for flag in action.option_strings if flag.startswith("--")]
    for word in extra:
        if word.startswith("--"):
            close = difflib.get_close_matches(word.split("=", 1)[0], flags, n=1, cutoff=0.6)
            if close:
                return f" (did you mean {close[0]}?)"
    return ""


# API words in error messages -> the flags of the command that was typed
_HINTS: list[tuple[str, str, str]] = [  # (command or "*", API text, CLI text)
    ("*", "raise num_ctx", "raise --ctx"),
    ("*", "raise the context", "raise --ctx"),
    ("bench", "(BackendParams(flash_attention=True))", "(-fa 1)"),
    ("*", "(BackendParams(flash_attention=True))", "(--flash-attn on)"),
    ("embed", "(shorten it, or truncate it)", "(shorten it, or pass --truncate)"),
    ("run", "(ask it for embeddings instead)", "(use `pyggml embed` instead)"),
    *(("run", f"Sampler: {name} must", f"--{name.replace('_', '-')} must")
      for name in ("top_k", "top_p", "min_p", "repeat_penalty", "temperature")),
    ("embed", "embeddings need an embedding model such as BERT",
     "`pyggml embed` needs an embedding model such as BERT; use `pyggml run` to generate text"),
    ("embed", "pass pooling='mean', 'cls' or 'last'", "pass --pooling mean, cls or last"),
    ("convert", "(pass pooling=... to override)", "(pass --pooling to override)"),
    ("serve", "lower parallel, num_ctx or batch_size", "lower --parallel, --ctx or --batch-size"),
    ("*", "lower parallel, num_ctx or batch_size", "lower --ctx"),
    ("serve", "use flash attention, or a smaller num_ctx or parallel", "use --flash-attn on, or a smaller --ctx "
                                                                        "or --parallel"),
    ("*", "use flash attention, or a smaller num_ctx or parallel", "use --flash-attn on, or a smaller --ctx"),
    ("*", "n_threads=", "--threads "),
]


def cli_hint(message: str, command: str) -> str:
    """``message`` with the Python API's advice replaced by the flags of ``pyggml COMMAND``."""
    for where, api, cli in _HINTS:
        if where in ("*", command):
            message = message.replace(api, cli)
    return message


if __name__ == "__main__":
    sys.exit(main())
