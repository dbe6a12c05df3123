"""Traffic at a request rate: the Poisson schedule, the serving figures computed by hand, the
paired rate protocol's order and schedule, and the config's refusals. The schedule sent to a real
llama-server is in tests/test_engines.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from tuner.measure.rates import Traffic, measure_rates, rate_figures, schedule
from tuner.measure.traffic import (StreamedRequest, arrival_schedule, meets, percentile,
                                   rate_summary)


def test_the_schedule_is_poisson_at_the_rate_and_seeded():
    """4000 gaps at 4 requests/s follow the exponential law of mean 0.25 s (Kolmogorov-Smirnov),
    and the law of another rate is rejected by the same test; the same seed gives the same
    schedule, another seed another."""
    times = arrival_schedule(4.0, 4001, torch.Generator().manual_seed(0))
    assert times[0] == 0.0 and all(b > a for a, b in zip(times, times[1:]))
    gaps = np.diff(times)
    assert stats.kstest(gaps, "expon", args=(0, 0.25)).pvalue > 1e-3
    assert stats.kstest(gaps, "expon", args=(0, 0.5)).pvalue < 1e-3      # 2 requests/s
    assert stats.kstest(gaps, "uniform", args=(0, 0.5)).pvalue < 1e-3    # evenly spread
    again = arrival_schedule(4.0, 4001, torch.Generator().manual_seed(0))
    assert again == times
    assert arrival_schedule(4.0, 4001, torch.Generator().manual_seed(1)) != times
    assert schedule(4.0, 0, 8, 7) == schedule(4.0, 0, 8, 7) != schedule(4.0, 1, 8, 7)
    with pytest.raises(ValueError):
        arrival_schedule(0.0, 3, torch.Generator())


def test_percentiles_interpolate_as_numpy_does():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert percentile([5], 99) == 5 and math.isnan(percentile([], 50))
    values = list(np.random.default_rng(0).exponential(size=101))
    for q in (50, 90, 99):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def request(index: int, sent: float, times: tuple[float, ...]) -> StreamedRequest:
    return StreamedRequest(index, sent, sent, times)


def test_a_requests_figures_by_hand():
    """Sent at 1.0; tokens at 1.5, 1.5 (a burst: a step that accepted a draft), 1.7, 2.1."""
    r = request(0, 1.0, (1.5, 1.5, 1.7, 2.1))
    assert r.ttft_s == pytest.approx(0.5) and r.e2e_s == pytest.approx(1.1)
    assert r.tpot_s == pytest.approx(0.6 / 3)
    assert r.gaps == pytest.approx((0.0, 0.2, 0.4))
    assert meets(r, {"tpot_ms": 200.001}) and not meets(r, {"tpot_ms": 199.9})
    assert meets(r, {"ttft_ms": 500.001, "e2e_ms": 1100.001})
    assert not meets(r, {"ttft_ms": 500.001, "e2e_ms": 1000})
    one = request(1, 0.0, (0.3,))
    assert one.tpot_s is None and meets(one, {"tpot_ms": 1})     # no TPOT: vacuous, as vLLM


def test_a_schedules_summary_by_hand():
    """Three requests over 2 s: TPOT 0.2, 0.1 and 0.4 s; two meet tpot_ms <= 250."""
    requests = [request(0, 0.0, (0.5, 0.7, 0.9)),
                request(1, 0.5, (0.6, 0.7, 0.8, 0.9)),
                StreamedRequest(2, 1.0, 1.02, (1.2, 1.6, 2.0))]
    s = rate_summary(requests, {"tpot_ms": 250})
    assert s["duration_s"] == pytest.approx(2.0)
    assert s["output_tokens"] == 10 and s["output_tokens_per_s"] == pytest.approx(5.0)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["goodput"] == pytest.approx(1.0) and s["good_fraction"] == pytest.approx(2 / 3)
    assert s["tpot_ms_p50"] == pytest.approx(200.0)
    assert s["ttft_ms_p50"] == pytest.approx(180.0)             # 500, 100, 180 ms
    assert s["itl_ms_p90"] == pytest.approx(percentile([200, 200, 100, 100, 100, 400, 400], 90))
    assert s["late_send_ms_max"] == pytest.approx(20.0)
    assert rate_summary(requests, {})["goodput"] == pytest.approx(1.5)   # no bound: all good


def test_rate_figures_compare_the_sides():
    method = {**dict.fromkeys(("ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "tpot_ms_p90",
                               "tpot_ms_p99", "itl_ms_p50", "itl_ms_p90", "itl_ms_p99",
                               "e2e_ms_p50", "e2e_ms_p90", "request_throughput",
                               "late_send_ms_max", "good_fraction"), 1.0),
              "tpot_ms_p50": 40.0, "output_tokens_per_s": 30.0, "goodput": 2.0}
    vanilla = {**method, "tpot_ms_p50": 60.0, "output_tokens_per_s": 20.0, "goodput": 1.0}
    out = rate_figures(4.0, method, vanilla, with_slo=True)
    assert out["tpot_ratio@r4"] == pytest.approx(1.5)
    assert out["throughput_ratio@r4"] == pytest.approx(1.5)
    assert out["goodput_ratio@r4"] == 2.0 and out["vanilla_goodput@r4"] == 1.0
    assert "goodput_ratio@r0.5" not in rate_figures(0.5, method, {**vanilla, "goodput": 0.0},
                                                    with_slo=True)
    assert "goodput@r4" not in rate_figures(4.0, method, vanilla, with_slo=False)


def test_tokens_are_counted_by_the_servers_running_count():
    """llama-server holds back a token that ends inside a multi-byte character and sends the
    next event with only its own id: its running count (tokens_predicted) still says both
    arrived. An error event inside the stream fails the request with the server's message."""
    from tuner.engines.client import RequestFailed
    from tuner.engines.llamacpp import LlamaCppEvaluator
    from tuner.engines.stream import arrived
    parse = LlamaCppEvaluator.parse_stream
    events = [{"tokens": [5], "tokens_predicted": 1, "stop": False},
              {"tokens": [9], "tokens_predicted": 3, "stop": False},   # a held-back token
              {"tokens": [], "tokens_predicted": 3, "stop": True, "timings": {}}]
    seen, counts = 0, []
    for event in events:
        ids, total, last = parse(event)
        counts.append(arrived(seen, ids, total))
        seen += counts[-1]
    assert counts == [1, 2, 0] and last
    assert arrived(4, [1, 2], None) == 2            # no running count: the ids it carries
    with pytest.raises(RequestFailed, match="llama-server stopped the stream: slot busy"):
        parse({"error": {"code": 500, "message": "slot busy", "type": "server_error"}})


def test_a_figure_without_a_value_is_left_out_not_nan():
    """One-token answers have no TPOT: no tpot_ratio (NaN would rank arbitrarily and read ON)."""
    single = [StreamedRequest(i, float(i), float(i), (i + 0.1,)) for i in range(3)]
    side = rate_summary(single, {})
    assert math.isnan(side["tpot_ms_p50"])
    out = rate_figures(2.0, side, side, with_slo=False)
    assert "tpot_ratio@r2" not in out and "tpot_ms_p50@r2" not in out
    assert out["ttft_ms_p50@r2"] == pytest.approx(100.0)


class Recording:
    """A rate backend that records what it was asked to send and answers from a fixed law: the
    method's tokens come twice as fast as the baseline's."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, tuple[float, ...], tuple[str, ...]]] = []

    def settle(self) -> None:
        pass

    def stream(self, server, prompts, offsets, method):
        self.sent.append(("method" if method else "baseline", tuple(offsets), tuple(prompts)))
        step = 0.05 if method else 0.1
        return [StreamedRequest(i, t, t, tuple(t + 0.2 + step * k for k in range(4)))
                for i, t in enumerate(offsets)]


def test_both_sides_get_the_same_schedule_in_alternating_order():
    backend = Recording()
    traffic = Traffic((1.0, 4.0), 5, {"tpot_ms": 80})
    out = measure_rates(backend, "server", ["a", "b"], traffic, seed=3, parity=0)
    assert [side for side, _, _ in backend.sent] == ["baseline", "method", "method", "baseline"]
    for first, second in (backend.sent[:2], backend.sent[2:]):
        assert first[1:] == second[1:]                      # same send times, same prompts
    assert backend.sent[0][2] == ("a", "b", "a", "b", "a")  # prompts cycled over the schedule
    assert backend.sent[0][1] == schedule(1.0, 0, 5, 3)
    assert out["tpot_ratio@r1"] == pytest.approx(2.0) and out["tpot_ratio@r4"] == pytest.approx(2)
    assert out["goodput@r4"] > 0 and out["vanilla_goodput@r4"] == 0.0   # 100 ms > 80 ms
    again = Recording()
    measure_rates(again, "server", ["a", "b"], traffic, seed=3, parity=1)
    assert [s for s, _, _ in again.sent] == ["method", "baseline", "baseline", "method"]
    assert [x[1] for x in again.sent] == [x[1] for x in backend.sent]   # every trial alike


BAD = [
    (["budget.request_rate=[4]"], "budget.request_rate=[4] is invalid for engine=hf"),
    (["budget.request_rate=[0]"], "budget.request_rate=[0] is invalid: allowed is a list of "
                                  "distinct numbers"),
    (["budget.request_rate=[2,2]"], "budget.request_rate=[2, 2] is invalid"),
    (["budget.requests_per_rate=0"], "budget.requests_per_rate=0 is invalid"),
    (["search.slo={tpot_ms:50}"], "search.slo={'tpot_ms': 50} is set but "
                                  "budget.request_rate=[] measures no rate"),
    (["search.slo={tpot_p90:50}"], "search.slo={'tpot_p90': 50} is invalid"),
    (["search.objectives=[goodput@r4]"], "goodput@r4 names request rate 4, which "
                                         "budget.request_rate=[] does not measure"),
    (["search.objectives=[goodput@rfast]"], "search.objectives=['goodput@rfast'] is invalid"),
    (["budget.request_rate=[0.01]"], "a schedule at 0.01/s lasts about 800 s per server and "
                                     "trial: allowed are schedules up to 600 s"),
    (["budget.request_rate=[1.0000001,1.0000002]"], "two rates share the figures' key"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(c[0]) for c in BAD])
def test_bad_traffic_settings_get_one_line(overrides, message):
    from tests.conftest import compose_cfg
    from tuner.config.errors import ConfigError
    from tuner.study.settings import StudySettings
    with pytest.raises(ConfigError) as caught:
        StudySettings.from_config(compose_cfg(None, *overrides))
    assert message in str(caught.value) and "\n" not in str(caught.value), str(caught.value)


def test_rates_leave_older_study_names_alone():
    """``search.slo: null`` and ``budget.request_rate: []`` are not in the fingerprint, so no
    study made before they existed changes its name."""
    from tests.conftest import compose_cfg
    from tuner.study.settings import StudySettings
    settings = StudySettings.from_config(compose_cfg(None))
    assert "traffic" not in settings.fingerprint
    assert "slo" not in settings.fingerprint["search"]
    assert settings.traffic == Traffic()
