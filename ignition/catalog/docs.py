"""Render the generated sections of docs/api.md from the contract tables.

``python -m ignition.catalog.docs`` rewrites the blocks between ``<!-- BEGIN GENERATED: x -->``
and ``<!-- END GENERATED: x -->``; ``--check`` exits 1 when the file is stale. A test runs
the check, so the documented contract cannot drift from the code.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from ignition.catalog.abi import RecordField
from ignition.catalog.buffers import (CHUNK_INPUTS, COMPLETION_BUFFERS, CONSTRAINT_INPUTS, LANE_INPUTS, PACKED_INPUTS,
                                      PROMPT_BUFFERS, SAMPLING_INPUTS, MIXED_BUFFERS, SPECULATIVE_INPUTS, WINDOW_INPUTS,
                                      shape_expression)
from ignition.catalog.enums import ENUMS, reserved_status

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def _enum_tables() -> str:
    parts = []
    for enum in ENUMS:
        rows = "\n".join(f"| `{member.name}` | {member.value} | "
                         f"{'reserved, not built yet: ' + reserved_status(member) if reserved_status(member) else 'built'} |"
                         for member in enum)
        parts.append(f"#### {enum.__name__}\n\n| name | code | status today |\n|---|---|---|\n{rows}\n")
    return "\n".join(parts)


def _buffer_table(specs) -> str:
    rows = "\n".join(
        f"| `{s.name}` | {s.dtype} | `{shape_expression(s)}` | {s.role.name.lower()} | "
        f"{s.source.name + f' ({s.source.value})' if s.source else '-'} | {s.meaning} |" for s in specs)
    return "| buffer | dtype | shape | role | value source | meaning |\n|---|---|---|---|---|---|\n" + rows + "\n"


def _record_fields() -> str:
    rows = "\n".join(f"| {f.value} | `{f.name}` |" for f in RecordField)
    return "| word | field |\n|---|---|\n" + rows + "\n| 16 .. 16+T-1 | emitted token ids, position 0 first |\n"


def _rules() -> str:
    from ignition.catalog.rules import RULES
    rows = "\n".join(f"| `{rule}` | {text} |" for rule, text in RULES.items())
    return "| rule id | what it requires |\n|---|---|\n" + rows + "\n"


def _limits() -> str:
    from ignition.catalog.limits import LIMITS
    rows = "\n".join(f"| `{name}` | {'integer' if r.integer else 'finite number'} | {r} | {r.why} |"
                     for name, r in LIMITS.items())
    return "| value | kind | range | why |\n|---|---|---|---|\n" + rows + "\n"


def _geometry() -> str:
    from ignition.catalog.geometry import (ATTENTION_RECIPES, ATTENTION_WEIGHTS, DERIVED, FIELDS, KIND_LAYERS,
                                           OFFSETS, STATE_SHAPES, SYMBOL_RULES, VOCAB_WEIGHTS)
    attention = f"weight ({', '.join(ATTENTION_RECIPES)}; a rank: its heads)"
    tensors = [("state", n, e) for n, e in STATE_SHAPES.items()] + [("weight", n, e) for n, e in VOCAB_WEIGHTS.items()] \
        + [(attention, n, e) for n, e in ATTENTION_WEIGHTS.items()]
    rows = "\n".join(f"| {kind} | `{name}` | `[{', '.join(map(str, e))}]` |" for kind, name, e in tensors)
    symbols = "\n".join(f"| `{s}` | `{'.'.join(path)}` | {SYMBOL_RULES.get(s, 'GEOM-MODEL')} |" for s, path in FIELDS.items())
    symbols += "".join(f"\n| `{s}` | `{' * '.join('.'.join(FIELDS[p]) for p in parts)}` | GEOM-MODEL |"
                       for s, parts in DERIVED.items())
    symbols += "".join(f"\n| `{s}` | count of `{kind}` in `model.layer_kinds` | {SYMBOL_RULES[s]} |"
                       for s, kind in KIND_LAYERS.items())
    symbols += "".join(f"\n| `{s}` | `{'.'.join(FIELDS[field])} {offset:+d}` | GEOM-MODEL |"
                       for s, (field, offset) in OFFSETS.items())
    return ("| kind | tensor | shape |\n|---|---|---|\n" + rows + "\n\n| symbol | manifest field | rule |\n|---|---|---|\n"
            + symbols + "\n")


def _cache_kinds() -> str:
    from ignition.catalog.cache_kinds import CACHE_KINDS
    rows = "\n".join(f"| `{k.name}` | {k.code.value} | {', '.join(f'`{b}`' for b in k.buffers) or '-'} | "
                     f"`{k.layers_symbol}` | {', '.join(f'`model.{f}`' for f in k.fields) or '-'} | "
                     f"{'accepted' if k.built else 'reserved, refused'}: {k.summary} |" for k in CACHE_KINDS.values())
    return ("| kind | code | state buffers | layer count | model fields | status |\n|---|---|---|---|---|---|\n"
            + rows + "\n")


def _exchanges() -> str:
    from ignition.catalog.parallel import EXCHANGES
    rows = "\n".join(f"| `{e.name}` | {e.dtype} | {e.words} per {e.per} per rank | "
                     + "; ".join(f"{field}: words {first}..{first + count - 1}" for field, first, count in e.layout) + " |"
                     for e in EXCHANGES)
    return "| exchange | dtype | words | layout (other words are zero) |\n|---|---|---|---|\n" + rows + "\n"


def _sharded_launches() -> str:
    from ignition.catalog.parallel import SCORING_LAUNCHES, VOCABULARY_LAUNCHES

    def table(prefix, launches):
        rows = "\n".join(f"| {i} | `{prefix}.{x.name}` | `{x.op}` | {x.grid} | {x.writes} | "
                         f"{'`' + x.before + '` (all-gather)' if x.before else '-'} |"
                         for i, x in enumerate(launches, 1))
        return "| # | launch | issued by | grid | writes | precedes exchange |\n|---|---|---|---|---|---|\n" + rows + "\n"

    return (table("vocab", VOCABULARY_LAUNCHES) + "\nPrompt scoring, per row block of at most 64 rows "
            "(`catalog.parallel.SCORING_LAUNCHES`):\n\n" + table("score", SCORING_LAUNCHES))


def _shards() -> str:
    from ignition.catalog.parallel import SHARD_RULES
    rows = "\n".join(f"| `*.{r.suffix}` | {r.kind} | {'-' if r.dim is None else r.dim} |" for r in SHARD_RULES)
    return ("| weight | split | dim |\n|---|---|---|\n" + rows
            + "\n| anything else (norms, q/k norms) | replicated | - |\n")


SECTIONS = {
    "enums": _enum_tables,
    "completion-buffers": lambda: _buffer_table(COMPLETION_BUFFERS),
    "prompt-buffers": lambda: _buffer_table(PROMPT_BUFFERS),
    "lane-inputs": lambda: _buffer_table(LANE_INPUTS + CHUNK_INPUTS + SAMPLING_INPUTS + SPECULATIVE_INPUTS
                                         + MIXED_BUFFERS + WINDOW_INPUTS + PACKED_INPUTS),
    "constraint-inputs": lambda: _buffer_table(CONSTRAINT_INPUTS),
    "record-fields": _record_fields,
    "rules": _rules,
    "limits": _limits,
    "geometry": _geometry,
    "cache-kinds": _cache_kinds,
    "exchanges": _exchanges,
    "sharded-launches": _sharded_launches,
    "shards": _shards,
}


def render_blocks(text: str, sections, where: str) -> str:
    """``text`` with each ``<!-- BEGIN GENERATED: name -->`` block rewritten by ``sections[name]()``."""
    for name, fn in sections.items():
        pattern = re.compile(rf"(<!-- BEGIN GENERATED: {name} -->\n).*?(<!-- END GENERATED: {name} -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"{where} lacks the generated block {name!r}")
        text = pattern.sub(lambda m: m.group(1) + fn() + m.group(2), text)
    return text


def render(text: str) -> str:
    return render_blocks(text, SECTIONS, "docs/api.md")


def regenerate(doc: Path, render_text, argv: list[str]) -> int:
    """Rewrite ``doc`` with ``render_text``; with ``--check``, exit status 1 when it is stale instead."""
    current = doc.read_text()
    fresh = render_text(current)
    if "--check" in argv:
        return 0 if fresh == current else 1
    doc.write_text(fresh)
    return 0


def main(argv: list[str]) -> int:
    return regenerate(DOC, render, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
