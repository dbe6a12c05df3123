"""Has the deployment's acceptance changed? A two-sided CUSUM against the deployment's own start.

The statistic is a window's accepted tokens per decode step, x_w = A_w / S_w (so the mean
accepted length L_w = 1 + x_w). Its reference comes from the first ``warmup`` windows of a segment
(live traffic, not the study's prompts):

    μ0 = Σ A / Σ S                          pooled over the warm-up
    v0 = the variance of accepted tokens per step, from the pooled per-position counts
         (E[X²] = Σ (2i + 1) p_i): what a window's mean would vary by if steps were independent
    φ  = max(1, Σ S_w (x_w − μ0)² / ((W − 1) v0))   the warm-up's dispersion beyond that
         (requests differ: steps of one request are not independent draws)
    σ²_w = φ v0 / S_w                       a window's variance, by its own number of steps,
         floored at (δ / 8)² (a shift of δ is at most 8 standard errors: no alarm on a reference
         that happens to have no spread, e.g. nothing accepted at all)

Each window adds the log-likelihood ratio of a mean shifted by δ = ``shift`` · L0 (L0 = 1 + μ0)
against μ0, for a normal mean with variance σ²_w, to one CUSUM per direction (Page 1954;
the log-likelihood-ratio form, Basseville & Nikiforov 1993, §2.2):

    g⁻_w = max(0, g⁻ + (δ / σ²_w)(μ0 − x_w − δ/2))       (a drop)
    g⁺_w = max(0, g⁺ + (δ / σ²_w)(x_w − μ0 − δ/2))       (a rise)

and alarms when either exceeds h = ln(2 · ``arl``): Lorden's bound (1971) gives each one-sided
CUSUM of log-likelihood ratios an in-control average run length of at least e^h = 2 · ``arl``
windows under the model, so both together about ``arl`` (1/ARL ≈ 1/ARL⁺ + 1/ARL⁻, the usual
approximation for a two-sided scheme). After an alarm the test starts a new warm-up: the new
regime becomes the reference.

Measured on simulated traffic (bench/watch_drift.py; tests/test_watch.py runs a shorter version;
200 steps of k = 4 drafts per window from 8 requests of 25 steps; acceptance α per position of
0.3, 0.6, 0.85), with the defaults (warm-up 12, shift 0.2, arl 4000):
* false alarms per 1,000 steady windows (80 runs of 1,000): 0.00–0.10 with independent steps,
  0.44–0.74 where requests differ (Beta(ακ, (1 − α)κ) per request, κ = 20), 0.65–0.89 at κ = 5;
* a 20 % drop in L found within 5 windows: in 100 % of 200 runs with independent steps (median 1
  window), 82–96 % at κ = 20 (median 2–3), but only 26–57 % at κ = 5 (median 5–8): where requests
  differ that much, 200 steps from 8 requests cannot tell a 20 % drop from the request mix in 5
  windows; windows of 800 steps (32 requests, ``--min-steps 800``) can: 96–99 % within 5
  (median 2), 0.15–0.45 false alarms per 1,000 windows.
A test that ignores the requests' dispersion (φ = 1) raises several false alarms per 1,000
windows at κ = 5 (the test of that is tests/test_watch.py's).

Windows sized to the traffic (``--min-steps auto``, ``WindowSizer``, ``sized_steps``): a first
warm-up of windows of ``AUTO_START`` (200) steps measures the traffic; from its reference the
windows hold the fewest steps S with which a change of ``shift`` is found within ``WITHIN`` (5)
windows in ``POWER`` of cases by
the normal approximation of the CUSUM's walk: each window adds, under the change, a normal step of
mean D = δ² / (2σ²_w) and standard deviation √(2D), so after n windows the sum exceeds h with
probability Φ((nD − h) / √(2nD)); S = 2 D* φ v0 / δ² for the least D* with n D* − z √(2 n D*) ≥ h
(z = Φ⁻¹(POWER), POWER 97.5 %). φ is a property of the traffic, not of the window (a window of
twice the steps holds twice the requests): it is measured at 200 steps and holds at S. The
reference is itself an estimate from ``warmup`` windows, so φ is taken at its upper 90 % bound (``dispersion_bound``) and
97.5 % is asked for where the target is 90 %: with φ̂ itself the κ = 5 traffic was found within 5
windows in only 83-93 % of runs; and φ is read from the windows' successive differences
(``Reference.successive``), which a change inside the warm-up barely moves (sized from its pooled
spread, a live warm-up that spanned a traffic switch gave windows of 11,735 steps). Then the
change test warms up again on windows of S steps, so
that its reference pools ``warmup`` windows of the size it judges (a reference of 12 × 200 steps
judged against windows of 1,000 is itself off by a third of a window's error: 1.07 false alarms
per 1,000 windows at κ = 5). After an alarm or a restart the traffic is measured again at 200.

A change inside any warm-up (``level_shift``, every ``ChangeTest`` warm-up, fixed ``--min-steps``
too): where von Neumann's ratio of the warm-up's windows is below its lower 1 % point under no
change, the windows before the estimated change point are dropped and the warm-up goes on, at
most ``REMEASURES`` times; so a reference is rarely the mix of two regimes (a live vLLM warm-up
of 6 windows that spanned a switch read L 1.67 between 3.26 and 1.22, with a dispersion that then
hid a 27 % drop from the CUSUM: 1.1 against 9.0 after 8 windows). Its power needs windows: a clean
step halfway through W windows reads 2/W (0.17 at the default 12, against a bound of 0.38; 0.33 at
6, against 0.21: not seen).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from decoding.acceptance import AcceptanceCounts

WARMUP = 12          # windows of a segment that make its reference
SHIFT = 0.2          # the relative change in mean accepted length the test is tuned to
ARL = 4000.0         # windows between false alarms, at least, under the model (both sides)
SIGMA_FLOOR = 8.0    # a shift of δ is at most this many standard errors of a window
AUTO_START = 200     # --min-steps auto: decode steps per window of a warm-up (then sized)
WITHIN = 5           # --min-steps auto: a change of `shift` found within this many windows ...
POWER = 0.975        # ... in this share of cases (the target is 90 %: the reference is estimated)
REMEASURES = 2       # a warm-up that held a change is measured on from it at most this often
SHIFT_LEVEL = 0.01   # ... where von Neumann's ratio is below its lower 1 % point under no change
AUTO_BOUNDS = (50, 100_000)     # the least and the most decode steps a sized window holds
DISPERSION_CONFIDENCE = 0.9     # φ is taken at this upper confidence bound of its estimate


@dataclass(frozen=True)
class Reference:
    """What a segment's warm-up measured."""

    mean: float                  # μ0: accepted tokens per step
    variance: float              # v0: per step
    dispersion: float            # φ ≥ 1
    windows: int
    steps: int
    successive: float = 1.0      # φ from successive windows' differences, ≥ 1 (sizing only)

    @property
    def mean_length(self) -> float:
        return 1.0 + self.mean


@dataclass(frozen=True)
class Verdict:
    """The change test after one window."""

    state: str                   # "warm-up" | "steady" | "ALARM"
    mean_length: float           # this window's L
    reference: Reference | None  # None during the warm-up
    drop: float                  # g⁻
    rise: float                  # g⁺
    threshold: float             # h
    direction: str = ""          # "drop" | "rise" on an alarm
    shifted: LevelShift | None = None   # the warm-up held a change: measured on from it

    @property
    def change(self) -> float | None:
        """This window's L relative to the reference's, − 1."""
        if self.reference is None:
            return None
        return self.mean_length / self.reference.mean_length - 1.0


@dataclass(frozen=True)
class Observation:
    """What the test reads of a window: its steps, accepted tokens and per-step variance."""

    steps: int
    accepted: int
    variance: float


def spreads(warm: Sequence[Observation]) -> tuple[float, float]:
    """The windows' spread about their pooled mean, Σ S_w (x_w − μ)², and their successive
    differences, Σ (x_{w+1} − x_w)² / (1/S_w + 1/S_{w+1}) (von Neumann's: each term has the mean
    φ v0 when nothing changed; a level shift inside the warm-up adds to one difference only, but
    to every window's distance from the mean)."""
    mean = sum(o.accepted for o in warm) / sum(o.steps for o in warm)
    xs = [o.accepted / o.steps for o in warm]
    spread = sum(o.steps * (x - mean) ** 2 for o, x in zip(warm, xs))
    jumps = sum((xb - xa) ** 2 / (1 / a.steps + 1 / b.steps)
                for a, b, xa, xb in zip(warm, warm[1:], xs, xs[1:]))
    return spread, jumps


def reference_of(warm: Sequence[Observation]) -> Reference:
    steps = sum(o.steps for o in warm)
    mean = sum(o.accepted for o in warm) / steps
    # the pooled per-step variance: E over steps of the windows' own second moments
    second = sum(o.steps * (o.variance + (o.accepted / o.steps) ** 2) for o in warm) / steps
    variance = max(second - mean * mean, 0.0)
    if len(warm) > 1 and variance > 0:
        spread, jumps = spreads(warm)
        dispersion = max(1.0, spread / ((len(warm) - 1) * variance))
        successive = max(1.0, jumps / ((len(warm) - 1) * variance))
    else:
        dispersion = successive = 1.0
    return Reference(mean, variance, dispersion, len(warm), steps, successive)


@dataclass(frozen=True)
class Sizing:
    """The window size ``sized_steps`` chose, and why (said once per reference)."""

    steps: int
    drift: float                 # D*: the CUSUM's mean step per window under the change
    reference: Reference
    shift: float
    within: int
    power: float
    bounded: str = ""            # "" or why the bounds cut it

    def describe(self) -> str:
        ref = self.reference
        return (f"windows of {self.steps} decode steps from now on, the change test warming up "
                f"again on them (--min-steps auto: the "
                f"warm-up's {ref.windows} windows read L {ref.mean_length:.2f}, a per-step "
                f"variance {ref.variance:.2f} and a dispersion φ {ref.dispersion:.1f} between "
                f"windows, {ref.successive:.1f} from successive windows (which a change inside "
                f"the warm-up barely moves), {dispersion_bound(ref):.1f} at its upper "
                f"{DISPERSION_CONFIDENCE:.0%} bound; with windows of {self.steps} steps a "
                f"{self.shift:.0%} change in L is found within {self.within} windows in "
                f"{self.power:.1%} of cases by the "
                "CUSUM's normal approximation" + (f"; {self.bounded}" if self.bounded else "")
                + ")")


@dataclass(frozen=True)
class LevelShift:
    """A change inside a warm-up (``level_shift``): its windows from ``at`` on are kept."""

    ratio: float                 # von Neumann's ratio, halved (1 where nothing changed)
    bound: float                 # its lower SHIFT_LEVEL point under no change
    at: int                      # the first window after the change
    windows: int
    before: float                # L before and after
    after: float

    def describe(self) -> str:
        return (f"the traffic changed inside the warm-up: L {self.before:.2f} in its "
                f"first {self.at} windows, {self.after:.2f} in the next {self.windows - self.at} "
                f"(successive windows differ {self.ratio:.2f} times as much as about their mean, "
                f"below {self.bound:.2f}, the least that steady traffic reads in "
                f"{1 - SHIFT_LEVEL:.0%} of warm-ups): measuring on from the change")


def level_shift(warm: Sequence[Observation], level: float = SHIFT_LEVEL) -> LevelShift | None:
    """Did the warm-up's windows change level? Von Neumann's ratio (1941) of their mean square
    successive difference to their spread about the mean, halved: about 1 where the windows are
    exchangeable, small where they hold a shift (a shift adds to one difference, but to every
    window's distance from the mean). It is tested against its normal approximation (mean 1,
    variance (W − 2) / (W² − 1) for W windows; each window weighted by its steps); where it is
    below its lower ``level`` point, the change is put where splitting the windows in two
    explains most of their spread (the usual estimate of a single change point)."""
    from statistics import NormalDist
    n = len(warm)
    if n < 4:
        return None
    spread, jumps = spreads(warm)
    if spread <= 0:
        return None
    ratio = jumps / spread
    total = sum(o.steps for o in warm)
    mean = sum(o.accepted for o in warm) / total
    bound = 1.0 + NormalDist().inv_cdf(level) * math.sqrt((n - 2) / (n * n - 1))
    if ratio >= bound:
        return None

    def explained(at: int) -> float:
        s1 = sum(o.steps for o in warm[:at])
        a1 = sum(o.accepted for o in warm[:at])
        m1, m2 = a1 / s1, (mean * total - a1) / (total - s1)
        return s1 * (total - s1) / total * (m1 - m2) ** 2
    at = max(range(1, n), key=explained)
    before = sum(o.accepted for o in warm[:at]) / sum(o.steps for o in warm[:at])
    after = sum(o.accepted for o in warm[at:]) / sum(o.steps for o in warm[at:])
    return LevelShift(ratio, bound, at, n, 1.0 + before, 1.0 + after)


def dispersion_bound(ref: Reference, confidence: float = DISPERSION_CONFIDENCE) -> float:
    """An upper ``confidence`` bound of φ from the warm-up's W windows, from their successive
    differences (``Reference.successive``: a change inside the warm-up barely moves it, where the
    spread about the pooled mean grows with the change's square): φ̂ ν / χ²_{1−c, ν}, with ν =
    2 (W − 1)² / (3 W − 4) the degrees of freedom of the mean square successive difference
    (von Neumann et al. 1941: its variance is (3 W − 4) / (W − 1)² times its mean's square, where a
    spread about the mean has ν = W − 1); the χ² quantile by Wilson and Hilferty's cube-root
    approximation; never below 1."""
    from statistics import NormalDist
    if ref.windows < 2:
        return ref.successive
    df = 2.0 * (ref.windows - 1) ** 2 / (3.0 * ref.windows - 4.0)
    z = NormalDist().inv_cdf(1.0 - confidence)
    quantile = df * (1.0 - 2.0 / (9.0 * df) + z * math.sqrt(2.0 / (9.0 * df))) ** 3
    return max(1.0, ref.successive * df / max(quantile, 1e-9))


def sized_steps(ref: Reference, shift: float = SHIFT, arl: float = ARL, within: int = WITHIN,
                power: float = POWER) -> Sizing:
    """The fewest decode steps per window that find a relative change ``shift`` in L within
    ``within`` windows with probability ``power`` (module docstring), within ``AUTO_BOUNDS``."""
    from statistics import NormalDist
    h = math.log(2.0 * arl)
    z = NormalDist().inv_cdf(power)
    root = (z * math.sqrt(2 * within) + math.sqrt(2 * within * z * z + 4 * within * h)) / \
        (2 * within)
    drift = root * root                      # D*: n D − z √(2 n D) = h
    delta = shift * ref.mean_length
    per_step = dispersion_bound(ref) * ref.variance
    low, high = AUTO_BOUNDS
    if per_step <= 0:       # nothing varies (nothing accepted, or everything): the floor decides
        return Sizing(low, drift, ref, shift, within, power,
                      "no step-to-step variance in the warm-up: the least size")
    steps = math.ceil(2.0 * drift * per_step / (delta * delta))
    bounded = f"cut to {high} from {steps}" if steps > high else \
        f"raised to {low} from {steps}" if steps < low else ""
    return Sizing(min(max(steps, low), high), drift, ref, shift, within, power, bounded)


@dataclass
class WindowSizer:
    """``--min-steps auto`` (module docstring): ``steps`` is the size of the next window; call
    ``after`` once the change test has observed a window (or restarted)."""

    shift: float = SHIFT
    arl: float = ARL
    steps: int = AUTO_START
    phase: str = "measure"            # "measure" (200-step warm-up) | "reference" | "watch"

    def restart(self) -> None:
        """A server restart: the traffic is measured again at ``AUTO_START``."""
        self.phase, self.steps = "measure", AUTO_START

    def after(self, test: ChangeTest) -> Sizing | None:
        """The new size where the measuring warm-up just ended (the test then warms up again at
        it; a warm-up that held a change was measured on by the test itself, ``level_shift``);
        back to ``AUTO_START`` where the test lost its reference (an alarm, a restart)."""
        if test.reference is None:
            if self.phase == "watch":
                self.phase, self.steps = "measure", AUTO_START
            return None
        if self.phase == "measure":
            sizing = sized_steps(test.reference, self.shift, self.arl)
            self.phase, self.steps = "reference", sizing.steps
            test.restart()
            return sizing
        self.phase = "watch"
        return None


@dataclass
class ChangeTest:
    """The two-sided CUSUM of the module docstring, one window at a time."""

    warmup: int = WARMUP
    shift: float = SHIFT
    arl: float = ARL
    warm: list[Observation] = field(default_factory=list)
    reference: Reference | None = None
    drop: float = 0.0
    rise: float = 0.0
    remeasured: int = 0          # times this warm-up was measured again from a change in it

    @property
    def threshold(self) -> float:
        return math.log(2.0 * self.arl)

    def restart(self) -> None:
        """A new warm-up (after an alarm, or a server restart)."""
        self.warm, self.reference, self.drop, self.rise = [], None, 0.0, 0.0
        self.remeasured = 0

    def observe(self, obs: Observation) -> Verdict:
        length = AcceptanceCounts(steps=obs.steps, accepted=obs.accepted).tokens_per_decode_step
        if self.reference is None:
            self.warm.append(obs)
            shifted = None
            if len(self.warm) >= self.warmup:
                # a warm-up that held a change is measured on from it (module docstring)
                shifted = level_shift(self.warm) if self.remeasured < REMEASURES else None
                if shifted is not None:
                    self.remeasured += 1
                    self.warm = self.warm[shifted.at:]
                else:
                    self.reference, self.remeasured = reference_of(self.warm), 0
            return Verdict("warm-up", length, None, 0.0, 0.0, self.threshold, shifted=shifted)
        ref = self.reference
        delta = self.shift * ref.mean_length
        variance = max(ref.dispersion * ref.variance / obs.steps, (delta / SIGMA_FLOOR) ** 2)
        x = obs.accepted / obs.steps
        self.drop = max(0.0, self.drop + delta / variance * (ref.mean - x - delta / 2))
        self.rise = max(0.0, self.rise + delta / variance * (x - ref.mean - delta / 2))
        if max(self.drop, self.rise) > self.threshold:
            direction = "drop" if self.drop >= self.rise else "rise"
            verdict = Verdict("ALARM", length, ref, self.drop, self.rise, self.threshold,
                              direction)
            self.restart()
            return verdict
        return Verdict("steady", length, ref, self.drop, self.rise, self.threshold)
