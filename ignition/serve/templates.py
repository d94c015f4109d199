"""Chat templates: where the server's comes from, and how a request-supplied one is rendered within bounds.

The server's template is, in order: ``--chat-template``, ``TOKENIZER/chat_template.jinja`` (where
Hugging Face saves it), ``TOKENIZER/tokenizer_config.json``'s ``chat_template``. A request's
``chat_template`` is refused unless the server allows them. Either is parsed with a size and nesting bound and rendered in Jinja's
immutable sandbox with a time, step and output bound (``TemplateLimits``): a trace function counts every
line the render executes, and the operators and calls that could allocate without running a
line check their operands first and refuse before they run: integer bit sizes (``**``, ``*``), repeat
counts and concatenations, ``%`` and ``str.format`` widths and precisions, ``join`` separators,
``indent`` and ``tojson`` indents, the ``replace`` filter and the ``str.replace``, ``str.join`` and
``str.expandtabs`` methods (``_BoundedEnvironment``). The server's own template (the core's, or
``--chat-template``) is rendered the same way: a core is untrusted data, so its template gets the same
pre-checks and limits, with an output bound of at least ``--max-prompt-bytes``. Rendering happens on a
worker thread, never on the event loop.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import re
import string
import sys
import time
from pathlib import Path

from jinja2 import nodes
from jinja2.ext import loopcontrols
from jinja2.filters import make_attrgetter
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ignition.serve.config import TemplateLimits


MAX_JSON_INDENT = 16  # tojson's indent in a request template; chat templates use 2 or 4

class TemplateLimitError(Exception):
    """A request's template went past one of the server's TemplateLimits."""


def template_of(directory: Path, config: dict, jinja: str | None) -> tuple[str | None, str]:
    """The tokenizer directory's chat template and where it came from (for messages): ``jinja`` is the text of
    its chat_template.jinja (read once by the caller), else tokenizer_config.json's ``chat_template``."""
    if jinja is not None:
        return jinja, str(directory / "chat_template.jinja")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    source = str(directory / "tokenizer_config.json")
    return (template if isinstance(template, str) else None), source


def special_token(config: dict, name: str) -> str | None:
    """A special token of tokenizer_config.json as text (Hugging Face writes some as AddedToken objects)."""
    value = config.get(name)
    return value.get("content") if isinstance(value, dict) else value


def _raise_exception(message):
    raise ValueError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _environment(env: ImmutableSandboxedEnvironment) -> ImmutableSandboxedEnvironment:
    """What Hugging Face's chat-template environment adds to Jinja."""
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_PERCENT_WIDTH = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_DIGITS = re.compile(r"\d+")
_NESTING_BLOCKS = (nodes.For, nodes.If, nodes.Macro, nodes.CallBlock, nodes.FilterBlock, nodes.With)


def _size(value) -> int:
    return len(value) if isinstance(value, str | list | tuple | dict) else 0


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox for request templates: every operator and call that could allocate or compute past a bound
    checks its operands' sizes first (integer bits, repeat counts, widths, separators, indents) and refuses
    before it runs."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self, limits: TemplateLimits):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        self.limits = limits
        _environment(self)
        for name in ("center", "wordwrap", "truncate"):
            self.filters[name] = self._bounded_widths(self.filters[name])
        self.filters["indent"] = self._bounded_indent(self.filters["indent"])
        self.filters["replace"] = self._bounded_replace(self.filters["replace"])
        self.filters["format"] = self._bounded_format(self.filters["format"])
        self.filters["join"] = self._bounded_join(self.filters["join"])
        self.filters["tojson"] = self._bounded_tojson(self.filters["tojson"])

    def _refuse(self, what: str):
        raise TemplateLimitError(f"{what} would exceed the template output bound of "
                                 f"{self.limits.max_output_bytes} bytes")

    def _check_ints(self, values) -> None:
        for value in values:
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > self.limits.max_output_bytes:
                self._refuse(f"an argument of {value}")

    def _check_bits(self, what: str, bits: int) -> None:
        if bits > self.limits.max_int_bits:
            raise TemplateLimitError(f"{what} would make an integer of about {bits} bits; at most "
                                     f"{self.limits.max_int_bits} bits are allowed in a template")

    def _check_percent(self, fmt, values) -> None:
        """``fmt % values``: literal widths and precisions, and the values a ``*`` takes them from."""
        if isinstance(fmt, str):
            for match in _PERCENT_WIDTH.finditer(fmt):
                self._check_ints(int(g) for g in match.groups() if g and g != "*")
            self._check_ints(values if isinstance(values, tuple) else (values,))

    def _check_format_spec(self, fmt: str) -> None:
        """``fmt.format(...)``: every number in a replacement field's spec (width, precision) is bounded."""
        for _, field_name, spec, _ in string.Formatter().parse(fmt):
            if field_name is not None and spec:
                if "{" in spec:
                    raise TemplateLimitError(f"the format field {{{field_name}:{spec}}} takes its spec from an "
                                             "argument, which templates may not do")
                if any(int(d) > self.limits.max_output_bytes for d in _DIGITS.findall(spec)):
                    self._refuse(f"the format field {{{field_name}:{spec}}}")

    def wrap_str_format(self, value):
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:  # checked when the method is looked up, before any call
            self._check_format_spec(value.__self__)
        return wrapped

    def _bounded_widths(self, filter_):
        @functools.wraps(filter_)
        def bounded(*args, **kwargs):
            self._check_ints([*args[1:], *kwargs.values()])
            return filter_(*args, **kwargs)
        return bounded

    def _bounded_indent(self, filter_):
        @functools.wraps(filter_)
        def bounded(s, width=4, *args, **kwargs):
            width_chars = width if isinstance(width, int) else _size(width)
            if len(str(s)) + (str(s).count("\n") + 1) * width_chars > self.limits.max_output_bytes:
                self._refuse(f"indent({width_chars} characters)")
            return filter_(s, width, *args, **kwargs)
        return bounded

    def _bounded_replace(self, filter_):
        @functools.wraps(filter_)
        def bounded(eval_ctx, s, old, new, count=None):
            text, old, new = str(s), str(old), str(new)
            hits = text.count(old) if old else len(text) + 1
            if len(text) + hits * len(new) > self.limits.max_output_bytes:
                self._refuse("replace")
            return filter_(eval_ctx, s, old, new, count)
        return bounded

    def _bounded_format(self, filter_):
        @functools.wraps(filter_)
        def bounded(value, *args, **kwargs):
            self._check_percent(value, tuple(args) or tuple(kwargs.values()))
            return filter_(value, *args, **kwargs)
        return bounded

    def _bounded_join(self, filter_):
        @functools.wraps(filter_)
        def bounded(eval_ctx, value, d="", attribute=None):
            items = list(value) if attribute is None else list(map(make_attrgetter(self, attribute), value))
            total = len(str(d)) * max(len(items) - 1, 0)
            if total > self.limits.max_output_bytes:
                self._refuse(f"join of {len(items)} items with a {len(str(d))}-character separator")
            for item in items:
                total += len(item) if isinstance(item, str) else len(str(item))
                if total > self.limits.max_output_bytes:
                    self._refuse(f"join of {len(items)} items")
            return filter_(eval_ctx, items, d)
        return bounded

    def _bounded_tojson(self, filter_):
        @functools.wraps(filter_)
        def bounded(value, indent=None):
            if indent is not None:
                width = indent if isinstance(indent, int) else _size(indent)
                if not isinstance(indent, int | str) or isinstance(indent, bool) or not 0 <= width <= MAX_JSON_INDENT:
                    raise TemplateLimitError(f"tojson(indent={str(indent)[:20]!r}): an indent of 0 to "
                                             f"{MAX_JSON_INDENT} spaces (or as short a string) is allowed")
            return filter_(value) if indent is None else self._indented_json(value, indent)
        return bounded

    def _indented_json(self, value, indent) -> str:
        """``json.dumps(value, indent=indent)`` written piece by piece, stopped as soon as it passes the bound."""
        pieces, size = [], 0
        for piece in json.JSONEncoder(ensure_ascii=False, indent=indent).iterencode(value):
            size += len(piece)
            if size > self.limits.max_output_bytes:
                self._refuse(f"tojson(indent={indent!r})")
            pieces.append(piece)
        return "".join(pieces)

    def call_binop(self, context, operator, left, right):
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(times, int) \
                        and len(seq) * times > self.limits.max_output_bytes:
                    self._refuse("a repetition")
            if ints:
                self._check_bits(f"{operator}", left.bit_length() + right.bit_length())
        elif operator == "**":
            if ints and abs(left) > 1 and right > 0:
                self._check_bits(f"a power with exponent {right}", int(right * math.log2(abs(left))) + 1)
        elif operator == "+":
            if isinstance(left, str | list | tuple) and isinstance(right, str | list | tuple) \
                    and len(left) + len(right) > self.limits.max_output_bytes:
                self._refuse("a concatenation")
        elif operator == "%":
            self._check_percent(left, right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's signature)
        __self._check_ints([*args, *kwargs.values()])
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str) and args:
            args = __self._check_str_method(owner, getattr(__obj, "__name__", ""), args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def _check_str_method(self, text: str, name: str, args: tuple, kwargs: dict) -> tuple:
        """``text.replace``, ``text.join`` and ``text.expandtabs`` (string methods that can build more than their
        operands) refused before they run when the result would pass the output bound; ``args`` as called (a
        ``join`` of an iterator gets the list it was read into)."""
        bound = self.limits.max_output_bytes
        if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
            old, new = args[0], args[1]
            count = args[2] if len(args) > 2 and isinstance(args[2], int) else kwargs.get("count", -1)
            hits = text.count(old) if old else len(text) + 1
            hits = hits if count is None or count < 0 else min(hits, count)
            if len(text) + hits * (len(new) - len(old)) > bound:
                self._refuse(f"str.replace ({hits} replacements of {len(new)} characters)")
        elif name == "join":
            items = list(args[0])
            total = len(text) * max(len(items) - 1, 0) + sum(len(item) if isinstance(item, str) else 0
                                                              for item in items)
            if total > bound:
                self._refuse(f"str.join of {len(items)} items with a {len(text)}-character separator")
            return (items, *args[1:])
        elif name == "expandtabs":
            width = args[0] if isinstance(args[0], int) else 8
            if len(text) + text.count("\t") * max(width, 0) > bound:
                self._refuse(f"str.expandtabs({width})")
        return args


def _nesting(node: nodes.Node, depth: int = 0) -> int:
    deepest = depth
    for child in node.iter_child_nodes():
        deepest = max(deepest, _nesting(child, depth + isinstance(child, _NESTING_BLOCKS)))
    return deepest


@functools.lru_cache(maxsize=8)
def _bounded_template(source: str, limits: TemplateLimits):
    size = len(source.encode("utf-8", "surrogatepass"))
    if size > limits.max_template_bytes:
        raise TemplateLimitError(f"the template has {size} bytes; at most {limits.max_template_bytes} are allowed")
    env = _BoundedEnvironment(limits)
    depth = _nesting(env.parse(source))
    if depth > limits.max_nesting:
        raise TemplateLimitError(f"the template nests {depth} blocks deep; at most {limits.max_nesting} are allowed")
    return env.from_string(source)


def render_bounded(source: str, limits: TemplateLimits, variables: dict) -> str:
    """Render a request's template on this thread within ``limits``; TemplateLimitError when one is passed."""
    template = _bounded_template(source, limits)
    deadline = time.monotonic() + limits.render_seconds
    steps = 0

    def trace(frame, event, arg):
        nonlocal steps
        if event == "line":
            steps += 1
            if steps > limits.max_steps:
                raise TemplateLimitError(f"the template ran more than {limits.max_steps} steps")
            if time.monotonic() > deadline:
                raise TemplateLimitError(f"the template rendered for more than {limits.render_seconds} s")
        elif event == "return" and isinstance(arg, str | list) and len(arg) > limits.max_output_bytes:
            raise TemplateLimitError(f"the template built a value of {len(arg)} items; at most "
                                     f"{limits.max_output_bytes} are allowed")
        return trace

    sys.settrace(trace)
    try:
        rendered = template.render(**variables)
    finally:
        sys.settrace(None)
    if len(rendered) > limits.max_output_bytes:
        raise TemplateLimitError(f"the template rendered {len(rendered)} characters; at most "
                                 f"{limits.max_output_bytes} are allowed")
    return rendered
