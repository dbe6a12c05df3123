"""Every ``python -m tuner`` command in the README and docs/*.md runs (CPU-runnable ones, shrunk to tiny models
and a tiny budget, MLflow tracking on), so an example cannot crash unnoticed. Commands that need
what this machine lacks or that another test runs on the same path are composed and validated
completely, and name that test (``ELSEWHERE``, ``STUDIED``); none is skipped."""

from __future__ import annotations

import re
import shlex

import pytest

from tests.conftest import ROOT, SIDE_BY_SIDE, compose_cfg
from tests.helpers.services import require_llama_server, require_vllm

# The commands run here are every ``python -m tuner`` line in the bash blocks of README.md and of
# every docs/*.md page (the README keeps one example per step of its tour; the reference pages hold
# the rest), each distinct command once.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# the pages the README links to ("Where to look things up"); docs/README.md lists every page
REFERENCE_PAGES = ["tuning.md", "engines.md", "slurm.md", "decoding.md", "bad-input.md",
                   "benchmarks.md", "verification.md", "phrase_drafting.md", "mjsd.md",
                   "performance.md", "watch.md"]
# the README's first two commands, exactly: CI runs "the README's test command"
FIRST_COMMANDS = ["make tune", "make test"]

# what makes a README command small: appended after its own overrides, so these win
TINY = ["models=tiny", "task.n_prompts=1", "task.n_held_out=1", "task.max_new_tokens=4",
        "search.n_trials=2", "warmup_prompts=0", *SIDE_BY_SIDE,
        "budget=full"]
ENGINE = ["models=smollm2", "engine.target_type=native", "task.n_prompts=1",
          "task.n_held_out=1", "task.max_new_tokens=8", "search.n_trials=2", "warmup_prompts=0",
          *SIDE_BY_SIDE, "budget=full"]
VLLM = ["models=smollm2", "task.n_prompts=1", "task.n_held_out=1", "task.max_new_tokens=8",
        "search.n_trials=1", "warmup_prompts=0", *SIDE_BY_SIDE,
        "budget=full", "engine.kv_cache_gib=1", "engine.ctx_per_slot=1024"]
# commands not run here as written: (why, the test that runs their path, or None where no test
# can: hub weights are unreachable here). Each is still composed and validated completely.
ELSEWHERE = {   # fragment of the command -> (why, "path::test" or None)
    "models=llama_pair": ("a hub model pair on a GPU (no hub access here)", None),
    "yuhuili/": ("a hub EAGLE head (no hub access here)", None),
    # before "launcher=slurm" (the first fragment found names the test): its own path
    "launcher=slurm tracking=server": ("starts an MLflow server and submits Slurm jobs",
                                       "tests/test_sweep.py::test_four_slurm_workers_on_"
                                       "postgresql_with_one_killed_log_to_a_server_the_"
                                       "launcher_starts"),
    "launcher=slurm": ("submits Slurm jobs", "tests/test_sweep.py::"
                       "test_four_slurm_workers_on_a_journal_with_one_killed"),
    "tracking=server": ("needs an MLflow server", "tests/test_storage_services.py::"
                        "test_tracker_logs_a_study_through_the_server"),
    "+best=": ("replays a finished study", "tests/test_readme.py::test_the_printed_replay_runs"),
    # an engine's own profile takes minutes to measure; that test makes a small one and runs
    # a study with it on the same path
    "search.profile=profiles/smollm2-llamacpp-cpu.json": (
        "needs llama.cpp's profile (python -m tuner.profile --engine llamacpp)",
        "tests/test_engines.py::test_a_study_predicts_each_level_from_the_engines_profile_and_"
        "confirms_its_schedule"),
}
# examples whose whole study another test runs on the same path (engine, method, levels; the
# compiled target in process, there with method=tree on buckets [1, 4, 16]): here their config
# is validated completely (the engine's own checks, its program and models included) and the
# study is not measured a second time
STUDIED = {
    "method=speculative engine.compile=true":
        ("tests/test_compiled.py", "test_a_study_with_engine_compile_records_it_and_stays_"
                                   "lossless"),
    "method=prompt_lookup engine=vllm budget.concurrency=[1,4]":
        ("tests/test_vllm.py", "test_a_study_at_two_levels_with_the_servers_counts_and_a_refused_"
                               "point"),
    "method=prompt_lookup engine=llamacpp budget.concurrency=[1,4] "
    "search.objectives=[throughput_ratio]":
        ("tests/test_engines.py", "test_a_prompt_lookup_study_finishes_with_the_servers_counts"),
    "method=auto search=heuristic engine=llamacpp":
        ("tests/test_engines.py", "test_a_study_across_methods_launches_each_members_server_and_"
                                  "names_the_method"),
    "method=speculative engine=llamacpp":
        ("tests/test_engines.py", "test_greedy_outputs_equal_the_engines_own"),
    "budget.request_rate=[1,4]":        # the same study path with one rate and a 1 s SLO
        ("tests/test_engines.py", "test_a_prompt_lookup_study_finishes_with_the_servers_counts"),
}


def bash_lines(text: str) -> list[str]:
    """Every line of a page's bash blocks, continuation lines joined."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        lines += [line.strip() for line in block.replace("\\\n", " ").splitlines()]
    return lines


def page_commands(page) -> list[list[str]]:
    """The arguments of every ``python -m tuner`` line in a page's bash blocks."""
    return [shlex.split(line, comments=True)[3:] for line in bash_lines(page.read_text())
            if line.startswith("python -m tuner ") and "--help" not in line]


def readme_commands() -> list[list[str]]:
    """The arguments of every ``python -m tuner`` line in the README's bash blocks."""
    return page_commands(ROOT / "README.md")


def documented_commands() -> dict[tuple[str, ...], str]:
    """Every distinct ``python -m tuner`` command of the README and docs/*.md -> the first page
    (README first) that shows it."""
    commands: dict[tuple[str, ...], str] = {}
    for page in PAGES:
        for args in page_commands(page):
            commands.setdefault(tuple(args), page.relative_to(ROOT).as_posix())
    return commands


DOCUMENTED = documented_commands()
COMMANDS = [list(args) for args in DOCUMENTED]


def test_the_readme_has_tuner_examples():
    assert len(COMMANDS) >= 10 and any("engine=llamacpp" in c for c in COMMANDS)


def test_the_readme_starts_with_make_tune_and_make_test():
    """The first two commands of the README are the set-up-and-tune one and the test one."""
    first = [line.split("#")[0].strip() for line in bash_lines((ROOT / "README.md").read_text())
             if line and not line.startswith("#")][:2]
    assert first == FIRST_COMMANDS, first


def test_the_readme_tour_has_one_example_per_step():
    """Tune, open MLflow, replay a winner, an engine study, a Slurm sweep: each in the README."""
    readme = readme_commands()
    lines = bash_lines((ROOT / "README.md").read_text())
    assert ["+task=gsm8k"] in readme, readme
    assert any(line.startswith("mlflow ui --backend-store-uri sqlite:///mlruns/mlflow.db")
               for line in lines), lines
    assert any(any(a.startswith("+best=") for a in c) for c in readme), readme
    assert any("engine=llamacpp" in c for c in readme), readme
    assert any("launcher=slurm" in c for c in readme), readme
    # every README command is also on a reference page, with what it needs explained there
    docs = {tuple(args) for page in PAGES[1:] for args in page_commands(page)}
    assert all(tuple(c) in docs for c in readme), [c for c in readme if tuple(c) not in docs]


def test_the_readme_reads_in_ten_minutes():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move reference text to docs/"


def test_the_readme_and_the_docs_index_link_every_page():
    readme = (ROOT / "README.md").read_text()
    index = (ROOT / "docs" / "README.md").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md")
    assert set(REFERENCE_PAGES) <= set(pages), pages
    assert not [p for p in REFERENCE_PAGES if f"](docs/{p})" not in readme]
    assert not [p for p in pages if f"]({p})" not in index], "docs/README.md must list every page"


def anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings (lower case, punctuation dropped, spaces -> '-')."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_relative_link_resolves(page):
    """Every relative link of the README and docs/*.md names an existing file (and, with
    ``#anchor``, a heading of it); no page points outside the repository."""
    text = page.read_text()
    assert "../shared/" not in text
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"```.*?```", "", text, flags=re.S)):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or ROOT not in file.parents:
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(target)
    assert not broken, f"{page.name}: broken links {broken}"


@pytest.mark.parametrize("args", [
    pytest.param(c, marks=[pytest.mark.alone] if any(a.startswith("engine=") for a in c) else [],
                 id=f"{DOCUMENTED[tuple(c)]}: {' '.join(c)}"[:80]) for c in COMMANDS])
def test_a_readme_example_runs(tmp_path, monkeypatch, args):
    line = " ".join(args)
    monkeypatch.chdir(tmp_path)
    elsewhere = next((where for part, where in ELSEWHERE.items() if part in line), None)
    if elsewhere is not None:
        validate_elsewhere(tmp_path, args, *elsewhere)
        return
    small = ENGINE if "engine=llamacpp" in args else VLLM if "engine=vllm" in args else TINY
    if "+task=cnndm" in args and small is TINY:   # its articles (up to 8,478 bytes) overflow the tiny model's 4096
        small = [*small, "models.target.max_position_embeddings=16384"]   # byte-level positions
    if "engine=llamacpp" in args:
        require_llama_server()
    if "engine=vllm" in args:
        require_vllm()
    studied = next((where for part, where in STUDIED.items() if part in line), None)
    if studied is not None:
        from tuner.study.settings import StudySettings
        settings = StudySettings.from_config(compose_cfg(tmp_path, *args, *small, base=()))
        assert settings.default and (settings.engine["kind"] in line or
                                     settings.engine["compile"] is True)
        path, test = studied
        assert f"def {test}" in (ROOT / path).read_text(), f"{path}::{test} is gone"
        return
    for profile in (a.split("=", 1)[1] for a in args if a.startswith("search.profile=")):
        from tuner import profile as cli       # the page's first step, for the models run here
        assert cli.main(["--models", "tiny", "--repeats", "1", "--contexts", "8", "64",
                         "--rows", "1", "4", "--draft-rows", "1", "2", "--out", profile]) == 0
    for profile in (a.split("=", 1)[1] for a in args if a.startswith("search.predict_for=")):
        from tuner import profile as cli       # a roofline for the models run here
        assert cli.main(["--models", "tiny", "--roofline", "H100", "--batches", "1", "8", "64",
                         "--out", profile]) == 0
    from tuner.run import run
    result = run(compose_cfg(tmp_path, *args, *small, "tracking.experiment=readme", base=()))
    assert result.get("study_name")
    import mlflow
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["readme"], output_format="list")
    assert runs and all(r.info.status == "FINISHED" for r in runs)


def validate_elsewhere(tmp_path, args, why: str, test: str | None) -> None:
    """A command not run as written (``why``): its config is composed and validated completely
    (a replay's needs a finished study: the named test makes one and replays it), and the test
    that runs its path exists."""
    from tuner.engines import validated
    from tuner.study.settings import StudySettings
    if not any(a.startswith("+best=") for a in args):
        cfg = compose_cfg(tmp_path, *args, base=())
        if cfg.method.get("kind") == "auto":   # the study across methods: every member validated
            StudySettings.from_config(cfg)
        else:
            validated(cfg)
    if test is None:
        assert "no hub access" in why, why
        return
    path, name = test.split("::")
    assert f"def {name}(" in (ROOT / path).read_text(), f"{test} is gone ({why})"


def test_the_printed_replay_runs(tmp_path, monkeypatch, capsys):
    """A tiny study's best YAML replays as printed (its models, sampling and budget), and the
    replay says it measures with the study's own budget."""
    monkeypatch.chdir(tmp_path)
    from tuner.run import run
    study = [*TINY, "task.max_new_tokens=6", "search=grid", "search.ranges=full",
             "method=speculative", "method.space.num_draft_tokens.high=2",
             "method.params.num_draft_tokens=2", "tracking=none", "study_name=r"]
    run(compose_cfg(tmp_path, "+task=gsm8k", *study, base=()))
    best = (tmp_path / "studies" / "best" / "r.yaml").read_text()
    printed = next(line for line in best.splitlines() if "python -m tuner" in line)
    args = shlex.split(printed.lstrip("# "))[3:]
    capsys.readouterr()
    result = run(compose_cfg(tmp_path, *args, "tracking=none", *SIDE_BY_SIDE, base=()))
    out = capsys.readouterr().out
    assert "replay: the study's own budget: 1 held-out prompts x 6 new tokens" in out
    assert result["held_out_prompts"] == 1 and result["params"]["num_draft_tokens"] in (1, 2)
