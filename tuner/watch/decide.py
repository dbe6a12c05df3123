"""The decision, by acceptance × cost at the live batch: what each k would give now.

A window's counts price every k with the engine's own hardware profile
(``python -m tuner.profile --engine …``; ``tuner.predict.served.decode_speedup``):

    predicted decode-phase speedup of k = L_k · T_b(1) / E[T_b]

at the window's live batch b (rounded; linear between the profile's batch sizes), with E[T_b]
the expected step where each request drafts d_k / s tokens in a share s = D / S of the steps
and none in the rest (``tuner.predict.served``: n-gram drafting is all or nothing; s = 1 for a
draft model), and p_i = c_i / S the fraction of decode steps that accepted draft position i
(from 0):

* the deployed k: L = 1 + A / S and d = T / S as counted (exact);
* k′ < k: L = 1 + Σ_{i<k′} p_i and d = k′ · D / S — exact only where every draft had full length
  (T = D · k: a step that accepted position i drafted it); where drafts vary in length (an n-gram
  match, llama.cpp's ``p_min``, a per-batch table) an estimate;
* k′ > k: p_i beyond the last counted position continue geometrically with the last positions'
  ratio p_{k−1} / p_{k−2} (or p_0 · S / D for k = 1), d = k′ · D / S: an estimate;
* k = 0 (speculation off): 1.

Only k′ whose rows the profile measured (k′ + 1 ≤ its largest row count) are priced, and none
at which the deployment would draft nothing (``ServerEngine.least_drafting_k``). A switch is
recommended (``Decider``) only when the best k′ beats the deployed k by more than the margin (the
study's calibration error of predicted against measured speedups, where it recorded one) in
``persist`` consecutive windows. The measured time per output token stands beside the
prediction E[T_b] / L of the deployed k (the profile's absolute scale: another time on a
shared machine, a ratio is what transfers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tuner.predict.schedule import LevelChoice, Schedule, from_winners
from tuner.predict.served import decode_speedup, drafting_share, expected_step_s, step_s

if TYPE_CHECKING:
    from tuner.predict.surface import HardwareProfile
    from tuner.watch.windows import Window

PERSIST = 3          # windows in a row the same switch must win by the margin


@dataclass(frozen=True)
class Priced:
    """One k at one window's live batch."""

    k: int
    speedup: float               # predicted decode-phase speedup against speculation off
    mean_length: float           # L_k it used
    drafted_per_step: float      # d_k it used
    exact: bool                  # from the counts (else an estimate, module docstring)
    tpot_s: float                # T_b(d + 1) / L: the profile's time per output token


@dataclass(frozen=True)
class Pricing:
    """Every k priced at one window."""

    batch: int
    deployed: Priced
    options: tuple[Priced, ...]  # k = 0, 1, ... (the deployed one among them)
    note: str = ""               # e.g. the live batch beyond the profile's batch sizes

    @property
    def best(self) -> Priced:
        return max(self.options, key=lambda p: (p.speedup, -p.k))     # ties: the smaller k

    @property
    def gain(self) -> float:
        """What the best k is predicted to gain over the deployed one."""
        return self.best.speedup / self.deployed.speedup - 1.0

    def line(self) -> str:
        best = self.best
        shown = "off" if best.k == 0 else f"k={best.k}"
        est = "" if best.exact else " (estimate)"
        return (f"batch {self.batch}: deployed k={self.deployed.k} {self.deployed.speedup:.2f}x"
                f", best {shown} {best.speedup:.2f}x{est}")


def step_fractions(window: Window, k: int) -> tuple[list[float], bool]:
    """p_0 … p_{k−1} for ``k`` positions (extrapolated beyond the counted ones) and whether
    they are all counted."""
    p = list(window.step_fractions)
    counted = len(p)
    if k <= counted:
        return p[:k], True
    if counted >= 2 and p[-2] > 0:
        ratio = p[-1] / p[-2]
    elif counted >= 1 and window.drafts:
        ratio = p[0] * window.steps / window.drafts
    else:
        ratio = 0.0
    ratio = min(max(ratio, 0.0), 1.0)
    last = p[-1] if p else 0.0
    while len(p) < k:
        last *= ratio
        p.append(last)
    return p, False


def price(window: Window, profile: HardwareProfile, deployed_k: int,
          least_k: int = 1) -> Pricing:
    """Every k the profile's rows reach, at the window's live batch (module docstring); none
    in 0 < k < ``least_k`` (the deployment would draft nothing there: llama.cpp's ngram-simple
    below its lookup size)."""
    sizes = profile.batch_sizes()
    live = window.live_batch or 1
    batch = min(max(live, sizes[0]), sizes[-1])
    note = "" if batch == live else (f"the live batch {live} is outside the profile's batch "
                                     f"sizes {list(sizes)}: priced at {batch}")
    if window.batch is None:
        note = "the live batch is unknown (the gauge was not printed): priced at batch 1"
    rows = max(profile.at_batch(batch).target.rows)
    top = rows - 1
    full = window.full_length(deployed_k)
    share = window.drafts / window.steps if window.steps else 0.0   # steps that drafted
    drafting = drafting_share(window.drafts, window.draft_tokens, window.steps)

    def priced(k: int, length: float, drafted: float, exact: bool) -> Priced:
        return Priced(k, decode_speedup(profile, batch, length, drafted, drafting), length,
                      drafted, exact, expected_step_s(profile, batch, drafted, drafting) /
                      length)

    # the deployed k from its own counts: exact where the profile measured rows as wide as a
    # drafting step's
    widest = window.drafted_per_step / drafting if drafting else 0.0
    deployed = priced(deployed_k, window.mean_length, window.drafted_per_step,
                      widest + 1.0 <= rows + 1e-9)
    if not deployed.exact:
        beyond = (f"the deployed k={deployed_k} drafts beyond the profile's rows "
                  f"({rows}): its price is extrapolated")
        note = f"{note}; {beyond}" if note else beyond
    options = [Priced(0, 1.0, 1.0, 0.0, True, step_s(profile, batch, 1))]
    for k in range(1, max(top, deployed_k) + 1):
        if k == deployed_k:
            options.append(deployed)
            continue
        if k > top or k < least_k:
            continue
        fractions, counted = step_fractions(window, k)
        # a shorter k never drafts more than the deployment did
        drafted = min(k * share, window.drafted_per_step) if k < deployed_k else k * share
        options.append(priced(k, 1.0 + sum(fractions), drafted,
                              counted and full and k < deployed_k))
    return Pricing(batch, deployed, tuple(options), note)


@dataclass
class Decider:
    """Recommends a switch that wins by more than ``margin`` in ``persist`` windows in a row,
    once per k until the best k changes or ``reset`` (an alarm, a restart)."""

    margin: float
    persist: int = PERSIST
    streak: list[Pricing] = field(default_factory=list)
    said: int | None = None          # the k last recommended

    def reset(self) -> None:
        self.streak, self.said = [], None

    def skip(self) -> None:
        """A window priced where no switch may be recommended (the profile's cells out of
        order at its batch): the streak ends; a k already recommended is not said again."""
        self.streak = []

    def observe(self, pricing: Pricing) -> Recommendation | None:
        """The recommendation this window completes (None: none, or the same as the last)."""
        best = pricing.best
        if best.k == pricing.deployed.k:
            self.streak, self.said = [], None
            return None
        if pricing.gain <= self.margin:
            self.streak = []
            return None
        if self.streak and self.streak[-1].best.k != best.k:
            self.streak = []
        self.streak = [*self.streak, pricing][-self.persist:]
        if len(self.streak) < self.persist or best.k == self.said:
            return None
        held, self.streak, self.said = self.streak, [], best.k
        return Recommendation(best.k, tuple(held), self.margin)


@dataclass(frozen=True)
class Recommendation:
    """Switch from the deployed k to ``k`` (0: speculation off), and the windows it rests on."""

    k: int
    windows: tuple[Pricing, ...]
    margin: float

    @property
    def deployed_k(self) -> int:
        return self.windows[-1].deployed.k

    @property
    def gains(self) -> list[float]:
        return [p.gain for p in self.windows]

    @property
    def exact(self) -> bool:
        return all(p.best.exact for p in self.windows)

    def schedule(self) -> Schedule:
        """The best k per live batch size these windows priced (the last window's per batch)."""
        by_batch: dict[int, Pricing] = {}
        for p in self.windows:
            by_batch[p.batch] = p
        if len(by_batch) >= 2:
            return from_winners({b: p.best.k for b, p in by_batch.items()}, max(by_batch))
        [(batch, p)] = by_batch.items()
        return Schedule((LevelChoice(batch, p.best.k, p.best.speedup),), (), batch)

    def line(self) -> str:
        what = "turn speculation off" if self.k == 0 else f"switch to k={self.k}"
        low, high = min(self.gains), max(self.gains)
        est = "" if self.exact else " (an ESTIMATE: k beyond what the counts give exactly)"
        return (f"{what} (deployed k={self.deployed_k}): predicted +{100 * low:.0f} to "
                f"+{100 * high:.0f} % in the decode phase over {len(self.windows)} windows in a "
                f"row, beyond the margin of {100 * self.margin:.0f} %{est}")

