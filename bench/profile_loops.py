"""Where a generation's time goes: the models' forwards vs our own loop, per decoding method.

    python bench/profile_loops.py [--prompts 3] [--max-new-tokens 64] [--models smollm2|tiny]
                                  [--methods vanilla speculative ...] [--out docs/profile.md]

Every method runs at its ``conf/method`` default (greedy) on the same prompts after one untimed
warm-up prompt, two passes per method:

1. **Timing** (no profiler): the outermost call of every model (target, draft, EAGLE head and the
   target's LM head when the head borrows it) is timed by module hooks with ``perf_counter``; the
   rest of ``generate`` is ours: drafting bookkeeping, cache cropping, masks, verification,
   ``int``/``tolist`` round trips, allocations. Reported: ms per generation, target steps, the
   share of wall time outside the forwards and that time per target step.
2. **Profile** (``torch.profiler``, CPU): each hooked forward is wrapped in a ``record_function``
   range, so every aten op recorded outside those ranges is our loop's. Reported: its self time per
   step, the host syncs per step (``aten::_local_scalar_dense``: ``.item()``/``int(t)``), and the
   ops that cost most.

The profiler's own overhead inflates pass 2, so shares come from pass 1 only. Writes a markdown
table (``--out``) and prints it; nothing here is a test assertion (tests/test_bench_scripts.py only
runs it small).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
import yaml
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile
from trees import prompts_for, tiny_related  # bench/trees.py: the same pair and prompts

from decoding import build_method, generate, load_pair
from decoding.models import ModelPair
from tuner.config.identity import hardware

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["vanilla", "speculative", "block", "tree", "specinfer", "ouroboros", "lookahead",
           "eagle", "eagle3", "prompt_lookup", "mjsd"]
FORWARD = "model forward"          # the record_function range around every hooked forward
HOST_SYNC = "aten::_local_scalar_dense"


@dataclass
class ForwardHooks:
    """Times the outermost hooked forward (nested hooked calls are inside it: counted once) and,
    while ``label`` is set, opens a profiler range around it."""

    label: bool = False
    seconds: float = 0.0
    calls: int = 0
    _depth: int = 0
    _began: float = 0.0
    _ranges: list = field(default_factory=list)
    _handles: list = field(default_factory=list)

    def attach(self, modules: list[torch.nn.Module]) -> None:
        for module in {id(m): m for m in modules}.values():
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._leave))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def _enter(self, module, args) -> None:
        self._depth += 1
        if self._depth == 1:
            if self.label:
                scope = record_function(FORWARD)
                scope.__enter__()
                self._ranges.append(scope)
            self._began = time.perf_counter()

    def _leave(self, module, args, output) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.seconds += time.perf_counter() - self._began
            self.calls += 1
            if self._ranges:
                self._ranges.pop().__exit__(None, None, None)


def method_defaults(name: str, models: str) -> dict:
    params = yaml.safe_load((ROOT / "conf" / "method" / f"{name}.yaml").read_text())["params"]
    if name in ("eagle", "eagle3"):     # the shipped SmolLM2 head, or a random one on tiny models
        params["head"] = "auto" if models == "smollm2" else "random"
    return params


def hooked_modules(method, pair: ModelPair) -> list[torch.nn.Module]:
    modules = [pair.target] + ([pair.draft] if pair.draft is not None else [])
    head = getattr(method, "head", None)
    if isinstance(head, torch.nn.Module):
        # an EAGLE-1/2 head borrows the target's LM head; an EAGLE-3 head runs its own ``fc``
        # (fusing the target's layers) and ``norm`` + ``lm_head`` (draft vocabulary) outside
        # its forward
        parts = [getattr(head, name, None) for name in ("fc", "norm", "lm_head")]
        modules += [head, pair.target.get_output_embeddings(),
                    *(part for part in parts if isinstance(part, torch.nn.Module))]
    return modules


def outside_forwards(prof) -> tuple[Counter, int]:
    """Self CPU µs per aten op recorded outside every ``FORWARD`` range, and the host syncs there."""
    spent: Counter = Counter()
    syncs = 0
    for event in prof.events():
        if event.name == FORWARD:
            continue
        parent, inside = event.cpu_parent, False
        while parent is not None:
            if parent.name == FORWARD:
                inside = True
                break
            parent = parent.cpu_parent
        if inside:
            continue
        spent[event.name] += event.self_cpu_time_total
        syncs += event.name == HOST_SYNC
    return spent, syncs


def measure(name: str, pair: ModelPair, models: str, prompts: list[list[int]],
            max_new_tokens: int) -> dict:
    method = build_method(name, pair, **method_defaults(name, models))
    hooks = ForwardHooks()
    hooks.attach(hooked_modules(method, pair))
    try:
        generate(method, prompts[0], max_new_tokens)                        # warm-up, untimed
        hooks.reset()
        wall, steps, tokens = 0.0, 0, 0
        for prompt in prompts[1:]:
            began = time.perf_counter()
            out = generate(method, prompt, max_new_tokens)
            wall += time.perf_counter() - began
            steps, tokens = steps + out.stats.steps, tokens + out.stats.new_tokens
        forward_s, forward_calls = hooks.seconds, hooks.calls
        hooks.label = True
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for prompt in prompts[1:]:
                generate(method, prompt, max_new_tokens)
        spent, syncs = outside_forwards(prof)
    finally:
        hooks.detach()
    generations = len(prompts) - 1
    outside_s = wall - forward_s
    return {"method": name, "tokens_per_s": tokens / wall, "ms_per_generation":
            1000 * wall / generations, "steps_per_generation": steps / generations,
            "forwards_per_step": forward_calls / steps,
            "outside_share": outside_s / wall, "outside_us_per_step": 1e6 * outside_s / steps,
            "aten_outside_us_per_step": sum(spent.values()) / steps,
            "host_syncs_per_step": syncs / steps,
            "top_ops_outside": [(op, round(us / steps, 1)) for op, us in spent.most_common(4)]}


def table(rows: list[dict], header: str) -> str:
    lines = [header, "",
             "| method | tok/s | target steps / gen | forwards / step | outside forwards | "
             "outside µs / step | aten ops outside µs / step | host syncs / step | "
             "costliest ops outside (µs / step) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        ops = ", ".join(f"{op.removeprefix('aten::')} {us}" for op, us in r["top_ops_outside"])
        lines.append(
            f"| {r['method']} | {r['tokens_per_s']:.2f} | {r['steps_per_generation']:.1f} | "
            f"{r['forwards_per_step']:.1f} | {100 * r['outside_share']:.1f} % | "
            f"{r['outside_us_per_step']:.0f} | {r['aten_outside_us_per_step']:.0f} | "
            f"{r['host_syncs_per_step']:.1f} | {ops} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=3, help="timed prompts (after 1 warm-up)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--models", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    parser.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    pair = tiny_related() if args.models == "tiny" else load_pair(args.models)
    prompts = prompts_for(args.models, pair, args.prompts)
    header = (f"{hardware(torch.device('cpu'))}, torch {torch.__version__}, "
              f"transformers {transformers.__version__}, {args.threads} threads; "
              f"{pair.target_name} + {pair.draft_name}; {args.prompts} GSM8K prompts "
              f"(after 1 warm-up), {args.max_new_tokens} new tokens, greedy, each method at its "
              f"conf/method default")
    print("# " + header, flush=True)
    rows = []
    for name in args.methods:
        rows.append(measure(name, pair, args.models, prompts, args.max_new_tokens))
        r = rows[-1]
        print(f"{name:<14} {r['tokens_per_s']:6.2f} tok/s  outside forwards "
              f"{100 * r['outside_share']:5.1f} %  ({r['outside_us_per_step']:.0f} µs/step, "
              f"{r['host_syncs_per_step']:.1f} host syncs/step)", flush=True)
    text = table(rows, header)
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
