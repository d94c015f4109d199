"""Rule ids of validate-core: each id appears in findings and in docs/api.md."""

from ignition.catalog.limits import MAX_JSON_DEPTH

RULES = {
    "CORE-MISSING": "The core path is a directory holding manifest.json.",
    "JSON-PARSE": f"Every metadata file is strict UTF-8 JSON (no NaN/Infinity, no object repeating a key), nested "
                  f"at most {MAX_JSON_DEPTH} levels deep.",
    "SCHEMA": "Every metadata file matches its JSON Schema (draft 2020-12); unknown fields are rejected.",
    "FORMAT-VERSION": "The manifest's format_version is the one this Ignition writes; an older format is refused "
                      "with the change that retired it (catalog/contract.py FORMAT_CHANGES).",
    "ENUM-OPERATION": "A variant's operation is a known Operation code.",
    "ENUM-SOURCE": "A binding's value source is a known ValueSource code.",
    "ENUM-RESERVED": "A variant's operation is not a code reserved for a feature not built yet (DRAFT_PROPOSE).",
    "FILE-PATH": "Files named by the core are relative POSIX paths inside it (no absolute paths, no '..').",
    "FILE-MISSING": "Every file listed or named by the core exists.",
    "FILE-HASH": "Every file matches the sha256 recorded in the manifest.",
    "FILE-UNLISTED": "Every file the catalog, manifest or kernel table names is listed with a sha256.",
    "FILE-EXTRA": "The core holds no file that the manifest does not list.",
    "FILE-REGULAR": "Every core file Ignition reads is a regular file (no symbolic link, FIFO or device) within its "
                    "size cap (256 MiB for JSON, 16 GiB for a graph), checked before a byte is read.",
    "GEOM-T": "Resolved T (0 or omitted: 8) is at most 64: FORCED_MASK is one int64 record word, one bit per position.",
    "GEOM-VOCAB": "vocab_size <= vocab_padded, and eos_token_id < vocab_size.",
    "GEOM-SLOTS": "model.num_slots is the slot extent of every slot-indexed state tensor (per-slot caches, penalty "
                  "counts, the rows of block_tables) and at least the widest decode capacity.",
    "GEOM-SEQ": "model.max_seq_len is the position extent of the per-slot caches, sets the width of block_tables "
                "(ceil(max_seq_len / block_size)) within model.kv_blocks, and holds a chunk_limit prefill chunk.",
    "GEOM-BLOCK-SIZE": "model.block_size is the block extent of the paged caches (catalog/geometry.py PAGED_STATE: "
                       "k_cache, v_cache; MLA's latent_cache, rope_key_cache) and divides the key window granule.",
    "GEOM-KV-BLOCKS": "model.kv_blocks (the declared upper bound of the dynamic pool extent) is the block count of "
                      "the paged caches.",
    "GEOM-BLOCK-TABLES": "Every variant declares the input block_tables, int32 [num_slots, ceil(max_seq_len / "
                         "block_size)] bound to BLOCK_TABLES, exactly when the core has paged caches.",
    "GEOM-WINDOW-BLOCKS": "model.window_kv_blocks is the block count of the sliding pools (k_window_cache, "
                          "v_window_cache), stated exactly when they are declared: num_slots x min(ceil((window_cells "
                          "+ block_size - 1) / block_size), ceil(max_seq_len / block_size)) + 1 (every slot's window "
                          "and the null block).",
    "GEOM-WINDOW-TABLES": "Every variant declares the input window_block_tables, int32 [num_slots, ceil(max_seq_len / "
                          "block_size)] bound to WINDOW_BLOCK_TABLES, exactly when the core has sliding-window pools.",
    "GEOM-VOCAB-TENSOR": "vocab_padded is the row count of the vocabulary weights (embedding, lm_head) in the "
                         "weights file and the last extent of penalty_counts.",
    "GEOM-VOCAB-GRAPH": "Every graph's calls to Ignition's reduction ops pass manifest.json:vocab_size (and a sharded "
                        "core's vocab_shard) and logits of vocab_padded columns (vocab_shard for a shard's op).",
    "GEOM-MODEL": "The model's sizes (layers, KV heads, head_dim, hidden_size) and dtype match the state and "
                  "vocabulary weight tensors.",
    "GEOM-KIND": "model.layer_kinds names one cache kind of catalog/cache_kinds.py for each of model.num_layers "
                 "layers.",
    "GEOM-KIND-RESERVED": "No layer declares a reserved cache kind (a kind whose table entry is not built).",
    "GEOM-KIND-BUFFERS": "The state declares each cache kind's buffers exactly when some layer has that kind, with "
                         "that kind's layer count as their first extent, and states the kind's model fields "
                         "(sliding: sliding_window, window_cells).",
    "GEOM-WINDOW": "A sliding layer's step reads its window plus the step's rows: window_cells = min(sliding_window "
                   "+ R - 1, max_seq_len), R the most rows one slot writes in a step (the chunk limit, a verify "
                   "round's S+1); window_cells is the position extent of DeepSeek V4's window rings (shared_window, "
                   "compressed and heavily_compressed K=V rings) and the positions a sliding pool's read spans.",
    "GEOM-COMPRESS": "A compressed layer's extents follow its rate m (csa_rate, hca_rate): an entry table of "
                     "max_seq_len // m + 1 entries (csa_entries, hca_entries) and a source ring of 2m + R - 1 (CSA) or "
                     "m + R - 1 (HCA) cells (csa_source_cells, hca_source_cells), R a step's most rows.",
    "GEOM-TOKENIZER": "The tokenizer's token ids (added tokens included) are below vocab_size.",
    "TOKENIZER-PARSE": "The core's tokenizer JSON files parse and tokenizer.json loads.",
    "CATALOG-DUP": "Variant names and argument names within a variant are unique.",
    "CATALOG-CAPACITIES": "The manifest's capacities are exactly the decode variants' capacities.",
    "CATALOG-PREFILL": "The catalog has exactly one PREFILL variant; its chunk capacity is the manifest's chunk_limit.",
    "CATALOG-DECODE": "The catalog has at least one DECODE variant.",
    "BUF-ROLE": "Contract buffers have their table role: records/logprobs are outputs, flags/IDs/targets inputs.",
    "BUF-DTYPE": "Contract buffers have their exact table dtype.",
    "BUF-FRAMES": "Frame extents of completion_records, completion_logprobs and prompt_logprobs are 2.",
    "BUF-CAPACITY": "Every contract buffer of a variant uses that variant's capacity.",
    "BUF-T": "Records ([2, capacity, 16+T]) and packed logprobs ([2, capacity, T, W]) use the core's T.",
    "BUF-SHAPE": "Contract buffers have exactly the table's shape.",
    "LP-PARTIAL": "completion_logprobs and logprob_requested come together, and only with completion_records.",
    "LP-IDS-ALL": "A variant declaring any explicit-ID input declares all five CompletionOutputs buffers.",
    "LP-WIDTH": "Without ID inputs the packed width is 2+2K with 1 <= K <= 20; with them it is 258.",
    "LP-K": "Without logprob buffers K is 0; with them every variant and the manifest agree on K; with ID inputs K is 20.",
    "BIND-MISSING": "Every input argument has a value binding.",
    "BIND-UNKNOWN": "Bindings name declared arguments only.",
    "BIND-OUTPUT": "Outputs, state and weights are never bound: the logprob output cannot be uploaded.",
    "BIND-SOURCE": "Contract inputs are bound to their table value source.",
    "BIND-FLAG": "Sampling graphs with logprob outputs bind the flag vector.",
    "BIND-IDS": "When the ID inputs are declared, sampling graphs bind both of them.",
    "BIND-NONE": "Graphs without logprob outputs declare and bind neither flags nor explicit IDs.",
    "LAYOUT": "The semantic contract's layout agrees with the declared buffers.",
    "SLOT-LIMIT": "Only a DECODE variant declares layout.slot_limit, equal to its capacity, which is at least 2 and "
                  "below both num_slots and the widest decode capacity (that variant serves every slot).",
    "PROMPT-PARTIAL": "Prompt scoring is all or nothing: both buffers, only and always in SCORED_PREFILL variants.",
    "PROMPT-BIND": "prompt_target_tokens is bound to PROMPT_TARGET_TOKEN (39).",
    "PROMPT-K": "Prompt scoring requires K = 20 generation logprob outputs.",
    "PROMPT-CAPACITIES": "Scored capacities are 128*4^k below the chunk limit, then the chunk limit.",
    "SPEC-LAYOUT": "layout.speculative is present exactly in SPECULATIVE_VERIFY variants, with positions = "
                   "draft_tokens + 1 and drafts = draft_token_ids.",
    "SPEC-T": "A verify variant's S+1 positions fit the core's T.",
    "SPEC-DRAFTS": "draft_token_ids ([capacity, S] int64, bound to DRAFT_TOKEN_IDS) is declared by every "
                   "SPECULATIVE_VERIFY variant and by no other.",
    "SPEC-RETURNS": "A verify variant returns next_tokens int64 [capacity, S+1].",
    "MIXED-ROLES": "A MIXED variant declares mixed_prompt_lane and each role's private frames (records, and "
                   "packed logprobs when the bundle has them) with the shared bundle's shapes; no other variant "
                   "declares them.",
    "MIXED-MERGE": "layout.mixed is present exactly in MIXED variants and names the prompt lane input, both roles' "
                   "frames and the active-frame merge.",
    "MIXED-SCORED": "A MIXED variant declares no prompt-scoring buffers: scored requests never enter the prompt role.",
    "PACKED-INPUTS": "A PACKED_PREFILL variant declares every packed input (packed_input_ids [capacity*C], "
                     "segment_starts, segment_lengths, segment_emits [capacity], segment_window [C], with C its "
                     "layout.packed.segment_rows) with its table dtype and role, and none of the single-chunk inputs "
                     "(chunk_*, input_ids, positions); no other variant declares a packed input.",
    "PACKED-LAYOUT": "layout.packed is present exactly in PACKED_PREFILL variants and names packed_input_ids and "
                     "segment_window with segment_rows = the PREFILL variant's chunk rows (a lane's chunk is the one "
                     "a serial round runs); the variant's capacity is at least 2 and at most model.num_slots (each "
                     "lane needs its own slot).",
    "CONSTRAINT-PARTIAL": "token_bitmask, logit_bias_ids and logit_bias_values come together, only in sampling "
                          "variants of PREFILL, SCORED_PREFILL, DECODE, MIXED and PACKED_PREFILL (never "
                          "SPECULATIVE_VERIFY).",
    "CONSTRAINT-ALL": "A core declares the structured-output inputs in every PREFILL, SCORED_PREFILL, DECODE, MIXED "
                      "and PACKED_PREFILL variant, or in none.",
    "CONSTRAINT-WORDS": "token_bitmask's last extent is ceil(vocab_padded / 32): one bit per logit column.",
    "FEAT-MISMATCH": "The manifest's features equal what the catalog declares (an omitted structured_output is false).",
    "STATE-DECL": "State arguments match a manifest state declaration (dtype, shape).",
    "WEIGHT-DECL": "Weight arguments exist in the weights file with the declared dtype and shape.",
    "TP-RANKS": "A sharded core's rank count divides its query heads, the KV heads its state is split by "
                "(none for one K=V head, whole on every rank) and its padded vocabulary "
                "(vocab_shard * ranks = vocab_padded), names one file entry per rank, and every collective in "
                "its graphs runs over that many ranks of the recorded group; an unsharded core runs none.",
    "TP-SHARD": "Every weight argument has a shard entry whose shard shape is the declared argument and whose full "
                "shape is the shard times the rank count along its split dim; every rank's weights file holds "
                "each weight with that shard shape and dtype.",
    "TP-EXCHANGE": "The manifest's exchange table is the contract's, and every exchange a graph hands to an "
                   "all-gather carries that exchange's word count and dtype per row per rank.",
    "TP-RANK-BIND": "Each rank's entry names its own rank and the sha256 of its weights file, which is the file's, "
                    "unlike every other rank's; a rank r >= 1 file's header metadata records rank r.",
    "TP-VARIANTS": "Every rank has a graph for exactly the catalog's variants (same declarations on every rank); "
                   "rank 0's files are the core's own weights and graphs.",
    "MANIFEST-CANONICAL": "manifest.json is exactly its canonical JSON (sorted keys, no repeated key, fixed "
                          "indentation and separators, a final newline): the digest covers these bytes.",
    "CORE-DIGEST": "The core digest (sha256 of manifest.json's bytes) equals the expected one (--expect-digest).",
    "SIGNATURE": "signature.json, when present or required by a trusted key, is an Ed25519 signature over the core "
                 "digest that verifies (with the trusted key, when one is given).",
    "PT2-ARCHIVE": "A graph .pt2 is a plain zip: one root folder, stored members, unique names, nothing before "
                   "the first member or after the end record.",
    "PT2-MEMBER": "A graph .pt2 holds only what torch.export.save writes for an Ignition graph, each member with "
                  "its content kind (fixed text, JSON, raw tensor bytes named by a payload config).",
    "PT2-PICKLE": "No .pt2 member is a pickle or is configured to be unpickled (pickled tensors, custom or opaque "
                  "objects, non-empty sample inputs).",
    "PT2-PROGRAM": "The serialized program is static: tensor inputs only, no guards_code, symbolic expressions, "
                   "range constraints or custom objects; node targets in allowed operator namespaces.",
    "GRAPH-OPERATOR": "A graph calls only the operators the recipes emit (ignition/catalog/operators.py, checked "
                      "before torch reads the program); file, storage, process and printing operators "
                      "(aten.from_file, save, load, ...) are refused by name.",
    "GRAPH-LOAD": ("Every variant's .pt2 loads with torch.export.load (validate-core) and with Ignition's program "
                   "reader (load_core), after the safe reader accepted it."),
    "GRAPH-SIGNATURE": "The .pt2's inputs and outputs have the declared names, dtypes and shapes, in order.",
    "GRAPH-MUTATION": "The graph writes its outputs and state, and never writes inputs or weights.",
    "GRAPH-ALLOCATION": "Every tensor a graph creates or grows from a size it names (new_full, zeros, empty, arange, "
                        "expand, repeat, pad; ONNX ConstantOfShape, Expand, Tile, Range with constant inputs) holds at "
                        "most as many elements as all the variant's declared buffers together.",
    "ONNX-PAIRING": "ONNX graphs and .pt2 variants match one-to-one: none, or every variant names graphs/<name>.onnx "
                    "in packages.onnx.",
    "ONNX-LOAD": "Every ONNX graph parses as an ONNX model (protobuf only; nothing executes).",
    "ONNX-CHECKER": "onnx.checker.check_model(full_check=True) accepts every ONNX graph (weights presented as typed "
                    "inputs, since their external data lives at the core root).",
    "ONNX-OPSET": "ONNX graphs use the default domain at opset >= 18 and nothing else: no custom domains or functions.",
    "ONNX-INPUTS": "An ONNX graph's inputs are the variant's non-weight arguments: names, dtypes, shapes, in order.",
    "ONNX-OUTPUTS": "An ONNX graph's outputs are next_tokens, then <buffer>.out for each output and state buffer, in "
                    "argument order, with the declared dtypes and shapes.",
    "ONNX-WEIGHTS": "Every weight is an initializer with external data in the manifest's weights file at that "
                    "tensor's own offset and length, with the declared dtype and shape; nothing else is external.",
    "ONNX-INPLACE": "Every node reading a written buffer's input is the producer of <buffer>.out or one of its "
                    "ancestors, so binding both to one memory is safe.",
    "KERNEL-MISSING": "Every launch of every variant has a prepared binary for every target.",
    "KERNEL-FILE": "Kernel binaries exist inside the core.",
    "KERNEL-HASH": "Kernel binaries match their recorded sha256.",
    "KERNEL-SMEM": "A kernel's shared memory fits its target's per-block limit.",
    "KERNEL-TARGET": "Kernel targets are known targets.",
    "KERNEL-SHARDED": "A sharded core's logprob variants each list the six vocabulary-sharded launches "
                      "(catalog.parallel.VOCABULARY_LAUNCHES) in order, then a scored variant the seven scoring "
                      "launches (catalog.parallel.SCORING_LAUNCHES) of each row-block size, built for the core's "
                      "rank count, rows (row block) and vocab_shard (tiles covering the shard); a single-rank core "
                      "lists none of them.",
    "VALIDATOR-ERROR": "The validator itself failed on this input (always a bug; please report).",
}
