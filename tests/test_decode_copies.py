"""One decode step of a real-width core copies no KV cache and reads only the live key window (issues 23, 52).

A 4-layer checkpoint at Qwen3-0.6B's width (hidden 1024, 16 query and 8 KV heads, head_dim 128, MLP
3072; a 4,096-word vocabulary keeps the export short: the vocabulary never touches the cache) is
exported, loaded and driven through the engine. A dispatch mode watches every operator of one
decode step at batch 4, 2 and 1: the caches are pools of blocks (catalog/geometry.py ``PAGED_STATE``), and no
operator may read a pool and produce a new tensor larger than the lanes' live key window of one layer (the
one gather a layer makes through the block tables, ``[lanes, window, kv_heads, head_dim]``; a clone, an expansion
of the grouped heads or a gather of whole slots or of the pool would be larger), the gathers of a step add up
to at most that window for each layer's K and V, and attention must read the live window, not all
``max_seq_len`` positions. With the paged attention kernel (``runtime/backends/paged_attention.py``, the CPU's
default), a step gathers nothing from a pool: the kernel is handed the live window's cells, and the cache writes
copy the lanes' new rows into their cells (``write_cells``).

DeepSeek V4's state (rings and entry tables per slot, recipes/deepseek_v4_attention.py) obeys the same rule: a
decode step of the tiny checkpoint gathers from each buffer only the ring cells its rows read, the slot's entry
tables and the old values of the cells it writes, never a slot's whole ring.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ignition.catalog.buffers import KEY_WINDOW, WINDOWS

MAX_SEQ_LEN, KV_HEADS, HEAD_DIM, SLOTS = 256, 8, 128, 4


def storages_read_and_fresh_outputs(args, kwargs, out) -> tuple[set[int], list[torch.Tensor]]:
    """An operator call's input storages (not oneDNN's packed weights: opaque, never the cache or the logits) and
    the output tensors in a storage none of its inputs had."""
    read = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and not t.is_mkldnn}
    fresh = [t for t in pytree.tree_leaves(out)
             if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in read]
    return read, fresh


class CacheCopies(TorchDispatchMode):
    """Operators that read the cache's storage and return a fresh tensor larger than ``limit`` bytes."""

    def __init__(self, cache_storages: set[int], limit: int):
        super().__init__()
        self.cache_storages, self.limit = cache_storages, limit
        self.copies: list[tuple[str, tuple[int, ...]]] = []
        self.attention_keys: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        read, fresh = storages_read_and_fresh_outputs(args, kwargs, out)
        if "scaled_dot_product" in str(func):
            self.attention_keys.append(tuple(args[1].shape))
        if read & self.cache_storages:
            self.copies += [(str(func), tuple(t.shape)) for t in fresh if t.untyped_storage().nbytes() > self.limit]
        return out


@pytest.fixture(scope="module")
def real_width_core(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ignition.exporter.export import export_core
    from ignition.recipes.base import ExportOptions

    root = tmp_path_factory.mktemp("real-width")
    config = Qwen3Config(vocab_size=4096, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                         num_attention_heads=16, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).eval().save_pretrained(root / "checkpoint")
    export_core(ExportOptions(recipe="qwen3", checkpoint=root / "checkpoint", capacities=(1, 2, SLOTS), chunk_limit=16,
                              max_seq_len=MAX_SEQ_LEN), root / "core")
    return root / "core"


@pytest.fixture(scope="module")
def loaded(real_width_core):
    from ignition.runtime.core import load_core
    return load_core(real_width_core, gemm="packed")  # the packed path, whichever this CPU's calibration picks


@pytest.fixture(scope="module")
def gathering(real_width_core):
    """The same core with attention on ATen's kernel over the gathered windows (no paged attention kernel)."""
    from ignition.runtime.core import load_core
    return load_core(real_width_core, gemm="packed", native_kernels=False)


def decode_round(core, lanes: int):
    """An engine whose next step is one decode round of ``lanes`` lanes (their prompts prefilled)."""
    from ignition.runtime.engine import Engine
    from ignition.runtime.requests import Request

    engine = Engine(core)
    for lane in range(lanes):
        engine.submit(Request([lane + 1, 7, 9, 11, 13], max_tokens=8, logprobs=5, ignore_eos=True))
    while not engine.running or any(s.prefilled < len(s.context()) for s in engine.running):
        engine.step()  # every prompt prefilled: the next step is one decode round of every lane
    return engine


@pytest.mark.parametrize("lanes", [SLOTS, 2, 1])
def test_a_paged_decode_step_gathers_no_window_and_attends_over_the_live_one(loaded, lanes: int, monkeypatch):
    from ignition.runtime.backends import paged_attention

    if not loaded.options.native_kernels:
        pytest.skip(f"this machine cannot build the paged attention kernel: {paged_attention.unavailable()}")
    core = loaded
    engine = decode_round(core, lanes)
    window = WINDOWS[KEY_WINDOW].granule  # the prompts and their 8 tokens fit in one
    calls = []
    attend = paged_attention._graph_attend

    def recorded(query, key_cache, value_cache, layer, cells, mask, scale):
        calls.append((tuple(query.shape), layer, cells.shape[0], key_cache.untyped_storage().data_ptr()))
        return attend(query, key_cache, value_cache, layer, cells, mask, scale)

    monkeypatch.setattr(paged_attention, "_graph_attend", recorded)
    watch = CacheCopies({t.untyped_storage().data_ptr() for t in core.state.values()}, 0)
    with watch:
        engine.step()
    # no gather of the pool at all: the writes copy each lane's new rows into their cells in place
    # (cell_writes.write_cells), and attention reads the cells where they are
    assert not [copy for copy in watch.copies if "index_select" in copy[0]], watch.copies
    assert not watch.attention_keys
    # one call a layer, each over the lanes' live window (one 32-position granule, not the 256 cached)
    assert sorted(call[1] for call in calls) == [0, 1, 2, 3]
    assert {call[0] for call in calls} == {(lanes, KV_HEADS, 2, HEAD_DIM)}
    assert {call[2] for call in calls} == {lanes * window}
    assert {call[3] for call in calls} <= watch.cache_storages


@pytest.mark.parametrize("lanes", [SLOTS, 2, 1])
def test_a_decode_step_copies_no_cache_and_reads_the_live_window(gathering, lanes: int):
    core = gathering
    engine = decode_round(core, lanes)
    window = WINDOWS[KEY_WINDOW].granule  # the prompts and their 8 tokens fit in one
    live = lanes * window * KV_HEADS * HEAD_DIM * 4  # the lanes' live window of one layer's pool, fp32
    watch = CacheCopies({t.untyped_storage().data_ptr() for t in core.state.values()}, live)
    gathered = CacheCopies(watch.cache_storages, 0)  # every fresh tensor read from a pool, whatever its size
    with watch, gathered:
        engine.step()
    assert watch.attention_keys, "the decode step ran no attention"
    assert watch.copies == [], f"operators copied more than the lanes' live window of a layer: {watch.copies[:5]}"
    copied = sum(torch.Size(shape).numel() * 4 for func, shape in gathered.copies if "index_select" in func)
    # K and V of 4 layers: the live window's blocks, and the old values of the cells each lane writes (write_rows)
    assert 0 < copied <= 2 * 4 * (live + lanes * KV_HEADS * HEAD_DIM * 4), gathered.copies
    # [batch, kv_heads, window, head_dim]: one key-window granule (32 positions), not the 256 cached
    assert set(watch.attention_keys) == {(lanes, KV_HEADS, window, HEAD_DIM)}, watch.attention_keys
    assert len(watch.attention_keys) == 4  # one attention call a layer, 4 layers


def test_real_width_projections_run_on_packed_weights(loaded):
    from ignition.catalog.enums import Operation
    from ignition.runtime.backends.packed_linear import PACKED_TARGET, packing_available

    if not packing_available():
        pytest.skip("this torch build has no oneDNN packed linear")
    decode = loaded.by_operation(Operation.DECODE)[0]
    targets = [str(n.target) for n in decode.runner.graph_module.graph.nodes if "linear" in str(n.target)]
    assert targets and set(targets) == {PACKED_TARGET}  # 4 layers' projections and the LM head, all FP32 >= 256 Ki
    assert sum(t.is_mkldnn for t in loaded.weights.values()) >= 4 * 4  # released raw copies: the packed ones held


class VocabularyRows(TorchDispatchMode):
    """Operators that return a fresh float32 tensor holding at least ``rows`` whole vocabulary rows."""

    def __init__(self, vocabulary: int, rows: int):
        super().__init__()
        self.vocabulary, self.rows = vocabulary, rows
        self.made: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        _, fresh = storages_read_and_fresh_outputs(args, kwargs, out)
        self.made += [(str(func), tuple(t.shape)) for t in fresh
                      if t.dtype == torch.float32 and t.dim() >= 2 and t.shape[-1] >= self.vocabulary
                      and t.numel() >= self.rows * self.vocabulary]
        return out


@pytest.mark.parametrize("lanes", [SLOTS, 1])
def test_a_greedy_decode_step_makes_one_vocabulary_wide_row_per_lane(loaded, lanes: int):
    """The LM head's logits are the step's only ``[lanes, vocabulary]`` float32 tensor: the sampling transforms write
    their window of columns in place and put it back (``components.sampling.transformed_row``), the greedy pick and
    the logprob reduction read the logits where they are."""
    core = loaded
    engine = decode_round(core, lanes)
    watch = VocabularyRows(core.manifest["vocab_size"], lanes)
    with watch:
        engine.step()
    assert [shape for _, shape in watch.made] == [(lanes, core.manifest["vocab_size"])], watch.made


V4_WINDOW, V4_CHUNK, V4_MAX_SEQ_LEN, V4_LANES = 8, 16, 64, 2


@pytest.fixture(scope="module")
def deepseek_v4_core(tmp_path_factory):
    """The tiny DeepSeek V4 (examples/make_tiny_deepseek_v4.py, its first 3 layers: HCA, CSA and sliding) exported
    with 16-row prompt chunks, so every ring holds a step's 16 rows beside the positions a decode step reads."""
    import importlib.util
    from pathlib import Path

    from ignition.exporter.export import export_core
    from ignition.recipes.base import ExportOptions

    spec = importlib.util.spec_from_file_location(
        "make_tiny_deepseek_v4", Path(__file__).parents[1] / "examples" / "make_tiny_deepseek_v4.py")
    make_tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tiny)
    root = tmp_path_factory.mktemp("dsv4-copies")
    checkpoint = make_tiny.make_checkpoint(root / "checkpoint", layers=3, window=V4_WINDOW)
    export_core(ExportOptions(recipe="deepseek_v4", checkpoint=checkpoint, capacities=(V4_LANES,),
                              chunk_limit=V4_CHUNK, max_seq_len=V4_MAX_SEQ_LEN), root / "core")
    return root / "core"


class StateReads(TorchDispatchMode):
    """Each operator's fresh outputs read from a state buffer: (buffer name, output elements)."""

    def __init__(self, state: dict[str, torch.Tensor]):
        super().__init__()
        self.names = {t.untyped_storage().data_ptr(): name for name, t in state.items()}
        self.reads: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        read, fresh = storages_read_and_fresh_outputs(args, kwargs, out)
        self.reads += [(self.names[ptr], t.numel()) for ptr in read if ptr in self.names for t in fresh]
        return out


def deepseek_v4_reads(manifest: dict) -> dict[str, tuple[int, int]]:
    """State buffer -> (elements a decode step of one lane may gather from it over all its layers, the largest one
    read): a window ring its ``W - 1`` previous positions and the old value of the cell it writes, a compressor's
    source ring the ``2m - 1`` (CSA) or ``m - 1`` (HCA) positions a window mixes and its written cell, an entry
    table the whole slot table (the attention's keys, the indexer's candidates) and the one entry it may write."""
    model, state = manifest["model"], {s["name"]: s["shape"] for s in manifest["state"]}
    window, csa, hca = model["sliding_window"], model["csa_rate"], model["hca_rate"]
    cells_read = {"swa_kv_cache": [window], "csa_window_cache": [window], "hca_window_cache": [window],
                  "csa_source": [2 * csa - 1, 1], "csa_index_source": [2 * csa - 1, 1], "hca_source": [hca - 1, 1],
                  "csa_kv_cache": [model["csa_entries"], 1], "csa_index_cache": [model["csa_entries"], 1],
                  "hca_kv_cache": [model["hca_entries"], 1]}
    allowed = {}
    for name, shape in state.items():
        if name not in cells_read:  # not a DeepSeek V4 buffer (the sampling state)
            continue
        row = torch.Size(shape[3:]).numel()  # [layers, slots, cells, ...]
        allowed[name] = (shape[0] * sum(cells_read[name]) * row, max(cells_read[name]) * row)
    return allowed


@pytest.mark.parametrize("lanes", [V4_LANES, 1])
def test_a_deepseek_v4_decode_step_gathers_only_the_cells_it_reads(deepseek_v4_core, lanes: int):
    """The DeepSeek V4 graphs step each lane's state in place (``deepseek_v4_attention.SlotCells``): a decode step
    gathers the ring cells its rows read, the slot's entry tables and the old values of the cells it writes, and
    copies only its new rows in, never a slot's whole state (every lane of the graph's capacity steps: an idle one
    rewrites its cells' old values)."""
    from ignition.runtime.core import load_core
    from ignition.runtime.engine import Engine
    from ignition.runtime.requests import Request

    core = load_core(deepseek_v4_core)
    engine = Engine(core)
    for lane in range(lanes):
        engine.submit(Request([lane + 1, 7, 9, 11, 13, 15, 17, 19, 21, 23], max_tokens=4, logprobs=5, ignore_eos=True))
    while not engine.running or any(s.prefilled < len(s.context()) for s in engine.running):
        engine.step()
    allowed = deepseek_v4_reads(core.manifest)
    watch = StateReads(core.state)
    with watch:
        engine.step()
    assert watch.reads, "the decode step read no state"
    for name, (per_lane, largest) in allowed.items():
        sizes = [size for read, size in watch.reads if read == name]
        if "window" in name or "source" in name:  # a ring: one slot's whole ring is larger than a step's reads
            assert largest < torch.Size(core.state[name].shape[2:]).numel(), name
        assert sizes and max(sizes) <= largest and sum(sizes) <= V4_LANES * per_lane, (name, sizes, per_lane)
