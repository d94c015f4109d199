"""Presentation of loader results: the `ignition run --json` object and the human output.

The human output is the completion text first, then one row per generated token (its string;
its logprob and alternatives only when the request asked for logprobs; "forced" only for a
token the forced-token binding emitted), then the prompt's scores when ``--prompt-logprobs``
asked for them. Alternatives print as token strings; ``--json`` carries their ids too.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

_SHOWN_ALTERNATIVES = 8


def token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False) if tokenizer is not None else ""


def completion_text(result, tokenizer) -> str | None:
    """The generated tokens decoded together (None without a tokenizer)."""
    return tokenizer.decode(result.token_ids, skip_special_tokens=False) if tokenizer is not None else None


def _alternative(token: int, logprob: float, tokenizer) -> dict:
    return {"id": token, "text": token_text(tokenizer, token), "logprob": logprob}


def run_json(result, tokenizer) -> dict:
    """``{"prompt_ids", "text", "finish_reason", "tokens": [{"id", "text", "logprob", "top_logprobs"}]}``;
    a forced token also carries ``"forced": true``; ``prompt_logprobs`` with ``--prompt-logprobs``."""
    out = {"prompt_ids": result.prompt_ids, "text": completion_text(result, tokenizer),
           "finish_reason": result.finish_reason, "tokens": []}
    for e in result.entries:
        token = {"id": e.id, "text": token_text(tokenizer, e.id), "logprob": e.logprob,
                 "top_logprobs": [_alternative(i, v, tokenizer) for i, v in e.top]}
        if e.forced:
            token["forced"] = True
        out["tokens"].append(token)
    if result.error is not None:
        out["error"] = result.error
    if getattr(result, "prompt_entries", None) is not None:
        out["prompt_logprobs"] = [None if p is None else
                                  {**p, "text": token_text(tokenizer, p["id"]),
                                   "top_logprobs": [_alternative(a["id"], a["logprob"], tokenizer)
                                                    for a in p["top_logprobs"]]}
                                  for p in result.prompt_entries]
    return out


def _shown(token: int, tokenizer) -> str:
    """A token as a row shows it: its string (quoted, escapes visible), or its id without a tokenizer."""
    return repr(token_text(tokenizer, token)) if tokenizer is not None else str(token)


def _alternatives(pairs: list[tuple[int, float]], tokenizer) -> str:
    shown = ", ".join(f"{_shown(i, tokenizer)} {v:.3f}" for i, v in pairs[:_SHOWN_ALTERNATIVES])
    return shown + (f" (+{len(pairs) - _SHOWN_ALTERNATIVES} more)" if len(pairs) > _SHOWN_ALTERNATIVES else "")


def _table(logprobs: bool, rank: bool = False) -> Table:
    table = Table()
    table.add_column("#", justify="right")
    table.add_column("id", justify="right")
    table.add_column("token")
    if logprobs:
        table.add_column("logprob", justify="right")
        if rank:
            table.add_column("rank", justify="right")
        table.add_column("alternatives")
    return table


def render_run(result, tokenizer, console: Console) -> None:
    """The completion text, the generated tokens and (when asked) the prompt's scores."""
    text = completion_text(result, tokenizer)
    if text is not None:
        console.print(text, markup=False, highlight=False, soft_wrap=True)
    logprobs = any(e.logprob is not None or e.top or e.forced for e in result.entries)
    console.print(f"{len(result.entries)} tokens, finish_reason={result.finish_reason}", highlight=False)
    table = _table(logprobs)
    for index, e in enumerate(result.entries):
        row = [str(index), str(e.id), _shown(e.id, tokenizer)]
        if logprobs:
            row += ["forced" if e.forced else ("" if e.logprob is None else f"{e.logprob:.4f}"),
                    _alternatives(e.top, tokenizer)]
        table.add_row(*row)
    console.print(table)
    if getattr(result, "prompt_entries", None) is not None:
        console.print(f"prompt logprobs, {len(result.prompt_ids)} tokens", highlight=False)
        scores = _table(True, rank=True)
        for index, (token, entry) in enumerate(zip(result.prompt_ids, result.prompt_entries)):
            if entry is None:
                scores.add_row(str(index), str(token), _shown(token, tokenizer), "", "", "")
            else:
                pairs = [(a["id"], a["logprob"]) for a in entry["top_logprobs"]]
                scores.add_row(str(index), str(token), _shown(token, tokenizer), f"{entry['logprob']:.4f}",
                               str(entry["rank"]), _alternatives(pairs, tokenizer))
        console.print(scores)
    if result.error:
        console.print(f"error: {result.error}", markup=False, highlight=False)
