"""docs/server.md's table of request fields, written from the request models and their FieldTables
(request_fields.py): `python -m prefixkv.server.field_docs` prints it, `--write` puts it between the markers."""

from __future__ import annotations

import sys
from pathlib import Path

from prefixkv.server import gemini_protocol, messages_protocol, protocol, responses_protocol, tokenize
from prefixkv.server.request_fields import TableFields, markdown

BODIES: dict[str, type[TableFields]] = {
    "POST /v1/chat/completions": protocol.ChatCompletionRequest,
    "POST /v1/completions": protocol.CompletionRequest,
    "POST /v1/responses": responses_protocol.ResponsesRequest,
    "POST /v1/messages": messages_protocol.MessagesRequest,
    "POST /v1/messages/count_tokens": messages_protocol.CountTokensRequest,
    "Gemini generateContent / streamGenerateContent": gemini_protocol.GenerateContentRequest,
    "Gemini generationConfig": gemini_protocol.GenerationConfig,
    "POST /tokenize": tokenize.TokenizeRequest,
    "POST /detokenize": tokenize.DetokenizeRequest,
}
DOC = Path(__file__).resolve().parents[2] / "docs" / "server.md"
BEGIN = "<!-- request fields: begin (python -m prefixkv.server.field_docs --write) -->"
END = "<!-- request fields: end -->"


def table() -> str:
    return markdown({title: (model, model.FIELDS) for title, model in BODIES.items()})


def written(doc: str) -> str:
    """doc with the table between its markers replaced by today's."""
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table()}{END}{tail}"


if __name__ == "__main__":
    if "--write" in sys.argv:
        DOC.write_text(written(DOC.read_text()))
    else:
        print(table(), end="")
