"""Tensor and vocabulary parallelism as data: the exchanges, their word layouts, and the weight shard table.

A sharded core holds N rank shards of one model (Megatron layout): column-parallel q/k/v/gate/up
(output rows split), row-parallel o/down (input columns split; FP32 subtotals all-gathered and
added by the single-rank tree, ``ROW_REDUCTION_BLOCKS``; BF16/FP16 partial sums all-reduced),
vocabulary-parallel embedding and LM head (rows of the padded vocabulary split evenly); MoE
routers replicated and each expert split like an MLP; MLA's q_a/kv_a compressions replicated and
q_b/kv_b split by heads; DeepSeek V4's query heads, output groups and index heads split, its one K=V head
replicated. ``SPLIT_FIELDS`` lists the model sizes that must divide by N. The
logprob reduction and prompt scoring never move a vocabulary matrix: each exchange is an
all-gather of a fixed number of 32-bit words per row per rank, listed in ``EXCHANGES``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ignition.catalog.contract import MAX_SELECTED_IDS, NATURAL_K, TILE_SORT_KEYS
from ignition.catalog.geometry import STATE_SHAPES

MAX_TENSOR_PARALLEL = 64
"""Largest rank count ``--tensor-parallel`` accepts."""

SHARDABLE_RECIPES = ("qwen3", "llama", "qwen3_moe", "deepseek_v3", "gemma3", "gpt_oss", "deepseek_v4")
"""Recipes with a tensor-parallel layout (recipes/sharding.py): the GQA decoders, dense and MoE (gemma3's and
gpt_oss's sliding pools split by KV head like their full caches, gpt_oss's sinks by query head), MLA, and
DeepSeek V4 (query heads, output groups and index heads split; its state, one K=V head, whole on every rank)."""

ROW_REDUCTION_BLOCKS = 8
"""Row-parallel layers (o_proj, down_proj) sum their input dimension as at most this many equal blocks, pairwise.

Every core, single-rank included, computes ``x @ W.T`` as B products over equal slices of K (B the
largest power of two <= 8 with K a multiple of B * ROW_BLOCK_ALIGN), added as a balanced pairwise
tree with the bias in the first leaf. A rank of an N-way core holds B / N consecutive leaves, and
the ranks' subtotals are all-gathered and added by the same tree: the same FP32 products in the
same order at every N that divides B, so hidden states and logits are bit-identical to TP=1.
FP32 models only: a BF16 or FP16 GEMM rounds its output, so those keep one GEMM per layer (per
rank) and one all-reduce, as Megatron does, and match TP=1 to their own rounding."""

ROW_BLOCK_ALIGN = 16
"""Lanes a reduction block's width is a multiple of: GEMMs over narrower or odd slices may round differently
with the weight's row stride (single-rank K versus a rank's K / N)."""

RANKS_DIR = "ranks"
"""Rank r >= 1 stores its weights and graphs under ranks/{r}/; rank 0 uses the core's top-level files."""
RANK_METADATA, RANKS_METADATA = "ignition.tensor_parallel.rank", "ignition.tensor_parallel.ranks"
"""Header metadata of rank r >= 1's weights file: its rank and the rank count (TP-RANK-BIND)."""

PROCESS_GROUP_TIMEOUT_S = 120
"""Default process-group timeout of a TP run: a dead or stuck rank fails every other rank after at most this."""

EXCHANGE_WORDS = 256
"""32-bit words per position per rank in each generation-logprob exchange."""

SCORING_EXCHANGE_WORDS = 64
"""int32 words per prompt row per rank in each prompt-scoring exchange."""


@dataclass(frozen=True, slots=True)
class Exchange:
    """One all-gather of the sharded reduction: ``words`` 32-bit words per row per rank, in ``dtype``."""

    name: str
    dtype: str
    words: int
    per: str  # what one row is: a generation position or a prompt row
    layout: tuple[tuple[str, int, int], ...]  # (field, first word, word count); other words are zero

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "words": self.words, "per": self.per,
                "layout": [{"field": f, "first": a, "count": n} for f, a, n in self.layout]}


EXCHANGES: tuple[Exchange, ...] = (
    Exchange("logprob_statistics", "float32", EXCHANGE_WORDS, "position",
             (("shard_max", 0, 1), ("shard_exp_mass", 1, 1))),
    Exchange("logprob_candidates", "float32", EXCHANGE_WORDS, "position",
             (("chosen_raw_logit", 0, 1), ("sort_keys (int64, low word first)", 1, 2 * TILE_SORT_KEYS),
              ("candidate_values", 1 + 2 * TILE_SORT_KEYS, TILE_SORT_KEYS),
              ("selected_raw_logits (rows with selected ids, instead)", 1, MAX_SELECTED_IDS))),
    Exchange("prompt_statistics", "int32", SCORING_EXCHANGE_WORDS, "prompt row",
             (("shard_max (fp32 bits)", 0, 1), ("shard_exp_mass (fp32 bits)", 1, 1),
              ("target_raw_logit (fp32 bits, owner only)", 2, 1))),
    Exchange("prompt_candidates", "int32", SCORING_EXCHANGE_WORDS, "prompt row",
             (("strictly_greater_count", 0, 1), ("alternatives (id, fp32 bits)", 1, 2 * NATURAL_K))),
)
"""Every exchange of the sharded reduction, in the order the graphs run them."""

STATS, CANDIDATES, PROMPT_STATS, PROMPT_CANDIDATES = EXCHANGES

CANDIDATE_KEYS_WORD = 1
CANDIDATE_VALUES_WORD = 1 + 2 * TILE_SORT_KEYS
SELECTED_WORD = 1


@dataclass(frozen=True, slots=True)
class ShardRule:
    """How one weight (by our name's suffix) is split over ranks: ``dim`` (None: replicated)."""

    suffix: str
    dim: int | None
    kind: str  # column, row, vocabulary, replicated, bias_once (kept on rank 0, zero elsewhere)


SHARD_RULES: tuple[ShardRule, ...] = (
    ShardRule("q_proj", 0, "column"), ShardRule("k_proj", 0, "column"), ShardRule("v_proj", 0, "column"),
    ShardRule("q_bias", 0, "column"), ShardRule("k_bias", 0, "column"), ShardRule("v_bias", 0, "column"),
    ShardRule("gate_proj", 0, "column"), ShardRule("up_proj", 0, "column"),
    ShardRule("gate_bias", 0, "column"), ShardRule("up_bias", 0, "column"),
    ShardRule("o_proj", 1, "row"), ShardRule("down_proj", 1, "row"),
    ShardRule("o_bias", None, "bias_once"), ShardRule("down_bias", None, "bias_once"),
    ShardRule("embed", 0, "vocabulary"), ShardRule("lm_head", 0, "vocabulary"),
    # MoE: every rank routes every row itself (bit-identical inputs, so identical choices); the experts'
    # gate/up/down (experts.{e}.*, shared.*) take the MLP rules above.
    ShardRule("router", None, "replicated"), ShardRule("router_bias", None, "replicated"),
    # GPT-OSS: one sink logit per query head, split with its heads; the stacked experts ([E, d_model, 2I] with
    # gate and up interleaved, so a contiguous split keeps each gate/up pair on one rank; [E, I, d_model]) split
    # their intermediate columns like gate/up and down (their down_bias takes the rule above).
    ShardRule("sinks", 0, "column"),
    ShardRule("gate_up", 2, "column"), ShardRule("gate_up_bias", 1, "column"), ShardRule("down", 1, "row"),
    # MLA: the compressions and their norms are replicated (every rank caches the same latent and rope key);
    # q_b and kv_b split by heads (rows are head-major), o_proj (above) takes the heads' columns.
    ShardRule("q_a_proj", None, "replicated"), ShardRule("q_a_norm", None, "replicated"),
    ShardRule("kv_a_proj", None, "replicated"), ShardRule("kv_a_norm", None, "replicated"),
    ShardRule("q_b_proj", 0, "column"), ShardRule("kv_b_proj", 0, "column"),
    # DeepSeek V4 (its release names): wq_a, wkv, the compressors and hyper-connections are replicated (every rank
    # writes the same K=V ring and entry tables); wq_b (the attention's and the indexer's) and weights_proj split by
    # query or index heads, attn_sink with its heads, wo_a by output groups (each group's rows are its heads'), wo_b
    # takes the groups' columns; the router (ffn.gate) and router_bias replicated, experts' w1/w3 rows and w2 columns
    # split like gate/up/down.
    ShardRule("wq_b", 0, "column"), ShardRule("weights_proj", 0, "column"), ShardRule("attn_sink", 0, "column"),
    ShardRule("wo_a", 0, "column"), ShardRule("wo_b", 1, "row"),
    ShardRule("w1", 0, "column"), ShardRule("w3", 0, "column"), ShardRule("w2", 1, "row"),
)
"""Weights not matched by a suffix here (norms, q/k norms) are replicated on every rank."""


@dataclass(frozen=True, slots=True)
class SplitField:
    """A model size the shard rules divide by the rank count; ``field`` is the config attribute (dotted for
    a nested one), ``hf_field`` its config.json name, ``applies`` the config property that says whether the
    model has what it sizes (absent: always)."""

    field: str
    hf_field: str
    what: str
    applies: str | None = None


SPLIT_FIELDS: tuple[SplitField, ...] = (
    SplitField("num_heads", "num_attention_heads", "query heads (GQA or MLA)"),
    SplitField("num_kv_heads", "num_key_value_heads", "GQA KV heads"),
    SplitField("intermediate_size", "intermediate_size", "the dense MLP width", "dense_mlp_layers"),
    SplitField("moe.intermediate_size", "moe_intermediate_size", "each routed and shared expert's width",
               "moe_layers"),
    SplitField("o_groups", "o_groups", "DeepSeek V4's output-projection groups (each rank holds whole groups)"),
    SplitField("index_heads", "index_n_heads", "DeepSeek V4's lightning-indexer heads"),
)
"""What must divide by N for ``--tensor-parallel N``; a config without the field (MLA has no KV heads) skips it."""


KV_HEADS_SYMBOL = "num_kv_heads"
"""A state buffer whose shape (``catalog.geometry.STATE_SHAPES``) names this symbol is split by KV heads over the
ranks (each rank holds its heads' slice); every other state buffer is whole on every rank, each rank writing the same
values: MLA's latent and rope key, DeepSeek V4's K=V rings, entry tables and compressor sources, the linear
recurrent states and the penalty counts."""


def split_state(name: str) -> bool:
    """Whether state buffer ``name`` is split by KV heads over the ranks (``KV_HEADS_SYMBOL``)."""
    return KV_HEADS_SYMBOL in STATE_SHAPES.get(name, ())


def shard_rule(name: str) -> ShardRule:
    """The rule for weight ``name`` (e.g. ``layers.3.q_proj``); replicated when no suffix matches."""
    last = name.rsplit(".", 1)[-1]
    return next((rule for rule in SHARD_RULES if rule.suffix == last), ShardRule(last, None, "replicated"))


def padded_vocabulary(vocab_padded: int, ranks: int) -> int:
    """The smallest multiple of ``ranks`` that holds ``vocab_padded`` rows: each rank owns an equal slice."""
    return -(-vocab_padded // ranks) * ranks


@dataclass(frozen=True, slots=True)
class ShardLaunch:
    """One prepared launch of the vocabulary-sharded reduction, run by every rank in this order."""

    name: str  # the kernel table names it ``vocab.{name}``
    stage: str  # the custom op that issues it: statistics, candidates or merge
    op: str
    grid: str
    writes: str
    before: str | None  # the exchange it precedes (the one whose words it writes), if any

    def to_json(self) -> dict:
        return {"name": self.name, "stage": self.stage, "op": self.op, "grid": self.grid, "writes": self.writes,
                "before": self.before}


VOCABULARY_LAUNCHES: tuple[ShardLaunch, ...] = (
    ShardLaunch("tile_stats", "statistics", "ignition::vocab_shard_statistics", "rows x tiles",
                "tile maximum, exp mass and sub-block maxima (workspace)", None),
    ShardLaunch("shard_statistics", "statistics", "ignition::vocab_shard_statistics", "rows",
                "exchange words (shard max, mass); tau = 32nd sub-block maximum (workspace)", STATS.name),
    ShardLaunch("global_normalization", "candidates", "ignition::vocab_shard_candidates", "rows",
                "lse (rank-order sum) and the shard cutoff tau - lse (workspace)", None),
    ShardLaunch("tile_candidates", "candidates", "ignition::vocab_shard_candidates", "rows x tiles",
                "each tile's best 32 local sort keys at or above the cutoff (workspace)", None),
    ShardLaunch("shard_candidates", "candidates", "ignition::vocab_shard_candidates", "rows",
                "exchange words (chosen raw; best 32 global keys + values, or selected raw logits)", CANDIDATES.name),
    ShardLaunch("merge", "merge", "ignition::merge_vocabulary_logprobs", "rows",
                "the packed logprob row (single-rank layout)", None),
)
"""The six prepared launches per rank of the sharded generation reduction; every rank shares their binaries."""

SCORING_LAUNCHES: tuple[ShardLaunch, ...] = (
    ShardLaunch("tile_stats", "statistics", "ignition::score_shard_statistics", "rows x tiles",
                "tile maximum, exp mass and sub-block maxima of every row (workspace)", None),
    ShardLaunch("statistics", "statistics", "ignition::score_shard_statistics", "rows",
                "exchange words (shard max, mass, target raw logit where owned); row validity and tau = 20th "
                "sub-block maximum (workspace)", PROMPT_STATS.name),
    ShardLaunch("normalization", "candidates", "ignition::score_shard_candidates", "rows",
                "lse (rank-order sum), the shard cutoff tau - lse and the target's reported value (workspace)", None),
    ShardLaunch("tile_candidates", "candidates", "ignition::score_shard_candidates", "rows x tiles",
                "each tile's best 20 local sort keys at or above the cutoff (workspace)", None),
    ShardLaunch("tile_greater", "candidates", "ignition::score_shard_candidates", "rows x tiles",
                "each tile's count of reported values strictly above the target's (workspace)", None),
    ShardLaunch("candidates", "candidates", "ignition::score_shard_candidates", "rows",
                "exchange words (strictly-greater count; best 20 (global id, value) pairs)", PROMPT_CANDIDATES.name),
    ShardLaunch("merge", "merge", "ignition::merge_prompt_scores", "rows",
                "the 43-word prompt row (single-rank layout; invalid targets: the invalid pattern)", None),
)
"""The seven prepared launches per rank of sharded prompt scoring, per row block of at most SCORING_ROW_BLOCK rows;
every rank shares their binaries. ``tile_greater`` re-reads the shard (the single-rank ``tile_candidates`` kernel is
reused unchanged, so the count is its own launch)."""


def scoring_row_blocks(rows: int, row_block: int) -> list[int]:
    """The distinct row-block sizes sharded scoring of ``rows`` prompt rows launches, in first-use order:
    full blocks of ``row_block`` rows, then the remainder (each size has its own seven prepared launches)."""
    blocks = []
    for start in range(0, rows, row_block):
        size = min(row_block, rows - start)
        if size not in blocks:
            blocks.append(size)
    return blocks


def variant_scoring_blocks(entry: dict) -> list[int]:
    """The distinct row-block sizes a catalog variant's sharded scoring launches (none for an unscored variant):
    ``scoring_row_blocks`` of the rows of its prompt-logprob targets argument."""
    scoring = entry["contract"]["layout"].get("prompt_logprobs")
    if not scoring:
        return []
    rows = next(a["shape"][0] for a in entry["arguments"] if a["name"] == scoring["targets"])
    return scoring_row_blocks(rows, scoring["row_block"])
