"""One device call: generate self-distillation data once, train drafts for several block sizes,
evaluate simulated DDTree acceptance on the held-aside prompts, write everything to $OUT.

Used for the committed draft (ddtree_diag/data/draft-smollm2/README.md gives the exact knobs).
Knobs (env): JOB_RUNS ("8:random,16:random,..." block size and init per run), JOB_SECONDS
(training seconds per run), JOB_MAX_PROMPTS, JOB_MAX_NEW, JOB_FOLLOW_UP (second-turn tokens,
0 = none), JOB_FOLLOW_UPS_PER, JOB_BATCH, JOB_WD, JOB_GEN_BATCH, JOB_VAL (fraction of sequences
held back for early stopping), JOB_ANCHORS (blocks per sequence per step), JOB_DEADLINE (seconds
after the job's start by which everything must be written: the last run's training time shrinks
to fit, keeping JOB_RESERVE seconds for its evaluation and packing); JOB_INIT (continue from
this draft directory), JOB_LR, JOB_DATA / JOB_EVAL_DATA (the .json.gz data of an earlier job:
no generation); JOB_SAMPLED (add this many user prompts written by the target itself,
``draft_training.sample_user_prompts``, kept away from the held-aside prompts; saved to
sampled_prompts.txt); JOB_TINY=1 for a CPU smoke run.
"""

import gzip
import json
import os
import tarfile
import time
from pathlib import Path

import torch

from ddtree_diag.engine.embedded import ensure_target_dir
from ddtree_diag.training import draft as dt

out = Path(os.environ.get("OUT", "/tmp/gpu_job_out"))
out.mkdir(parents=True, exist_ok=True)
tiny = os.environ.get("JOB_TINY") == "1"
seconds = float(os.environ.get("JOB_SECONDS", "150"))
# Runs as "block_size:init", init = random (standard recipe) or target (copy the last target layers).
runs = [r.split(":") for r in os.environ.get("JOB_RUNS", "8:random").split(",")]
max_new = int(os.environ.get("JOB_MAX_NEW", "384"))
follow_up_tokens = int(os.environ.get("JOB_FOLLOW_UP", "256"))  # 0 = first turns only
batch_size = int(os.environ.get("JOB_BATCH", "32"))
weight_decay = float(os.environ.get("JOB_WD", "0.01"))
max_prompts = int(os.environ.get("JOB_MAX_PROMPTS", "0")) or None  # first N lines of train.txt
gen_batch = int(os.environ.get("JOB_GEN_BATCH", "512"))
follow_ups_per_prompt = int(os.environ.get("JOB_FOLLOW_UPS_PER", "2"))
val_fraction = float(os.environ.get("JOB_VAL", "0.05"))  # early stopping on held-back sequences
anchors_per_seq = int(os.environ.get("JOB_ANCHORS", "32"))
deadline = float(os.environ.get("JOB_DEADLINE", "0"))  # 0: no deadline
init_from = os.environ.get("JOB_INIT") or None  # continue from this draft directory
learning_rate = float(os.environ.get("JOB_LR", "6e-4"))
reuse_data = os.environ.get("JOB_DATA") or None  # train_data.json.gz of an earlier job: skip generation
reuse_eval = os.environ.get("JOB_EVAL_DATA") or None  # eval_data.json.gz of an earlier job
reserve = float(os.environ.get("JOB_RESERVE", "75"))
sampled_count = int(os.environ.get("JOB_SAMPLED", "0"))
data_dir = Path(__file__).resolve().parents[1] / "ddtree_diag" / "data" / "prompts"
log_file = open(out / "log.txt", "a")  # noqa: SIM115 (open for the whole job)


def log(msg: str) -> None:
    print(msg, flush=True)
    log_file.write(msg + "\n")
    log_file.flush()


t0 = time.time()
log(
    f"torch {torch.__version__} cuda {torch.cuda.is_available()} "
    f"{torch.cuda.get_device_name() if torch.cuda.is_available() else ''}"
)
import transformers  # noqa: E402

log(f"transformers {transformers.__version__}")
target_dir = ensure_target_dir()
log(f"target dir built in {time.time() - t0:.1f}s")
device = "cuda" if torch.cuda.is_available() else "cpu"
if device == "cuda":
    torch.backends.cuda.matmul.allow_tf32 = True
target, tokenizer = dt.load_target(target_dir, device)
prompts = dt.load_prompts(data_dir / "train.txt")[:max_prompts]
heldout = dt.evaluation_prompts()  # the smoke prompt first
if tiny:
    prompts, heldout = prompts[:3], heldout[:1]
t1 = time.time()
if reuse_data:
    with gzip.open(reuse_data, "rt") as fh:
        records = json.load(fh)
else:
    if sampled_count:
        sampled = dt.sample_user_prompts(
            target, tokenizer, 4 if tiny else sampled_count, min(gen_batch, 1024), seed=1,
            temperature=0.9, exclude=heldout,
        )
        (out / "sampled_prompts.txt").write_text("\n".join(sampled) + "\n")
        log(f"sampled {len(sampled)} user prompts in {time.time() - t1:.1f}s")
        prompts = prompts + sampled
    records = dt.generate_greedy(target, tokenizer, prompts, 8 if tiny else max_new, gen_batch)
    if follow_up_tokens:
        conversations = dt.follow_up_conversations(records, tokenizer, follow_ups_per_prompt)
        records += dt.generate_greedy(
            target, tokenizer, conversations, 8 if tiny else follow_up_tokens, gen_batch
        )
log(
    f"train data: {len(records)} seqs, {sum(len(r['response_ids']) for r in records)} tokens, "
    f"{time.time() - t1:.1f}s"
)
data_file = out / "train_data.json"
data_file.write_text(json.dumps(records))
with gzip.open(out / "train_data.json.gz", "wt") as fh:  # early: a timeout still returns it
    json.dump(records, fh)
if reuse_eval:
    with gzip.open(reuse_eval, "rt") as fh:
        eval_records = {m == "True": r for m, r in json.load(fh).items()}
else:
    eval_records = {
        m: dt.generate_greedy(target, tokenizer, heldout, 8 if tiny else 128, 64, m) for m in (False, True)
    }
with gzip.open(out / "eval_data.json.gz", "wt") as fh:
    json.dump({str(m): r for m, r in eval_records.items()}, fh)
log(f"eval data ready at {time.time() - t0:.1f}s")
del target

results = {}
for bs_text, init in runs:
    bs = int(bs_text)
    name = f"b{bs}-{init}"
    run_dir = Path(f"/tmp/draft-{name}")
    run_seconds = seconds
    if deadline and not tiny:
        # validation passes are not counted in max_seconds: leave them ~15 % on top
        run_seconds = min(seconds, (deadline - (time.time() - t0) - reserve) / 1.15)
        log(f"{name}: {run_seconds:.0f}s of training fit before the deadline")
    settings = dt.TrainSettings(
        prompts_file=str(data_dir / "train.txt"),
        out_dir=str(run_dir),
        target_dir=str(target_dir),
        block_size=bs,
        steps=3 if tiny else 100000,
        max_seconds=None if tiny else max(run_seconds, 10.0),
        batch_size=2 if tiny else batch_size,
        weight_decay=weight_decay,
        val_fraction=val_fraction,
        eval_every_seconds=2 if tiny else 30,
        anchors_per_seq=4 if tiny else anchors_per_seq,
        data_file=str(data_file),
        device=device,
        init_from_target=init == "target",
        init_from=init_from,
        lr=learning_rate,
        log_every=1 if tiny else 50,
    )
    res = dt.train_draft(settings, log=log)
    # Files come back at most 16 MiB each: split the tar right away (a timeout still returns it).
    tar_path = out / f"draft-{name}.tar"
    with tarfile.open(tar_path, "w") as tar:
        tar.add(run_dir, arcname=f"draft-{name}")
    data = tar_path.read_bytes()
    for index in range(0, len(data), 15 * 2**20):
        (out / f"{tar_path.name}.part{index // (15 * 2**20)}").write_bytes(data[index : index + 15 * 2**20])
    tar_path.unlink()
    # evaluated after packing: a timeout during the evaluation still returns the weights
    table = dt.evaluate(
        res["draft"], res["target"], res["tokenizer"], None, [0, 4, 16, 64, 256], records_by_mode=eval_records
    )
    results[name] = {"summary": res["summary"], "acceptance": table}
    log(f"{name}: {json.dumps(table)}  (at {time.time() - t0:.1f}s)")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    del res
    if device == "cuda":
        torch.cuda.empty_cache()
data_file.unlink()
log(f"done in {time.time() - t0:.1f}s")
log_file.close()
with tarfile.open(out / "meta.tar", "w") as tar:
    for name in ("log.txt", "results.json", "train_data.json.gz", "eval_data.json.gz", "sampled_prompts.txt"):
        if not (out / name).exists():
            continue
        tar.add(out / name, arcname=name)
        (out / name).unlink()
