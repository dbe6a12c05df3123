"""Is a hardware profile to be believed? Two checks, one when it is made, one in every study.

1. **The fit** (``fit_flags``, when ``python -m tuner.profile`` makes it). The loops' per-step
   overheads are differences of two large sums (a run's wall time − its forwards' price), so a
   few seconds of other work on the machine become an additive error on every step's price. A
   fit is flagged when
     * other processes used more than ``BUSY_THRESHOLD`` of our CPUs during any timed run or
       round of cells (``tuner.predict.loops.LoopFit.busy``);
     * a loop's fitted overhead is uncertain by more than ``SPREAD_BOUND`` of the price of its
       step (``LoopFit.spread``: the standard error over rounds; quiet fits of the default on a
       2-core CPU gave 2–8 %, where single runs of 2.5 s there differ by up to 20 %; the +73 ms
       case below: 26 %);
   No bound is put on the overhead's size: it is the loop's own cost beyond its forwards, which
   is large where the loop is host-bound (our vanilla loop on the H200 took 36.7 ms per token
   against a 19 ms forward) or the model tiny (a random 2-layer model: +36 %).
2. **Against trial 0** (``vanilla_check``, after a study's first trial, before anything is
   ranked by the profile). The profile's price of vanilla per decoded token and the trial's
   measured vanilla time per decoded token (the decode phase: every step after the first, so
   neither the prefill nor a generation's fixed set-up weighs on short generations), each
   divided by the target's 1-row forward at the same context — the
   profile's own cell, and the same cell timed now beside the trial — must agree within
   ``VANILLA_CHECK_BOUND``. Dividing by the forward timed now makes the check blind to a machine
   that is uniformly faster or slower than when the profile was made (predicted speedups are
   ratios: they survive that), and sharp on what breaks them: a per-step overhead that is not
   the loop's. Nothing is rescaled: a profile that fails is not used, and the study says so.
   The bound leaves room for the check's own noise: studies of the default on a quiet 2-core
   CPU checked fresh profiles at −6.2 %, +7.6 %, +4.8 % (5-round profiles) and +14.1 % (a
   1-round profile), 3 prompts × 31 decoded tokens each; the +73 ms profile is off by about
   −40 % (it prices vanilla 1.7× too high per forward).
   Under ``MIN_CHECK_S`` of measured decoding (tiny test models, a handful of tokens: the
   timing is noise) the check says so and judges nothing.
   **Confirmed before it is refused.** Trial 0's vanilla and the forwards timed after it are
   seconds to minutes apart, and a shared machine's speed moves in between: a fresh 3-round
   profile of the default, made a minute before, read +40.3 % on a CI machine and +23.9 % in a
   local serial suite (each passed when run again), and this 2-core Xeon's profile rounds took
   23-41 s within ten minutes with other processes at 0-1 % of the CPUs. So a decisive reading
   beyond the bound is measured once more (``confirm_against_trial_0``): vanilla decoded again
   on trial 0's prompts, each generation between two timings of its 1-row forward (their mean
   its unit), so that a drift has seconds, not minutes, to act; that reading decides. A profile
   truly off (the +73 ms case) reads beyond the bound both times.
3. **Order** (``inversions``, when an engine's profile is made, and at the batch size where
   ``python -m tuner.watch`` prices a decision). Prices between k are read from the cells by
   rows (a step feeding d + 1 tokens, interpolated); that rests on a step's cost growing with
   its rows. Where a step of more rows is priced more than ``INVERSION_BOUND`` below one of
   fewer rows at the same batch size, the cells do not follow the rows: noise, or an engine path
   of its own at some k. Either way a decision between k is not read from them. Found live
   (vLLM's draft-free steps, 2-core CPU): at batch 1 a k = 1 step (2 rows) dearer than a k = 2
   step (3 rows) in two profiles, 90.6 against 72.2 ms (4 prompts a cell) and 83.1 against
   73.0 ms (10 prompts): a path of vLLM's own at k = 1, not noise; at batch 2 −7.0 %, then
   −1.8 % (within the bound). From the first the watch priced k = 1 at +10 % over the deployed
   k = 4 at batch 2, and the A B A B measurement went 7 % the other way (the deployed server's
   own two runs differed by 19 %).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from tuner.predict.loops import BUSY_THRESHOLD

if TYPE_CHECKING:
    from tuner.measure.evaluator import Paired
    from tuner.predict.loops import LoopFit
    from tuner.predict.surface import HardwareProfile

SPREAD_BOUND = 0.15          # of a loop's priced step: its overhead's standard error
VANILLA_CHECK_BOUND = 0.20   # |trial 0's vanilla per token / the profile's − 1|, per forward
ONE_ROW_ROUNDS = 10          # rounds of the 1-row forwards timed beside trial 0
MIN_CHECK_S = 1.0            # trial 0's vanilla decode seconds below which nothing is judged
INVERSION_BOUND = 0.02       # a wider step this much cheaper than a narrower one: flagged


def inversions(profile: HardwareProfile, bound: float = INVERSION_BOUND,
               batch: int | None = None) -> list[str]:
    """One line per batch size (and context) where a step of more rows is priced more than
    ``bound`` below one of fewer rows (the largest such drop; empty: the cells are in order);
    ``batch``: only the surface at that batch size (blended between the measured ones)."""
    if batch is not None:
        surfaces = [(batch, profile.at_batch(batch).target)]
    else:
        surfaces = [(b, target) for b, target, _ in profile.batches] or [(1, profile.target)]
    found = []
    for batch, surface in surfaces:
        for context, line in zip(surface.contexts, surface.seconds):
            worst = None
            for i, narrow in enumerate(line):
                for j in range(i + 1, len(line)):
                    drop = 1.0 - line[j] / narrow
                    if drop > bound and (worst is None or drop > worst[0]):
                        worst = (drop, surface.rows[i], narrow, surface.rows[j], line[j])
            if worst is not None:
                drop, few, few_s, many, many_s = worst
                found.append(f"at batch {batch} (context {context}) a step of {many} rows is "
                             f"priced {1e3 * many_s:.1f} ms, {100 * drop:.1f} % below one of "
                             f"{few} rows ({1e3 * few_s:.1f} ms): the cells do not follow the "
                             "rows (noise, or an engine path of its own at some k), so prices "
                             "between k read from them by rows are not to be believed")
    return found


def fit_flags(fit: LoopFit) -> list[str]:
    """One line per reason not to believe ``fit`` (empty: believed)."""
    flags = []
    if fit.busy:
        flags.append(f"other processes used more than {BUSY_THRESHOLD:.0%} of the CPUs during "
                     f"{len(fit.busy)} timed part(s) of the profile, e.g. {fit.busy[0]}")
    for loop in fit.samples:
        spread, step = fit.spread(loop), fit.step_s[loop]
        if spread > SPREAD_BOUND * step:
            flags.append(f"{loop}'s fitted overhead is uncertain by ±{1e3 * spread:.1f} ms per "
                         f"step (standard error over rounds), {spread / step:.0%} of its step's "
                         f"forwards ({1e3 * step:.1f} ms; bound {SPREAD_BOUND:.0%})")
    return flags


@dataclass(frozen=True)
class VanillaGeneration:
    """Trial 0's vanilla run on one prompt, its decode phase (every step after the first: the
    prefill and a generation's fixed set-up left out), and the 1-row forward timed beside it."""

    prompt_len: int             # prompt tokens
    decode_tokens: int          # tokens vanilla generated after its first step
    decode_s: float             # their measured seconds
    one_row_s: float            # a 1-row forward after ``context()`` cached tokens, timed now

    def context(self) -> int:
        """The decode phase's middle: where its 1-row forwards are compared."""
        return self.prompt_len + 1 + self.decode_tokens // 2


@dataclass(frozen=True)
class VanillaCheck:
    """The profile's vanilla against trial 0's, per 1-row forward (module docstring)."""

    priced: float               # the profile's vanilla seconds per token / its 1-row forward
    measured: float             # trial 0's vanilla seconds per token / the 1-row forward now
    seconds: float              # trial 0's vanilla decode seconds the check rests on
    bound: float = VANILLA_CHECK_BOUND
    again: bool = False         # measured again now, beside its forwards (not trial 0's)

    @property
    def error(self) -> float:
        return self.measured / self.priced - 1.0

    @property
    def decisive(self) -> bool:
        """Enough measured decoding to judge by (``MIN_CHECK_S``)."""
        return self.seconds >= MIN_CHECK_S

    @property
    def ok(self) -> bool:
        """Not refused: within the bound, or too little measured to judge."""
        return not self.decisive or abs(self.error) <= self.bound

    def line(self, profile_name: str) -> str:
        whose = "vanilla measured again beside its forwards" if self.again else "trial 0"
        read = "read" if self.again else "measured"
        head = (f"profile check: {profile_name} prices vanilla at {self.priced:.3f} 1-row "
                f"forwards per token, {whose} {read} {self.measured:.3f} ({self.error:+.1%}")
        if not self.decisive:
            decoded = "vanilla measured again" if self.again else "trial 0's vanilla"
            return (f"{head}; not judged: {decoded} decoded for {self.seconds:.2f} s, "
                    f"under the {MIN_CHECK_S:g} s a judgement needs: the profile is used "
                    "unchecked)")
        verdict = "within" if self.ok else "BEYOND"
        return f"{head}, {verdict} the ±{self.bound:.0%} bound)"

    def to_json(self) -> dict[str, float | bool]:
        return {"priced": self.priced, "measured": self.measured, "error": self.error,
                "seconds": self.seconds, "bound": self.bound, "decisive": self.decisive,
                "ok": self.ok, "again": self.again}


def vanilla_check(profile: HardwareProfile, runs: Sequence[VanillaGeneration],
                  bound: float = VANILLA_CHECK_BOUND) -> VanillaCheck:
    """Trial 0's vanilla decode phases ``runs`` against ``profile``'s price of the same steps
    (each a 1-row forward after the tokens before it, plus vanilla's overhead)."""
    from tuner.predict.predict import priced
    runs = [r for r in runs if r.decode_tokens > 0]
    if not runs:
        raise ValueError("no vanilla decode step to check the profile against")
    overhead = profile.step_overhead_s.get("vanilla", 0.0)
    target = profile.target
    price = sum(priced(target.step_s(r.prompt_len + i, 1), overhead)
                for r in runs for i in range(r.decode_tokens))
    price_units = sum(r.decode_tokens * target.step_s(r.context(), 1) for r in runs)
    measured = sum(r.decode_s for r in runs)
    measured_units = sum(r.decode_tokens * r.one_row_s for r in runs)
    return VanillaCheck(price / price_units, measured / measured_units, measured, bound)


def trial_0_generations(profile: HardwareProfile | None, ids: Mapping[str, Sequence[int]],
                        pairs: Sequence[Paired]) -> dict[str, VanillaGeneration]:
    """Trial 0's vanilla decode phases by prompt id (a cycled prompt: once), their 1-row
    forward not yet timed; empty where ``profile`` is not a measured one (a roofline is not
    checked) or nothing decoded. ``ids``: every study prompt's token ids by prompt id."""
    if profile is None or profile.kind != "measured":
        return {}
    runs = {p.baseline.prompt_id: p.baseline for p in pairs}
    return {i: VanillaGeneration(len(ids[i]), m.decode_tokens, m.decode_s, 0.0)
            for i, m in runs.items() if m.decode_tokens and m.decode_s is not None}


def one_row_seconds(target: Any, contexts: Sequence[int]) -> dict[int, float]:
    """``target``'s 1-row forward after each of ``contexts`` cached tokens, timed now
    (``tuner.predict.loops.measure_surface``, ``ONE_ROW_ROUNDS`` rounds)."""
    from tuner.predict.loops import measure_surface
    contexts = sorted(set(contexts))
    now = measure_surface(target, contexts=contexts, rows=(1,), prefill=(),
                          repeats=ONE_ROW_ROUNDS)
    return dict(zip(contexts, (line[0] for line in now.seconds)))


def check_against_trial_0(profile: HardwareProfile | None, target: Any,
                          ids: Mapping[str, Sequence[int]], pairs: Sequence[Paired]
                          ) -> VanillaCheck | None:
    """``profile``'s vanilla against trial 0's measured vanilla (``pairs``), each per 1-row
    forward of ``target`` at the generation's middle context: the profile's own cell, and the
    same forward timed now. None where nothing is checked (``trial_0_generations``)."""
    shapes = list(trial_0_generations(profile, ids, pairs).values())
    if not shapes:
        return None
    one_row = one_row_seconds(target, [g.context() for g in shapes])
    return vanilla_check(profile, [replace(g, one_row_s=one_row[g.context()]) for g in shapes])


def confirm_against_trial_0(profile: HardwareProfile | None, target: Any,
                            ids: Mapping[str, Sequence[int]], pairs: Sequence[Paired],
                            vanilla: Callable[[str], tuple[float, int]] | None
                            ) -> VanillaCheck | None:
    """The check again on trial 0's prompts, vanilla timed now as a trial times it
    (``vanilla(prompt_id)``: its decode seconds and tokens), each generation between two
    timings of its 1-row forward (their mean its unit): a machine whose speed moved between
    trial 0 and the forwards timed after it cannot decide this reading ("Confirmed before it
    is refused" above). None where nothing can be run."""
    shapes = trial_0_generations(profile, ids, pairs)
    if not shapes or vanilla is None:
        return None
    runs = []
    for prompt_id, shape in shapes.items():
        before = one_row_seconds(target, [shape.context()])[shape.context()]
        decode_s, decode_tokens = vanilla(prompt_id)
        after = one_row_seconds(target, [shape.context()])[shape.context()]
        runs.append(VanillaGeneration(shape.prompt_len, decode_tokens, decode_s,
                                      (before + after) / 2))
    return replace(vanilla_check(profile, runs), again=True)
