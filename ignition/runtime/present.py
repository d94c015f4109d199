"""Presentation of loader results: the `ignition run --json` object and a rich table."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False) if tokenizer is not None else ""


def run_json(result, tokenizer) -> dict:
    """``{"prompt_ids", "finish_reason", "tokens": [{"id", "text", "logprob", "top_logprobs"}]}``."""
    out = {
        "prompt_ids": result.prompt_ids,
        "finish_reason": result.finish_reason,
        "tokens": [{"id": e.id, "text": token_text(tokenizer, e.id), "logprob": e.logprob,
                    "top_logprobs": [{"id": i, "logprob": v} for i, v in e.top]} for e in result.entries],
    }
    if result.error is not None:
        out["error"] = result.error
    if getattr(result, "prompt_entries", None) is not None:
        out["prompt_logprobs"] = result.prompt_entries
    return out


def render_run(result, tokenizer, console: Console) -> None:
    table = Table(title=f"{len(result.entries)} tokens, finish_reason={result.finish_reason}")
    for column in ("#", "id", "text", "logprob", "top alternatives"):
        table.add_column(column, justify="right" if column in ("#", "id", "logprob") else "left")
    for index, e in enumerate(result.entries):
        top = ", ".join(f"{i}:{v:.3f}" for i, v in e.top[:8]) + (" ..." if len(e.top) > 8 else "")
        table.add_row(str(index), str(e.id), repr(token_text(tokenizer, e.id)),
                      "forced" if e.logprob is None and not e.top else (f"{e.logprob:.4f}" if e.logprob is not None else "-"), top)
    console.print(table)
    if result.error:
        console.print(f"[red]error:[/red] {result.error}")
