"""The server's tokenizer_config.json and chat_template.jinja are read once, from bytes the core's verified
manifest records (issue 24, finding 3): a file swapped or added after verification is refused, not served."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from _serving_tokenizers import CHAT_TEMPLATE
from ignition.serve.tokenize import TokenizerLoadError, load_tokenizer_files


@pytest.fixture
def core(serving_cores, tmp_path) -> Path:
    copy = tmp_path / "core"
    shutil.copytree(serving_cores[0], copy)
    return copy


def _files(core: Path) -> dict[str, str]:
    return json.loads((core / "manifest.json").read_bytes())["files"]


def test_the_verified_files_are_read_once(core, monkeypatch):
    reads, hashes = [], _files(core)
    original = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: reads.append(self.name) or original(self))
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: pytest.fail(f"{self} read as text"))
    files = load_tokenizer_files(core / "tokenizer", None, 250, hashes=hashes)
    assert files.chat_template == CHAT_TEMPLATE and files.config["eos_token"] == "<|end|>"
    assert sorted(reads) == ["tokenizer_config.json"]  # the core has no chat_template.jinja


@pytest.mark.parametrize("swap", ["config", "added-template"])
def test_a_file_changed_after_verification_is_refused(core, swap):
    directory = core / "tokenizer"
    if swap == "config":
        config = json.loads((directory / "tokenizer_config.json").read_text())
        (directory / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": "{{ 'pwned' }}"}))
    else:
        (directory / "chat_template.jinja").write_text("{{ 'pwned' }}")
    with pytest.raises(TokenizerLoadError, match="FILE-HASH: expected .*changed after the core was verified"):
        load_tokenizer_files(directory, None, 250, hashes=_files(core))
    assert load_tokenizer_files(directory, None, 250).chat_template == "{{ 'pwned' }}"  # --tokenizer DIR: no record
