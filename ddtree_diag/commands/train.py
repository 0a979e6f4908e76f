"""``train-draft``: train a DFlash draft for a target by self-distillation (engine extra)."""

from __future__ import annotations

import typer

from ddtree_diag.commands.options import DEBUG, DEVICE


def register(app: typer.Typer) -> None:
    @app.command("train-draft")
    def train_draft(
        out: str = typer.Option(..., "--out", help="Output draft directory (config.json + safetensors)."),
        prompts: str | None = typer.Option(
            None, "--prompts", help="Training prompts file (default: the packaged train.txt)."
        ),
        target_dir: str | None = typer.Option(
            None, "--target-dir", help="HF target directory (default: embedded SmolLM2)."
        ),
        block_size: int = typer.Option(8, "--block-size", help="Draft block size (tree depth + 1)."),
        target_layers: str | None = typer.Option(
            None, "--target-layers",
            help="Target layer ids the draft reads, e.g. 1,16,31,46,61 (default: five spread over the depth).",
        ),
        mask_token_id: int | None = typer.Option(
            None, "--mask-token-id", help="Mask token id (default: a token id no text uses)."
        ),
        draft_layers: int = typer.Option(2, "--draft-layers", help="Draft decoder layers."),
        max_prompts: int | None = typer.Option(None, "--max-prompts", help="Use at most N prompts."),
        max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Greedy answer length per prompt."),
        gen_batch_size: int = typer.Option(128, "--gen-batch-size", help="Prompts per generation batch."),
        follow_up_tokens: int = typer.Option(0, "--follow-up-tokens", help="> 0: add a second turn per prompt."),
        sampled_prompts: int = typer.Option(0, "--sampled-prompts", help="Add N prompts the target writes itself."),
        steps: int = typer.Option(2000, "--steps", help="Optimiser steps."),
        max_seconds: float | None = typer.Option(None, "--max-seconds", help="Stop training after this long."),
        batch_size: int = typer.Option(32, "--batch-size", help="Sequences per step."),
        anchors: int = typer.Option(32, "--anchors", help="Blocks sampled per sequence."),
        lr: float = typer.Option(6e-4, "--lr", help="Peak learning rate."),
        weight_decay: float = typer.Option(0.0, "--weight-decay", help="AdamW weight decay."),
        seed: int = typer.Option(0, "--seed", help="Random seed."),
        device: str | None = DEVICE,
        data_file: str | None = typer.Option(None, "--data-file", help="JSON cache of generated sequences."),
        init_from_target: bool = typer.Option(False, "--init-from-target", help="Copy the target's last layers."),
        eval_prompts: str | None = typer.Option(None, "--eval-prompts", help="Evaluate simulated acceptance on these."),
        eval_out: str | None = typer.Option(None, "--eval-out", help="Write the evaluation table (JSON) here."),
        debug: bool = DEBUG,
    ) -> None:
        """Train a DFlash draft by self-distillation (block-diffusion objective)."""
        import json
        from importlib import resources
        from pathlib import Path

        from ddtree_diag.engine.models import require_engine_extra

        require_engine_extra()  # first: the zipapp has no training package at all
        check_train_flags(
            out=out, prompts=prompts, target_dir=target_dir, eval_prompts=eval_prompts, eval_out=eval_out,
            data_file=data_file,
            counts={"--block-size": (block_size, 2), "--draft-layers": (draft_layers, 1), "--steps": (steps, 1),
                    "--batch-size": (batch_size, 1), "--anchors": (anchors, 1),
                    "--max-new-tokens": (max_new_tokens, 1), "--gen-batch-size": (gen_batch_size, 1),
                    "--follow-up-tokens": (follow_up_tokens, 0),
                    "--sampled-prompts": (sampled_prompts, 0), "--max-prompts": (max_prompts, 1),
                    "--mask-token-id": (mask_token_id, 0)},
            rates={"--lr": (lr, False), "--weight-decay": (weight_decay, True), "--max-seconds": (max_seconds, False)},
        )
        from ddtree_diag.training.draft import TrainSettings, evaluate, load_prompts, train_draft

        prompts_file = prompts or str(resources.files("ddtree_diag").joinpath("data", "prompts", "train.txt"))
        settings = TrainSettings(
            prompts_file=prompts_file, out_dir=out, target_dir=target_dir, block_size=block_size,
            num_draft_layers=draft_layers, max_prompts=max_prompts, max_new_tokens=max_new_tokens,
            gen_batch_size=gen_batch_size, steps=steps, max_seconds=max_seconds, batch_size=batch_size,
            anchors_per_seq=anchors, lr=lr, seed=seed, device=device, data_file=data_file,
            init_from_target=init_from_target, follow_up_tokens=follow_up_tokens, weight_decay=weight_decay,
            sampled_prompts=sampled_prompts, mask_token_id=mask_token_id,
            target_layer_ids=parse_layer_ids(target_layers),
        )
        result = train_draft(settings)
        typer.echo(json.dumps(result["summary"], indent=1))
        if eval_prompts:
            table = evaluate(result["draft"], result["target"], result["tokenizer"], load_prompts(eval_prompts),
                             [0, 4, 16, 64, 256])
            typer.echo(json.dumps(table, indent=1))
            if eval_out:
                Path(eval_out).write_text(json.dumps(table, indent=1))


def check_train_flags(*, out: str, prompts: str | None, target_dir: str | None, eval_prompts: str | None,
                      eval_out: str | None, data_file: str | None, counts: dict[str, tuple[int | None, int]],
                      rates: dict[str, tuple[float | None, bool]]) -> None:
    """Everything that can be told before a model loads: one line and exit 2 at once, not an
    error after minutes of generation (the evaluation's files are only read after training)."""
    import math
    from pathlib import Path

    from ddtree_diag.errors import UsageError
    from ddtree_diag.output.reportfile import check_writable
    from ddtree_diag.training.prompts import load_prompts

    for flag, (value, least) in counts.items():
        if value is not None and value < least:
            raise UsageError(f"{flag} must be >= {least}, got {value}")
    for flag, (value, zero_ok) in rates.items():
        if value is None:
            continue
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            raise UsageError(f"{flag} must be a finite number {'>=' if zero_ok else '>'} 0, got {value}")
    for flag, path in (("--prompts", prompts), ("--eval-prompts", eval_prompts)):
        if path is None:
            continue
        try:
            prompts_read = load_prompts(path)
        except FileNotFoundError:
            raise UsageError(f"{flag} {path}: no such file") from None
        except IsADirectoryError:
            raise UsageError(f"{flag} {path}: a directory, not a prompts file") from None
        except OSError as exc:
            raise UsageError(f"{flag} {path}: cannot read it ({exc.strerror})") from None
        except UnicodeDecodeError as exc:
            raise UsageError(f"{flag} {path}: not UTF-8 text (byte {exc.start})") from None
        if not prompts_read:
            raise UsageError(f"{flag} {path}: no prompts in it (one a line; '#' lines are comments)")
    if Path(out).exists() and not Path(out).is_dir():
        raise UsageError(f"--out {out}: a file, not a directory")
    if target_dir is not None and not Path(target_dir).is_dir():
        raise UsageError(f"--target-dir {target_dir}: no such directory")
    if data_file is not None and Path(data_file).is_dir():
        raise UsageError(f"--data-file {data_file}: a directory, not a file")
    check_writable(eval_out, "--eval-out")


def parse_layer_ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0:
        from ddtree_diag.errors import UsageError

        raise UsageError(f"--target-layers: expected comma-separated layer ids >= 0, got {text!r}")
    return ids
