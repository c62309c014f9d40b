"""Hugging Face -> GGUF: ``convert_hf(hf_dir, out_path)``, the engine of ``pyggml convert``.

Shared code reads the checkpoint (safetensors, memory-mapped, or torch .bin), the tokenizer
(SentencePiece, BPE, WordPiece, Unigram) and writes the file tensor by tensor (peak memory about one tensor);
each architecture is one small file registered by its Hugging Face ``architectures`` name (llama,
bert (and BERT / XLM-RoBERTa encoders and cross-encoder rerankers), nomic_bert, qwen2, qwen3 (and
Qwen3-Reranker), qwen3moe, gemma2, gemma3 (with vision), gemma4 (with vision), phi3, gpt_oss, lfm2 (and lfm2moe),
olmo2 (and olmo3), smollm3, mistral3 (Ministral 3 text), granitehybrid, nemotron_h, qwen35 (and qwen35moe,
qwen3next), llama4 (text), gemma_embedding (EmbeddingGemma), qwen2vl (Qwen2-VL, Qwen 2.5-VL, with vision),
qwen3vl (Qwen3-VL and its MoE, with vision), deepseek2 (DeepSeek V2/V3), glm4moe (GLM-4.5); the hooks are
described in ``base.py``). Tensor names and metadata keys are llama.cpp's (names through
``gguf``'s tensor-name map), so the files also load there.

Only numpy and the ``gguf`` package (writer, quantisers) are needed: no torch, safetensors or
sentencepiece at conversion time (torch only to read a pytorch_model.bin; the compiled module for
``--type`` q4_k_m and the other ``pyggml quantize`` types).
"""

from . import (  # noqa: F401
    bert,
    deepseek2,
    gemma2,
    gemma3,
    gemma3_vision,
    gemma4,
    gemma4_vision,
    gemma_embedding,
    glm4moe,
    gpt_oss,
    granitehybrid,
    lfm2,
    llama,
    llama4,
    mistral3,
    mistral3_vision,
    mllama,
    nemotron_h,
    nomic_bert,
    olmo2,
    phi3,
    qwen2,
    qwen2vl,
    qwen3,
    qwen3moe,
    qwen3vl,
    qwen35,
    smollm3,
)
from .base import Architecture, architecture_for, register, supported
from .llama import from_interleaved_rope, llama3_rope_factors, to_interleaved_rope
from .tensors import OUT_TYPES, Source
from .writer import convert_hf

__all__ = ["OUT_TYPES", "Architecture", "Source", "architecture_for", "convert_hf", "from_interleaved_rope",
           "llama3_rope_factors", "register", "supported", "to_interleaved_rope"]
