"""Qwen3-VL text model (GGUF architecture "qwen3vl"): Qwen 3 with interleaved mRoPE (the rotated pairs
take the temporal, height and width positions in turn: pair i on axis i mod 3 while that axis's section
lasts, else temporal) and DeepStack: an image's embeddings carry, after the merger's, one more set per
``qwen3vl.n_deepstack_layers``, added to the image's rows after each of the first layers. Images come
from the vision part (qwen3vl_vision.py) with the positions of Qwen 2.5-VL (qwen2vl.py). "qwen3vlmoe" is the
same with Qwen 3 MoE's experts."""

from __future__ import annotations

import logging

import numpy as np

from pyggml import nn
from pyggml.backend import Backend, Context
from pyggml.models import Batch, ModelError, qwen2vl, qwen3, qwen3moe, register
from pyggml.tensor import Tensor

log = logging.getLogger(__name__)


class Options(qwen3.Options):
    @classmethod
    def from_config(cls, config, **extra) -> Options:
        return qwen2vl.with_mrope(super().from_config(config, **extra), config, interleaved=True)


class MoeOptions(qwen3moe.Options):
    @classmethod
    def from_config(cls, config, **extra) -> MoeOptions:
        return qwen2vl.with_mrope(super().from_config(config, **extra), config, interleaved=True)


@register("qwen3vl")
class Qwen3VL(qwen2vl.Qwen2VL, qwen3.Qwen3):
    Options, Weights = Options, qwen3.Weights

    def __init__(self, backend: Backend):
        super().__init__(backend)
        self.n_deepstack = backend.config.uint("n_deepstack_layers", 0, max=self.options.n_layers - 1)
        if self.vision is None and backend.get("v.patch_embed.weight") is not None:
            log.warning("%s: its vision part is in Ollama's layout (v.patch_embed, v.merger), which pyggml does not "
                        "read yet: the model runs text only (convert the Hugging Face checkpoint for images)",
                        backend.path)
        self.check_vision()

    def attach_mmproj(self, projector: Backend) -> None:
        super().attach_mmproj(projector)
        self.check_vision()

    def check_vision(self) -> None:
        if self.vision is not None and len(self.vision.options.deepstack) != self.n_deepstack:
            raise ModelError(f"qwen3vl: the vision part has {len(self.vision.options.deepstack)} DeepStack layers, "
                             f"the text model takes {self.n_deepstack} (qwen3vl.n_deepstack_layers)")

    def forward(self, ctx: Context, batch: Batch) -> Tensor:
        w, o = self.weights, self.options
        inputs = nn.batch_inputs(ctx, batch, rope_axes=o.rope.n_axes)
        h = nn.tap("token_embd", w.token_embd(inputs.tokens))
        images = self.image_rows(ctx, batch)
        if images is not None:
            h = h.set_rows(images[1][0], images[0])
        factors = o.rope.factors(ctx)
        for i, layer, rows in nn.layers(w.blk, self.cache, inputs.outputs):
            h = layer(ctx, h, inputs.rope_positions, rows, self.cache, o, factors)
            if images is not None and i < self.n_deepstack:  # DeepStack: more of the image, layer by layer
                h = h.set_rows(h.rows(images[0]) + images[1][i + 1], images[0])
            h = nn.tap(f"blk.{i}", h)
        return nn.tap("output", w.output(nn.tap("output_norm", w.output_norm(h, o.eps))))

    def image_rows(self, ctx: Context, batch: Batch) -> tuple[Tensor, list[Tensor]] | None:
        """The batch rows of its image tokens (I32) and their embeddings: the merger's, then each DeepStack
        layer's, (hidden, n) each; None without images."""
        if not batch.multimodal:
            return None
        hidden, n_sets = self.options.hidden_size, 1 + self.n_deepstack
        index, parts = [], []
        for item in batch.multimodal:
            if any(np.shape(m.tensor)[-1] != hidden * n_sets for m in item.multimodal):
                raise ValueError(f"qwen3vl: image embeddings must have width {hidden} x {n_sets}")
            rows = np.concatenate([np.asarray(m.tensor, np.float32).reshape(-1, hidden * n_sets)
                                   for m in item.multimodal])
            index.extend(range(item.index, item.index + len(rows)))
            parts.append(rows)
        rows = np.concatenate(parts)
        if index[-1] >= len(batch.inputs):
            raise ValueError(f"qwen3vl: {len(rows)} image rows do not fit a batch of {len(batch.inputs)}")
        sets = [ctx.from_numpy(np.ascontiguousarray(rows[:, k * hidden:(k + 1) * hidden])) for k in range(n_sets)]
        return nn.int32_input(ctx, index), sets


@register("qwen3vlmoe")
class Qwen3VLMoe(Qwen3VL):
    """Qwen3-VL-30B-A3B and kin: Qwen3-VL with Qwen 3 MoE's experts (qwen3moe.py) in every layer."""

    Options, Weights = MoeOptions, qwen3moe.Weights
