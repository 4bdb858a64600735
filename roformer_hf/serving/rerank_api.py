"""The rerank API that Jina's and Cohere's clients speak, as vLLM and Infinity serve it: `POST /v1/rerank` and
`POST /v2/rerank` (Cohere's second version's path) on a cross-encoder. It ranks `documents` (strings, or objects
with a `text`) by their relevance to `query`, best first: `{"id", "model", "usage": {"total_tokens"}, "results":
[{"index", "relevance_score", "document": {"text"}}]}`. The scores are text-embeddings-inference's `/rerank`'s: the
sigmoid of the cross-encoder's logit. `POST /rerank` takes both: text-embeddings-inference's body (`query`, `texts`)
and, as vLLM and Infinity answer there too, a body with `documents`."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from pydantic import Field, StrictBool, StrictInt, StrictStr

from . import tei_api
from .errors import RequestError
from .protocol import Body, Parsed, Route, check_count, check_model, route
from .tasks import Item
from .tei_api import encode_pairs, label_scores

if TYPE_CHECKING:
    from .served import ServedModel


def _reranker(loaded) -> bool:
    return loaded.is_reranker


class Document(Body):
    text: StrictStr


class DocumentsRerankRequest(Body):
    query: StrictStr
    documents: list[StrictStr | Document]
    model: StrictStr | None = None
    top_n: StrictInt | None = Field(None, ge=0)  # the best top_n; all where absent or 0 (vLLM's reading)
    return_documents: StrictBool = True
    user: StrictStr | None = None  # accepted, not used
    truncate: StrictBool | None = None  # not theirs: cut long pairs instead of refusing them (None: --auto-truncate)


@route("POST", "/v1/rerank", DocumentsRerankRequest, "rerank", _reranker)
@route("POST", "/v2/rerank", DocumentsRerankRequest, "rerank", _reranker)
def rerank_documents(served: ServedModel, body: DocumentsRerankRequest, _) -> Parsed:
    check_model(served, body.model)
    check_count(served, "documents", len(body.documents))
    if not body.query.strip():
        raise RequestError(422, "query", "query='': expected a non-empty string")
    texts = [document if isinstance(document, str) else document.text for document in body.documents]
    rows = encode_pairs(served, [body.query] * len(texts), texts, "documents", body.truncate, "right")

    def respond(logits):
        relevance = [label_scores(served, row, raw=False)[0].item() for row in logits]
        ranked = sorted(range(len(relevance)), key=lambda i: -relevance[i])[:body.top_n or None]
        return {"id": f"rerank-{secrets.token_hex(12)}", "model": served.loaded.name,
                "usage": {"total_tokens": sum(len(row["input_ids"]) for row in rows)},
                "results": [{"index": i, "relevance_score": relevance[i],
                             **({"document": {"text": texts[i]}} if body.return_documents else {})}
                            for i in ranked]}

    return Parsed([Item("classify", (), row, len(row["input_ids"])) for row in rows], respond)


TEI_SHAPE = Route("POST", "/rerank", tei_api.RerankRequest, "tei", _reranker, tei_api.rerank)
DOCUMENTS_SHAPE = Route("POST", "/rerank", DocumentsRerankRequest, "rerank", _reranker, rerank_documents)


@route("POST", "/rerank", dict, "tei", _reranker)
def rerank(served: ServedModel, body: dict, params: dict[str, str]) -> Parsed:
    """Text-embeddings-inference's `/rerank` (`query`, `texts`); with `documents` in place of `texts`, the shape above."""
    if "documents" not in body and "texts" not in body:
        raise RequestError(422, "texts", "texts: missing: expected texts (text-embeddings-inference's body) or "
                           "documents (Jina's and Cohere's)")
    return served.parse_for(DOCUMENTS_SHAPE if "documents" in body else TEI_SHAPE, body, params)


__all__ = ["DOCUMENTS_SHAPE", "Document", "DocumentsRerankRequest", "TEI_SHAPE"]
