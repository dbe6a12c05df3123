"""The power of every end-to-end law test: ``python -m tests.helpers.law_power [ID ...]``.

Runs each case of ``tests.helpers.law_cases`` with the right rule and, where the case has one,
with its mutant, at the case's draws, and prints per run: Pearson's X², its degrees of freedom
(cells after pooling bins expecting < 5 draws, minus one) and the p-value; for a mutant also the
estimated power at the case's draws (plug-in noncentral chi-square with λ = X² − dof,
``laws.ChiSquare.power``) and the fewest draws for an estimated power of 0.99 (for the right rule
these are noise and left out). ``--json FILE`` also writes the rows.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tests.helpers import law_cases
from tests.helpers.laws import ALPHA

FAMILIES = {"methods": law_cases.method_cases, "prompt_lookup": law_cases.prompt_lookup_cases,
            "eagle": law_cases.eagle_cases}


def rows(selected: set[str]) -> list[dict]:
    out = []
    for family, cases in FAMILIES.items():
        for case in cases():
            name = f"{family}/{case.id}"
            if selected and name not in selected and family not in selected:
                continue
            for mutation in (None, case.mutation) if case.mutation else (None,):
                start = time.perf_counter()
                result = law_cases.run(case, mutation)
                row = dict(case=name, rule=mutation or "right", draws=case.draws,
                           statistic=round(result.statistic, 1), dof=result.dof,
                           pvalue=float(f"{result.pvalue:.3g}"))
                if mutation:
                    row.update(power=round(result.power(), 4),
                               draws_for_099=result.draws_for(0.99))
                row["seconds"] = round(time.perf_counter() - start, 1)
                print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
                out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ids", nargs="*", help="family or family/case ids (default: all)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"alpha={ALPHA}")
    result = rows(set(args.ids))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"alpha": ALPHA, "torch": torch.__version__,
                       "command": "PYTHONPATH=. OMP_NUM_THREADS=1 python -m "
                                  f"tests.helpers.law_power {' '.join(args.ids)} --json {args.json}",
                       "rows": result}, f, indent=1)


if __name__ == "__main__":
    main()
