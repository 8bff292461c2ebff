"""Copies of benchmarks/moe_qwen3_a3b.py's GGUF whose routers choose as a real one does, or
uniformly, for the expert cache's benchmark (benchmarks/expert_cache.py, issue 51).

A random model's residual stream is dominated by a few directions every token shares, so its
routers (random rows) give most tokens the same experts: in the A3B-shaped file, each layer's
most chosen 20% of experts take 68-99% of the routing, which flatters a cache. Here each layer's
router is rewritten, layer after layer (a router decides what the next layers see):

- ``uniform``: its rows with the layer input's top ``--directions`` shared directions projected
  out, so a token's experts follow what is its own (each expert chosen about equally);
- ``skewed``: those rows, plus a push along the dominant direction for 20% of the experts, sized
  so that they take ``--hot-share`` (0.8) of the routing on the probe tokens.

    python benchmarks/moe_router_variants.py /tmp/moe-a3b/qwen3-moe-a3b-small.Q8_0.gguf

writes ``<stem>.uniform.gguf`` and ``<stem>.skewed.gguf`` beside it: the same file with the
routers' float32 values replaced in place (nothing else changes), and prints each layer's share.
The layer inputs are recorded from pagedllm running the file (its Python layer loop), on seeded
samples of a few prompts.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

PROMPTS = [
    "The history of the city of Paris begins with",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole",
    "The mitochondria is the powerhouse of the cell, and",
    "Dear committee, I am writing to apply for the position of",
    "Ingredients: 2 cups of flour, 1 teaspoon of salt,",
]


def layer_inputs(llm, moes) -> list[torch.Tensor]:
    """Every token's input to each sparse layer's router, over seeded samples of PROMPTS."""
    from pagedllm import SamplingParams
    from pagedllm.kinds.sparse_moe.forward import SparseMoE

    seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(moes))}
    index = {id(m): i for i, m in enumerate(moes)}
    route = SparseMoE.route

    def recording(self, x):
        seen[index[id(self)]].append(x.float().clone())
        return route(self, x)

    SparseMoE.route = recording  # type: ignore[method-assign]
    try:
        llm.generate(PROMPTS, SamplingParams(max_tokens=48, temperature=1.0, seed=3, ignore_eos=True))
    finally:
        SparseMoE.route = route  # type: ignore[method-assign]
    return [torch.cat(seen[i]) for i in range(len(moes))]


def hot_share(weight: torch.Tensor, x: torch.Tensor, top_k: int, hot: int) -> float:
    chosen = torch.topk(x @ weight.T, top_k, dim=-1).indices
    return float((chosen < hot).float().mean())


def rewrite(llm, moes, variant: str, directions: int, target: float) -> list[torch.Tensor]:
    top_k = moes[0].top_k
    hot = round(0.2 * moes[0].router.weight.shape[0])
    for layer, moe in enumerate(moes):
        x = layer_inputs(llm, moes)[layer]
        _, _, v = torch.linalg.svd(x, full_matrices=False)
        shared = v[:directions].T  # [hidden, directions]
        weight = moe.router.weight.data.float()
        flat = weight - (weight @ shared) @ shared.T
        flat *= weight.norm(dim=1, keepdim=True) / flat.norm(dim=1, keepdim=True)
        if variant == "skewed":
            lead = v[0] * torch.sign((x @ v[0]).mean())
            push = torch.zeros_like(flat)
            push[:hot] = lead
            lo, hi = 0.0, 1.0
            while hot_share(flat + hi * push, x, top_k, hot) < target and hi < 1e4:
                hi *= 2
            for _ in range(30):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if hot_share(flat + mid * push, x, top_k, hot) < target else (lo, mid)
            flat = flat + hi * push
        moe.router.weight.data.copy_(flat.to(moe.router.weight.dtype))
    return [m.router.weight.data.float().clone() for m in moes]


def shares(llm, moes) -> list[float]:
    """Each layer's most chosen 20% of experts' share of the routing on the probe tokens."""
    out = []
    for moe, x in zip(moes, layer_inputs(llm, moes)):
        counts = torch.bincount(torch.topk(x @ moe.router.weight.float().T, moe.top_k, dim=-1).indices.flatten())
        ranked = torch.sort(counts.float(), descending=True).values
        out.append(round(float(ranked[: round(0.2 * moe.router.weight.shape[0])].sum() / ranked.sum()), 2))
    return out


def write(source: Path, target: Path, routers: list[torch.Tensor]) -> None:
    import gguf

    shutil.copyfile(source, target)
    reader = gguf.GGUFReader(target, "r+")
    by_name = {t.name: t for t in reader.tensors}
    for layer, weight in enumerate(routers):
        tensor = by_name[f"blk.{layer}.ffn_gate_inp.weight"]
        assert tensor.tensor_type == gguf.GGMLQuantizationType.F32 and tuple(tensor.data.shape) == tuple(weight.shape)
        tensor.data[...] = weight.numpy()
    del reader


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--directions", type=int, default=8)
    ap.add_argument("--hot-share", type=float, default=0.8)
    a = ap.parse_args()
    from pagedllm import LLM

    for variant in ("uniform", "skewed"):
        llm = LLM(str(a.gguf), dtype="float32")
        llm.loaded.model.use_decode_program = False  # the Python layers, whose routers we watch
        moes = [layer.mlp for layer in llm.loaded.model.model.decoder_layers()]
        print(f"{variant}: before {shares(llm, moes)}", flush=True)
        routers = rewrite(llm, moes, variant, a.directions, a.hot_share)
        print(f"{variant}: after  {shares(llm, moes)}", flush=True)
        target = a.gguf.with_name(a.gguf.name.replace(".gguf", f".{variant}.gguf"))
        write(a.gguf, target, routers)
        print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
