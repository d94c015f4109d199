"""Cost of the plain batched MoE block (every expert on every row) against sparse dispatch.

``python -m benchmarks.moe`` times one MoE layer of the ``qwen3_moe`` recipe
(``ignition.recipes.moe.moe_block``: static shapes, exportable) and transformers-style sparse
dispatch (each expert runs only on the rows routed to it; data-dependent shapes, so it cannot be
captured in a static graph) on the same weights, for decode-sized and prefill-sized row counts.
It also prints the arithmetic ratio ``num_experts / experts_per_token`` the plain block pays.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks._common import best_of


def sparse_dispatch(weights, prefix, moe, hidden):
    """transformers' eager experts loop: gather each expert's rows, run it, index_add the weighted result."""
    from ignition.recipes.layers import gated_mlp
    from ignition.recipes.moe import ROUTERS

    routing = ROUTERS[moe.router](weights, prefix, moe, hidden)  # [R, E], zero where not routed
    out = torch.zeros_like(hidden)
    for expert in torch.nonzero(routing.sum(0)).flatten().tolist():
        rows = torch.nonzero(routing[:, expert]).flatten()
        name = f"{prefix}experts.{expert}."
        result = gated_mlp(hidden[rows], weights[name + "gate_proj"], weights[name + "up_proj"],
                           weights[name + "down_proj"])
        out.index_add_(0, rows, result * routing[rows, expert:expert + 1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=384, help="per-expert intermediate size")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--rows", default="1,8,64,256")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from ignition.recipes.moe import ROUTERS, MoeConfig, moe_block

    moe = MoeConfig(router="softmax_topk", num_experts=args.experts, experts_per_token=args.top_k,
                    intermediate_size=args.intermediate, sparse_layers=(0,), norm_topk_prob=True)
    generator = torch.Generator().manual_seed(0)
    hidden, inter = args.hidden, args.intermediate
    weights = {"router": torch.randn(args.experts, hidden, generator=generator) / hidden**0.5}
    for expert in range(args.experts):
        for name, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
            weights[f"experts.{expert}.{name}"] = torch.randn(shape, generator=generator) / shape[1] ** 0.5
    expert_bytes = sum(t.nbytes for n, t in weights.items() if n.startswith("experts."))
    print(f"one MoE layer: hidden {hidden}, {args.experts} experts x intermediate {inter}, top-{args.top_k}, fp32, "
          f"torch threads {torch.get_num_threads()}; expert weights {expert_bytes / 2**20:.0f} MiB")
    print(f"plain batched does {args.experts / args.top_k:.0f}x the expert FLOPs of sparse dispatch on every row")
    print(f"{'rows':>6} {'plain ms':>10} {'sparse ms':>10} {'plain/sparse':>13} {'experts hit':>12}")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, hidden, generator=generator)
        with torch.no_grad():
            torch.testing.assert_close(moe_block(weights, "", moe, x), sparse_dispatch(weights, "", moe, x),
                                       atol=1e-4, rtol=1e-4)
            plain = best_of(lambda: moe_block(weights, "", moe, x), args.repeats)
            sparse = best_of(lambda: sparse_dispatch(weights, "", moe, x), args.repeats)
            hit = int((ROUTERS[moe.router](weights, "", moe, x) != 0).any(0).sum())
        print(f"{rows:>6} {plain * 1e3:>10.2f} {sparse * 1e3:>10.2f} {plain / sparse:>12.1f}x {hit:>12}")


if __name__ == "__main__":
    main()
