"""The measurement seam: what an evaluator is and what it returns.

An *evaluator* measures one configuration of a method against its baseline on a list of prompts.
The study (``tuner.study``) decides which configuration and which prompts; the evaluator decides
how they are run: in this process with transformers (``tuner.engines.inprocess.HFEvaluator``) or inside
an inference engine's server. It knows nothing of Optuna or MLflow, and returns plain records:

  * ``measure(...)`` yields one ``Paired`` per prompt as soon as it is measured (so a pruner can
    stop a trial early): the method and its baseline on the same prompt, interleaved A/B with the
    order alternating, the lossless check already applied (a violation raises
    ``LosslessViolation``);
  * ``assess(pairs)`` runs after the timed window and turns the pairs into an ``Evaluation``: the
    summary numbers (speedup, tokens/s, acceptance, energy, quality, ...), with task quality and
    perplexity scored outside any timed window.

Failures an evaluator must tell apart: ``ParametersRefused`` (the method rejected this point:
a configuration error, not a measurement) and everything else (a bug or an accident of the run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Protocol, Sequence

from tuner.measure.hygiene import ContentionGuard
from tuner.measure.rates import Traffic

if TYPE_CHECKING:
    import torch

    from decoding.base import DecodingMethod
    from tuner.measure.measurement import Measurement
    from tuner.tasks.task import Prompt, Task


class MethodView:
    """What a study's method and sampling imply, for any record with ``method`` (``_target_``,
    ``lossless``, ``params``, ``space``) and ``sampling`` (``MeasureSettings``,
    ``StudySettings``)."""

    method: Mapping[str, Any]
    sampling: Mapping[str, Any]

    @property
    def space(self) -> dict[str, dict]:
        return dict(self.method.get("space") or {})

    @property
    def default(self) -> dict[str, Any]:
        """Every parameter's default (trial 0): searched and fixed ones."""
        return dict(self.method.get("params") or {})

    def params_at(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """Every parameter that builds the point ``values``: the defaults under its values (a
        union of methods: its member's defaults, ``tuner.config.union.params_at``)."""
        from tuner.config.union import params_at
        return params_at(self.method, values)

    @property
    def lossless(self) -> bool:
        return bool(self.method.get("lossless", True))

    @property
    def greedy(self) -> bool:
        return float(self.sampling["temperature"]) == 0.0

    @property
    def method_class(self) -> type[DecodingMethod]:
        """The ``decoding`` class ``_target_`` names (validated: a ``DecodingMethod``), whose
        declared capabilities (``replayable``, ``traceable``, ...) the stages read."""
        from tuner.config.methods import method_class
        return method_class(self.method)


@dataclass(frozen=True)
class MeasureSettings(MethodView):
    """What an evaluator needs of a study, and nothing else (``StudySettings.measuring`` builds
    it): the prompts, the budget, the sampling, the models and the method as the engine sees it,
    and how to time fairly (threads, contention, warm-up, the near-tie tolerance)."""

    task: Task                         # encodes the prompts, scores quality
    tuning: tuple[Prompt, ...]         # prompts the search measures on
    held_out: tuple[Prompt, ...]       # prompts only the winner's confirmation sees
    budget: Mapping[str, int]          # max_new_tokens (and the task's sizes)
    concurrency: tuple[int, ...]       # requests in flight at once, one measurement per level
    sampling: Mapping[str, Any]        # temperature, top_k, top_p
    seed: int
    models: Mapping[str, Any]          # target/draft specs (decoding.models)
    method: Mapping[str, Any]          # _target_, lossless, needs_draft, params, space
    method_choice: str                 # the conf/method file name
    engine: Mapping[str, Any]          # conf/engine: kind and its settings
    warmup_prompts: int
    near_tie_ulps: float
    device: torch.device
    threads: Any                       # "auto" or an int (tuner.measure.hygiene)
    contention: str                    # wait | warn | fail
    contention_wait_s: float
    contention_window_s: float         # seconds of each load sample before a pair
    scores_perplexity: bool            # perplexity is scored after the timed window
    work_dir: str                      # the study's own folder (an engine's server logs)
    head_identity: str | None = None   # method.head's recorded identity (JSON), if any
    traffic: Traffic = Traffic()       # request rates (engine servers; tuner.measure.rates)
    profile: Any = None                # search.profile, loaded (tuner.predict.surface), or None
    predict_for: Any = None            # search.predict_for: another machine's profile, or None
    untimed: str = "halving"           # search=predict: how points needing untimed runs are
    #                                    ranked (halving | sweep: tuner.predict.halving)
    untimed_workers: int = 1           # processes those untimed runs share (tuner.predict.workers)
    bound_slack: float = 0.25          # tuner.measure.bounds: the physical bound's slack

    def contention_guard(self) -> ContentionGuard:
        """The ``contention=`` policy every backend applies before each measured pair."""
        return ContentionGuard(self.contention, max_wait_s=self.contention_wait_s,
                               window_s=self.contention_window_s)


class ParametersRefused(ValueError):
    """The method refused its parameters when it was built (e.g. a tree deeper than its budget):
    the point is a configuration error, not a measurement, and costs no budget once fixed."""


@dataclass(frozen=True)
class Paired:
    """One prompt measured with the method and with its baseline."""

    index: int                 # the prompt's position in the study's list (the pruner's step)
    method: Measurement        # ``speedup`` = the baseline's seconds/token over the method's
    baseline: Measurement      # the baseline on the same prompt
    fresh_baseline: bool       # measured in this call (False: the study's stored baseline)


@dataclass(frozen=True)
class Evaluation:
    """What a configuration measured on some prompts, ready for the optimizer and the trackers."""

    summary: dict[str, float]                      # per-trial numbers (tuner.measure.measurement)
    measurements: tuple[Measurement, ...]          # the method, one per prompt
    baselines: tuple[Measurement, ...] = ()        # fresh baseline runs of this call
    baseline_summary: dict[str, float] = field(default_factory=dict)   # their summary
    notes: tuple[str, ...] = ()                    # what the reader must know (contention, ...)


class BaselineStore(Protocol):
    """Where a once-per-study baseline is kept (``baseline=per_study``): a study attribute."""

    def get(self) -> Mapping[str, Any] | None: ...

    def put(self, value: Mapping[str, Any]) -> None: ...


class Evaluator(Protocol):
    """How a configuration is measured; see the module docstring for the contract."""

    def open(self) -> None:
        """Acquire what measuring needs (load models, start a server); called once."""

    def close(self) -> None:
        """Release it (stop servers); always called, also after a failure or Ctrl-C."""

    def describe(self) -> dict[str, str]:
        """What the numbers were measured with (engine, versions, threads) for the records."""

    def measure(self, params: Mapping[str, Any], prompts: Sequence[tuple[int, Prompt]],
                parity: int, store: BaselineStore | None = None) -> Iterator[Paired]:
        """Measure ``params`` on ``prompts`` ((index, prompt) in measuring order).

        Args:
            params: every parameter of the method (searched and fixed).
            prompts: the prompts, in the order to measure them, with their study indices.
            parity: the baseline runs first on the k-th pair (k = 1, 2, ...) when
                ``(parity + k) % 2 == 0``, so the order alternates and shifts between trials.
            store: ``baseline=per_study``: the study's stored baseline (measured on first use);
                None: the baseline is measured beside the method on every prompt.
        """

    def control(self, params: Mapping[str, Any], prompts: Sequence[tuple[int, Prompt]],
                parity: int, levels: Sequence[int] | None = None,
                rates: bool = True) -> Iterator[Paired]:
        """The A/A control of ``params``' measuring path (``tuner.measure.control``): the
        baseline as ``measure`` runs it, against a sibling of equal cost in the method's place
        (in process: a second vanilla after the method ran; a server engine: a second server
        launched with the method's line and drafting off), by the same protocol; ``levels``:
        these concurrency levels only; ``rates``: False leaves the request rates out. The
        rates' streamed requests are kept in ``rate_requests`` for the control to pair."""

    def assess(self, pairs: Sequence[Paired]) -> Evaluation:
        """Summarise ``pairs`` (quality and perplexity are scored here, outside timing)."""

    def ranker(self) -> Any:
        """The ranker on this evaluator's loaded models (``tuner.predict.ranker.Ranker``: the
        profile's check and price, ``search=predict``'s ranking, each trial's prediction), or
        None where this engine's points are not ranked so (an engine server predicts each
        trial per level from its own surface, in ``extra_summary``); asked after ``open``."""
        return None

    def speculative_base(self, params: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """The fixed entries of a speculative config for ``params`` (method, draft model, every
        knob but the drafted-token count) that a vLLM schedule form is written around; None
        where the backend is not vLLM's (a schedule form for vLLM then says why it is absent)."""
        return None

    def deployment(self, params: Mapping[str, Any],
                   per_level: Mapping[int, Mapping[str, Any] | None] | None = None
                   ) -> dict[str, Any]:
        """How to run ``params`` where it was measured (an engine's exact launch line);
        ``per_level``: the best parameters per concurrency level (None: speculation off there),
        for engines that take a per-batch-size schedule."""
