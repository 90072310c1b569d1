"""Optuna samplers by name, each drawing a trial from a seed of its own: (``--seed``, trial number).

Workers sharing a study are started with the same ``--seed``. With one sampler RNG per worker they would all draw
the same sequence and measure the same points side by side; seeded per trial number (unique in a study), they
draw different points, and a single worker stays reproducible. The samplers keep no other state between trials
(TPE and NSGA-II read the history from the study), so building one per trial loses nothing.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

SAMPLERS: dict[str, Callable[[int], optuna.samplers.BaseSampler]] = {
    "tpe": lambda seed: optuna.samplers.TPESampler(seed=seed, n_startup_trials=8),
    "nsga2": lambda seed: optuna.samplers.NSGAIISampler(seed=seed, population_size=10),
    "random": lambda seed: optuna.samplers.RandomSampler(seed=seed),
}


def trial_seed(seed: int, number: int) -> int:
    """The seed of trial ``number`` in a study searched with ``--seed seed`` (mixed by numpy's SeedSequence)."""
    return int(np.random.SeedSequence([seed, number]).generate_state(1)[0])


class PerTrialSeed(optuna.samplers.BaseSampler):
    """``SAMPLERS[name]`` rebuilt for each trial with ``trial_seed(seed, trial.number)``."""

    def __init__(self, name: str, seed: int):
        self._make, self._seed = SAMPLERS[name], seed
        self._inner = self._make(seed)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self._inner = self._make(trial_seed(self._seed, trial.number))
        self._inner.before_trial(study, trial)

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return self._inner.infer_relative_search_space(study, trial)

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        return self._inner.sample_relative(study, trial, search_space)

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        return self._inner.sample_independent(study, trial, param_name, param_distribution)

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: list[float] | None) -> None:
        self._inner.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self._inner.reseed_rng()
