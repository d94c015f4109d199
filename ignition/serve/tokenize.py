"""The tokenizer behind the server: its files, and POST /tokenize, POST /detokenize, GET /tokenizer_info.

Shapes follow vLLM (``vllm/entrypoints/serve/tokenize``), so lm-evaluation-harness's remote
tokenizer works against the server without downloading one: /tokenize takes a prompt or chat
messages (rendered with the server's template), /detokenize decodes ids with special tokens
kept (Hugging Face's ``decode``), /tokenizer_info is tokenizer_config.json without file paths,
with ``tokenizer_class``, ``eos_token``, ``bos_token`` and the served ``chat_template``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ignition.serve.chat import chat_prompt_ids
from ignition.serve.context import ServerContext
from ignition.serve.errors import ApiError, tokenizer_errors
from ignition.serve.protocol import (DetokenizeRequest, DetokenizeResponse, TokenizeChatRequest,
                                     TokenizeCompletionRequest, TokenizeResponse, TokenizerInfoResponse)
from ignition.serve.templates import template_of

TOKENIZER_DIR = "tokenizer"  # a core's tokenizer files, as its manifest's files map names them


class TokenizerLoadError(ValueError):
    """--tokenizer names a directory the server cannot use."""


@dataclass(slots=True)
class TokenizerFiles:
    tokenizer: object | None
    directory: Path
    config: dict
    chat_template: str | None
    chat_template_source: str


def _read_once(directory: Path, name: str, hashes: dict[str, str] | None) -> bytes | None:
    """A tokenizer file's bytes, read once; with ``hashes`` (the core's verified files map) they must be the bytes
    the manifest records, so a file swapped or added after verification is refused (FILE-HASH)."""
    path, rel = directory / name, f"{TOKENIZER_DIR}/{name}"
    try:
        data = path.read_bytes() if path.is_file() else None
    except OSError as exc:
        raise TokenizerLoadError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    if hashes is None or (data is None and rel not in hashes):
        return data
    expected, found = hashes.get(rel), None if data is None else hashlib.sha256(data).hexdigest()
    if found != expected:
        raise TokenizerLoadError(f"{path}: FILE-HASH: expected {'sha256 ' + expected if expected else 'no such file'} "
                                 f"(the core's verified manifest), found {'sha256 ' + found if found else 'none'}; "
                                 "the file changed after the core was verified")
    return data


def load_tokenizer_files(directory: Path, tokenizer: object | None, vocab_size: int,
                         load: bool = False, hashes: dict[str, str] | None = None) -> TokenizerFiles:
    """The tokenizer directory's config and template, each read once; with ``load``, its tokenizer.json too
    (``--tokenizer``). ``hashes``: the loaded core's files map, for the core's own tokenizer directory."""
    if load:
        file = directory / "tokenizer.json"
        if not file.is_file():
            raise TokenizerLoadError(f"--tokenizer {directory}: no tokenizer.json there")
        from tokenizers import Tokenizer
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception for every malformed file
            raise TokenizerLoadError(f"--tokenizer {file}: cannot load it: {exc}") from None
        size = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        if size > vocab_size:
            raise TokenizerLoadError(f"--tokenizer {directory}: its ids reach {size - 1}, outside the core's "
                                     f"vocabulary [0, {vocab_size})")
    config_bytes = _read_once(directory, "tokenizer_config.json", hashes)
    jinja_bytes = _read_once(directory, "chat_template.jinja", hashes)
    try:
        config = json.loads(config_bytes) if config_bytes is not None else {}
        jinja = jinja_bytes.decode("utf-8") if jinja_bytes is not None else None
    except (UnicodeDecodeError, ValueError) as exc:
        raise TokenizerLoadError(f"{directory}: tokenizer_config.json or chat_template.jinja is not readable "
                                 f"UTF-8 / JSON: {exc}") from None
    config = config if isinstance(config, dict) else {}
    template, source = template_of(directory, config, jinja)
    return TokenizerFiles(tokenizer, directory, config, template, source)


def _token_strs(ctx: ServerContext, ids: list[int]) -> list[str | None]:
    return [ctx.tokenizer.id_to_token(i) for i in ids]


def tokenize(ctx: ServerContext, body: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
    """POST /tokenize (on a preprocessing thread)."""
    if isinstance(body, TokenizeChatRequest):
        ids = chat_prompt_ids(ctx, body)
    else:
        ids = ctx.encode(body.prompt, body.add_special_tokens, "prompt")
    return TokenizeResponse(count=len(ids), max_model_len=ctx.max_context, tokens=ids,
                            token_strs=_token_strs(ctx, ids) if body.return_token_strs else None)


def detokenize(ctx: ServerContext, body: DetokenizeRequest) -> DetokenizeResponse:
    """POST /detokenize (on a preprocessing thread): special tokens are kept, as Hugging Face's decode does."""
    if ctx.tokenizer is None:
        raise ApiError(f"this core has no tokenizer ({ctx.core.path}/tokenizer/tokenizer.json)", "tokens")
    outside = [t for t in body.tokens if not 0 <= t < ctx.core.vocab_size]
    if outside:
        raise ApiError(f"token id {outside[0]} is outside the vocabulary [0, {ctx.core.vocab_size})", "tokens")
    # decode_batch releases the GIL while Rust decodes (decode does not)
    with tokenizer_errors("tokens", "decode"):
        return DetokenizeResponse(prompt=ctx.tokenizer.decode_batch([body.tokens], skip_special_tokens=False)[0])


def _plain(value):
    """AddedToken objects ({"content": ..., ...}) as their text, recursively."""
    if isinstance(value, dict):
        return value["content"] if isinstance(value.get("content"), str) else {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def tokenizer_info(ctx: ServerContext) -> TokenizerInfoResponse:
    """GET /tokenizer_info."""
    if ctx.tokenizer is None:
        raise ApiError(f"this core has no tokenizer ({ctx.core.path}/tokenizer/tokenizer.json)", None)
    info = {k: _plain(v) for k, v in ctx.tokenizer_config.items() if not k.endswith("_file")}
    info.pop("chat_template", None)
    token_ids = {"eos_token": ctx.core.spec.eos_token_id, "bos_token": None}  # a manifest records no BOS id
    for name, token_id in token_ids.items():  # lm-eval's remote tokenizer reads both keys
        if info.get(name) is None:
            info[name] = ctx.tokenizer.id_to_token(token_id) if isinstance(token_id, int) else None
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    if ctx.chat_template is not None:
        info["chat_template"] = ctx.chat_template
    return TokenizerInfoResponse(**info)
