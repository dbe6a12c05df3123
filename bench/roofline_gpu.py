"""The roofline against a cost measured on a GPU: ``bench/results_gpu_h200/cost.json`` (one
7B-shaped bf16 target forward of n new tokens after a 512-token context, eager, CUDA events, on
an H200) against the H200's datasheet roofline for the same shape (``tuner.predict.roofline``;
the model is built on the meta device: no weights, no GPU needed).

    python bench/roofline_gpu.py [--cost bench/results_gpu_h200/cost.json] [--gpu H200]
        [--out bench/results_roofline_gpu.json]

Prints per n: measured ms, roofline ms, their ratio, and the error on the n / 1 ratio a
prediction uses.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONTEXT = 512                       # bench/gpu.py cost: the forward follows a 512-token context


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cost", default=str(ROOT / "bench/results_gpu_h200/cost.json"))
    parser.add_argument("--gpu", default="H200")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench.random_models import SHAPES
    from tuner.predict import roofline
    measured = json.loads(Path(args.cost).read_text())["results"]["cost"]
    shape_name = measured["target"].split("-", 1)[0]                 # "7b-shaped bfloat16 ..."
    config = AutoConfig.for_model("llama", tie_word_embeddings=False, **SHAPES[shape_name])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    shape = roofline.ModelShape.of(model, f"{shape_name}-shaped", bf16=True)
    machine = roofline.GPUS[roofline.machine_named(args.gpu)]
    rows, one = [], None
    for cell in measured["cost"]:
        estimate = roofline.step_seconds(shape, machine, CONTEXT, cell["n"])
        seconds = cell["chain_ms"] / 1e3
        one = one or (estimate, seconds)
        rows.append({"n": cell["n"], "measured_ms": 1e3 * seconds, "roofline_ms": 1e3 * estimate,
                     "error": estimate / seconds - 1,
                     "ratio_error": (estimate / one[0]) / (seconds / one[1]) - 1})
        print(f"n={cell['n']:>3}: measured {1e3 * seconds:6.2f} ms, roofline {1e3 * estimate:5.2f}"
              f" ms ({100 * rows[-1]['error']:+.0f} %), n/1 ratio error "
              f"{100 * rows[-1]['ratio_error']:+.0f} %")
    print(f"{machine.source}; {shape.weight_bytes / 1e9:.1f} GB of bf16 matmul weights, "
          f"{shape.kv_bytes_per_token / 1e3:.0f} kB KV per token; measured on "
          f"{measured['device']} (torch {measured['torch']}, eager)")
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": machine.name, "source": machine.source,
                                              "measured_on": measured["device"],
                                              "context": CONTEXT, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
