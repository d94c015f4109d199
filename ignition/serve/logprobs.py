"""Logprob presentation in vLLM's wire formats (Completions, Chat, prompt_logprobs).

Payloads attached to released spans: a TokenEntry for a generated token (logprob None: a
forced token, which gets no entry), a prompt score converted to a TokenEntry, or None for
prompt position zero (a row whose values are null). -inf is written as -9999.0.
"""

from __future__ import annotations

from ignition.serve.detokenize import Span, TokenTable
from ignition.catalog.abi import TokenEntry
from ignition.serve.protocol import (ChatCompletionLogProb, ChatCompletionLogProbsContent, CompletionLogProbs,
                                              PromptLogprob)

FLOOR = -9999.0  # OpenAI's "very unlikely": what -inf is written as


def clamp(value: float) -> float:
    return value if value > FLOOR else FLOOR


class Presenter:
    """Names and bytes of tokens for one response."""

    def __init__(self, table: TokenTable, as_token_ids: bool = False):
        self.table, self.as_token_ids = table, as_token_ids

    def name(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_token_ids else self.table.names[token_id]

    def bytes(self, token_id: int) -> list[int]:
        return list(self.table.bytes[token_id])


def prompt_entry(score: dict | None) -> TokenEntry | None:
    """The engine's prompt score as a TokenEntry (None stays None: position zero has no score)."""
    if score is None:
        return None
    return TokenEntry(score["id"], score["logprob"], [(a["id"], a["logprob"]) for a in score["top_logprobs"]])


def add_completion_logprobs(out: CompletionLogProbs, spans: list[Span], presenter: Presenter,
                            offset_base: int) -> None:
    """Append spans to Completions logprobs; top_logprobs hold the chosen token, then its alternatives.

    Keys are token names; when two tokens share a name the first (the chosen token, then the
    more likely alternative) keeps the key.
    """
    for span in spans:
        entry: TokenEntry | None = span.payload
        if entry is not None and entry.logprob is None:
            continue  # a forced token has no logprob entry
        out.tokens.append(presenter.name(span.token_id))
        out.text_offset.append(offset_base + span.offset)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(clamp(entry.logprob))
        top = {presenter.name(entry.id): clamp(entry.logprob)}
        for token_id, logprob in entry.top:
            top.setdefault(presenter.name(token_id), clamp(logprob))
        out.top_logprobs.append(top)


def chat_logprobs(spans: list[Span], presenter: Presenter) -> list[ChatCompletionLogProbsContent]:
    """Chat content entries; top_logprobs are exactly the natural alternatives (or the caller's ids) in order."""
    content = []
    for span in spans:
        entry: TokenEntry | None = span.payload
        if entry is None or entry.logprob is None:
            continue
        content.append(ChatCompletionLogProbsContent(
            token=presenter.name(entry.id), logprob=clamp(entry.logprob), bytes=presenter.bytes(entry.id),
            top_logprobs=[ChatCompletionLogProb(token=presenter.name(t), logprob=clamp(v), bytes=presenter.bytes(t))
                          for t, v in entry.top]))
    return content


def prompt_logprobs(scores: list[dict | None], presenter: Presenter) -> list[dict[int, PromptLogprob] | None]:
    """vLLM's prompt_logprobs: per position the prompt token with its rank, then alternatives ranked 1..n."""
    out: list[dict[int, PromptLogprob] | None] = []
    for score in scores:
        if score is None:
            out.append(None)
            continue
        row = {score["id"]: PromptLogprob(logprob=clamp(score["logprob"]), rank=score["rank"],
                                          decoded_token=presenter.name(score["id"]))}
        for rank, alternative in enumerate(score["top_logprobs"], start=1):
            row.setdefault(alternative["id"], PromptLogprob(logprob=clamp(alternative["logprob"]), rank=rank,
                                                            decoded_token=presenter.name(alternative["id"])))
        out.append(row)
    return out
