"""Routed MoE experts (``recipes/moe.py``'s sorted dispatch) against the dense form, at a real MoE width.

``python -m benchmarks.moe --threads 2`` builds ``--layers`` MoE layers at Qwen3-30B-A3B's widths
(hidden 2048, 128 experts, top-8, expert intermediate 768; random fp32 weights) and times, on the
same weights and inputs, a batch-8 decode step and a 512-token prefill (``--rows``) through:

* **routed**: ``ignition.recipes.moe.moe_block`` as the graphs run it (static shapes: each expert
  runs on its own rows padded to a rung of the capacity ladder, an expert no row picked runs nothing);
* **dense**: the form it replaced, every expert on every row weighted by the row's dense routing
  weight (zero for the experts it did not pick): ``num_experts / top_k`` times the expert FLOPs,
  and every expert's weights read on every call;
* **eager loop**: transformers' expert loop (gather each picked expert's rows, run it,
  ``index_add_``), whose data-dependent shapes no static graph can hold: the floor routed approaches.

It prints the three times, dense / routed, and how many experts each layer's rows picked.
"""

from __future__ import annotations

import argparse
import time

import torch



def dense_block(weights, prefix, moe, hidden):
    """The dense form: every expert on every row, times the dense routing weight (0 where not picked)."""
    from ignition.recipes.layers import gated_mlp
    from ignition.recipes.moe import ROUTERS

    top_experts, top_weights = ROUTERS[moe.router](weights, prefix, moe, hidden)  # [R, k] each
    routing = top_weights.new_zeros(hidden.shape[0], moe.num_experts).scatter(1, top_experts, top_weights)
    out = torch.zeros_like(hidden)
    for expert in range(moe.num_experts):
        name = f"{prefix}experts.{expert}."
        result = gated_mlp(hidden, weights[name + "gate_proj"], weights[name + "up_proj"], weights[name + "down_proj"])
        out = out + (result * routing[:, expert:expert + 1]).to(out.dtype)
    return out


def eager_loop(weights, prefix, moe, hidden):
    """transformers' eager experts loop: gather each picked expert's rows, run it, index_add the weighted result."""
    from ignition.recipes.layers import gated_mlp
    from ignition.recipes.moe import ROUTERS

    top_experts, top_weights = ROUTERS[moe.router](weights, prefix, moe, hidden)
    out = torch.zeros_like(hidden)
    for expert in torch.unique(top_experts).tolist():
        rows, choice = torch.where(top_experts == expert)
        name = f"{prefix}experts.{expert}."
        result = gated_mlp(hidden[rows], weights[name + "gate_proj"], weights[name + "up_proj"],
                           weights[name + "down_proj"])
        out.index_add_(0, rows, (result * top_weights[rows, choice, None]).to(out.dtype))
    return out


def timed(fn, repeats: int) -> tuple[float, torch.Tensor]:
    """Best wall time of ``repeats`` calls (the machine is shared) and the last call's output."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - started)
    return best, out


def random_layers(args) -> dict[str, torch.Tensor]:
    """``--layers`` MoE layers of random fp32 weights, scaled so every layer's output stays O(1)."""
    generator = torch.Generator().manual_seed(0)
    hidden, inter, weights = args.hidden, args.intermediate, {}
    for layer in range(args.layers):
        weights[f"layers.{layer}.router"] = torch.randn(args.experts, hidden, generator=generator) / hidden**0.5
        for expert in range(args.experts):
            for name, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                                ("down_proj", (hidden, inter))):
                weights[f"layers.{layer}.experts.{expert}.{name}"] = (
                    torch.randn(shape, generator=generator) / shape[1] ** 0.5)
    return weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768, help="per-expert intermediate size")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", default="8,512", help="rows per call: decode batch sizes and prefill lengths")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from ignition.recipes.moe import ROUTERS, MoeConfig, moe_block

    moe = MoeConfig(router="softmax_topk", num_experts=args.experts, experts_per_token=args.top_k,
                    intermediate_size=args.intermediate, sparse_layers=tuple(range(args.layers)), norm_topk_prob=True)
    weights = random_layers(args)
    expert_bytes = sum(t.nbytes for n, t in weights.items() if ".experts." in n)
    print(f"{args.layers} MoE layers: hidden {args.hidden}, {args.experts} experts x intermediate {args.intermediate}, "
          f"top-{args.top_k}, fp32, torch threads {torch.get_num_threads()}; expert weights "
          f"{expert_bytes / 2**30:.1f} GiB")

    def forward(block, x):
        for layer in range(args.layers):
            x = x + block(weights, f"layers.{layer}.", moe, x)
        return x

    print(f"{'rows':>6} {'routed ms':>10} {'dense ms':>10} {'dense/routed':>13} {'eager loop ms':>14} "
          f"{'experts hit':>12}")
    generator = torch.Generator().manual_seed(1)
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, args.hidden, generator=generator)
        with torch.no_grad():
            routed, routed_out = timed(lambda: forward(moe_block, x), args.repeats)
            dense, dense_out = timed(lambda: forward(dense_block, x), args.repeats)
            loop, loop_out = timed(lambda: forward(eager_loop, x), args.repeats)
            torch.testing.assert_close(routed_out, loop_out, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(routed_out, dense_out, atol=1e-4, rtol=1e-4)
            hit = torch.unique(ROUTERS[moe.router](weights, "layers.0.", moe, x)[0]).numel()
        print(f"{rows:>6} {routed * 1e3:>10.1f} {dense * 1e3:>10.1f} {dense / routed:>12.1f}x {loop * 1e3:>14.1f} "
              f"{hit:>12}", flush=True)


if __name__ == "__main__":
    main()
