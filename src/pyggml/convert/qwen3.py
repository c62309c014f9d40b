"""Qwen 3 (GGUF ``qwen3``): Qwen 2 without biases, with per-head RMSNorm of q and k before rope.

Qwen3-Reranker (``pooling="rank"``, or a README titled "# Qwen3-Reranker" as llama.cpp detects it) is
written as llama.cpp writes it: rank pooling, the "yes" and "no" rows of the LM head as
``cls.output`` (no ``output.weight``), and the prompt as the named chat template ``rerank``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import gguf

from .base import register
from .qwen2 import Qwen2
from .tensors import Source
from .vocab import Vocab

# the prompt Qwen3-Reranker was trained with (its model card), with the default instruction
RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant passages that answer the query\n"
    "<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


@register("Qwen3ForCausalLM", "Qwen3Model", model_types=("qwen3",))
class Qwen3(Qwen2):
    gguf_arch = "qwen3"
    always_head_dim = True  # as llama.cpp does for a config.json that states head_dim

    def __init__(self, hf_dir: Path, config: dict, pooling: str | None = None) -> None:
        rerank = pooling == "rank" or "# Qwen3-Reranker" in _readme(hf_dir)
        super().__init__(hf_dir, config, None if pooling == "rank" else pooling)
        self.yes_no: tuple[int, int] | None = None
        if rerank:
            if self.headless:
                raise ValueError("a Qwen3 reranker needs its LM head (Qwen3ForCausalLM), for the yes/no rows")
            tokens = super().vocab().tokens
            missing = [t for t in ("yes", "no") if t not in tokens]
            if missing:
                raise ValueError(f"a Qwen3 reranker's vocabulary must have the tokens 'yes' and 'no'; it lacks "
                                 f"{', '.join(map(repr, missing))}")
            self.yes_no = (tokens.index("yes"), tokens.index("no"))
            self.pooling_type = gguf.PoolingType.RANK

    def metadata(self, w: gguf.GGUFWriter) -> None:
        super().metadata(w)
        if self.yes_no:
            w.add_classifier_output_labels(["yes", "no"])

    def vocab(self) -> Vocab:
        vocab = super().vocab()
        if self.yes_no:
            templates = vocab.chat_template
            if isinstance(templates, str):
                templates = [{"name": "default", "template": templates}]
            vocab.chat_template = [*(templates or []), {"name": "rerank", "template": RERANK_TEMPLATE}]
        return vocab

    def tensors(self, name: str, source: Source) -> Iterable[tuple[str, Source]]:
        head = "model.embed_tokens.weight" if self.tied else "lm_head.weight"
        if self.yes_no and name == head:
            yield "cls.output.weight", source.map(lambda w: w[list(self.yes_no)], (2, source.shape[1]))
            if not self.tied:  # the LM head itself is not kept
                return
        yield from super().tensors(name, source)

    def expected(self) -> dict[str, tuple[int, ...]]:
        norms = {"blk.{bid}.attn_q_norm.weight": (self.head_dim,), "blk.{bid}.attn_k_norm.weight": (self.head_dim,)}
        shapes = (super().expected() if self.config.get("attention_bias") else self.decoder_shapes()) | norms
        if self.yes_no:
            shapes = {n: s for n, s in shapes.items() if n != "output.weight"} | {"cls.output.weight": (2, self.n_embd)}
        return shapes


def _readme(hf_dir: Path) -> str:
    path = Path(hf_dir) / "README.md"
    return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
