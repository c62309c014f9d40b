"""Qwen 2-VL / 2.5-VL text model (GGUF architecture "qwen2vl", as llama.cpp names both): Qwen 2 with
multi-axis rotary positions (mRoPE): each head's rotated pairs fall into sections
(``qwen2vl.rope.dimension_sections``, e.g. 16/24/24 pairs) turned by a token's temporal, height and
width position. Text has the same position on every axis (a plain rope, so text-only batches and the
context shift are Qwen 2's); an image's tokens get (start, start + row, start + column) and the text
after it goes on from start + max(rows, columns) (``Input.rope_offset``/``rope_step``, set by the
vision part, qwen2vl_vision.py, whose embeddings replace the ``<|image_pad|>`` placeholders)."""

from __future__ import annotations

from dataclasses import replace

from pyggml import nn
from pyggml.backend import Backend, Context
from pyggml.models import Batch, ModelError, qwen2, qwen2vl_vision, register
from pyggml.tensor import Tensor


class Options(qwen2.Options):
    @classmethod
    def from_config(cls, config, **extra) -> Options:
        return with_mrope(super().from_config(config, **extra), config)


def with_mrope(opts, config, interleaved: bool = False):
    """``opts`` with its rope made multi-axis by ``<arch>.rope.dimension_sections`` (pairs per axis; Ollama's
    files: ``rope.mrope_section``)."""
    sections = config.uints("rope.dimension_sections", None, max=opts.head_dim) or \
        config.uints("rope.mrope_section", [], max=opts.head_dim)  # Ollama's name
    if len(sections) < 3 or sum(sections[:3]) * 2 != opts.rope.n_dims or any(sections[3:]):
        raise ModelError(f"{config.architecture}: rope.dimension_sections {sections} must give the three axes "
                         f"(time, height, width) {opts.rope.n_dims // 2} rotated pairs in all")
    return replace(opts, rope=nn.MRope.sections(opts.rope, sections[:3], interleaved))


@register("qwen2vl")
class Qwen2VL(qwen2.Qwen2):
    Options = Options
    vision: qwen2vl_vision.Vision | None = None

    def __init__(self, backend: Backend):
        super().__init__(backend)
        self.vision = qwen2vl_vision.load(backend, self.options.hidden_size)

    def attach_mmproj(self, projector: Backend) -> None:
        self.attach_vision(projector, qwen2vl_vision.load(projector, self.options.hidden_size))

    def forward(self, ctx: Context, batch: Batch) -> Tensor:
        w, o = self.weights, self.options
        inputs = nn.batch_inputs(ctx, batch, rope_axes=o.rope.n_axes)
        h = nn.tap("token_embd", w.token_embd(inputs.tokens))
        if batch.multimodal:
            h = nn.multimodal_embeddings(ctx, h, batch)
        factors = o.rope.factors(ctx)
        for i, layer, rows in nn.layers(w.blk, self.cache, inputs.outputs):
            h = nn.tap(f"blk.{i}", layer(ctx, h, inputs.rope_positions, rows, self.cache, o, factors))
        return nn.tap("output", w.output(nn.tap("output_norm", w.output_norm(h, o.eps))))

    def shift(self, ctx: Context, layer: int, key: Tensor, shift: Tensor) -> Tensor:
        return self.options.rope(key, shift)  # the same shift on every axis: a plain rope
