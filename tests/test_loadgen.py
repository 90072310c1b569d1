"""Load generators and serving metrics: arrival processes, closed/open loop drivers, percentiles, α/τ."""
import asyncio

import numpy as np
import pytest

from serving.requests import Request, RequestResult, SpecCounters
from specdec.proposers.base import ProposerSpec, parse_proposer_spec
from serving.loadgen import LoadSpec, arrival_offsets, closed_loop_async, open_loop_async
from serving.serving_metrics import SLO, spec_summary, summarize
from runtime.errors import UserError


def test_poisson_offsets_have_the_requested_rate():
    offsets = arrival_offsets(4000, rate=2.0, seed=1)
    gaps = np.diff(offsets)
    assert offsets[0] == 0 and np.all(gaps >= 0)
    assert abs(gaps.mean() - 0.5) < 0.03  # mean inter-arrival 1/λ
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.06  # exponential: CV = 1


def test_gamma_burstiness_changes_dispersion_not_rate():
    bursty = np.diff(arrival_offsets(4000, rate=2.0, burstiness=0.25, seed=1))
    regular = np.diff(arrival_offsets(4000, rate=2.0, burstiness=4.0, seed=1))
    assert abs(bursty.mean() - 0.5) < 0.06 and abs(regular.mean() - 0.5) < 0.03
    assert bursty.std() / bursty.mean() > 1.6 > 0.6 > regular.std() / regular.mean()


@pytest.mark.parametrize("kwargs, needle", [
    (dict(kind="open", rate=0), "--request-rate must be > 0"),
    (dict(kind="open", rate=-1.0), "--request-rate must be > 0"),
    (dict(kind="closed", concurrency=0), "--max-concurrency must be >= 1"),
    (dict(kind="open", rate=1.0, burstiness=0), "--burstiness"),
    (dict(kind="batch"), "unknown load kind"),
])
def test_bad_load_is_a_user_error(kwargs, needle):
    with pytest.raises(UserError, match=needle):
        LoadSpec(**kwargs)


def _fake_server(service_s: float, log: list):
    async def send(request: Request, scheduled):
        r = RequestResult(request.index, len(request.prompt_ids), asyncio.get_running_loop().time(), scheduled)
        log.append(("start", request.index))
        await asyncio.sleep(service_s)
        r.first_token = r.end = asyncio.get_running_loop().time()
        r.token_ids = [0] * request.max_tokens
        r.finish_reason = "length"
        log.append(("end", request.index))
        return r
    return send


def test_closed_loop_keeps_exactly_c_in_flight():
    log = []
    requests = [Request(i, [1, 2], 3) for i in range(7)]
    results = asyncio.run(closed_loop_async(_fake_server(0.01, log), requests, concurrency=3))
    assert [r.index for r in results] == list(range(7))
    in_flight = peak = 0
    for event, _ in log:
        in_flight += 1 if event == "start" else -1
        peak = max(peak, in_flight)
    assert peak == 3


def test_open_loop_does_not_wait_for_replies():
    """Arrivals every 10 ms with 100 ms service: requests overlap; no request is dropped."""
    log = []
    requests = [Request(i, [1], 1) for i in range(5)]
    offsets = [0.0, 0.01, 0.02, 0.03, 0.04]
    results = asyncio.run(open_loop_async(_fake_server(0.1, log), requests, offsets))
    assert len(results) == 5
    assert [e for e, _ in log[:5]] == ["start"] * 5  # all five sent before the first reply


def _result(i, sent, first, end, n, chunks=(), scheduled=None):
    return RequestResult(i, 10, sent, scheduled, first_token=first, end=end, token_ids=[0] * n,
                         chunk_times=list(chunks), finish_reason="length")


def test_summary_counts_real_tokens_and_percentiles():
    results = [_result(0, 0.0, 0.5, 2.5, 21, chunks=[0.5, 1.0, 2.5]), _result(1, 1.0, 1.2, 3.0, 10, scheduled=0.8),
               RequestResult(2, 10, 1.5, error="ConnectError: refused")]
    s = summarize(results, SLO(ttft_s=0.4, tpot_s=1.0))
    assert s["output_tokens"] == 31 and s["n_failed"] == 1
    assert s["window_s"] == pytest.approx(3.0)  # first send -> last completion
    assert s["effective_tok_s"] == pytest.approx(31 / 3.0)
    assert s["ttft_s"]["p50"] == pytest.approx(0.35)
    assert s["tpot_s"]["mean"] == pytest.approx((2.0 / 20 + 1.8 / 9) / 2)
    assert s["itl_s"]["p50"] == pytest.approx(1.0)  # gaps 0.5 and 1.5
    assert s["goodput_rps"] == pytest.approx(1 / 3.0)  # only request 1 meets TTFT <= 0.4
    assert s["send_lag_s"]["max"] == pytest.approx(0.2)
    assert s["errors"] == ["ConnectError: refused"]


def test_spec_summary_uses_vllm_definitions():
    delta = SpecCounters(10, 40, 20, [8, 6, 4, 2]) - SpecCounters(0, 0, 0, [0, 0, 0, 0])
    s = spec_summary(delta)
    assert s["alpha"] == pytest.approx(0.5) and s["tau"] == pytest.approx(3.0)
    assert s["accepted_per_pos"] == pytest.approx([0.8, 0.6, 0.4, 0.2])
    assert spec_summary(SpecCounters())["alpha"] is None


def test_counter_deltas():
    before, after = SpecCounters(3, 12, 5, [3, 2]), SpecCounters(5, 20, 9, [5, 3, 1])
    d = after - before
    assert (d.drafts, d.draft_tokens, d.accepted, d.accepted_per_pos) == (2, 8, 4, [2, 1, 1])
    assert (before + d).accepted_per_pos == [5, 3, 1]


def test_k_rides_in_the_proposer_spec():
    assert parse_proposer_spec("ngram:k=4") == ProposerSpec("ngram", "", 4)
    assert parse_proposer_spec("ngram:min=2,k=8,max=4") == ProposerSpec("ngram", "min=2,max=4", 8)
    assert parse_proposer_spec("draft:/x/y") == ProposerSpec("draft", "/x/y", None)
    assert parse_proposer_spec(None) is None
    with pytest.raises(UserError, match="k must be an integer"):
        parse_proposer_spec("ngram:k=four")