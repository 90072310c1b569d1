"""``quantspec search`` (an Optuna study under a quality floor) and ``quantspec pareto`` (its table and plot).

The study modules are imported inside the commands: they need optuna, and the CLI starts without it (the GPU
machine has none), where these commands answer one line."""
from __future__ import annotations

from pathlib import Path

import typer

import quantspec
from quantspec import DEFAULT_STUDY_DIR, GRACE_S, HEARTBEAT_S, UserError, require_optuna
from quantspec.cli.app import DataDirOption, app, compile_option, flag
from quantspec.report import console, print_study, search_with_progress


def _k_range(text: str | None) -> list[int] | None:
    """``--k`` in the grammar of every command, as the search's [low, high] (it samples K from a range)."""
    if text is None:
        return None
    ks = quantspec.parse_ks(text)
    if ks != list(range(ks[0], ks[-1] + 1)):
        raise UserError(f"search samples K from a range: use LOW-HIGH, e.g. --k {ks[0]}-{ks[-1]}, not {text!r}")
    return [ks[0], ks[-1]]


def _split(text: str | None) -> list[str] | None:
    return None if text is None else [p.strip() for p in text.split(",") if p.strip()]


@app.command()
def search(
    space: str = typer.Option(None, "--space", help="Search-space YAML: a path or a name in studies/spaces/ (default: default)."),
    model: str = typer.Option(None, "--model", "-m", help="Override the space's model."),
    backends: str = typer.Option(None, "--backend", help="Comma list: native,vllm."),
    weights: str = typer.Option(None, "--scheme", help="Comma list of weight schemes, e.g. none,w8ch-sym,w4g32-asym."),
    methods: str = typer.Option(None, "--method", help="Comma list of weight methods, e.g. rtn,gptq."),
    activations: str = typer.Option(None, "--activations", help="Comma list of activation schemes, e.g. none,a8tok-dyn."),
    rotate: str = typer.Option(None, "--rotate", help="Comma list of rotations before quantizing, e.g. none,hadamard."),
    kv: str = typer.Option(None, "--kv", help="Comma list of KV-cache formats, e.g. none,int8."),
    proposers: str = typer.Option(None, "--spec", help="Comma list of proposer specs, e.g. none,ngram."),
    k: str = typer.Option(None, "--k", help="Draft lengths to sample from, a range LOW-HIGH, e.g. 1-8."),
    floor: str = typer.Option(None, help="Quality floor: 0.98 = 98% of the reference's accuracy at the paired-bootstrap "
                                         "lower bound, abs:0.40 = absolute accuracy (default 0.98)."),
    mode: str = typer.Option(None, help="constrained (max tok/s s.t. floor) or pareto (speed and quality)."),
    sampler: str = typer.Option("tpe", help="tpe, nsga2 or random."),
    seed: int = typer.Option(0, help="Sampler seed; each trial draws from (seed, trial number), so workers sharing a "
                             "study and a seed draw different points and one worker reruns alike."),
    n_trials: int = typer.Option(20, "--n-trials", help="Study-wide number of finished trials to reach."),
    timeout: float = typer.Option(None, help="Stop starting new trials after this many seconds."),
    storage: str = typer.Option(None, help="Optuna storage URL (sqlite:///, postgresql://, mysql://, journal:///FILE.log); "
                                           "default SQLite in the study dir."),
    study_name: str = typer.Option(None, "--study-name", help="Study to create (--create), join or resume."),
    study_dir: Path = typer.Option(DEFAULT_STUDY_DIR, "--study-dir", help="Folder for the default SQLite storage."),
    create: bool = flag("--create", help="Create --study-name if it does not exist."),
    resume: bool = flag("--resume", help="Continue a study; trials of dead workers are failed and re-queued."),
    heartbeat: int = typer.Option(HEARTBEAT_S, "--heartbeat", help="RDB storages: seconds between a worker's heartbeats."),
    grace: int = typer.Option(GRACE_S, "--grace", help="RDB storages: seconds without a heartbeat after which a "
                                                       "worker's RUNNING trial is failed and re-queued once."),
    evaluator: str = typer.Option("real", help="Trial evaluator (registry name)."),
    exact_fraction: float = typer.Option(0.25, "--exact-fraction", help="Share of exact-by-construction speculative "
                                         "trials whose greedy outputs are re-checked against no speculation (the "
                                         "others are always checked; unequal outputs make a trial infeasible)."),
    length_band: str = typer.Option("0.9,1.1", "--length-band", help="Output-length gate: mean output tokens per "
                                    "sample (natural end-of-turn) over the reference's must lie in LO,HI; 'off' "
                                    "records it without enforcing it."),
    data_dir: str = DataDirOption,
    tasks: str = typer.Option("arc_easy", "--tasks", "-t", help="lm-eval task(s) scoring quality, comma-separated."),
    limit: int = typer.Option(None, "--limit", "-L", help="Eval items per task (default 200)."),
    prompts: int = typer.Option(4, "--num-prompts", "-n", help="Spec-Bench prompts per speed run (batch 1, greedy)."),
    new_tokens: int = typer.Option(64, "--output-len", help="Fixed output length per speed-run prompt (ignore_eos)."),
    length_tokens: int = typer.Option(256, "--length-tokens", help="Output-length gate: each prompt is generated "
                                      "up to this many tokens, stopping at the end of turn."),
    length_prompts: int = typer.Option(8, "--length-prompts", help="Output-length gate: prompts of the workload "
                                       "generated by each configuration and the reference (the gate is enforced "
                                       "where their paired interval decides it)."),
    threads: int = typer.Option(None, help="torch threads for speed and quality runs (default: chosen per engine "
                                           "by a short timed probe of the candidates; recorded)."),
    noise_threshold: float = typer.Option(0.10, "--noise-threshold", help="Speed is measured paired with the "
                                          "reference in interleaved blocks until the speedup's 95% CI is within "
                                          "this relative half-width (3 to 12 rounds of every speed prompt; a point "
                                          "infeasible already keeps 3); wider rows are marked noisy."),
    csv: str = typer.Option(None, help="Also write the table as CSV."),
    png: str = typer.Option(None, help="Also write the Pareto plot."),
    json_out: str = typer.Option(None, "--output-path", "-o", "--json", show_default=False,
                                 help="Also write the table as JSON."),
    compile: str = compile_option("auto"),
):
    """Search configurations for the most effective tokens/s whose quality passes the floor (Optuna)."""
    require_optuna("quantspec search")
    overrides = {"model": model, "backends": _split(backends), "weights": _split(weights), "methods": _split(methods),
                 "activations": _split(activations), "rotate": _split(rotate), "kv": _split(kv),
                 "proposers": _split(proposers), "k": _k_range(k)}
    given = space is not None or any(v is not None for v in overrides.values())
    settings = quantspec.SearchSettings(
        space=quantspec.load_space(space or "default", **overrides) if given else None, floor=floor, n_trials=n_trials,
        mode=mode, sampler=sampler, seed=seed, study_name=study_name, storage=storage, study_dir=study_dir,
        create=create, resume=resume, exact_fraction=exact_fraction, timeout_s=timeout, heartbeat_s=heartbeat,
        grace_s=grace, length_band=length_band)
    trial_evaluator = quantspec.get_evaluator(evaluator, data_dir=data_dir, limit=limit, tasks=tasks, num_prompts=prompts,
                                    output_len=new_tokens, length_tokens=length_tokens, length_prompts=length_prompts,
                                    threads=threads, compile=compile,
                                    protocol=quantspec.SpeedProtocol(threshold=noise_threshold))
    outcome = search_with_progress(settings, trial_evaluator)
    if outcome.recovered:
        console.print(f"re-queued trial(s) {outcome.recovered} left RUNNING by a dead worker (marked FAIL)")
    if outcome.lost:
        console.print(f"trial(s) {outcome.lost} of this worker were taken for dead by another worker (no heartbeat "
                      "within --grace) and re-queued; their results were dropped: raise --grace if this recurs")
    console.print(f"study {outcome.study.study_name!r} in {quantspec.study_url(storage, study_dir)}; this worker ran "
                  f"{outcome.ran} trial(s)")
    print_study(quantspec.summarize(outcome.study), csv, png, json_out)


@app.command()
def pareto(
    storage: str = typer.Option(None, help="Optuna storage URL (default: SQLite in --study-dir)."),
    study_name: str = typer.Option(None, "--study-name", help="Study (optional when the storage holds one)."),
    study_dir: Path = typer.Option(DEFAULT_STUDY_DIR, "--study-dir", help="Folder of the default SQLite storage."),
    csv: str = typer.Option(None, help="Write the table as CSV."),
    png: str = typer.Option(None, help="Write the Pareto plot (PNG)."),
    json_out: str = typer.Option(None, "--output-path", "-o", "--json", show_default=False,
                                 help="Write the table as JSON."),
):
    """The speed/quality table of a study, sorted by speed, Pareto-optimal rows marked."""
    print_study(quantspec.pareto(storage, study_name, study_dir), csv, png, json_out)
