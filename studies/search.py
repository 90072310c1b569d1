"""Optuna search: maximise effective tokens/s subject to quality >= floor, or the (speed, quality) Pareto front.

One trial = one ``Config`` sampled from the space. Points no backend can run are pruned with the reason
as user attr ``pruned_reason``. Quality is measured once per model transformation *and serving backend/dtype*
(``study_quality_key``: a vLLM point is scored through vLLM on its export, never given the native number) and
shared through the study's user attrs.

Quality is never borrowed across different outputs. A speculative trial reuses the quality of its
non-speculative twin only when (user attr ``quality_basis``, shown in the table):

* ``exact by construction``: the evaluator states that the kernels it ran make speculation token-exact (native
  bf16: eager attention, it and every linear kernel probed row-invariant, ``specdec.speculative.check_bf16_exact``);
  a sampled fraction of these is still re-checked on greedy outputs; or
* ``verified``: its greedy outputs on the evaluator's prompts equal the twin's (``exact_check``, always run when
  exactness does not hold by construction). Where its speculation ran on another decoding step than the twin's
  engine (native: a compiled verification probed inexact sends the point eager), the twin's outputs are decoded
  again on that step (``reference_step`` in the check): lossless speculation reproduces plain decoding on its own
  kernels, not another step's rounding.

A trial whose greedy outputs differ from its twin's is **infeasible** (constraint ``exactness`` = 1) with the
reason recorded: the quality tasks score log-likelihoods of the target model, which speculation does not
touch, so re-measuring them would only copy the twin's number again; the outputs it would serve are not those.

Constraints, set with ``Trial.set_constraint`` (Optuna 5's replacement for the deprecated ``constraints_func``;
TPE and NSGA-II both read them; feasible = all <= 0): ``quality_floor`` = floor - quality; ``exactness``
(speculative trials); ``length_band`` (MLPerf's second gate: mean output tokens per prompt with natural
end-of-turn over the reference's on the same prompts must lie in ``--length-band``; enforced only where the
prompts decide it, ``studies.length_gate``; lengths are measured once per serving transformation, and an exact
speculative point shares its twin's unless it was checked on another step; off with ``--length-band off``, recorded in the study).

Several workers on one study end with exactly ``n_trials`` finished trials: a worker starts a trial only while
finished + in-flight trials are fewer, and a trial that two workers started at once beyond the target ends FAIL
with user attr ``surplus``, unmeasured. Before measuring a transformation's quality, a trial claims it (user attr
``quality_claim``); the earliest claimant measures and the others wait for its study user attr.
"""
from __future__ import annotations

import random
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import optuna
from optuna.trial import TrialState

from evals.config import Config
from runtime.errors import UserError
from serving.backends import BACKENDS
from studies.objective import QualityResult, SpeedResult, TrialEvaluator
from studies.samplers import SAMPLERS, PerTrialSeed, trial_seed
from studies.space import SearchSpace, invalid_reason, load_space
from studies.defaults import DEFAULT_STUDY_DIR, GRACE_S, HEARTBEAT_S
from studies.length_gate import decide_length
from studies.storage import (WORKER_ATTR, awaiting_trials, in_flight, open_storage, recover_stale_trials,
                             storage_url, worker_id)

DIRECTIONS = {"constrained": ["maximize"], "pareto": ["maximize", "maximize"]}
METRIC_NAMES = {"constrained": ["tok_s"], "pareto": ["tok_s", "quality"]}  # optuna-dashboard's axis names
CONSTRAINT, EXACTNESS, LENGTH = "quality_floor", "exactness", "length_band"
INFEASIBLE_WHY = {CONSTRAINT: "quality below the floor", EXACTNESS: "greedy outputs differ from its twin's"}
DEFAULT_LENGTH_BAND = (0.9, 1.1)
LENGTH_ATTR = "length/"  # study user attr prefix, one entry per serving transformation (``length_key``)
EXACT_BASES = ("exact by construction", "verified")  # quality bases under which a point serves its twin's outputs
QUALITY_ATTR = "quality/"  # study user attr prefix, one entry per quality key
CLAIM_ATTR, SURPLUS_ATTR = "quality_claim", "surplus"
CLAIM_SETTLE_S = 0.3  # a claimant looks for rivals this long after claiming, so concurrent claims see each other
POLL_S = 0.5  # waiting for another worker's quality measurement or in-flight trials
CREATION_WAIT_S = 60  # a worker joining a study waits this long for its creator to store the study's settings


@dataclass
class SearchSettings:
    space: SearchSpace | None = None  # None: the stored space of an existing study
    floor: str | None = None  # None: the stored floor (or the evaluator's default for a new study)
    n_trials: int = 20  # study-wide target of finished trials (complete, pruned, or failed with an error)
    mode: str | None = None  # constrained | pareto
    sampler: str = "tpe"
    seed: int = 0
    study_name: str | None = None
    storage: str | None = None
    study_dir: Path = DEFAULT_STUDY_DIR
    create: bool = False
    resume: bool = False
    exact_fraction: float = 0.25  # share of exact-by-construction speculative trials re-checked on greedy outputs
    length_band: tuple[float, float] | None | str = DEFAULT_LENGTH_BAND  # None or "off": no length gate
    timeout_s: float | None = None
    heartbeat_s: int = HEARTBEAT_S
    grace_s: int = GRACE_S

    def __post_init__(self):
        if self.n_trials < 1:
            raise UserError(f"--n-trials must be >= 1, got {self.n_trials}")
        if self.mode is not None and self.mode not in DIRECTIONS:
            raise UserError(f"unknown mode {self.mode!r}: use {', '.join(DIRECTIONS)}")
        if self.sampler not in SAMPLERS:
            raise UserError(f"unknown sampler {self.sampler!r}: use {', '.join(SAMPLERS)}")
        if not 0.0 <= self.exact_fraction <= 1.0:
            raise UserError(f"--exact-fraction must be in [0, 1], got {self.exact_fraction}")
        self.length_band = parse_length_band(self.length_band)
        if not 1 <= self.heartbeat_s < self.grace_s:
            raise UserError(f"need 1 <= --heartbeat < --grace (seconds), got {self.heartbeat_s} and {self.grace_s}")


def parse_length_band(text) -> tuple[float, float] | None:
    """``0.9,1.1`` -> (0.9, 1.1); ``off``/None -> None (no output-length gate)."""
    if text is None or (isinstance(text, str) and text.strip().lower() in ("off", "none", "")):
        return None
    try:
        lo, hi = (float(x) for x in (text.split(",") if isinstance(text, str) else text))
    except (ValueError, TypeError):
        raise UserError(f"--length-band {text!r}: use LO,HI (e.g. 0.9,1.1) or off") from None
    if not 0 < lo <= 1 <= hi:
        raise UserError(f"--length-band needs 0 < LO <= 1 <= HI, got {lo},{hi}")
    return lo, hi


def length_key(config: Config, exact: bool) -> str:
    """What decides a point's greedy outputs: backend, dtype and transformation, plus the proposer and K unless
    the point is exact (then it serves its non-speculative twin's outputs)."""
    key = f"{config.backend}|{config.dtype}|{config.quality_key}"
    return key if exact or not config.speculative else f"{key}|{config.label}"


def study_quality_key(config: Config) -> str:
    """The quality cache key of a point, as its backend states it (``Backend.quality_key``): its transformation,
    plus the backend and dtype for a backend that scores its own quality (a vLLM point's quality is measured
    through vLLM in its serving dtype, never borrowed from native)."""
    return BACKENDS.get(config.backend).quality_key(config)


def open_study(settings: SearchSettings, default_floor: str | None = None,
               on_wait: Callable[[str], None] | None = None) -> optuna.Study:
    """Create or load the study; its floor, mode and space are stored as study user attrs on creation.
    ``on_wait`` hears, once, that this worker waits for the study's creator (``_wait_for_creator``)."""
    storage = open_storage(storage_url(settings.storage, settings.study_dir), heartbeat_s=settings.heartbeat_s,
                           grace_s=settings.grace_s)
    names = optuna.get_all_study_names(storage)
    name = settings.study_name
    if name is None:
        if settings.resume:
            if len(names) != 1:
                raise UserError(f"--resume needs --study-name: the storage holds {len(names)} studies "
                                f"({', '.join(names) or 'none'})")
            name = names[0]
        else:
            name, settings.create = time.strftime("search-%Y%m%d-%H%M%S"), True
    sampler = PerTrialSeed(settings.sampler, settings.seed)
    if name in names:
        study = optuna.load_study(study_name=name, storage=storage, sampler=sampler)
        _wait_for_creator(study, on_wait)
        _check_stored(study, settings)
        return study
    if not settings.create:
        raise UserError(f"study {name!r} does not exist in this storage (has: {', '.join(names) or 'none'}); "
                        "pass --create to start it")
    if settings.resume:
        raise UserError(f"--resume: study {name!r} does not exist yet; drop --resume (and pass --create) to start it")
    space = settings.space or load_space("default")
    floor = settings.floor if settings.floor is not None else default_floor
    if floor is None:
        raise UserError("a new study needs --floor")
    mode = settings.mode or "constrained"
    settings.space, settings.floor, settings.mode = space, floor, mode
    study = optuna.create_study(study_name=name, storage=storage, sampler=sampler, load_if_exists=True,
                                directions=DIRECTIONS[mode])
    if "floor" not in study.user_attrs:  # first of several workers creating it
        store_settings(study, space, floor, mode)
    _check_stored(study, settings)
    return study


def flat_attrs(quality: QualityResult, speed: SpeedResult) -> dict[str, float | bool]:
    """A trial's headline numbers as flat user attributes (optuna-dashboard charts and filters these; the nested
    ``quality`` and ``speed`` attributes keep everything); unmeasured ones are left out."""
    ci = speed.speedup_ci or (None, None)
    values = {"tok_s": speed.tok_s, "speedup": speed.speedup, "speedup_ci_low": ci[0], "speedup_ci_high": ci[1],
              "noisy": speed.noisy, "alpha": speed.alpha, "tau": speed.tau, "accuracy": quality.accuracy,
              "delta": quality.delta, "kl": quality.kl, "passes_floor": quality.passes}
    return {name: value for name, value in values.items() if value is not None}


def store_settings(study: optuna.Study, space: SearchSpace, floor: str, mode: str) -> None:
    """A new study's mode, space and reference trial (enqueued first), then its floor, which marks it complete."""
    study.set_user_attr("mode", mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names(METRIC_NAMES[mode])
    study.set_user_attr("space", space.to_dict())
    study.set_user_attr("reference", space.reference().to_dict())
    study.enqueue_trial(SearchSpace.params_of(space.reference()), user_attrs={"reference": True}, skip_if_exists=True)
    study.set_user_attr("floor", floor)


def _wait_for_creator(study: optuna.Study, on_wait: Callable[[str], None] | None = None) -> None:
    """A worker that finds the study before its creator has stored the settings waits for them: joining early, it
    would sample before the reference trial is enqueued, and without the stored mode return values that Optuna
    fails silently after they were measured."""
    deadline = time.monotonic() + CREATION_WAIT_S
    if on_wait is not None and "floor" not in study.user_attrs:
        on_wait(f"study {study.study_name!r} has no settings yet: waiting up to {CREATION_WAIT_S} s for its creator")
    while "floor" not in study.user_attrs:
        if time.monotonic() > deadline:
            raise UserError(f"study {study.study_name!r} has no stored floor after {CREATION_WAIT_S} s: it was not "
                            "made by `quantspec search`, or its creator stopped while making it; start a new study "
                            "(--study-name NEW --create)")
        time.sleep(POLL_S)


def _check_stored(study: optuna.Study, settings: SearchSettings) -> None:
    """Fill unset settings from the stored study; refuse ones that contradict it."""
    stored = {"floor": study.user_attrs.get("floor"), "mode": study.user_attrs.get("mode"),
              "space": SearchSpace(**study.user_attrs["space"]) if "space" in study.user_attrs else None}
    for key, value in stored.items():
        given = getattr(settings, key)
        if given is not None and value is not None and given != value:
            shown = "a different space" if key == "space" else f"{key} {value}"
            raise UserError(f"study {study.study_name!r} was created with {shown}; drop --{key} or start a new "
                            "study (--study-name NEW --create)")
        if value is not None:
            setattr(settings, key, value)
    if settings.space is None or settings.floor is None:
        raise UserError(f"study {study.study_name!r} was not made by `quantspec search` (no stored space/floor); "
                        "start a new study with --create")


def _check_evaluator(study: optuna.Study, evaluator: TrialEvaluator, floor: str) -> None:
    """Every worker of a study must measure the same way (tasks, items, prompts, lengths); the first one records it."""
    mine = evaluator.describe()
    stored = study.user_attrs.get("evaluator")
    if stored is None:
        study.set_user_attr("evaluator", mine)
        study.set_user_attr("floor_value", evaluator.floor_value(floor))
    elif stored != mine:
        diff = {k: (stored.get(k), v) for k, v in mine.items() if stored.get(k) != v}
        raise UserError(f"study {study.study_name!r} measures with {', '.join(f'{k}={a}' for k, (a, _) in diff.items())}; "
                        f"this worker would use {', '.join(f'{k}={b}' for k, (_, b) in diff.items())}: pass the same "
                        "options or start a new study")


def finished_trials(study: optuna.Study, trials: list[optuna.trial.FrozenTrial] | None = None
                    ) -> list[optuna.trial.FrozenTrial]:
    """Trials that count towards --n-trials: complete, pruned, or failed by their own error (not by a dead worker).
    ``trials``: a snapshot already read (see ``in_flight``)."""
    return [t for t in (study.get_trials(deepcopy=False) if trials is None else trials)
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
            or (t.state == TrialState.FAIL and "error" in t.user_attrs)]


def taken_for_dead(study: optuna.Study, number: int | None) -> bool:
    """Whether trial ``number`` is finished although this worker was still running it: another worker took it for
    dead (no heartbeat within the grace period), failed and re-queued it, and Optuna refuses this worker's result."""
    return number is not None and any(t.number == number and t.state.is_finished()
                                      for t in study.get_trials(deepcopy=False))


class SurplusTrial(Exception):
    """Started together with another worker's trial when only one more was needed (recorded FAIL, not counted)."""


class TrialRunner:
    """The Optuna objective: suggest, validate, measure (quality cached), record."""

    def __init__(self, study: optuna.Study, settings: SearchSettings, evaluator: TrialEvaluator):
        self.study, self.settings, self.evaluator = study, settings, evaluator
        self.space, self.floor = settings.space, evaluator.floor_value(settings.floor)
        self._reference_tokens: dict[str, list[list[int]]] = {}
        self.number: int | None = None  # the trial running or last run

    def __call__(self, trial: optuna.Trial) -> float | tuple[float, float]:
        self.number = trial.number
        trial.set_user_attr(WORKER_ATTR, worker_id())
        self._refuse_surplus(trial)
        try:
            config = self.space.suggest(trial)
        except UserError as exc:  # a combination that does not parse (e.g. weights that carry activations)
            self._prune(trial, str(exc))
        trial.set_user_attr("config", config.to_dict())
        trial.set_user_attr("label", config.label)
        reason = invalid_reason(config)
        if reason:
            self._prune(trial, reason)
        try:
            quality, speed = self._measure(trial, config)
            constraints = self._constraints(trial, config, quality)
            failed = [INFEASIBLE_WHY[name] for name, value in constraints.items() if value > 0]
            infeasible = f"infeasible already ({'; '.join(failed)})" if failed else None
            speed = self._settle(trial, config, speed, infeasible)
            length = trial.user_attrs.get("length") or self._length_gate(trial, config, infeasible)  # a duplicate has it
        except UserError as exc:  # the point cannot run (e.g. a backend refuses it): skip, not crash
            self._prune(trial, str(exc))
        except Exception as exc:
            trial.set_user_attr("error", f"{type(exc).__name__}: {exc}"[:2000])
            raise
        trial.set_user_attr("quality", quality.to_dict() | {"record": None})
        trial.set_user_attr("speed", speed.to_dict() | {"record": None})
        for name, value in flat_attrs(quality, speed).items():
            trial.set_user_attr(name, value)
        trial.set_user_attr("record", speed.record)
        for name, value in constraints.items():
            trial.set_constraint(name, value)
        trial.set_user_attr("length", length)
        if length.get("constraint") is not None:
            trial.set_constraint(LENGTH, length["constraint"])
        return speed.tok_s if len(self.study.directions) == 1 else (speed.tok_s, quality.value)  # the stored mode

    def _refuse_surplus(self, trial: optuna.Trial) -> None:
        """Workers that started trials at the same moment: those beyond the study's target stop unmeasured."""
        trials = self.study.get_trials(deepcopy=False)  # one read: a trial finishing between two would be in neither
        counted = {t.number for t in finished_trials(self.study, trials) + in_flight(self.study, trials)}
        ahead = sum(n < trial.number for n in counted)
        if ahead >= self.settings.n_trials:
            reason = f"not needed: {ahead} earlier trials were finished or running (--n-trials {self.settings.n_trials})"
            trial.set_user_attr(SURPLUS_ATTR, reason)
            raise SurplusTrial(reason)

    @staticmethod
    def _prune(trial: optuna.Trial, reason: str):
        trial.set_user_attr("pruned_reason", reason)
        raise optuna.TrialPruned(reason)

    def _measure(self, trial: optuna.Trial, config: Config) -> tuple[QualityResult, SpeedResult]:
        duplicate = self._finished_duplicate(config)
        if duplicate is not None:  # same point already measured in this study: reuse, do not re-measure
            trial.set_user_attr("duplicate_of", duplicate.number)
            for key in ("quality_basis", "exact_check", "length"):
                if key in duplicate.user_attrs:
                    trial.set_user_attr(key, duplicate.user_attrs[key])
            return (QualityResult.from_dict(duplicate.user_attrs["quality"]),
                    SpeedResult(**duplicate.user_attrs["speed"] | {"record": duplicate.user_attrs.get("record")}))
        # first: a point the engine refuses fails fast, before quality; its paired rounds held where they can be
        speed = self.evaluator.speed(config, settle=False) if hasattr(self.evaluator, "settle") else \
            self.evaluator.speed(config)
        quality = self.quality(config, trial)
        trial.set_user_attr("quality_basis", self.quality_basis(trial, config))
        return quality, speed

    def quality_basis(self, trial: optuna.Trial, config: Config) -> dict:
        """Why this trial's quality applies to the outputs it serves (see the module docstring)."""
        backend = f"{config.backend} {config.dtype}"
        if not config.speculative:
            return {"kind": "measured", "why": f"its own transformation, scored on {backend}"}
        probe = getattr(self.evaluator, "exactness", None)
        construction = probe(config) if probe is not None else {
            "by_construction": False, "why": "the evaluator does not state exactness by construction"}
        if construction["by_construction"] and not self._sampled_for_exact_check(trial.number):
            return {"kind": "exact by construction", "why": construction["why"]}
        check = self.exact_check(config)
        trial.set_user_attr("exact_check", check)
        n_equal = sum(check["equal_per_prompt"])
        if check["equal"]:
            if construction["by_construction"]:
                return {"kind": "exact by construction", "why": construction["why"],
                        "verified": f"{n_equal}/{check['n_prompts']} greedy outputs equal"}
            return {"kind": "verified", "why": f"greedy outputs equal its non-speculative twin's on "
                                               f"{n_equal}/{check['n_prompts']} prompts ({construction['why']})"}
        diverge = [d for d in check["first_divergence"] if d is not None]
        return {"kind": "infeasible", "why": (
            f"greedy outputs differ from its non-speculative twin's on {check['n_prompts'] - n_equal}/"
            f"{check['n_prompts']} prompts (first divergence at token {min(diverge)})"
            + (" although the kernel probe called it exact" if construction["by_construction"] else
               f" ({construction['why']})")
            + ": the twin's quality does not apply, and the quality tasks (log-likelihoods of the target model, "
              "which speculation does not change) cannot measure what this generator emits")}

    def _constraints(self, trial: optuna.Trial, config: Config, quality: QualityResult) -> dict[str, float]:
        """The quality floor's constraint, and exactness's for a speculative point (Optuna: feasible <= 0)."""
        basis = trial.user_attrs.get("quality_basis") or {}
        return {CONSTRAINT: self.floor - quality.value} | (
            {EXACTNESS: 0.0 if basis.get("kind") != "infeasible" else 1.0} if config.speculative else {})

    def _settle(self, trial: optuna.Trial, config: Config, speed: SpeedResult, infeasible: str | None
                ) -> SpeedResult:
        """The noise guard's rounds beyond the minimum for a point still feasible; a point the quality floor or
        exactness already fails keeps the minimum (its speed cannot put it on the front; its CI shows how wide)."""
        if "duplicate_of" in trial.user_attrs or not hasattr(self.evaluator, "settle"):
            return speed
        return self.evaluator.settle(config, speed, infeasible)

    def _length_gate(self, trial: optuna.Trial, config: Config, infeasible: str | None) -> dict:
        """Output tokens per prompt (natural end-of-turn) vs the reference's on the same prompts, and the band's
        verdict (``studies.length_gate``); not measured for a point the quality floor or exactness already fails."""
        band = self.settings.length_band
        if getattr(self.evaluator, "output_length", None) is None:
            return {"band": list(band) if band else None, "constraint": None,
                    "note": "not measured: the evaluator has no output_length"}
        if infeasible:  # its natural-length runs (minutes on an eager step) could not change its verdict
            return {"band": list(band) if band else None, "constraint": None, "verdict": "not measured",
                    "note": f"not measured: {infeasible}"}
        # an exact point serves its twin's outputs, unless its reference was decoded on another step than the twin's
        exact = (trial.user_attrs.get("quality_basis") or {}).get("kind") in EXACT_BASES and \
            (trial.user_attrs.get("exact_check") or {}).get("reference_step") is None
        reference = self.space.reference()
        key, ref_key = length_key(config, exact), length_key(reference, False)
        mine, ref = self._lengths(config, key), self._lengths(reference, ref_key)
        verdict = decide_length(mine["counts"], ref["counts"], band, identical=key == ref_key)
        out = verdict.to_dict() | {"eot_rate": mine["eot_rate"], "reference_eot_rate": ref["eot_rate"],
                                   "measured_on": mine["measured_on"], "prompts": mine.get("prompts")}
        if verdict.verdict == "off":
            out["note"] = "length band off (--length-band off): recorded, not enforced"
        elif verdict.verdict == "undecidable":
            out["note"] = (f"undecidable on {verdict.n} prompt(s): its interval straddles the band; recorded, not "
                           "enforced (more --length-prompts decide it)")
        return out

    def _lengths(self, config: Config, key: str) -> dict:
        """Output lengths of what ``config`` serves, measured once per study and ``length_key`` (study user attr):
        an exact speculative point serves its twin's outputs, so it shares its twin's lengths."""
        stored = self.study.user_attrs.get(LENGTH_ATTR + key)
        if stored is None:
            stored = self.evaluator.output_length(config) | {"measured_on": config.label}
            self.study.set_user_attr(LENGTH_ATTR + key, stored)
        return stored

    def _finished_duplicate(self, config: Config):
        wanted = config.to_dict()
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if t.user_attrs.get("config") == wanted and "speed" in t.user_attrs:
                return t
        return None

    def quality(self, config: Config, trial: optuna.Trial | None = None) -> QualityResult:
        """Quality of the config's model transformation, measured once per study and shared by all workers.

        With ``trial``, the trial claims the measurement; while an earlier claimant (by claim time, then number)
        is still running, this worker waits for its result instead of measuring the same thing again."""
        quality_key = study_quality_key(config)
        key = QUALITY_ATTR + quality_key
        claimed = False
        while (cached := self.study.user_attrs.get(key)) is None:
            if trial is None:
                break
            if not claimed:
                trial.set_user_attr(CLAIM_ATTR, {"key": quality_key, "at": time.time()})
                claimed = True
                time.sleep(CLAIM_SETTLE_S)
                continue
            if self._claim_winner(quality_key) == trial.number:
                break
            time.sleep(POLL_S)
            recover_stale_trials(self.study)  # a claimant that died stops blocking once its trial is failed
        if cached is not None:
            return QualityResult.from_dict(cached)
        result = self.evaluator.quality(config.transformation)
        self.study.set_user_attr(key, result.to_dict())
        return result

    def _claim_winner(self, quality_key: str) -> int | None:
        claims = [(t.user_attrs[CLAIM_ATTR]["at"], t.number) for t in self.study.get_trials(
                  deepcopy=False, states=(TrialState.RUNNING,))
                  if (t.user_attrs.get(CLAIM_ATTR) or {}).get("key") == quality_key]
        return min(claims)[1] if claims else None

    def _sampled_for_exact_check(self, number: int) -> bool:
        return random.Random(trial_seed(self.settings.seed, number)).random() < self.settings.exact_fraction

    def exact_check(self, config: Config) -> dict:
        """Greedy outputs of the speculative config vs the same transformation without speculation, decoded on the
        step the speculation ran on (``plain_tokens``), else the plain point's own."""
        got = self.evaluator.greedy_tokens(config)
        own_step = getattr(self.evaluator, "plain_tokens", None)
        on_step = own_step(config) if own_step is not None else None
        if on_step is None:
            twin = study_quality_key(config.transformation)
            if twin not in self._reference_tokens:
                self._reference_tokens[twin] = self.evaluator.greedy_tokens(config.transformation)
            ref, step = self._reference_tokens[twin], None
        else:
            ref, step = on_step
        equal = [a == b for a, b in zip(ref, got)]
        first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                      for a, b in zip(ref, got)]
        return {"n_prompts": len(ref), "equal": all(equal), "equal_per_prompt": equal, "reference_step": step,
                "first_divergence": [d if not e else None for d, e in zip(first_diff, equal)],
                "tokens_per_prompt": [len(a) for a in ref]}


@dataclass
class SearchOutcome:
    study: optuna.Study
    recovered: list[int] = field(default_factory=list)  # trials failed + re-queued because their worker died
    lost: list[int] = field(default_factory=list)  # this worker's trials another worker took for dead (re-queued)
    ran: int = 0  # trials this worker ran


def run_search(settings: SearchSettings, evaluator: TrialEvaluator, on_trial=None,
               on_wait: Callable[[str], None] | None = None) -> SearchOutcome:
    """Run (or resume, or join) a study until it holds ``n_trials`` finished trials (``on_wait``: see
    ``open_study``)."""
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # outcomes and errors are user attrs shown by our table
    if settings.floor is not None:
        settings.floor = str(settings.floor)
        evaluator.floor_value(settings.floor)  # out of range: UserError before any study is touched
    study = open_study(settings, evaluator.default_floor, on_wait)
    _check_evaluator(study, evaluator, settings.floor)
    if "length_band" in study.user_attrs:  # the stored band wins, like the floor: all workers gate alike
        stored = study.user_attrs["length_band"]
        settings.length_band = tuple(stored) if stored else None
    else:
        study.set_user_attr("length_band", list(settings.length_band) if settings.length_band else None)
    evaluator.prepare(settings.space, settings.floor)
    outcome = SearchOutcome(study, recover_stale_trials(study))
    runner = TrialRunner(study, settings, evaluator)
    deadline = time.monotonic() + settings.timeout_s if settings.timeout_s else None
    callbacks = [on_trial] if on_trial is not None else []
    try:
        while True:
            trials = study.get_trials(deepcopy=False)  # one read for both counts, as in the surplus check
            finished = len(finished_trials(study, trials))
            if finished >= settings.n_trials or (deadline is not None and time.monotonic() >= deadline):
                break
            pending = awaiting_trials(study, trials=trials)
            if finished + len(pending) >= settings.n_trials and not any(t.state == TrialState.WAITING for t in pending):
                # the rest is running: wait, as it may die
                time.sleep(POLL_S)
                outcome.recovered += recover_stale_trials(study)  # also Optuna's heartbeat check (RDB storages)
                continue
            try:
                study.optimize(runner, n_trials=1, catch=(Exception,), callbacks=callbacks)
            except (ValueError, optuna.exceptions.UpdateFinishedTrialError):
                if not taken_for_dead(study, runner.number):
                    raise
                outcome.lost.append(runner.number)
            outcome.ran += 1
    finally:
        close = getattr(evaluator, "close", None)  # e.g. the resident reference engine of paired speed runs
        if close is not None:
            close()
    return outcome
