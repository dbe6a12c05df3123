"""The A/A control (tuner.measure.control, python -m tuner.control): vanilla against itself
through each measuring path reads 1.00 within its noise; the guard before an engine study's
first trial refuses a path that does not, in one line, unless overridden (recorded).

One short control per path, on the embedded default: in process after a method ran, llama.cpp
(the baseline beside prompt lookup's server, two levels and a rate) and vLLM (two plain servers).
Each ratio is checked against a 99.9 % interval of its own pairs (the report's own bound is a 99 %
one): a path biased by a few per cent over these few prompts cannot be told from noise here (the
table in docs/benchmarks.md measures more), one biased as llama.cpp's plain baseline was (17 % at
the prefill) or planted (below) can."""

from __future__ import annotations

import math

import pytest
from optuna.trial import TrialState

from tests.conftest import SIDE_BY_SIDE, compose_cfg, load_study, run_study
from tests.helpers.services import require_llama_server, require_vllm
from tuner.config.errors import MeasurementRefused
from tuner.measure.control import ControlReport, ControlRow
from tuner.measure.intervals import Interval, t_quantile

pytestmark = pytest.mark.usefixtures("in_tmp")
QUICK = ["task.n_prompts=3", "task.n_held_out=3", "task.max_new_tokens=24", "warmup_prompts=1",
         "tracking=none", *SIDE_BY_SIDE]


def within_wide(row: ControlRow, confidence: float = 0.999) -> bool:
    """1.00 inside a ``confidence`` t interval of the row's own pairs. A request rate's requests
    queue behind one another in one schedule, so they are not independent pairs and their t
    interval is too narrow (docs/benchmarks.md: 0.75-1.48 in the A/A table): a rate's ratio is
    held within 0.67-1.5 (a side that stalls, or serves another model, leaves it)."""
    i = row.interval
    if row.at.startswith("request rate"):
        return 1 / 1.5 <= i.ratio <= 1.5
    if i.n < 2:
        return True
    half = t_quantile(0.5 + confidence / 2, i.n - 1) * i.log_sd / math.sqrt(i.n)
    return abs(math.log(i.ratio)) <= half


def control_of(tmp_path, *overrides: str) -> ControlReport:
    from tuner.control import control
    cfg = compose_cfg(tmp_path, *overrides, base=("+task=gsm8k",))
    assert control(cfg) in (True, False)
    import json
    from pathlib import Path
    found, = (Path("studies") / "control").glob("*.json")
    body = json.loads(found.read_text())
    rows = tuple(ControlRow(r["at"], r["figure"], Interval(r["ratio"], r["low"], r["high"],
                                                           r["n"], r["log_sd"]))
                 for r in body["rows"])
    return ControlReport(body["path"], rows, body["seconds"], body["details"])


def test_in_process_vanilla_reads_itself_after_a_method_ran(tmp_path):
    """In process: the method (speculative, the embedded pair) runs untimed on every prompt,
    then vanilla against a second vanilla, pair by pair, order alternating."""
    report = control_of(tmp_path, "method=speculative", "models=smollm2", *QUICK)
    assert report.path == ("in process (hf): vanilla against a second vanilla after "
                           "method=speculative ran")
    assert [(r.at, r.figure) for r in report.rows] == [
        ("concurrency 1", "end to end"), ("concurrency 1", "decode phase"),
        ("concurrency 1", "time to first token")]
    assert all(r.interval.n == 6 for r in report.rows)
    assert all(within_wide(r) for r in report.rows), report.lines()


def test_the_control_runs_the_method_before_vanilla_against_vanilla(tmp_path):
    """The method's runs come first (untimed), then only vanilla is timed: every pair's two
    sides are the same program."""
    from tuner.engines.inprocess import HFEvaluator
    from tuner.study.settings import StudySettings
    from decoding import generate
    seen = []

    def timer(method, ids, max_new_tokens, device):
        seen.append(type(method).__name__)
        return generate(method, ids, max_new_tokens), 1.0

    settings = StudySettings.from_config(compose_cfg(tmp_path, "method=speculative",
                                                     "models=tiny", *QUICK))
    evaluator = HFEvaluator(settings.measuring, timer)
    evaluator.open()
    prompts = list(enumerate(settings.tuning))
    pairs = list(evaluator.control(settings.default, prompts, 0))
    assert seen[:3] == ["SpeculativeDecoding"] * 3
    assert set(seen[3:]) == {"Vanilla"} and len(pairs) == 3
    assert all(p.method.speedup == 1.0 and p.method.tokens == p.baseline.tokens for p in pairs)


def test_llamacpp_baseline_and_sibling_are_the_method_line_with_drafting_off(tmp_path):
    """llama.cpp: the baseline beside a prompt-lookup server is that server's line with a
    lookup that never drafts (the same longest draft: 48, llama.cpp's size_m default here), and
    the control's sibling is launched alike; the baseline answers exactly as the plain server
    does (greedy), and two levels and a rate read 1.00 within their noise."""
    require_llama_server()
    from tuner.engines.llamacpp import longest_draft, never_drafting
    overrides = ("engine=llamacpp", "method=prompt_lookup", "models=smollm2",
                 "engine.target_type=native", "budget.concurrency=[1,2]",
                 "budget.request_rate=[2]", "budget.requests_per_rate=4", *QUICK)
    report = control_of(tmp_path, *overrides)
    assert report.path.startswith("llama.cpp: the baseline server (the same line with drafting "
                                  "made impossible) against method=prompt_lookup's server")
    places = {(r.at, r.figure) for r in report.rows}
    assert {("concurrency 1", "decode phase"), ("concurrency 2", "end to end"),
            ("request rate 2/s", "TPOT"), ("request rate 2/s", "time to first token")} <= places
    assert all(within_wide(r) for r in report.rows), report.lines()
    logs = {p.stem: p.read_text() for p in (tmp_path / "studies").glob("*/engine/*.log")}
    flags = never_drafting(48)
    assert longest_draft(["--spec-type", "ngram-simple"]) == 48
    assert " ".join(flags) in logs["baseline"] and " ".join(flags) in logs["method"]
    assert "-md" not in logs["baseline"]
    # the matched baseline is the engine's own non-speculative output
    from tuner.engines.client import send_batch
    from tuner.engines.llamacpp import LlamaCppEvaluator
    from tuner.study.settings import StudySettings
    settings = StudySettings.from_config(compose_cfg(tmp_path, *overrides,
                                                     base=("+task=gsm8k",)))
    evaluator = LlamaCppEvaluator(settings.measuring, say=lambda line: None)
    evaluator.open()
    try:
        plain = evaluator.baseline
        matched = evaluator._method_server(flags)
        for prompt in settings.tuning:
            answers = [send_batch(server.url + evaluator.endpoint,
                                  [evaluator.payload(prompt, False)])[0][0].body["tokens"]
                       for server in (plain, matched)]
            assert answers[0] == answers[1], prompt.id
    finally:
        evaluator.close()


def test_vllm_two_plain_servers_read_one(tmp_path):
    """vLLM (no never-drafting form: the plain server on both sides): method=vanilla is the
    control's own study, its method side a second plain server."""
    require_vllm()
    report = control_of(tmp_path, "engine=vllm", "method=vanilla", "models=smollm2",
                        "engine.kv_cache_gib=1", "engine.ctx_per_slot=1024", *QUICK)
    assert report.path == "vLLM: the baseline server against a second one launched alike"
    assert {r.figure for r in report.rows} == {"end to end", "decode phase",
                                               "time to first token"}
    assert all(within_wide(r) for r in report.rows), report.lines()


# -- the guard before an engine study's first trial ----------------------------------------------


class PlantedPath:
    """An evaluator whose control reads ``ttft`` at the prefill and 1.00 elsewhere (a path like
    llama.cpp's plain baseline beside a server that reserves 9 outputs); what the guard reads."""

    def __init__(self, ttft: float) -> None:
        self.ttft, self.bound_slack, self.rate_requests, self.calls = ttft, 0.25, {}, 0

    def describe(self):
        return {"engine": "planted"}

    def control(self, params, prompts, parity, levels=None, rates=True):
        from decoding.acceptance import AcceptanceCounts
        from tuner.measure.evaluator import Paired
        from tuner.measure.measurement import Measurement
        self.calls += 1
        for index, prompt in prompts:
            noise = 1.0 + 0.01 * ((index + parity) % 3 - 1)
            base = Measurement(prompt.id, "", (1,) * 24, "", 2.0, AcceptanceCounts(steps=24),
                               0.0, 0.0, prompt_s=1.0, decode_s=1.0, decode_tokens=23)
            side = Measurement(prompt.id, "", (1,) * 24, "", 2.0 / noise,
                               AcceptanceCounts(steps=24), 0.0, 0.0,
                               prompt_s=1.0 / self.ttft / noise, decode_s=1.0 / noise,
                               decode_tokens=23, speedup=noise, decode_speedup=noise)
            yield Paired(index, side, base, True)


def guard_settings(tmp_path, *overrides):
    from tuner.study.settings import StudySettings
    return StudySettings.from_config(compose_cfg(
        tmp_path, "engine=llamacpp", "engine.binary=/bin/true", "method=prompt_lookup",
        "models=smollm2", "tracking=none", *overrides, base=("+task=gsm8k",)))


def test_the_guard_refuses_a_path_that_does_not_read_itself_and_records_an_override(tmp_path):
    import optuna
    from tuner.study.guard import CONTROL, OVERRIDE, guard
    from tuner.answer.notes import control_notes
    lines: list[str] = []
    study = optuna.create_study()
    path = PlantedPath(ttft=1.17)
    with pytest.raises(MeasurementRefused) as refused:
        guard(guard_settings(tmp_path), study, path, lines.append)
    message = str(refused.value)
    assert "\n" not in message and "time to first token at concurrency 1 reads 1.170x" in message
    assert "control.override=true" in message and path.calls == 2       # measured twice
    assert study.user_attrs[CONTROL] is None                           # measured again next run
    study = optuna.create_study()
    guard(guard_settings(tmp_path, "control.override=true"), study, path, lines.append)
    assert "time to first token" in study.user_attrs[OVERRIDE]
    assert control_notes(study)[0].startswith("A/A control BEYOND its bound, measured anyway")
    fair = PlantedPath(ttft=1.0)
    study = optuna.create_study()
    guard(guard_settings(tmp_path), study, fair, lines.append)
    assert study.user_attrs[CONTROL]["within"] and fair.calls == 1
    assert fair.bound_slack == 0.25
    guard(guard_settings(tmp_path), study, fair, lines.append)         # resumed: read back
    assert fair.calls == 1 and "measured before the first trial" in lines[-1]


def test_a_vanilla_study_is_a_control_and_never_recommends_vanilla_over_itself(tmp_path, capsys):
    run_study(tmp_path, "method=vanilla", "task.n_held_out=3", "tracking=none", "search=grid")
    out = capsys.readouterr().out
    advice = next(line for line in out.splitlines() if line.startswith("RECOMMENDATION"))
    assert "use vanilla decoding: this study measured vanilla against itself" in advice
    assert "use the best parameters" not in out
    study = load_study(tmp_path)
    assert {t.state for t in study.trials} == {TrialState.COMPLETE}
