"""Hugging Face -> GGUF: ``convert_hf(hf_dir, out_path)``, the engine of ``pyggml convert``.

Shared code reads the checkpoint (safetensors, memory-mapped, or torch .bin), the tokenizer
(SentencePiece, BPE, WordPiece) and writes the file tensor by tensor (peak memory about one tensor);
each architecture is one small file registered by its Hugging Face ``architectures`` name (llama,
bert, nomic_bert, qwen2, qwen3, qwen3moe, gemma2, gemma3 (with vision), phi3, gpt_oss, lfm2 (and lfm2moe),
olmo2 (and olmo3), smollm3, mistral3 (Ministral 3 text), deepseek2 (DeepSeek V2/V3), glm4moe (GLM-4.5); the hooks
are described in ``base.py``). Tensor names and metadata keys are llama.cpp's (names through
``gguf``'s tensor-name map), so the files also load there.

Only numpy and the ``gguf`` package (writer, quantisers) are needed: no torch, safetensors or
sentencepiece at conversion time (torch only to read a pytorch_model.bin).
"""

from . import (  # noqa: F401
    bert,
    deepseek2,
    gemma2,
    gemma3,
    gemma3_vision,
    glm4moe,
    gpt_oss,
    lfm2,
    llama,
    mistral3,
    mllama,
    nomic_bert,
    olmo2,
    phi3,
    qwen2,
    qwen3,
    qwen3moe,
    smollm3,
)
from .base import Architecture, architecture_for, register, supported
from .llama import from_interleaved_rope, llama3_rope_factors, to_interleaved_rope
from .tensors import OUT_TYPES, Source
from .writer import convert_hf

__all__ = ["OUT_TYPES", "Architecture", "Source", "architecture_for", "convert_hf", "from_interleaved_rope",
           "llama3_rope_factors", "register", "supported", "to_interleaved_rope"]
