"""``quantspec train-draft``: train an EAGLE-style draft head for MODEL from the model itself."""
from __future__ import annotations

import typer
from rich.progress import TextColumn

import quantspec
from quantspec.cli.app import DataDirOption, DtypeOption, ModelArgument, ModelOption, app, pick_model
from quantspec.report import console, progress


@app.command("train-draft")
def train_draft(
    model: str = ModelArgument,
    model_option: str = ModelOption,
    out: str = typer.Option(..., "--output-dir", "--out", help="Head directory to write (model.safetensors + config.json)."),
    prompts: int = typer.Option(200, "--num-prompts", "-n", help="Alpaca instructions the target answers (self-distillation)."),
    max_answer_tokens: int = typer.Option(64, "--max-answer-tokens", help="Cap on each answer's length."),
    wikitext: int = typer.Option(32, "--wikitext", help="WikiText-2 validation chunks of --wikitext-len tokens."),
    wikitext_len: int = typer.Option(128, "--wikitext-len"),
    epochs: int = typer.Option(4, "--epochs"),
    batch: int = typer.Option(8, "--batch", help="Sequences per step."),
    lr: float = typer.Option(1e-3, "--lr"),
    ce_weight: float = typer.Option(quantspec.TrainConfig.ce_weight, "--ce-weight",
                                    help="Weight of the token cross-entropy beside the hidden-state regression "
                                         "(EAGLE-1: 0.1)."),
    draft_vocab: int = typer.Option(None, "--draft-vocab", help="Reduced draft vocabulary: the N most frequent "
                                                                "tokens (EAGLE-3 d2t map); default the full one."),
    train_seconds: float = typer.Option(None, "--train-seconds", help="Wall-clock cap on the training loop."),
    ttt_steps: int = typer.Option(quantspec.TrainConfig.ttt_steps, "--ttt-steps",
                                  help="Chain steps trained on the head's own predicted states (EAGLE-3's "
                                       "training-time test); 1 trains on the target's states only."),
    context_prompts: int = typer.Option(0, "--context-prompts",
                                        help="Long-context prompts (summarize / answer about a WikiText-2 validation "
                                             "passage, Spec-Bench's long-context shapes) the target also answers."),
    context_len: int = typer.Option(quantspec.TrainConfig.context_len, "--context-len",
                                    help="Passage tokens per long-context prompt."),
    fuse_layers: str = typer.Option("", "--fuse-layers",
                                    help="EAGLE-3 feature fusion: target layers (0-based) whose outputs the head reads "
                                         "with the final state, e.g. 2,15 for a 30-layer target (low, middle; the "
                                         "final state is the high one). Native backend only."),
    head_layers: int = typer.Option(quantspec.TrainConfig.head_layers, "--head-layers",
                                    help="Decoder layers in the head (EAGLE-1: 1; more costs more per draft)."),
    seed: int = typer.Option(0, "--seed"),
    dtype: str = DtypeOption,
    threads: int = typer.Option(None),
    data_dir: str = DataDirOption,
):
    """Train an EAGLE draft head on MODEL's own answers and hidden states; use it as --spec eagle:OUTPUT_DIR."""
    model = pick_model(model, model_option)
    cfg = quantspec.TrainConfig(n_prompts=prompts, max_answer_tokens=max_answer_tokens, n_wikitext=wikitext,
                                wikitext_len=wikitext_len, epochs=epochs, batch=batch, lr=lr, ce_weight=ce_weight,
                                draft_vocab=draft_vocab,
                                train_seconds=train_seconds, seed=seed, ttt_steps=ttt_steps,
                                n_context=context_prompts, context_len=context_len,
                                fuse_layers=quantspec.parse_layers(fuse_layers), head_layers=head_layers)
    lm = quantspec.load(model, dtype, threads, "eager")
    bar = progress(TextColumn("{task.fields[detail]}"))
    tasks: dict[str, int] = {}

    def on_progress(stage, done, total, detail):
        if stage == "epoch":
            console.print(f"epoch {done}/{total}: {detail}")
            return
        if stage not in tasks:
            tasks[stage] = bar.add_task(stage, total=total, detail="")
        bar.update(tasks[stage], completed=done, total=total, detail=detail)

    with bar:
        result = quantspec.train_draft(lm, out, cfg, data_dir, on_progress, target_name=model)
    console.print(f"{result.n_sequences} sequences ({result.n_alpaca_answers} Alpaca and {result.n_context_answers} "
                  f"long-context answers; {result.n_train_tokens} training positions, "
                  f"{result.n_dropped_prompts} prompts dropped for overlapping a benchmark turn), {result.steps} steps; "
                  f"time: extraction (answers + hidden states) {result.extract_s:.1f} s, training {result.train_s:.1f} s, "
                  f"evaluation {result.eval_s:.1f} s")
    console.print(f"head: {out} (use --spec eagle:{out})")
