"""export-core never deletes what it did not write: files a core does not list, directories that only
look like cores, and user directories named like an export's leftovers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ignition.exporter.export import export_core
from ignition.exporter.publish import PublishError, check_output, is_core, leftovers, recover
from ignition.recipes.base import ExportOptions
from ignition.validate.core import validate_core

TOY = dict(recipe="toy", capacities=(1,))


def test_overwrite_refuses_a_core_holding_a_file_it_does_not_list(tmp_path, toy_core):
    out = tmp_path / "core"
    shutil.copytree(toy_core, out)
    (out / "NOTES.txt").write_text("my notes")
    with pytest.raises(PublishError, match=r"refuses to replace .*FILE-EXTRA.*NOTES.txt"):
        export_core(ExportOptions(**TOY), out, overwrite=True)
    assert (out / "NOTES.txt").read_text() == "my notes"
    assert not list(tmp_path.glob(".core.*"))


@pytest.mark.parametrize("kind", ["minimal-manifest", "wrong-hash"])
def test_a_directory_that_only_looks_like_a_core_is_not_replaced(tmp_path, toy_core, kind):
    out = tmp_path / "data"
    if kind == "minimal-manifest":
        out.mkdir()
        (out / "manifest.json").write_text(json.dumps({"format_version": 1, "catalog": "c", "files": {}}))
        kept = out / "thesis.tex"
    else:
        shutil.copytree(toy_core, out)
        kept = out / "weights.safetensors"
    kept.write_text("irreplaceable")
    assert not is_core(out)
    with pytest.raises(PublishError, match="refuses to replace .* not an Ignition core exactly as exported"):
        export_core(ExportOptions(**TOY), out, overwrite=True)
    assert kept.read_text() == "irreplaceable"


def test_user_directories_named_like_leftovers_are_kept(tmp_path):
    out = tmp_path / "newcore"
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    mine = [tmp_path / ".newcore.old-999999", tmp_path / f".newcore.partial-{child.pid}",
            tmp_path / f".newcore.partial-{os.getpid()}"]
    for directory in mine:
        directory.mkdir()
        (directory / "keep.txt").write_text("user data")
    assert leftovers(out) == [] and recover(out) == []
    with pytest.raises(PublishError, match=r"partial-\d+ exists and was not created by an Ignition export"):
        export_core(ExportOptions(**TOY), out)  # its staging name is taken by a user directory
    shutil.rmtree(mine.pop())
    export_core(ExportOptions(**TOY), out)
    assert validate_core(out, check_graphs=False).ok
    assert all((d / "keep.txt").read_text() == "user data" for d in mine)
    assert not list(tmp_path.glob(".newcore.ignition-*"))  # no claim outlives a finished export


def test_the_current_directory_is_never_an_output(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    for out in (Path("."), tmp_path, Path("/")):
        with pytest.raises(PublishError, match="current directory or the file system root"):
            check_output(out, True, {})
    assert (tmp_path / "notes.txt").exists()


@pytest.mark.parametrize("plant", ["fifo", "links-only", "empty-directory", "manifest-fifo"])
def test_overwrite_deletes_nothing_the_core_does_not_list(tmp_path, toy_core, plant):
    """An unlisted FIFO, a subdirectory holding only symbolic links or nothing, and a manifest that is a FIFO
    (never waited on): each makes --out no core to replace, and each is still there afterwards."""
    out = tmp_path / "core"
    shutil.copytree(toy_core, out)
    (tmp_path / "target.txt").write_text("kept")
    kept = {"fifo": out / "queue", "links-only": out / "links" / "to-target",
            "empty-directory": out / "empty", "manifest-fifo": out / "manifest.json"}[plant]
    if plant == "links-only":
        kept.parent.mkdir()
        os.symlink(tmp_path, kept)  # a link to a directory is no file: only FILE-EXTRA of links keeps it
    elif plant == "empty-directory":
        kept.mkdir()
    else:
        kept.unlink(missing_ok=True)
        os.mkfifo(kept)
    assert not is_core(out)
    with pytest.raises(PublishError, match="refuses to replace"):
        export_core(ExportOptions(**TOY), out, overwrite=True)
    assert os.path.lexists(kept) and (tmp_path / "target.txt").read_text() == "kept"
