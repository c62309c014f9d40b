"""Reranking (``POST /v1/rerank``, also ``/rerank``, ``/v1/reranking`` and ``/reranking`` as llama-server
has them): the Jina/Cohere shape that llama-server speaks.

Request: ``model``, ``query``, ``documents`` (strings, or ``{"text": ...}`` objects), ``top_n``,
``return_documents`` (default false), ``truncate`` (default false). Answer: ``results``, one
``{"index", "relevance_score"}`` per document (``document: {"text"}`` too when asked), best first,
at most ``top_n``; ``usage`` counts the tokens read. The scores are the model's own: a
cross-encoder's logit, or Qwen3-Reranker's probability of "yes".
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pyggml.runner.embedding import ranked
from pyggml.server.models import served_for
from pyggml.server.params import APIError, Fields, read_json

RERANK_FIELDS = {"model", "query", "documents", "top_n", "return_documents", "truncate", "user"}


def _document_text(doc: Any, i: int) -> str:
    if isinstance(doc, dict) and set(doc) == {"text"}:
        doc = doc["text"]
    if not isinstance(doc, str) or not doc:
        raise APIError(400, f"documents[{i}] must be a non-empty string or an object {{\"text\": ...}}",
                       param="documents")
    return doc


async def rerank(request: Request) -> Response:
    body = await read_json(request)
    f = Fields(body, "the request", RERANK_FIELDS)
    query = f.string("query")
    if not query:
        raise APIError(400, "query must be a non-empty string", param="query")
    documents = body.get("documents")
    if not isinstance(documents, list) or not documents:
        raise APIError(400, "documents must be a non-empty array", param="documents")
    texts = [_document_text(d, i) for i, d in enumerate(documents)]
    top_n = f.integer("top_n", low=1)
    return_documents = f.boolean("return_documents", False)
    served = await served_for(request, body.get("model"))
    scores, n_tokens = await served.rerank(query, texts, truncate=f.boolean("truncate", False))
    results = [{"index": i, "relevance_score": score, **({"document": {"text": texts[i]}} if return_documents else {})}
               for i, score in ranked(scores, top_n)]
    return JSONResponse({"object": "list", "model": served.name, "results": results,
                         "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})


routes = [Route(path, rerank, methods=["POST"]) for path in ("/v1/rerank", "/rerank", "/v1/reranking", "/reranking")]
