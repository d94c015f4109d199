"""export-core loses no data: what --overwrite may replace, crash-safe replacement and recovery,
stale staging directories, and tokenizer files (links out of the checkpoint, corrupt files)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from ignition.exporter import publish as publish_module
from ignition.exporter.export import export_core
from ignition.exporter.publish import PublishError, leftovers, publish, recover, staging_dir
from ignition.recipes.base import ExportOptions, RecipeError
from ignition.validate.core import validate_core

TOY = dict(recipe="toy", capacities=(1,))
REPO = Path(__file__).resolve().parents[1]


def word_tokenizer(directory: Path, size: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {f"w{i}": i for i in range(size)}
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w1"}))
    return directory


def manifest_of(core: Path) -> bytes:
    return (core / "manifest.json").read_bytes()


# -- what --overwrite may replace ----------------------------------------------------------------
def test_overwrite_refuses_a_directory_that_is_not_a_core(tmp_path):
    out = tmp_path / "photos"
    out.mkdir()
    (out / "holiday.jpg").write_bytes(b"irreplaceable")
    with pytest.raises(PublishError, match=r"refuses to replace .*photos.*not an Ignition core"):
        export_core(ExportOptions(**TOY), out, overwrite=True)
    assert (out / "holiday.jpg").read_bytes() == b"irreplaceable"
    assert not list(tmp_path.glob(".photos.*"))


@pytest.mark.parametrize("kind", ["file", "symlink", "bad-manifest"])
def test_overwrite_refuses_files_links_and_fake_manifests(tmp_path, toy_core, kind):
    out = tmp_path / "out"
    if kind == "file":
        out.write_text("data")
    elif kind == "symlink":
        out.symlink_to(toy_core, target_is_directory=True)
    else:
        out.mkdir()
        (out / "manifest.json").write_text(json.dumps({"name": "not ours"}))
    with pytest.raises(PublishError, match="refuses to replace"):
        export_core(ExportOptions(**TOY), out, overwrite=True)
    assert out.exists() or out.is_symlink()
    assert validate_core(toy_core).ok


def test_never_the_checkpoint_or_tokenizer_it_reads(tmp_path):
    checkpoint_dir = tmp_path / "ckpt"
    tokenizer = word_tokenizer(checkpoint_dir / "tok", 10)
    source = tmp_path / "core"
    export_core(ExportOptions(**TOY), source)
    weights = checkpoint_dir / "toy.safetensors"
    shutil.copyfile(source / "weights.safetensors", weights)
    for out, label in [(checkpoint_dir, "checkpoint"), (weights, "checkpoint"), (tokenizer, "tokenizer directory"),
                       (tmp_path, "checkpoint")]:
        with pytest.raises(PublishError, match=f"is the {label} .* or holds it"):
            export_core(ExportOptions(**TOY, checkpoint=weights, tokenizer=tokenizer), out, overwrite=True)
    assert weights.is_file() and (tokenizer / "tokenizer.json").is_file()


def test_overwrite_replaces_a_core(tmp_path):
    out = tmp_path / "core"
    export_core(ExportOptions(**TOY, seed=1), out)
    before = manifest_of(out)
    export_core(ExportOptions(**TOY, seed=2), out, overwrite=True)
    assert manifest_of(out) != before and validate_core(out, check_graphs=False).ok
    assert leftovers(out) == []


@pytest.mark.parametrize("out", ["/proc/ignition-core", "file.txt/core"])
def test_unwritable_out_is_refused_before_any_work(tmp_path, monkeypatch, out):
    (tmp_path / "file.txt").write_text("x")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("ignition.exporter.export.build_recipe", lambda options: pytest.fail("built anyway"))
    with pytest.raises(PublishError, match="cannot create the core"):
        export_core(ExportOptions(**TOY), Path(out))


# -- crash-safe replacement ----------------------------------------------------------------------
def two_cores(tmp_path, toy_core):
    """An existing core at out/ and a finished staging directory holding a different one."""
    out = tmp_path / "core"
    shutil.copytree(toy_core, out)
    staging = staging_dir(out)  # claimed by this process, as an export makes it
    shutil.copytree(toy_core, staging, dirs_exist_ok=True)
    (staging / "manifest.json").write_text((staging / "manifest.json").read_text().replace('"toy"', '"toy-new"'))
    return out, staging


def test_crash_between_renames_keeps_the_old_core_and_recovers(tmp_path, toy_core, monkeypatch):
    out, staging = two_cores(tmp_path, toy_core)
    old = manifest_of(out)
    renames, real_rename = [], os.rename

    def crash_on_second(src, dst):
        renames.append((src, dst))
        if len(renames) == 2:
            raise KeyboardInterrupt("killed between the renames")
        real_rename(src, dst)

    monkeypatch.setattr(publish_module.os, "rename", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        publish(staging, out, overwrite=True)
    monkeypatch.setattr(publish_module.os, "rename", real_rename)
    assert not out.exists()  # the window the issue describes: no core at NAME ...
    (retired,) = [p for kind, _, p in leftovers(out) if kind == "old"]
    assert manifest_of(retired) == old  # ... but the old one is complete
    done = recover(out)
    assert manifest_of(out) == old and validate_core(out, check_graphs=False).ok
    assert any("restored" in line for line in done)
    assert leftovers(out) == []  # the cut-off staging directory is gone too


def test_killed_process_between_renames_is_recovered_by_the_next_export(tmp_path, toy_core):
    out, staging = two_cores(tmp_path, toy_core)
    old = manifest_of(out)
    child_staging = tmp_path / ".core.partial-CHILD"
    staging.rename(child_staging)
    code = f"""
import os, sys
from pathlib import Path
from ignition.exporter import publish as p
calls = []
real = os.rename
def rename(src, dst):
    calls.append(src)
    if len(calls) == 2:
        os._exit(9)  # like SIGKILL: no finally, no cleanup
    real(src, dst)
staging = Path({str(child_staging)!r}).rename(Path({str(tmp_path)!r}) / f".core.partial-{{os.getpid()}}")
p.claim(staging)  # as staging_dir claims the directory it creates
p.os.rename = rename
p.publish(staging, Path({str(out)!r}), overwrite=True)
"""
    child = subprocess.run([sys.executable, "-c", code], env=os.environ | {"PYTHONPATH": str(REPO)})
    assert child.returncode == 9
    assert not out.exists()
    assert sorted(kind for kind, _, _ in leftovers(out)) == ["old", "partial"]
    export_core(ExportOptions(**TOY), out, overwrite=True)  # recovers, then replaces
    assert leftovers(out) == [] and validate_core(out, check_graphs=False).ok
    assert manifest_of(out) != old


def test_stale_leftovers_of_dead_processes_are_removed_live_ones_kept(tmp_path, toy_core):
    out = tmp_path / "core"
    shutil.copytree(toy_core, out)
    stage = ("import sys, time; from pathlib import Path; from ignition.exporter.publish import staging_dir; "
             "(staging_dir(Path(sys.argv[1])) / 'x').write_text('x'); print(flush=True); time.sleep(float(sys.argv[2]))")
    env = os.environ | {"PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", stage, str(out), "0"], env=env, check=True, capture_output=True)
    live = subprocess.Popen([sys.executable, "-c", stage, str(out), "60"], env=env, stdout=subprocess.PIPE)
    try:
        live.stdout.readline()  # its staging directory exists
        dead = next(pid for kind, pid, _ in leftovers(out) if pid != live.pid)
        (tmp_path / f".other.partial-{dead}").mkdir()  # another output's leftovers are not ours to judge
        recover(out)
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".") and p.is_dir()) == [
            f".core.partial-{live.pid}", f".other.partial-{dead}"]
        assert validate_core(out, check_graphs=False).ok
    finally:
        live.kill()
        live.wait()


# -- tokenizer files -----------------------------------------------------------------------------
def test_tokenizer_link_out_of_the_directory_is_refused(tmp_path):
    tokenizer = word_tokenizer(tmp_path / "tok", 10)
    secret = tmp_path / "host-secret.json"
    secret.write_text(json.dumps({"password": "hunter2"}))
    (tokenizer / "tokenizer_config.json").unlink()
    (tokenizer / "tokenizer_config.json").symlink_to(secret)
    with pytest.raises(RecipeError, match=r"tokenizer file .*tokenizer_config.json is a link to .*host-secret.json"):
        export_core(ExportOptions(**TOY, tokenizer=tokenizer), tmp_path / "core")
    assert not (tmp_path / "core").exists() and not list(tmp_path.glob(".core.*"))


def test_tokenizer_links_inside_the_directory_and_the_hub_cache_are_copied_as_files(tmp_path):
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    blobs = word_tokenizer(repo / "blobs", 12)
    snapshot.mkdir(parents=True)
    (snapshot / "tokenizer.json").symlink_to(Path("../../blobs/tokenizer.json"))
    (snapshot / "tokenizer_config.json").symlink_to(blobs / "tokenizer_config.json")
    out = tmp_path / "core"
    export_core(ExportOptions(**TOY, tokenizer=snapshot), out)
    copied = out / "tokenizer" / "tokenizer.json"
    assert not copied.is_symlink() and copied.read_bytes() == (blobs / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("name, content, message", [
    ("tokenizer.json", b'{"version": "1.0", "model": {"type": "Nope"}}', "tokenizer.json does not load"),
    ("tokenizer.json", b"\xff\xfe garbage", "tokenizer.json is not valid UTF-8 JSON"),
    ("tokenizer_config.json", b"{truncated", "tokenizer_config.json is not valid UTF-8 JSON"),
])
def test_corrupt_tokenizer_fails_the_export_before_publishing(tmp_path, name, content, message):
    tokenizer = word_tokenizer(tmp_path / "tok", 10)
    (tokenizer / name).write_bytes(content)
    with pytest.raises(RecipeError, match=message):
        export_core(ExportOptions(**TOY, tokenizer=tokenizer), tmp_path / "core")
    assert not (tmp_path / "core").exists() and not list(tmp_path.glob(".core.*"))


def test_tokenizer_larger_than_the_vocabulary_is_refused_at_export(tmp_path):
    tokenizer = word_tokenizer(tmp_path / "tok", 300)
    with pytest.raises(RecipeError, match="token ids reach 299, beyond the model's vocabulary of 250"):
        export_core(ExportOptions(**TOY, tokenizer=tokenizer), tmp_path / "core")


def test_a_published_core_is_on_disk_before_its_name_is(tmp_path, monkeypatch):
    """Every file and directory of the core is flushed (fsync) before the rename publishes it, and the parent
    directory after: a crash leaves the old name or a whole core, never a name over empty files."""
    synced, renamed = [], []
    real_fsync, real_rename = os.fsync, os.rename
    monkeypatch.setattr(publish_module.os, "fsync",
                        lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    monkeypatch.setattr(publish_module.os, "rename",
                        lambda src, dst: renamed.append((str(src), len(synced))) or real_rename(src, dst))
    out = tmp_path / "core"
    export_core(ExportOptions(**TOY), out)
    staging, flushed_before = renamed[-1]
    files = [str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()]
    assert files and {str(Path(p).relative_to(staging)) for p in synced[:flushed_before]
                      if Path(p).is_relative_to(staging) and p != staging} >= set(files)
    assert staging in synced[:flushed_before]  # the directory entries too
    assert synced[flushed_before:] == [str(tmp_path)]  # then the rename itself
