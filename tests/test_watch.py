"""``python -m tuner.watch``: a running deployment watched against its study.

* The change test (tuner.watch.drift) on simulated sequences with known change points, many runs:
  at most one false alarm per 1,000 windows of steady traffic, and a 20 % drop in mean accepted
  length found within 5 windows at 200 steps per window; a variant that ignores the requests'
  dispersion breaks the false-alarm target (the test can fail).
* Recorded scrapes of our real servers (tests/fixtures/watch, made by record.py there): steady
  traffic gives no alarm, the recorded workload switch alarms within the stated windows, a restart
  mid-recording starts a new segment, n-gram drafts of varying length are priced as estimates.
* One live test per engine (llama-server; vLLM's CPU build): the study's deployment started from
  its launch line, a workload switch from extractive prompts to open ones alarms and the decision
  is priced; the MLflow run and the log hold the windows; the recording replays to the same
  windows.
* Bad input gets one line each.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from bench.watch_drift import delays, false_alarms_per_1000
from tests.conftest import ROOT
from tuner.engines.metrics import Counters
from tuner.watch.drift import ChangeTest, Reference
from tuner.watch.windows import Restart, Scrape, Window, Windower
from decoding.acceptance import AcceptanceCounts

FIXTURES = ROOT / "tests" / "fixtures" / "watch"


# ----------------------------------------------------------------------------------------------
# The change test on simulated traffic


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.85])
@pytest.mark.parametrize("kappa", [None, 20.0])
def test_the_change_test_meets_its_targets_on_simulated_traffic(alpha, kappa):
    """40 runs of 1,000 steady windows (200 steps of k = 4 drafts each, 8 requests per window;
    the simulator is bench/watch_drift.py's, whose longer run docs/watch.md reports):
    at most one false alarm per 1,000 windows; 200 runs of a 20 % drop in mean accepted length:
    found within 5 windows in 95 % of runs where steps are independent (kappa None), in 80 %
    where requests differ (Beta acceptance, κ = 20: per-request α spread ±0.1), median ≤ 3."""
    assert false_alarms_per_1000(alpha, kappa, 40, 1000, seed=1) <= 1.0
    found = delays(alpha, kappa, 200, seed=2)
    assert np.median(found) <= 3 and (found <= 5).mean() >= (0.95 if kappa is None else 0.8), \
        (np.median(found), (found <= 5).mean())


def test_a_test_that_ignores_the_requests_dispersion_raises_false_alarms():
    """The same steady traffic with requests that differ a lot (κ = 5): the shipped test stays
    within its target; one that takes the windows' spread as the steps' alone (φ = 1) alarms
    far more often than once per 1,000 windows."""
    class Blind(ChangeTest):
        def observe(self, obs):
            verdict = super().observe(obs)
            if self.reference is not None and self.reference.dispersion != 1.0:
                r = self.reference
                self.reference = Reference(r.mean, r.variance, 1.0, r.windows, r.steps)
            return verdict
    assert false_alarms_per_1000(0.6, 5.0, 20, 1000, seed=3) <= 1.0
    assert false_alarms_per_1000(0.6, 5.0, 20, 1000, seed=3, make=Blind) > 5.0


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.85])
def test_windows_sized_to_the_traffic_meet_the_targets_where_requests_differ_a_lot(alpha):
    """--min-steps auto on the heavy mix (κ = 5), where 200 steps per window found a 20 % drop
    within 5 windows in only 26-57 % of runs: the warm-up's windows at 200 steps, the rest
    sized from its reference (tuner.watch.drift.sized_steps): found within 5 windows in at least
    90 % of 200 runs, at most one false alarm per 1,000 windows (20 runs of 1,000). Sized from
    the dispersion's estimate itself (not its upper bound) the same runs found it in 83-93 %."""
    sizes: list[int] = []
    found = delays(alpha, 5.0, 200, seed=2, steps="auto", sizes=sizes)
    assert (found <= 5).mean() >= 0.9, ((found <= 5).mean(), np.median(sizes))
    assert false_alarms_per_1000(alpha, 5.0, 20, 1000, seed=1, steps="auto") <= 1.0
    assert 200 < np.median(sizes) < 5000          # larger than the fixed default, not unbounded


@pytest.mark.parametrize("kappa", [None, 5.0])
def test_a_change_inside_the_sizing_warm_up_does_not_inflate_the_windows(kappa):
    """The traffic changes (L -30 %) at the 7th window of --min-steps auto's measuring warm-up:
    the level-shift check (tuner.watch.drift.level_shift) keeps the windows after the change and
    measures on, so the size is about what steady traffic after the change gets (median within
    1.5x over 60 runs); sized from the first warm-up's pooled spread, as before, the windows were
    several times larger (the test can fail). Steady warm-ups are rarely measured again."""
    from bench.watch_drift import alpha_for, mean_length, sizes_across_a_change
    after = alpha_for(0.7 * mean_length(0.6, 4), 4)
    steady, _, measured_steady = sizes_across_a_change(after, kappa, 60, seed=5, change=0.0)
    sized, pooled, measured = sizes_across_a_change(0.6, kappa, 60, seed=5, change=-0.3)
    assert np.median(sized) <= 1.5 * np.median(steady), (np.median(sized), np.median(steady))
    assert np.median(pooled) >= 2.5 * np.median(steady), (np.median(pooled), np.median(steady))
    assert measured > 13 and measured_steady < 12.5, (measured, measured_steady)


def test_a_reference_is_never_the_mix_of_two_regimes(monkeypatch):
    """A fixed --min-steps 200 (default 12-window warm-up) whose traffic drops (L -40 %) at its
    7th window: the test says the shift on the window that completes the warm-up, keeps the
    windows after it, and its reference is the new level's; without the check (REMEASURES 0)
    the reference is the mix (and its dispersion would hide the next change)."""
    import tuner.watch.drift as drift
    from bench.watch_drift import alpha_for, mean_length, simulated_window
    after = alpha_for(0.6 * mean_length(0.85, 4), 4)

    def run(seed):
        rng = np.random.default_rng(seed)
        test, said = ChangeTest(), []
        for w in range(18):
            verdict = test.observe(simulated_window(rng, 0.85 if w < 6 else after, 4, 200, 25,
                                                   20.0))
            said += [verdict.shifted] if verdict.shifted is not None else []
        return test.reference, said
    new_level = mean_length(after, 4)
    for seed in range(5):
        reference, said = run(seed)
        assert len(said) == 1 and said[0].at == 6, said
        # (per-request α: the mean L sits a little above L of the mean α)
        assert abs(reference.mean_length / new_level - 1) < 0.1, (reference, new_level)
    monkeypatch.setattr(drift, "REMEASURES", 0)
    reference, said = run(0)
    assert not said and reference.mean_length / new_level - 1 > 0.25


def test_min_steps_auto_says_the_size_it_chose_and_why(capsys, tmp_path):
    """The default (--min-steps auto) on the recorded llama.cpp switch: windows of 200 steps
    while the traffic is measured, then the size from that reference, said in one line with its
    reasons, logged, and used by the next windows (the change test's own warm-up); the summary
    lists every size chosen."""
    from tuner.watch.drift import Reference, sized_steps
    rc, out, records = watch(capsys, tmp_path, "--replay", str(FIXTURES / "llamacpp-switch"
                                                                          ".jsonl.gz"),
                             "--study", str(LLAMA_STUDY), "--warmup", "4")
    assert rc == 0, out
    assert "windows of 200 decode steps during a warm-up, then sized to the traffic" in out
    sized = [r for r in records if r["kind"] == "window_size"]
    assert sized, out
    first = sized[0]
    said = re.search(r"windows of (\d+) decode steps from now on, the change test warming up "
                     r"again on them \(--min-steps auto: the "
                     r"warm-up's 4 windows read L ([\d.]+), a per-step variance ([\d.]+) and a "
                     r"dispersion φ ([\d.]+)", out)
    assert said and int(said.group(1)) == first["steps"], out
    ref = Reference(first["mean_length"] - 1, first["variance"], first["dispersion"], 4, 800,
                    first["successive"])
    assert sized_steps(ref).steps == first["steps"]
    windows = [r for r in records if r["kind"] == "window"]
    assert [w["steps"] for w in windows[:4]] and all(w["steps"] >= 200 for w in windows[:4])
    assert all(w["steps"] >= first["steps"] for w in windows[4:6]), windows[4:6]
    assert "windows sized to the traffic (--min-steps auto) after each warm-up of 200 steps: " \
        + ", ".join(str(r["steps"]) for r in sized) in out


# ----------------------------------------------------------------------------------------------
# Counters, windows, restarts


def counters(drafts, accepted_per_pos, generated, batch=1.0, tokens=None) -> Counters:
    accepted = sum(accepted_per_pos)
    k = len(accepted_per_pos)
    return Counters(drafts, tokens if tokens is not None else drafts * k, accepted,
                    tuple(accepted_per_pos), generated, 0.05 * generated, float(generated),
                    batch)


def test_windows_close_at_min_steps_and_a_restart_starts_a_segment_never_a_negative_rate():
    """Scrapes 0..3 grow; scrape 4 has every counter below scrape 3 (a restart): no window spans
    it, the event names segment 1, the next windows are differenced from scrape 4."""
    windower = Windower(min_steps=100)
    scrapes = [counters(0, [0, 0], 0), counters(40, [30, 20], 90), counters(90, [70, 40], 200),
               counters(150, [110, 70], 330), counters(20, [15, 10], 45),
               counters(120, [90, 55], 275)]
    events = [e for i, c in enumerate(scrapes) for e in windower.push(Scrape(float(i), c))]
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["Window", "Restart", "Window"], kinds
    first, restart, second = events
    assert (first.start, first.end, first.steps, first.accepted) == (0.0, 3.0, 150, 180)
    assert first.accepted_per_pos == (110, 70) and first.drafts == 150
    assert isinstance(restart, Restart) and restart.segment == 1 and restart.at == 4.0
    assert second.segment == 1 and (second.start, second.end) == (4.0, 5.0)
    assert second.accepted == (90 + 55) - (15 + 10) and second.drafts == 100
    assert second.steps == (275 - 45) - second.accepted
    assert second.mean_length == pytest.approx(1 + second.accepted / second.steps)


def test_positions_beyond_the_counted_ones_continue_geometrically_and_are_estimates():
    """p_i counted for 2 positions (0.6, 0.3 of the steps): k = 1, 2 from the counts; k = 4
    continues with the ratio 0.5 (0.15, 0.075) and is not counted."""
    from tuner.watch.decide import step_fractions
    window = Window(0, 0, 0.0, 1.0, AcceptanceCounts(steps=100, drafts=100, drafted=200,
                                                     accepted=90, accepted_per_position=(60, 30)),
                    190, None, 2.0)
    assert step_fractions(window, 2) == ([0.6, 0.3], True)
    fractions, counted = step_fractions(window, 4)
    assert fractions == pytest.approx([0.6, 0.3, 0.15, 0.075]) and not counted


def test_a_switch_is_said_once_until_the_best_returns_to_the_deployed_k():
    """The Decider recommends after ``persist`` windows beyond the margin, not again while the
    same k stays best, again after the deployed k was best once; its streak never grows past
    ``persist``."""
    from tuner.watch.decide import Decider, Priced, Pricing

    def pricing(best_k: int, gain: float) -> Pricing:
        deployed = Priced(4, 1.0, 2.0, 4.0, True, 0.01)
        other = Priced(best_k, 1.0 + gain, 1.0, 0.0, True, 0.01)
        return Pricing(1, deployed, (other, deployed) if best_k != 4 else (deployed,))
    decider = Decider(margin=0.1, persist=3)
    said = [decider.observe(pricing(0, 0.2)) for _ in range(10)]
    assert [s is not None for s in said] == [False, False, True] + [False] * 7
    assert len(decider.streak) == 3
    assert decider.observe(pricing(0, 0.05)) is None            # within the margin: reset
    assert decider.observe(pricing(4, 0.0)) is None             # the deployed k is best
    again = [decider.observe(pricing(0, 0.2)) for _ in range(3)]
    assert again[-1] is not None and again[-1].k == 0
    # a window at a batch whose cells are out of order (skipped, live vLLM at batch 1 between
    # windows at 2) ends the streak but does not make the same k new: said once, not thrice
    decider.skip()
    assert [decider.observe(pricing(0, 0.2)) for _ in range(6)] == [None] * 6
    decider.reset()                                             # an alarm, a restart
    assert [decider.observe(pricing(0, 0.2)) for _ in range(3)][-1] is not None


def test_the_per_step_variance_is_that_of_the_accepted_counts():
    """E[X²] from the per-position counts equals the variance of the steps' accepted counts."""
    rng = np.random.default_rng(0)
    x = np.minimum(4, np.floor(np.log(rng.random(5000)) / np.log(0.7))).astype(int)
    per_pos = tuple(int((x > i).sum()) for i in range(4))
    window = Window(0, 0, 0.0, 1.0, AcceptanceCounts(steps=5000, drafts=5000, drafted=20000,
                                                     accepted=int(x.sum()),
                                                     accepted_per_position=per_pos),
                    5000 + int(x.sum()), None, None)
    assert window.step_variance() == pytest.approx(float(x.var()), rel=1e-9)
    assert window.mean_length == pytest.approx(1 + x.mean())


# ----------------------------------------------------------------------------------------------
# The watch on recordings of our real servers (tests/fixtures/watch/README.md)

VLLM_STUDY = FIXTURES / "vllm-study.outcome.json"
LLAMA_STUDY = FIXTURES / "llamacpp-study.outcome.json"


def watch(capsys, tmp_path, *args: str) -> tuple[int, str, list[dict]]:
    """``python -m tuner.watch`` in process: (exit status, stdout + stderr, the log's records)."""
    from tuner.watch.__main__ import main
    out_dir = tmp_path / "watch"
    rc = main([*args, "--out", str(out_dir), "--tracking", "none"]
              if "--tracking" not in args else [*args, "--out", str(out_dir)])
    captured = capsys.readouterr()
    logs = sorted(out_dir.glob("*.jsonl"))
    records = [json.loads(line) for line in logs[-1].read_text().splitlines()] if logs else []
    return rc, captured.out + captured.err, records


def header(recording: Path) -> dict:
    from tuner.watch.source import header_of
    return header_of(recording)


def first_window_after(windows: list[dict], at: float) -> int:
    """The index of the first window that ends after ``at`` (the first holding the change)."""
    return next(w["window"] for w in windows if w["end"] > at)


@pytest.mark.parametrize("recording, study, min_steps", [
    ("vllm-switch.jsonl.gz", VLLM_STUDY, 80),
    ("llamacpp-switch.jsonl.gz", LLAMA_STUDY, 100)])
def test_a_recorded_workload_switch_alarms_within_five_windows_and_steady_traffic_does_not(
        capsys, tmp_path, recording, study, min_steps):
    """The recorded deployment served extractive prompts (prompt lookup copies them), then open
    questions: no alarm before the switch (its warm-up and steady windows), a drop alarmed within
    5 windows of the first window holding the switch."""
    path = FIXTURES / recording
    rc, out, records = watch(capsys, tmp_path, "--replay", str(path), "--study", str(study),
                             "--min-steps", str(min_steps))
    assert rc == 0, out
    windows = [r for r in records if r["kind"] == "window"]
    switch = header(path)["starts"]["open"]
    first = first_window_after(windows, switch)
    before = [w for w in windows if w["window"] < first and w["segment"] == 0]
    assert len(before) >= 12 + 3, len(before)      # the warm-up and steady windows
    assert all(w["state"] != "ALARM" for w in before), [w["window"] for w in before
                                                          if w["state"] == "ALARM"]
    alarms = [r for r in records if r["kind"] == "alarm"]
    assert alarms and alarms[0]["direction"] == "drop", alarms
    assert first <= alarms[0]["window"] < first + 5, (first, alarms[0])
    assert alarms[0]["change"] < -0.2
    assert re.search(r"ALARM: the mean accepted length drops", out)
    assert "the decision cannot be priced: no profile" in out


def test_a_restart_mid_recording_starts_a_new_segment(capsys, tmp_path):
    """llama-server stopped and started again mid-recording: its counters restart from zero; the
    watch says so, drops the open window, warms up again, and no window is negative."""
    path = FIXTURES / "llamacpp-switch.jsonl.gz"
    rc, out, records = watch(capsys, tmp_path, "--replay", str(path), "--study",
                             str(LLAMA_STUDY), "--min-steps", "100")
    assert rc == 0, out
    restarts = [r for r in records if r["kind"] == "restart"]
    assert len(restarts) == 1 and restarts[0]["segment"] == 1
    assert restarts[0]["at"] >= header(path)["restarted_at"] - 5
    windows = [r for r in records if r["kind"] == "window"]
    assert all(min(w["steps"], w["drafts"], w["accepted"], *w["accepted_per_pos"]) >= 0
               for w in windows)
    after = [w for w in windows if w["segment"] == 1]
    assert after and all(w["start"] >= restarts[0]["at"] for w in after)
    assert [w["state"] for w in after][:12] == ["warm-up"] * min(12, len(after))
    assert "server restarted (a counter went down): segment 1 begins" in out
    assert "segments 2 (server restarts: 1)" in out


def test_the_decision_is_priced_at_the_live_batch_and_varying_drafts_are_estimates(
        capsys, tmp_path):
    """With the engine's profile every k is priced per window: the deployed k exactly from its
    own counts (L · T_b(1) / E[T_b], the expected step of requests drafting their drafts'
    length in a share s of the steps, recomputed here from the profile's cells), the others
    labelled
    estimates where n-gram drafts varied in length (T ≠ D · k), none below the deployment's
    lookup size (llama.cpp's ngram-simple drafts nothing where m < n); the summary states the
    decision at the last window. The profile was measured with a draft model's steps and this
    deployment drafts n-grams: the watch says so and recommends no switch from those prices."""
    from math import comb

    from tuner.predict.served import step_s
    from tuner.predict.surface import load_profile
    path = FIXTURES / "llamacpp-switch.jsonl.gz"
    profile_path = FIXTURES / "llamacpp-profile.json"
    rc, out, records = watch(capsys, tmp_path, "--replay", str(path), "--study",
                             str(LLAMA_STUDY), "--min-steps", "100", "--profile",
                             str(profile_path))
    assert rc == 0, out
    profile = load_profile(profile_path)
    windows = [r for r in records if r["kind"] == "window" and r.get("pricing")]
    assert windows
    k = 4
    varied = 0
    for w in windows:
        options = {o["k"]: o for o in w["pricing"]["options"]}
        assert options[0]["speedup"] == 1.0 and options[k]["exact"]
        length = 1 + w["accepted"] / w["steps"]
        b, share = w["pricing"]["batch"], w["drafts"] / w["steps"]
        drafted = w["draft_tokens"] / w["drafts"]            # a drafting step's tokens
        expected = sum(comb(b, j) * share ** j * (1 - share) ** (b - j) *
                       step_s(profile, b, 1 + j * drafted / b) for j in range(b + 1))
        assert options[k]["speedup"] == pytest.approx(length * step_s(profile, b, 1) / expected)
        full = w["draft_tokens"] == w["drafts"] * k
        varied += not full
        assert all(options[j]["exact"] == full for j in range(2, k))
        assert 1 not in options        # ngram-simple n 2 drafts nothing at m 1: never priced
    assert varied > 0                              # n-gram drafts do vary in length here
    assert re.search(r"decision at the last window \(priced with \S*llamacpp-profile.json: a "
                     r"draft model's steps \(models.draft=\{'kind': 'int8_dynamic'\}\)\): "
                     r"batch \d+: deployed k=4", out), out
    # a draft-model profile prices n-gram steps too high: said, and nothing recommended from it
    assert "this deployment drafts from the context without a model" in out
    assert not [r for r in records if r["kind"] == "recommendation"]
    assert "decision: priced, no switch recommended" in out


def test_n_gram_drafting_is_priced_all_or_nothing_not_at_its_mean_rows():
    """The vLLM case that was not borne out (2026-11-29, 2-core Intel Xeon): a prompt-lookup
    deployment (k = 4) on CNN/DM summaries drafted in 19 % of its steps, each time 4 tokens.
    Priced at the mean rows, T(1 + 0.77), its step was 97 ms at batch 2 and the watch
    recommended k = 1 for +11 %; an A B of six alternating pairs measured k = 1 / k = 4 time per
    output token 0.992x (95 % interval 0.925-1.064). The step it paid is 0.19·T(5) + 0.81·T(1)
    (per request at batch 2: both, one or neither drafting): k = 4 stays best, k = 1 priced
    about 4 % slower, inside the measured interval. The window's counts are window 11 of that
    watch; the profile is the one it priced with (tests/fixtures/watch/README.md)."""
    from decoding.acceptance import AcceptanceCounts
    from tuner.predict.served import step_s
    from tuner.predict.surface import load_profile
    from tuner.watch.decide import price
    from tuner.watch.windows import Window
    profile = load_profile(FIXTURES / "vllm-ngram-profile.json")
    counts = AcceptanceCounts(steps=666, drafts=128, drafted=512, accepted=146,
                              accepted_per_position=(63, 36, 27, 20))
    window = Window(11, 0, 0.0, 50.0, counts, generated=825, tpot_s=0.104, batch=1.727)
    pricing = price(window, profile, deployed_k=4)
    options = {o.k: o for o in pricing.options}
    assert pricing.batch == 2 and pricing.best.k == 4
    assert options[1].speedup / options[4].speedup == pytest.approx(0.957, abs=0.01)
    t = {rows: step_s(profile, 2, rows) for rows in (1, 3, 5)}
    s = 128 / 666
    paid = s * s * t[5] + 2 * s * (1 - s) * t[3] + (1 - s) ** 2 * t[1]
    assert options[4].tpot_s == pytest.approx(paid / (1 + 146 / 666))
    # at the mean rows (the old price) k = 1 wins by over 10 %: what the A B did not bear out
    mean_rows = (1 + 146 / 666) * t[1] / step_s(profile, 2, 1 + 512 / 666)
    assert options[1].speedup / mean_rows > 1.10


def test_the_least_k_that_drafts_is_the_engines_to_say():
    """llama.cpp's ngram-simple copies nothing where its m-gram is shorter than its lookup
    n-gram (common/ngram-map.cpp: copy_max < n_draft_min), so a candidate below size_n would run
    as no speculation: its least drafting k is size_n (default 12); the other types draft from 1."""
    from tuner.engines import engine_named
    llama = engine_named("llamacpp")
    base = ["llama-server", "-m", "t.gguf", "--port", "8080"]
    simple = base + ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-m", "8"]
    assert llama.least_drafting_k(simple + ["--spec-ngram-simple-size-n", "3"]) == 3
    assert llama.least_drafting_k(simple) == 12
    assert llama.least_drafting_k(base + ["--spec-type", "ngram-mod"]) == 1
    assert llama.least_drafting_k(base + ["-md", "d.gguf", "--spec-draft-n-max", "4"]) == 1
    assert engine_named("vllm").least_drafting_k(["vllm", "serve", "m"]) == 1


def test_an_ngram_deployment_is_priced_by_the_draft_free_profile(capsys, tmp_path):
    """Both profiles python -m tuner.profile --engine writes, in either order: the n-gram
    deployment is priced with the draft-free one (models.draft None), said at the start and in
    the summary, and no bias is claimed; given only the draft-model one it says the bias (the
    test above). The draft-free profile here is the fixture's surface with every k > 0 step
    at 60 % of its draft-model price (n-gram steps run no draft forwards)."""
    profile = json.loads((FIXTURES / "llamacpp-profile.json").read_text())
    profile["models"]["draft"] = None
    for surface in [profile["target"], *[b["target"] for b in profile["batches"]]]:
        surface["seconds"] = [[t if rows == 1 else 0.6 * t for rows, t in zip(
            surface["rows"], line)] for line in surface["seconds"]]
    free = tmp_path / "llamacpp-ngram.json"
    free.write_text(json.dumps(profile))
    for order in ((FIXTURES / "llamacpp-profile.json", free),
                  (free, FIXTURES / "llamacpp-profile.json")):
        rc, out, records = watch(capsys, tmp_path, "--replay",
                                 str(FIXTURES / "llamacpp-switch.jsonl.gz"), "--study",
                                 str(LLAMA_STUDY), "--min-steps", "100",
                                 *[x for path in order for x in ("--profile", str(path))])
        assert rc == 0, out
        assert f"pricing with the profile {free}: draft-free steps (n-gram drafting, no draft " \
            "model)" in out
        assert "drafts from the context without a model" not in out
        assert "decision: priced, no switch recommended" not in out
        assert f"decision at the last window (priced with {free}: draft-free steps" in out
        start = next(r for r in records if r["kind"] == "start")
        assert start["profile"] == str(free) and start["profile_steps"].startswith("draft-free")
        priced = [r["pricing"] for r in records if r["kind"] == "window" and r.get("pricing")]
        assert priced and all(any(o["k"] == 4 for o in p["options"]) for p in priced)


def test_off_where_the_profile_says_off_once_the_gain_beats_the_margin(capsys, tmp_path):
    """A draft-model deployment (F32 target, Q8_0 self-draft, n_max 4) priced with the profile of
    the same models and drafting: at the live batch (2) every k prices below speculation off
    (the deployed k = 4 at 0.94-0.99x). With the default margin (10 %, no calibration recorded)
    nothing is recommended; with --margin 0.02 turning speculation off is, once, after 3 windows
    in a row beyond it, and the candidate is llama-server's launch line without its speculative
    flags."""
    study = FIXTURES / "llamacpp-draft-study.outcome.json"
    path = FIXTURES / "llamacpp-draft-switch.jsonl.gz"
    args = ["--replay", str(path), "--study", str(study), "--min-steps", "50", "--warmup", "4",
            "--profile", str(FIXTURES / "llamacpp-profile.json")]
    rc, out, records = watch(capsys, tmp_path / "default", *args)
    assert rc == 0 and not [r for r in records if r["kind"] == "recommendation"], out
    assert "a switch must win by 10 % (no calibration recorded by the study)" in out
    windows = [r for r in records if r["kind"] == "window"]
    for w in windows:
        best = max(w["pricing"]["options"], key=lambda o: o["speedup"])
        assert w["pricing"]["batch"] == 2 and best["k"] == 0, w["pricing"]
    rc, out, records = watch(capsys, tmp_path / "tighter", *args, "--margin", "0.02")
    found = [r for r in records if r["kind"] == "recommendation"]
    assert rc == 0 and len(found) == 1 and found[0]["k"] == 0, out
    gains = found[0]["gains"]
    assert len(gains) == 3 and min(gains) > 0.02
    candidate = json.loads(Path(found[0]["file"]).read_text())
    line = candidate["engine_form"]["llamacpp_per_level"]["2"]
    assert line.startswith("llama-server -m ") and "--spec-" not in line and "-md" not in line
    assert candidate["schedule"] == [[1, 2, 0]]
    assert "RECOMMENDATION: turn speculation off (deployed k=4)" in out
    assert "python -m tuner +task=prompts task.data.local=<your prompts file> " \
        "method=speculative engine=llamacpp" in out


def test_a_profile_whose_cells_are_out_of_order_recommends_nothing(capsys, tmp_path):
    """The same replay and margin as above (which recommends turning speculation off), with the
    profile's batch-2 step of 3 rows made 7 % cheaper than its step of 2 rows (as a live vLLM
    profile read: 89.3 against 96.0 ms): the watch still prices every window, says at the start
    at the first window priced at batch 2 that the cells there are out of order, and recommends
    no switch; the summary says why. The order is checked at the batch priced: the profile's
    batch 1 alone out of order would stop nothing here."""
    from tuner.predict.check import inversions
    from tuner.predict.surface import load_profile
    profile = json.loads((FIXTURES / "llamacpp-profile.json").read_text())
    [batch2] = [b for b in profile["batches"] if b["batch"] == 2]
    line = batch2["target"]["seconds"][0]          # rows 1, 2, 3, 5
    line[2] = 0.93 * line[1]
    bad = tmp_path / "out-of-order.json"
    bad.write_text(json.dumps(profile))
    [flag] = inversions(load_profile(bad))
    assert flag.startswith("at batch 2 (context 130) a step of 3 rows is priced ") and \
        "7.0 % below one of 2 rows" in flag
    assert not inversions(load_profile(FIXTURES / "llamacpp-profile.json"))
    args = ["--replay", str(FIXTURES / "llamacpp-draft-switch.jsonl.gz"), "--study",
            str(FIXTURES / "llamacpp-draft-study.outcome.json"), "--min-steps", "50",
            "--warmup", "4", "--profile", str(bad), "--margin", "0.02"]
    rc, out, records = watch(capsys, tmp_path / "watch", *args)
    assert rc == 0 and not [r for r in records if r["kind"] == "recommendation"], out
    assert out.count("no switch is recommended at batch 2: the profile's cells there are out "
                     "of order (at batch 2 ") == 1, out
    assert all(w["pricing"]["options"] for w in records if w["kind"] == "window")
    assert "decision at batch 2: priced, no switch recommended" in out
    assert "RECOMMENDATION" not in out
    [batch1] = [b for b in profile["batches"] if b["batch"] == 1]
    batch1["target"]["seconds"][0][2] = 0.93 * batch1["target"]["seconds"][0][1]
    batch2["target"]["seconds"][0][2] = 1.5 * batch2["target"]["seconds"][0][1]    # in order
    bad.write_text(json.dumps(profile))
    rc, out, records = watch(capsys, tmp_path / "batch1", *args)
    assert rc == 0 and "RECOMMENDATION: turn speculation off" in out, out


def test_traffic_at_another_temperature_is_not_compared_with_the_study(capsys, tmp_path):
    """The study ran at T = 0; live traffic said to sample at T = 0.7: the range check is off
    and the watch says why; the change test still runs against the deployment's own start."""
    rc, out, records = watch(capsys, tmp_path, "--replay",
                             str(FIXTURES / "vllm-switch.jsonl.gz"), "--study", str(VLLM_STUDY),
                             "--min-steps", "100",
                             "--temperature", "0.7")
    assert rc == 0, out
    assert "traffic at T=0.7 against a study at T=0: acceptance is not comparable" in out
    assert "re-tune hint" not in out
    assert not any(r.get("outside_study_range") for r in records if r["kind"] == "window")
    assert [r for r in records if r["kind"] == "alarm"]


def test_live_traffic_outside_the_studys_range_gets_the_re_tune_hint(capsys, tmp_path):
    """The llama.cpp study's held-out CNN/DailyMail summaries accepted none of its n-gram drafts;
    the recorded extractive traffic accepts most: above the study's range, said once with the
    intervals, and marked on the windows."""
    rc, out, records = watch(capsys, tmp_path, "--replay",
                             str(FIXTURES / "llamacpp-switch.jsonl.gz"), "--study",
                             str(LLAMA_STUDY), "--min-steps", "100")
    windows = [r for r in records if r["kind"] == "window"]
    assert rc == 0 and out.count("re-tune hint: live acceptance over the last 12 windows") >= 1
    assert re.search(r"is above what the study measured \(1\.00-1\.00, 95 % intervals\)", out)
    assert not any(w["outside_study_range"] for w in windows[:11])    # a reference's worth first
    assert sum(w["outside_study_range"] for w in windows) > len(windows) // 2


def test_ctrl_c_ends_a_live_watch_with_its_summary_and_the_run_killed(tmp_path):
    """SIGINT to a watch of a real llama-server: the summary is printed, the MLflow run ends
    KILLED, the exit status is 0, and the server (ours, not the watch's) is untouched."""
    import signal
    import subprocess
    import sys

    from mlflow import MlflowClient

    from tests.conftest import ENV
    from tests.helpers.deployed import deployed
    from tests.helpers.services import require_llama_server, sigint_default, wait_for
    require_llama_server()
    uri = f"sqlite:///{tmp_path}/mlruns/mlflow.db"
    recording = tmp_path / "scrapes.jsonl"
    with deployed(LLAMA_STUDY, tmp_path / "logs") as server:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tuner.watch", "--url", server.url, "--study",
             str(LLAMA_STUDY), "--interval", "0.2", "--tracking-uri", uri, "--out",
             str(tmp_path / "watch"), "--record", str(recording)], cwd=tmp_path, env=ENV,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            preexec_fn=sigint_default)
        # three scrapes recorded: the run and the log exist, the loop is scraping
        wait_for(lambda: recording.is_file() and len(recording.read_text().splitlines()) > 3,
                 timeout=90, what="three scrapes")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert server.alive()
    assert proc.returncode == 0, out
    assert "ended at Ctrl-C" in out and "no window closed" in out, out
    client = MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name("cnndm").experiment_id])
    assert run.info.status == "KILLED"
    [log] = (tmp_path / "watch").glob("*.jsonl")
    assert json.loads(log.read_text().splitlines()[-1])["kind"] == "summary"


# ----------------------------------------------------------------------------------------------
# Bad input: one line each


def one_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, out
    return lines[0]


@pytest.mark.parametrize("args, message", [
    (["--replay", "sglang-scrape.jsonl"], "SGLang's /metrics has only gauges"),
    (["--replay", "vllm-no-speculation.jsonl"], "no speculative counters"),
    (["--study", "nope"], "--study='nope' does not exist"),
    (["--interval", "0"], "--interval=0.0 is invalid: allowed is a number of seconds > 0"),
    (["--shift", "1.5"], "--shift=1.5 is invalid: allowed is a fraction in (0, 1)"),
    (["--min-steps", "many"], "--min-steps='many' is invalid: allowed are auto or an integer "
                              ">= 1"),
    (["--min-steps", "0"], "--min-steps='0' is invalid: allowed are auto or an integer >= 1"),
    (["--profile", "missing.json"], "--profile='missing.json': cannot read it"),
])
def test_bad_input_gets_one_line(capsys, tmp_path, args, message):
    base = {"--replay": str(FIXTURES / "vllm-switch.jsonl.gz"), "--study": str(VLLM_STUDY)}
    given = dict(zip(args[::2], args[1::2]))
    if given.get("--replay", "").endswith(".jsonl") and "/" not in given["--replay"]:
        given["--replay"] = str(FIXTURES / given["--replay"])
    rc, out, _ = watch(capsys, tmp_path, *[x for kv in {**base, **given}.items() for x in kv])
    assert rc == 2 and message in one_line(out), out


def test_a_binary_or_cut_short_recording_gets_one_line(capsys, tmp_path):
    """Read through before the watch starts: a binary file, and a gzip recording cut short
    (its scrapes readable up to the cut, so the first check alone would pass)."""
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 64)
    whole = (FIXTURES / "vllm-switch.jsonl.gz").read_bytes()
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(whole[: len(whole) * 2 // 3])
    for path, message in ((binary, "is not text (a binary file)"),
                          (cut, "is a damaged gzip file")):
        rc, out, _ = watch(capsys, tmp_path, "--replay", str(path), "--study", str(VLLM_STUDY))
        assert rc == 2 and f"--replay={str(path)!r} {message}" in one_line(out), out


def test_a_study_of_our_own_loops_is_not_watched(capsys, tmp_path, monkeypatch):
    """A real engine=hf study (tiny models): nothing runs as a server to watch."""
    from tests.conftest import run_study
    monkeypatch.chdir(tmp_path)
    run_study(tmp_path, "search=grid", "tracking=none", "search.n_trials=1")
    [outcome] = (tmp_path / "studies" / "best").glob("*.outcome.json")
    rc, out, _ = watch(capsys, tmp_path, "--replay", str(FIXTURES / "vllm-switch.jsonl.gz"),
                       "--study", str(outcome))
    assert rc == 2 and "was a study of engine=hf (our own loops)" in one_line(out), out


def test_the_deployed_k_is_read_from_the_winners_parameters_not_the_launch_line(tmp_path):
    """The typed reader (tuner.answer.outcome.read_outcome) and the engine's declared draft size:
    the k is the winner's size_m for ngram-simple and its mod_n_max once the type is ngram-mod
    (the same parameters, size_m still 4), whatever number the launch line's text holds; the
    launch line only names the flag a candidate sets."""
    from tuner.watch.study import read_study
    body = json.loads(LLAMA_STUDY.read_text())
    body["deploy"]["launch"] = body["deploy"]["launch"].replace(
        "--spec-ngram-simple-size-m 4", "--spec-ngram-simple-size-m 9")
    path = tmp_path / "s.outcome.json"
    path.write_text(json.dumps(body))
    study = read_study(str(path))
    assert (study.deployed_k, study.k_setting) == (4, "--spec-ngram-simple-size-m")
    body["winner"]["params"].update({"spec_type": "ngram-mod", "mod_n_max": 16})
    path.write_text(json.dumps(body))
    assert read_study(str(path)).deployed_k == 16
    assert read_study(str(VLLM_STUDY)).deployed_k == \
        json.loads(VLLM_STUDY.read_text())["winner"]["params"]["num_speculative_tokens"]


# ----------------------------------------------------------------------------------------------
# Live: the study's deployment, a workload switch, the watch beside it

LIVE = {"llamacpp": LLAMA_STUDY, "vllm": VLLM_STUDY}
BEFORE = 5          # windows the watch closes on the extractive prompts before the switch
AFTER = 9           # windows it watches after them: the alarm is due within 5 of the first
                    # after the switch, which requests still in flight may push a window or two on
CAP_S = 240.0       # seconds at most for each phase (a slow machine makes windows slower)


def windows_logged(out_dir: Path) -> int:
    """The windows the running watch has logged (its log is flushed as written)."""
    return sum(line.startswith('{"kind": "window"')
               for log in out_dir.glob("*.jsonl") for line in log.read_text().splitlines())


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["llamacpp", "vllm"])
def test_a_live_workload_switch_alarms_and_the_decision_is_priced(capsys, tmp_path, engine):
    """The study's deployment started from its launch line; two clients send extractive prompts,
    then open questions; the watch (1 s scrapes, windows of 50 steps, a warm-up of 4) alarms a
    drop within 5 windows of the switch and prices every k at the live batch with the engine's
    profile; the MLflow run under the study's experiment holds a point per window; the recording
    it kept replays to the same windows; no server is left."""
    from mlflow import MlflowClient

    from tests.helpers.deployed import deployed
    from tests.helpers.services import require_llama_server, require_vllm
    from tests.helpers.traffic import Load, extractive, open_ended
    (require_llama_server if engine == "llamacpp" else require_vllm)()
    study = LIVE[engine]
    uri = f"sqlite:///{tmp_path}/mlruns/mlflow.db"
    recording = tmp_path / "recording.jsonl"
    with deployed(study, tmp_path / "logs") as server:
        # the switch comes after BEFORE windows, however long they take on this machine
        load = Load(server.url, engine, [
            ("extractive", extractive(12), CAP_S,
             lambda: windows_logged(tmp_path / "watch") >= BEFORE),
            ("open", open_ended(12), CAP_S)]).start()
        try:
            rc, out, records = watch(
                capsys, tmp_path, "--url", server.url, "--study", str(study), "--profile",
                str(FIXTURES / f"{engine}-profile.json"), "--interval", "1", "--min-steps",
                "50", "--warmup", "4", "--windows", str(BEFORE + AFTER), "--duration",
                str(2 * CAP_S), "--record", str(recording), "--tracking", "mlflow",
                "--tracking-uri", uri)
        finally:
            load.close()
    assert not server.alive()
    assert rc == 0 and not load.errors, (out[-3000:], load.errors[:3])
    windows = [r for r in records if r["kind"] == "window"]
    start = first_window_after(windows, load.switched_at["open"])
    # the reference came from the extractive prompts: its 4 warm-up windows and one more ended
    # before the switch (start is the first window to end after it)
    assert start >= BEFORE, out[-4000:]
    alarms = [r for r in records if r["kind"] == "alarm" and r["window"] >= start]
    assert alarms and alarms[0]["direction"] == "drop", out[-4000:]
    assert alarms[0]["window"] < start + 5, (start, alarms[0], out[-4000:])
    assert all(w.get("pricing") for w in windows)
    assert "priced now: off 1.00x" in out
    # the record: one MLflow run under the study's experiment (its task), a point per window
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("cnndm")
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_name.startswith("watch-") and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "mean_length")
    assert [m.step for m in history] == [w["window"] for w in windows]
    assert run.data.metrics["alarms"] == len([r for r in records if r["kind"] == "alarm"])
    # the recording replays to the same windows
    _, _, replayed = watch(capsys, tmp_path / "again", "--replay", str(recording), "--study",
                           str(study), "--min-steps", "50", "--warmup", "4")
    again = [r for r in replayed if r["kind"] == "window"]
    assert [(w["steps"], w["accepted"], w["state"]) for w in again] == \
        [(w["steps"], w["accepted"], w["state"]) for w in windows]


def test_bad_servers_get_one_line_each(capsys, tmp_path):
    """Real llama-servers: nothing listening; one without --metrics (HTTP 501); one serving
    another model than the study's; a scrape interval below ten times a scrape's cost."""
    from tests.helpers.services import require_llama_server
    from tuner.engines.gguf import model_files
    from tuner.engines.server import EngineServer, free_port
    binary = require_llama_server()
    study = str(LLAMA_STUDY)
    rc, out, _ = watch(capsys, tmp_path, "--url", f"http://127.0.0.1:{free_port()}",
                       "--study", study)
    assert rc == 2 and "is unreachable" in one_line(out), out
    best = yaml.safe_load((FIXTURES / "llamacpp-study.yaml").read_text())
    target, draft = model_files({"target_type": "match_dtype", "self_draft_type": "Q4_0"},
                                {**best["models"], "draft": {"kind": "int8_dynamic"}}, True,
                                Path(binary).parent / "llama-quantize")
    base = [binary, "--host", "127.0.0.1", "--port", "{port}", "-np", "1", "-c", "512",
            "-t", "1"]
    with EngineServer([*base, "-m", str(target.path)], "plain", tmp_path) as plain, \
            EngineServer([*base, "-m", str(draft.path), "--metrics"], "other", tmp_path) as other:
        rc, out, _ = watch(capsys, tmp_path, "--url", plain.url, "--study", study)
        assert rc == 2 and "/metrics answered HTTP 501" in one_line(out) and \
            "--metrics" in one_line(out), out
        rc, out, _ = watch(capsys, tmp_path, "--url", other.url, "--study", study)
        line = one_line(out)
        assert rc == 2 and "not the model of study" in line and draft.path.name in line, out
    with EngineServer([*base, "-m", str(target.path), "--metrics"], "right", tmp_path) as right:
        rc, out, _ = watch(capsys, tmp_path, "--url", right.url, "--study", study,
                           "--interval", "0.001")
        assert rc == 2 and "--interval=0.001 is below this server's scrape cost" in \
            one_line(out), out


@pytest.mark.slow
def test_a_live_server_restart_is_a_new_segment_and_the_watch_goes_on(capsys, tmp_path):
    """The deployment is stopped and started again on the same port while the watch scrapes it
    every 0.5 s under load: the scrapes that find nothing are gaps (logged, the watch goes on),
    the counters that come back lower start segment 1, and windows close there again."""
    import threading

    from tests.helpers.deployed import deployed, launch_argv
    from tests.helpers.services import require_llama_server
    from tests.helpers.traffic import Load, extractive
    from tuner.engines.server import EngineServer
    require_llama_server()
    restarted: list[EngineServer] = []
    with deployed(LLAMA_STUDY, tmp_path / "logs", "first") as first:
        load = Load(first.url, "llamacpp", [("extractive", extractive(12), 32.0)]).start()

        def restart() -> None:
            # the thread that starts a server lives as long as it (the server dies with the
            # thread that started it: PR_SET_PDEATHSIG)
            load.stop.wait(10.0)
            first.stop()
            _, argv = launch_argv(LLAMA_STUDY)
            second = EngineServer([a.replace("{port}", str(first.port)) for a in argv],
                                  "second", tmp_path / "logs")
            second.port = first.port
            with second:
                restarted.append(second)
                load.stop.wait(120.0)

        thread = threading.Thread(target=restart, daemon=True)
        thread.start()
        try:
            rc, out, records = watch(capsys, tmp_path, "--url", first.url, "--study",
                                     str(LLAMA_STUDY), "--interval", "0.5", "--min-steps", "40",
                                     "--warmup", "3", "--duration", "32")
        finally:
            load.close()                        # sets load.stop: the second server stops
            thread.join(timeout=60)
    assert restarted and not restarted[0].alive()
    assert rc == 0, out[-3000:]
    gaps = [r for r in records if r["kind"] == "gap"]
    restarts = [r for r in records if r["kind"] == "restart"]
    assert gaps and "scrape failed" in out, out[-3000:]
    assert len(restarts) == 1 and restarts[0]["segment"] == 1, out[-3000:]
    assert [w for w in records if w["kind"] == "window" and w["segment"] == 1], out[-3000:]
    assert "segments 2 (server restarts: 1)" in out
