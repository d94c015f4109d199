"""The KV cache's server side: ``cache_salt`` as vLLM takes it, the options of ``serve`` and ``run`` (refused
before any load), the Prometheus metrics, the prefix-reuse refusal for per-slot state, and what a tensor-parallel
rank 0 changes outside a graph, which its other ranks repeat. The live server and the toy core are conftest's (the
toy core has no paged pool: its KV metrics read 0)."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pydantic
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

import ignition.runtime.core as runtime_core
from ignition.cli import app
from ignition.runtime.kv_pool import KVPool, PoolSize
from ignition.runtime.paging import (RankPool, block_manager_for, prefix_reuse_refusal, replay_operations,
                                     seed_penalty_counts, seed_prefix)
from ignition.runtime.parallel.group import RankGroup
from ignition.serve.defaults import KV_CACHE_OPTIONS, PREFIX_CACHING
from ignition.serve.protocol import ChatCompletionRequest, CompletionRequest

SALT_ERROR = "Parameter 'cache_salt' must be a non-empty string if provided."


@pytest.mark.parametrize("model,base", [(CompletionRequest, {"prompt": [1]}),
                                        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "a"}]})])
def test_cache_salt_is_a_non_empty_string(model, base):
    assert model.model_validate({**base, "cache_salt": "tenant-a"}).cache_salt == "tenant-a"
    assert model.model_validate(base).cache_salt is None
    with pytest.raises(pydantic.ValidationError, match=SALT_ERROR):
        model.model_validate({**base, "cache_salt": ""})
    with pytest.raises(pydantic.ValidationError, match="cache_salt"):
        model.model_validate({**base, "cache_salt": 7})


def test_an_empty_cache_salt_is_a_400_naming_it(served, monkeypatch):
    engine, salts = served.ctx.engine.engine, []
    submit = engine.submit
    monkeypatch.setattr(engine, "submit", lambda request, **kw: salts.append(request.cache_salt) or submit(request, **kw))
    response = served.post("/v1/completions", {"model": "toy", "prompt": [1, 2], "max_tokens": 1, "cache_salt": ""})
    assert response.status_code == 400
    error = response.json()["error"]
    assert SALT_ERROR in error["message"] and error["param"] == "cache_salt"
    salted = served.post("/v1/completions", {"model": "toy", "prompt": [1, 2], "max_tokens": 2, "cache_salt": "s"})
    plain = served.post("/v1/completions", {"model": "toy", "prompt": [1, 2], "max_tokens": 2})
    assert salted.status_code == plain.status_code == 200
    assert salts == ["s", None]  # the field reaches the engine's request, whose block hashes it keys
    assert salted.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]


def test_kv_metrics_are_exported_under_vllms_names(served):
    families = {f.name: f for f in text_string_to_metric_families(served.http.get("/metrics").text)}
    assert families["ignition:prefix_cache_queries"].type == "counter"
    assert families["ignition:prefix_cache_hits"].type == "counter"
    assert families["ignition:kv_cache_usage_perc"].type == "gauge"
    assert [s.value for s in families["ignition:kv_cache_usage_perc"].samples] == [0.0]  # the toy core has no pool


@pytest.fixture
def no_load(monkeypatch):
    def heavy(*args, **kwargs):
        raise AssertionError("the core was loaded before the options were checked")
    monkeypatch.setattr(runtime_core, "load_core", heavy)


@pytest.mark.parametrize("command", ["run", "serve"])
@pytest.mark.parametrize("option,message", [
    (["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization sizes the KV cache from a CUDA device's memory, "
                                          "and this load runs on cpu; give the KV cache's size as --kv-cache-memory"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be a fraction in (0, 1], got 1.5"),
    (["--kv-cache-memory", "0"], "--kv-cache-memory must be a positive number of bytes, got 0"),
    (["--kv-host-memory", "-1"], "--kv-host-memory must be 0 (no host tier) or a positive number of bytes, got -1"),
    (["--state-snapshot-memory", "-1"], "--state-snapshot-memory must be 0 (no snapshots) or a positive number of "
                                        "bytes, got -1"),
])
def test_cache_options_are_refused_before_loading(no_load, toy_core, command, option, message):
    args = [command, str(toy_core)] + (["--prompt-ids", "1,2"] if command == "run" else [])
    result = CliRunner().invoke(app, args + ["--device", "cpu"] + option)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()) and "Traceback" not in result.output


def test_the_options_table_holds_the_cli_defaults():
    assert PREFIX_CACHING.default is True
    flags = [option.flag.split("/")[0] for option in KV_CACHE_OPTIONS]
    assert flags == ["--enable-prefix-caching", "--kv-cache-memory", "--kv-host-memory", "--state-snapshot-memory",
                     "--gpu-memory-utilization"]
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "300"})
    for flag in flags + ["--no-enable-prefix-caching"]:
        assert flag in result.output


class Pool:
    num_blocks, block_size, host_blocks, paged = 9, 4, 0, True
    window = None  # no sliding layers: one KV-cache group


def fake_core(state_names, group=None, pool=Pool()):
    return SimpleNamespace(state={name: None for name in state_names}, group=group, kv_pool=pool,
                           path=SimpleNamespace(name="core"))


def test_prefix_reuse_is_refused_with_one_log_line_for_per_slot_state(caplog, monkeypatch):
    monkeypatch.setattr("ignition.runtime.paging.paged_states", lambda: {"k_cache", "v_cache"})
    paged = fake_core(["k_cache", "v_cache", "penalty_counts"])
    assert prefix_reuse_refusal(paged) is None
    with caplog.at_level(logging.INFO, logger="ignition.runtime"):
        assert block_manager_for(paged, True).prefix_caching
        hybrid = block_manager_for(fake_core(["k_cache", "v_cache", "k_window_cache", "v_window_cache"]), True)
        parallel = block_manager_for(fake_core(["k_cache", "v_cache", "penalty_counts"], group=object()), True)
        assert block_manager_for(fake_core(["k_cache"]), False).prefix_caching is False
    assert not hybrid.prefix_caching and parallel.prefix_caching and isinstance(parallel.pool, RankPool)
    assert [r.getMessage() for r in caplog.records] == [
        "prefix caching is off for core: its layers keep per-slot state (k_window_cache, v_window_cache) that a "
        "prefix hit cannot resume"]
    slot_only = SimpleNamespace(num_blocks=0, block_size=4, host_blocks=0, paged=False)
    assert block_manager_for(fake_core(["k_cache"], pool=slot_only), True) is None
    assert block_manager_for(fake_core(["k_cache"], pool=None), True) is None


def test_seeded_penalty_counts_are_what_a_prefill_from_zero_counts():
    state = {"penalty_counts": torch.full((3, 2, 10), 5, dtype=torch.int32)}  # a previous request's counts
    seed_penalty_counts(state, 1, [3, 3, 7, 0])
    expected = torch.zeros(2, 10, dtype=torch.int32)
    expected[0, 3], expected[0, 7], expected[0, 0] = 2, 1, 1
    assert torch.equal(state["penalty_counts"][1], expected)
    assert (state["penalty_counts"][0] == 5).all() and (state["penalty_counts"][2] == 5).all()


class RecordingGroup:
    """Rank 0's side of a group whose submissions are not sent: the operations of the next one."""

    def __init__(self):
        self.pending = []

    def replay(self, name, *arguments):
        RankGroup.replay(self, name, *arguments)


def test_what_rank_0_changes_outside_a_graph_every_rank_repeats():
    """A prefix hit's seeded counts and the block manager's moves run on rank 0 and, replayed from the JSON of the
    next wake line, leave another rank's state the same; an unknown operation is refused by name."""
    def state():
        torch.manual_seed(0)
        return {"penalty_counts": torch.full((3, 2, 10), 5, dtype=torch.int32), "k_cache": torch.randn(1, 6, 2, 3)}

    cores = []
    for _ in range(2):
        tensors = state()
        pool = KVPool(PoolSize(paged=True, num_blocks=6, block_size=2, bytes_per_block=24, max_blocks=2,
                               declared_blocks=6, host_blocks=2), {"k_cache": tensors["k_cache"]},
                      {"k_cache": torch.zeros(1, 2, 2, 3)})
        cores.append(SimpleNamespace(state=tensors, kv_pool=pool, group=None))
    rank0, peer = cores
    rank0.group = group = RecordingGroup()
    seed_prefix(rank0, 2, [3, 3, 9])
    moved = RankPool(rank0.kv_pool, group)
    moved.to_host([4], [1])
    moved.copy_blocks([1], [4])
    moved.from_host([1], [5])
    line = RankGroup.submission(group, 7)
    index, _, operations = line.partition(" ")
    assert index == "7" and group.pending == [] and RankGroup.submission(group, 3) == "3"
    replay_operations(peer, json.loads(operations))
    for name in rank0.state:
        assert torch.equal(peer.state[name], rank0.state[name]), name
    assert torch.equal(peer.kv_pool.host["k_cache"], rank0.kv_pool.host["k_cache"])
    assert peer.state["penalty_counts"][2, 0, 3] == 2 and torch.equal(peer.state["k_cache"][0, 5],
                                                                      state()["k_cache"][0, 4])
    with pytest.raises(ValueError, match="rank 0 asked for 'reset'; expected seed_penalty_counts"):
        replay_operations(peer, [["reset", 1]])


@pytest.mark.parametrize("enabled", [True, False])
def test_the_prefix_caching_flag_reaches_the_engine(enabled):
    from ignition.cli.loading import SharedOptions

    shared = SharedOptions(speculative=None, enable_prefix_caching=enabled, state_snapshot_memory=4096)
    assert shared.engine_options(loaded=None) == {"prefix_caching": enabled, "state_snapshot_memory": 4096}
