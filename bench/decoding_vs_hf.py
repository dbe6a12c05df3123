"""Benchmark: our decoding loops vs transformers' own, side by side in one process.

    python bench/decoding_vs_hf.py [--prompts 10] [--max-new-tokens 64] [--gamma 4] [--repeats 2]
                                   [--methods block tree eagle eagle3]

On the embedded default pair (SmolLM2-135M-Instruct fp32 target, int8-dynamic self-draft), greedy:
  * our ``vanilla`` vs ``model.generate`` (tokens/s ratio, token identity);
  * our ``speculative`` vs HF assisted generation (``assistant_model=``, same draft, same γ,
    ``num_assistant_tokens_schedule="constant"``, ``assistant_confidence_threshold=0``);
  * each of ``--methods`` (block verification, a token tree, EAGLE with the shipped EAGLE-2 and
    EAGLE-3 heads, each at its ``conf/method`` default) vs our own ``vanilla``: transformers has
    no counterpart for them, so the judge is the method's speedup over plain decoding in the same
    loop.
Runs are interleaved per prompt (A, B, A, B, ...) after one warm-up prompt, so machine drift hits
both sides alike; ratios are total-tokens/total-time and the geometric mean of per-prompt time
ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
import warnings
from pathlib import Path

import torch
import transformers

from decoding import build_method, encode_prompt, generate, load_pair

ROOT = Path(__file__).resolve().parents[1]
# rows against our own vanilla: label -> method (each at its conf/method default, shipped heads)
OWN_ROWS = {"block": "block", "tree": "tree", "eagle": "eagle", "eagle3": "eagle3"}


def gsm8k_prompts(tokenizer, count: int) -> list[list[int]]:
    lines = (ROOT / "data" / "gsm8k" / "test_200.jsonl").read_text().splitlines()
    return [encode_prompt(tokenizer, json.loads(line)["question"]) for line in lines[:count]]


def timed(fn):
    began = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - began


def hf_generate(model, prompt, max_new_tokens, **kwargs) -> tuple[int, ...]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, **kwargs)
    return tuple(out[0, ids.shape[1]:].tolist())


def compare(name, ours, theirs, prompts, repeats, against="HF") -> dict:
    ours(prompts[0]), theirs(prompts[0])                           # warm-up
    t_ours = t_theirs = 0.0
    n_ours = n_theirs = identical = 0
    log_ratio = []
    for prompt in prompts:
        for _ in range(repeats):
            a, ta = timed(lambda: ours(prompt))
            b, tb = timed(lambda: theirs(prompt))
            t_ours, t_theirs = t_ours + ta, t_theirs + tb
            n_ours, n_theirs = n_ours + len(a), n_theirs + len(b)
            identical += a == b
            log_ratio.append(math.log(tb / ta))
    row = {"comparison": name, "ours_tok_s": n_ours / t_ours, "baseline": against,
           "baseline_tok_s": n_theirs / t_theirs,
           "ratio": (n_ours / t_ours) / (n_theirs / t_theirs),
           "geomean_time_ratio": math.exp(sum(log_ratio) / len(log_ratio)),
           "identical": f"{identical}/{len(prompts) * repeats}"}
    print(f"{name:<34} ours {row['ours_tok_s']:6.2f} tok/s   {against} "
          f"{row['baseline_tok_s']:6.2f} tok/s   "
          f"ratio {row['ratio']:.3f} (per-prompt geomean {row['geomean_time_ratio']:.3f})   "
          f"identical {row['identical']}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--methods", nargs="*", default=list(OWN_ROWS), choices=list(OWN_ROWS),
                        help="methods compared with our own vanilla (none: skip those rows)")
    parser.add_argument("--out", type=Path, default=None, help="write the table as JSON here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)

    pair = load_pair("smollm2")
    prompts = gsm8k_prompts(pair.tokenizer, args.prompts)
    n = args.max_new_tokens
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, {args.threads} threads; {pair.target_name} "
          f"+ {pair.draft_name}; {len(prompts)} GSM8K prompts x {args.repeats}, {n} new tokens, "
          f"greedy, gamma={args.gamma}", flush=True)

    vanilla = build_method("vanilla", pair)
    speculative = build_method("speculative", pair, num_draft_tokens=args.gamma)
    rows = [
        compare("vanilla vs model.generate",
                lambda p: generate(vanilla, p, n).tokens,
                lambda p: hf_generate(pair.target, p, n), prompts, args.repeats),
        compare(f"speculative vs HF assisted (γ={args.gamma})",
                lambda p: generate(speculative, p, n).tokens,
                lambda p: hf_generate(pair.target, p, n, assistant_model=pair.draft,
                                      num_assistant_tokens=args.gamma,
                                      num_assistant_tokens_schedule="constant",
                                      assistant_confidence_threshold=0.0),
                prompts, args.repeats),
    ]
    from profile_loops import method_defaults    # bench/profile_loops.py: conf/method defaults
    for label in args.methods:
        method = build_method(OWN_ROWS[label], pair, **method_defaults(OWN_ROWS[label], "smollm2"))
        rows.append(compare(f"{label} vs our vanilla", lambda p, m=method: generate(m, p, n).tokens,
                            lambda p: generate(vanilla, p, n).tokens, prompts, args.repeats,
                            against="vanilla"))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
