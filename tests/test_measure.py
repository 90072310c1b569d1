"""runtime.measure (paired ratios, noise guard) and runtime.threads (thread choice), on a clock the test controls:
a fake backend whose step time follows a script (a drift, a burst, a slow phase, random noise)."""
import math
import random

import pytest
import torch

from runtime.errors import UserError
from runtime.loading import load_model
from runtime.measure import (LoadWindow, PairedRounds, Sample, SpeedProtocol, mean_ci, median_ci, paired_ratio,
                             single_shot_ratio)
from runtime.threads import choose_for_model, choose_threads
from studies.pareto import Row, mark_front, pareto_mask, separably_dominated

TOKENS = 32
TRUE_RATIO = 1.25  # the candidate is 25% faster per token than the reference


class FakeMachine:
    """A clock plus a load script: ``slowdown(t)`` multiplies every block's duration at time t."""

    def __init__(self, slowdown=lambda t: 1.0, jitter: float = 0.0, seed: int = 0):
        self.t, self.slowdown, self.jitter = 0.0, slowdown, jitter
        self.rng = random.Random(seed)
        self.blocks = 0

    def clock(self) -> float:
        return self.t

    def run(self, seconds_per_token: float) -> Sample:
        noise = math.exp(self.rng.gauss(0, self.jitter)) if self.jitter else 1.0
        seconds = TOKENS * seconds_per_token * self.slowdown(self.t) * noise
        self.t += seconds
        self.blocks += 1
        return Sample(TOKENS, seconds)

    def reference(self, unit: int) -> Sample:
        return self.run(0.04 * (1 + 0.1 * unit))  # units (prompts) differ in cost; the ratio does not

    def candidate(self, unit: int) -> Sample:
        return self.run(0.04 * (1 + 0.1 * unit) / TRUE_RATIO)


def measure(machine: FakeMachine, protocol=SpeedProtocol(), units: int = 2, on_noisy=None):
    return paired_ratio(machine.reference, machine.candidate, units, protocol, "fake block", on_noisy,
                        clock=machine.clock)


def single_shot(machine: FakeMachine, gap_s: float) -> float:
    """The old protocol: the reference once at the start, the candidate once after ``gap_s`` of other work."""
    ref = machine.reference(0)
    machine.t += gap_s
    return single_shot_ratio(ref, machine.candidate(0))


SCRIPTS = {
    "drift": lambda t: 1 + t / 20,  # the machine slows steadily (thermal, a neighbour ramping up)
    "burst": lambda t: 6.0 if 3.0 <= t < 3.8 else 1.0,  # one short burst hits a few blocks
    "slow phase": lambda t: 2.5 if t >= 4.0 else 1.0,  # a hog arrives half way through
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_paired_estimator_recovers_the_true_ratio_within_its_ci(script):
    result = measure(FakeMachine(SCRIPTS[script]))
    lo, hi = result.ratio.ci
    assert lo <= TRUE_RATIO <= hi and result.ratio.value == pytest.approx(TRUE_RATIO, rel=0.05)
    assert result.rounds >= SpeedProtocol().min_rounds and result.granularity == "fake block"


@pytest.mark.parametrize("script", ["drift", "slow phase"])
def test_single_shot_estimator_misses_the_true_ratio(script):
    """Negative control: the reference timed once, earlier, under other load: off by more than the 10% the paired
    estimator's CI allows."""
    ratio = single_shot(FakeMachine(SCRIPTS[script]), gap_s=10.0)
    assert abs(ratio / TRUE_RATIO - 1) > 0.10


def test_noise_beyond_the_threshold_marks_the_ratio_noisy_and_respects_the_cap():
    calls = []
    machine = FakeMachine(jitter=0.6)  # every block +-60% (log-normal): no CI can reach +-10%
    protocol = SpeedProtocol(min_rounds=4, max_rounds=8)
    result = measure(machine, protocol, on_noisy=lambda: calls.append(1) or "retuned")
    assert result.noisy and result.ratio.rel_halfwidth > protocol.threshold
    assert result.rounds == protocol.max_rounds and machine.blocks == 2 * 2 * protocol.max_rounds  # stopped at the cap
    assert calls == [1] and result.retuned == ["retuned"]  # the noise guard's hook ran once


def test_rounds_held_at_the_minimum_go_on_later_as_one_measurement():
    """A caller holds the rounds at the minimum (not noisy: cut short, and it says so), then goes on: the result is
    the one an uninterrupted measurement gives, round for round (negative control: the same noise measured straight
    through to the cap is noisy, so the hold is what cleared the flag)."""
    protocol = SpeedProtocol(min_rounds=3, max_rounds=8)
    calls = []
    machine = FakeMachine(jitter=0.6)
    rounds = PairedRounds(machine.reference, machine.candidate, 2, protocol, "fake block",
                          lambda: calls.append(1) or "retuned", clock=machine.clock)
    held = rounds.measure(hold_at=protocol.min_rounds)
    assert held.rounds == 3 and not held.noisy and held.stopped == "held at 3 rounds by the caller"
    assert machine.blocks == 2 * 2 * 3 and calls == []  # no round beyond the hold, no retune
    machine.t += 100.0  # other work in between (the point's quality) is not measuring time
    resumed = rounds.measure()
    straight = measure(FakeMachine(jitter=0.6), protocol)
    assert resumed.noisy and straight.noisy and resumed.rounds == straight.rounds == protocol.max_rounds
    assert resumed.ratio.value == straight.ratio.value and resumed.ratio.ci == straight.ratio.ci
    assert resumed.stopped == "the protocol's max rounds" and calls == [1]
    assert resumed.elapsed_s == pytest.approx(straight.elapsed_s)  # the 100 s gap is not counted


def test_a_hold_on_a_quiet_machine_is_not_a_hold():
    machine = FakeMachine(jitter=0.01)
    result = PairedRounds(machine.reference, machine.candidate, 2, clock=machine.clock).measure(hold_at=3)
    assert result.stopped == "within the threshold" and not result.noisy and result.rounds == 3


def test_time_budget_stops_adding_rounds():
    machine = FakeMachine(jitter=0.6)
    result = measure(machine, SpeedProtocol(min_rounds=4, max_rounds=1000, budget_s=10.0))
    assert result.noisy and result.elapsed_s >= 10.0 and result.rounds < 1000  # the budget ended it, not the cap


def test_quiet_machine_stops_at_the_minimum():
    machine = FakeMachine(jitter=0.01)
    result = measure(machine)
    assert not result.noisy and result.rounds == SpeedProtocol().min_rounds
    assert result.candidate.value / result.reference.value == pytest.approx(TRUE_RATIO, rel=0.02)


def test_bad_protocols_are_refused():
    with pytest.raises(UserError, match="noise-threshold"):
        SpeedProtocol(threshold=0)
    with pytest.raises(UserError, match="min rounds"):
        SpeedProtocol(min_rounds=8, max_rounds=4)


def test_spreads():
    s = median_ci([1.0, 1.1, 0.9, 1.05, 0.95, 1.0])
    assert s.ci[0] <= s.value <= s.ci[1] and s.n == 6 and s.iqr[0] <= s.iqr[1]
    assert not math.isfinite(median_ci([1.0, 2.0]).rel_halfwidth)  # two rounds: no CI claimed
    r = median_ci([1.2, 1.25, 1.3], log=True)
    assert r.ci[0] < 1.2 and r.ci[1] > 1.3  # three rounds: wider than their range (t with 2 degrees of freedom)
    m = mean_ci([10.0, 12.0, 11.0])
    assert m.value == pytest.approx(11.0) and m.ci[0] < 11.0 < m.ci[1]


def test_load_window_reads_the_machine():
    window = LoadWindow.start().stop()
    assert window.cpus >= 1 and window.load_1m_before is not None
    assert window.steal_pct is None or 0 <= window.steal_pct <= 100


class ThreadScriptedWork:
    """Work whose duration depends on the torch thread count: the fake clock advances by ``cost[threads]``."""

    def __init__(self, cost: dict[int, float]):
        self.cost, self.t = cost, 0.0

    def __call__(self):
        self.t += self.cost[torch.get_num_threads()]

    def clock(self):
        return self.t


@pytest.mark.parametrize("cost,best", [({2: 0.030, 1: 0.037}, 2),   # idle: two spinning threads win
                                       ({2: 0.031, 1: 0.030}, 2),   # a near-tie keeps all cores
                                       ({2: 0.120, 1: 0.036}, 1)])  # one core busy: one thread wins
def test_thread_choice_follows_the_probe(cost, best):
    """Negative control: a fixed choice (2 threads, torch's default here) loses the busy-machine case."""
    before = torch.get_num_threads()
    try:
        work = ThreadScriptedWork(cost)
        choice = choose_threads(work, [2, 1], clock=work.clock)
        assert choice.threads == best == torch.get_num_threads() and choice.how == "probe"
        assert set(choice.probe_ms) == {1, 2} and "load_1m_before" in choice.load
    finally:
        torch.set_num_threads(before)


def test_omp_num_threads_caps_the_thread_candidates(monkeypatch):
    """A process told to use one core (OMP_NUM_THREADS=1, as each of `make test`'s two workers is) is not probed
    onto two, which spin-wait for the core the other worker holds. Negative control: unset, both counts are tried."""
    from runtime import threads

    monkeypatch.setattr(threads, "cpus_available", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads.candidates() == [2, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = torch.get_num_threads()
    try:
        assert threads.candidates() == [1]
        choice = choose_threads(lambda: None)
        assert (choice.threads, choice.how, torch.get_num_threads()) == (1, "OMP_NUM_THREADS=1", 1)
    finally:
        torch.set_num_threads(before)


def test_thread_probe_leaves_the_models_cache_as_it_was(tiny_llama_dir):
    """The probe runs one-token forwards on a scratch cache; a decode in progress continues unchanged.
    Negative control: without restoring, the rope tables shrink to the probe's 8 positions and the decode fails."""
    from runtime.generate import Decoder
    from runtime.sampling import SamplingConfig

    lm = load_model(str(tiny_llama_dir))
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    expected = Decoder(lm, max_len=64).generate(prompt, 24, SamplingConfig(), ignore_eos=True).tokens
    decoder = Decoder(lm, max_len=64)
    first = decoder.generate(prompt, 12, SamplingConfig(), ignore_eos=True).tokens
    choose_for_model(lm.model, [1])
    choose_for_model(lm.model, [2, 1])
    following = int(decoder.forward([first[-1]])[-1].argmax())
    assert first + [following] == expected[:13]


def test_greedy_tokens_do_not_depend_on_the_thread_count(tiny_llama_dir):
    """Why a thread choice may change between runs: outputs are bitwise the same at 1 and 2 threads."""
    before = torch.get_num_threads()
    try:
        logits = {}
        for n in (1, 2):
            torch.set_num_threads(n)
            lm = load_model(str(tiny_llama_dir), "bf16")
            lm.model.setup_cache(1, 32)
            with torch.inference_mode():
                logits[n] = lm.model(torch.tensor([[5, 6, 7, 8, 9]]), torch.arange(5))
        assert torch.equal(logits[1], logits[2])
    finally:
        torch.set_num_threads(before)


def _row(number, speedup, ci, quality=0.95, delta_ci=(-0.01, 0.01)):
    return Row(number, "COMPLETE", f"p{number}", "native", {}, tok_s=10 * speedup, speedup=speedup,
               speedup_ci=list(ci), quality=quality, delta=0.0, ci=list(delta_ci), feasible=True)


def test_pareto_counts_a_point_dominated_only_beyond_both_cis():
    fast = _row(1, 1.50, (1.45, 1.55))
    slow = _row(2, 1.10, (1.05, 1.15))  # beaten beyond the CIs: dominated
    close = _row(3, 1.46, (1.30, 1.62))  # behind on the point estimate only: not separable
    rows = [fast, slow, close]
    mark_front(rows)
    assert fast.pareto and not slow.pareto and not slow.not_separable
    assert not close.pareto and close.not_separable
    # negative control: point estimates alone call `close` dominated, like `slow`
    assert pareto_mask([(r.speedup, r.quality) for r in rows]) == [True, False, False]
    assert separably_dominated([((1.45, 1.55), (0, 0)), ((1.30, 1.62), (0, 0))]) == [False, False]
