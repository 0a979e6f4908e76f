"""Tensor parallelism for the TARGET on the eager decode path, with plain ``torch.distributed``.

One process per device (``launch``: ``torch.multiprocessing`` spawn, gloo on CPU, NCCL on CUDA).
Every rank loads the engine, keeps only its shard of the target (``shard_target``) and then runs
the *same* eager decode loop: the draft (replicated), the tree build, the accept walk and the
commit are computed identically on every rank from identical inputs, so no rank ever needs
another's tree or tokens. Only rank 0 reports results.

The shard plan (``plan_shards``), Megatron-style, one ``all_reduce`` (sum) per half-layer:

- full attention: q_proj / k_proj / v_proj keep this rank's heads (rows; a gated query keeps each
  head's [query | gate] pair), o_proj the matching input columns; an all_reduce after o_proj. The
  KV cache of each rank holds its own KV heads only.
- Gated DeltaNet (Qwen3.5 layout, hybrid targets): this rank's value heads and the key heads that
  serve them (each key head serves Hv/Hk consecutive value heads, so both are split in contiguous
  blocks): the q|k|v rows of in_proj_qkv and the same conv1d channels, in_proj_z rows, in_proj_b /
  in_proj_a rows, A_log / dt_bias, out_proj columns; an all_reduce after out_proj. The gated
  RMSNorm is per value head (its weight is head_v_dim wide): replicated. Recurrent and conv states
  per rank hold its heads only.
- dense MLP: gate_proj / up_proj rows, down_proj columns; an all_reduce after down_proj.
- embeddings, final norm and lm_head: replicated (simplest; the vocab is not split).

A bias on a row-parallel projection (o_proj, down_proj, out_proj) is kept on rank 0 only, so the
sum adds it once. MoE MLPs (Qwen3-Next, Qwen3.5-MoE) are not sharded yet: refused with one line.
The fast path (``engine/fast``, CUDA graphs) is not sharded: a parallel engine runs eager only.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

from ddtree_diag.errors import UsageError


@dataclass(frozen=True)
class ShardPlan:
    """How a target splits over ``world`` devices (per-device counts)."""

    world: int
    layers: int
    heads: int  # query heads per device (full-attention layers)
    kv_heads: int
    intermediate: int  # dense MLP width per device
    linear_k_heads: int  # Gated DeltaNet key / value heads per device (0: not hybrid)
    linear_v_heads: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def _divides(what: str, count: int, world: int) -> int:
    if count % world:
        raise UsageError(f"cannot split {count} {what} over {world} devices: {count} is not divisible by {world}")
    return count // world


def plan_shards(config: Any, world: int) -> ShardPlan:
    """The per-device split of a target config over ``world`` devices; one-line UsageError when a
    head count (or the MLP width) does not divide, or for an MoE target (not sharded yet)."""
    from ddtree_diag.engine.arch import EXPERT_COUNT_FIELDS, is_hybrid, text_config

    if world < 1:
        raise UsageError(f"--devices must be >= 1, got {world}")
    cfg = text_config(config)
    moe = any(getattr(cfg, name, None) for name in EXPERT_COUNT_FIELDS)
    if moe and world > 1:
        raise UsageError(f"{cfg.model_type} has an MoE MLP: tensor parallelism shards dense MLPs only (use 1 device)")
    if getattr(cfg, "model_type", "") == "phi3" and world > 1:
        raise UsageError("phi3 projects q|k|v in one linear: tensor parallelism splits separate ones (use 1 device)")
    if getattr(cfg, "kv_lora_rank", None) and world > 1:
        raise UsageError(f"{cfg.model_type} has latent attention: tensor parallelism splits q/k/v heads (use 1 device)")
    heads = _divides("attention heads", cfg.num_attention_heads, world)
    kv_heads = _divides("key/value heads", cfg.num_key_value_heads or cfg.num_attention_heads, world)
    intermediate = _divides("MLP channels", cfg.intermediate_size, world)
    lk = lv = 0
    if is_hybrid(config):
        lk = _divides("Gated DeltaNet key heads", cfg.linear_num_key_heads, world)
        lv = _divides("Gated DeltaNet value heads", cfg.linear_num_value_heads, world)
    return ShardPlan(world, cfg.num_hidden_layers, heads, kv_heads, intermediate, lk, lv)


def plan_shards_of(target: str, gguf_file: str | None, world: int) -> ShardPlan:
    """``plan_shards`` of a target on disk (its config only)."""
    from ddtree_diag.engine.load import _target_location, target_config

    return plan_shards(target_config(*_target_location(target, gguf_file)), world)


# ----------------------------------------------------------------------------------------------
# Sharding a loaded TargetModel in place


def _keep_rows(linear: Any, rows: Any) -> None:
    import torch

    linear.weight = torch.nn.Parameter(linear.weight.data[rows].contiguous(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias.data[rows].contiguous(), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _keep_columns(linear: Any, cols: Any, rank: int) -> None:
    import torch

    linear.weight = torch.nn.Parameter(linear.weight.data[:, cols].contiguous(), requires_grad=False)
    if linear.bias is not None and rank != 0:  # the all_reduce adds rank 0's bias once
        linear.bias = torch.nn.Parameter(torch.zeros_like(linear.bias.data), requires_grad=False)
    linear.in_features = linear.weight.shape[1]


def _block(index: int, size: int) -> slice:
    return slice(index * size, (index + 1) * size)


def _head_rows(heads_local: int, rank: int, width: int) -> Any:
    """Row indices of this rank's heads in a [heads * width] projection."""
    import torch

    start = rank * heads_local * width
    return torch.arange(start, start + heads_local * width)


def _all_reduce_hook(group: Any) -> Any:
    import torch.distributed as dist

    def hook(module: Any, inputs: Any, output: Any) -> Any:
        dist.all_reduce(output, group=group)
        return output

    return hook


def shard_target(target: Any, rank: int, world: int, group: Any = None) -> ShardPlan:
    """Keep rank ``rank``'s shard of a loaded ``TargetModel`` (in place) and hook an all_reduce
    after every row-parallel projection. Returns the plan. ``world`` 1 leaves it untouched."""
    import torch

    from ddtree_diag.engine.target import KVCache

    plan = plan_shards(target.hf.config, world)
    if world == 1:
        return plan
    hook = _all_reduce_hook(group)
    for index, layer in enumerate(target.layers):
        if index in target.cache_slot:
            attn = layer.self_attn
            q_width = target.head_dim * (2 if target.arch.gated_query else 1)
            _keep_rows(attn.q_proj, _head_rows(plan.heads, rank, q_width))
            _keep_rows(attn.k_proj, _head_rows(plan.kv_heads, rank, target.head_dim))
            _keep_rows(attn.v_proj, _head_rows(plan.kv_heads, rank, target.head_dim))
            _keep_columns(attn.o_proj, _head_rows(plan.heads, rank, target.head_dim), rank)
            attn.o_proj.register_forward_hook(hook)
        else:
            _shard_gdn(layer.linear_attn, plan, rank)
            layer.linear_attn.out_proj.register_forward_hook(hook)
        mlp = layer.mlp
        if not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")):
            raise UsageError(f"layer {index}'s MLP is not a dense gate/up/down MLP: cannot shard it")
        rows = torch.arange(rank * plan.intermediate, (rank + 1) * plan.intermediate)
        _keep_rows(mlp.gate_proj, rows)
        _keep_rows(mlp.up_proj, rows)
        _keep_columns(mlp.down_proj, rows, rank)
        mlp.down_proj.register_forward_hook(hook)
    target.heads, target.kv_heads = plan.heads, plan.kv_heads
    target.kv = KVCache(len(target.attention_layers), plan.kv_heads, target.head_dim, target.kv.capacity,
                        target.device, target.dtype)
    target.reset()
    target.shard_plan = plan
    return plan


def _shard_gdn(module: Any, plan: ShardPlan, rank: int) -> None:
    """Keep this rank's value heads (and their key heads) of a Qwen3.5 GatedDeltaNet module."""
    import torch

    if not hasattr(module, "in_proj_qkv"):
        raise UsageError(f"{type(module).__name__}: only the Qwen3.5 GatedDeltaNet layout is sharded")
    dk, dv = module.head_k_dim, module.head_v_dim
    key_dim = module.key_dim
    q_rows = _head_rows(plan.linear_k_heads, rank, dk)
    v_rows = _head_rows(plan.linear_v_heads, rank, dv)
    channels = torch.cat([q_rows, key_dim + q_rows, 2 * key_dim + v_rows])  # the q | k | v layout
    heads = torch.arange(rank * plan.linear_v_heads, (rank + 1) * plan.linear_v_heads)
    _keep_rows(module.in_proj_qkv, channels)
    _keep_rows(module.in_proj_z, v_rows)
    _keep_rows(module.in_proj_b, heads)
    _keep_rows(module.in_proj_a, heads)
    conv = module.conv1d
    conv.weight = torch.nn.Parameter(conv.weight.data[channels].contiguous(), requires_grad=False)
    if conv.bias is not None:
        conv.bias = torch.nn.Parameter(conv.bias.data[channels].contiguous(), requires_grad=False)
    conv.in_channels = conv.out_channels = conv.groups = channels.shape[0]
    module.A_log = torch.nn.Parameter(module.A_log.data[heads].contiguous(), requires_grad=False)
    module.dt_bias = torch.nn.Parameter(module.dt_bias.data[heads].contiguous(), requires_grad=False)
    _keep_columns(module.out_proj, v_rows, rank)
    module.num_k_heads, module.num_v_heads = plan.linear_k_heads, plan.linear_v_heads
    module.key_dim, module.value_dim = plan.linear_k_heads * dk, plan.linear_v_heads * dv
    module.conv_dim = channels.shape[0]


# ----------------------------------------------------------------------------------------------
# Process groups and the launcher


def device_for(rank: int, device_type: str) -> str:
    return f"cuda:{rank}" if device_type == "cuda" else "cpu"


def init_group(rank: int, world: int, device_type: str, init_method: str) -> None:
    """Join the default process group: NCCL on CUDA (rank r drives cuda:r), gloo on CPU."""
    import torch
    import torch.distributed as dist

    backend = "nccl" if device_type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {}
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device(f"cuda:{rank}")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, **kwargs)


def load_sharded(rank: int, world: int, device_type: str, target: str, draft: str | None = None,
                 gguf_file: str | None = None, dtype: str | None = None, model_name: str | None = None) -> Any:
    """Load the engine on rank ``rank`` (inside a joined group): load the whole target on the CPU,
    keep this rank's shard, then move target and draft to this rank's device. The engine decodes
    eagerly. (Each rank holds the whole checkpoint in CPU memory while it loads: loading only the
    shard's slices of the safetensors files is not done yet.)"""
    import torch

    from ddtree_diag.engine.load import load_engine, resolve_dtype

    device = torch.device(device_for(rank, device_type))
    torch_dtype = resolve_dtype(dtype, device)
    engine = load_engine(target, draft=draft, gguf_file=gguf_file, device="cpu", dtype=str(torch_dtype),
                         decode_path="eager", model_name=model_name)
    plan = shard_target(engine.target, rank, world)
    if device.type != "cpu":
        engine.target.hf.to(device)
        engine.target.device = device
        engine.target.kv = type(engine.target.kv)(len(engine.target.attention_layers), engine.target.kv_heads,
                                                  engine.target.head_dim, engine.target.kv.capacity, device,
                                                  engine.target.dtype)
        if engine.draft is not None:
            engine.draft.to(device)
        engine.device = device
    engine._info["parallel"] = {"devices": world, "rank": rank, "backend": "nccl" if device.type == "cuda" else "gloo",
                                "plan": plan.as_dict()}
    return engine


def _worker(rank: int, world: int, device_type: str, init_method: str, job: Any, args: tuple, out: str) -> None:
    import pickle
    import time

    import torch
    import torch.distributed as dist

    if device_type == "cpu":  # the processes share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    init_group(rank, world, device_type, init_method)
    try:
        result: tuple[str, Any, float] = ("ok", job(rank, world, device_type, *args), time.time())
    except Exception as exc:  # reported in one line by the launcher; the earliest error is the cause
        result = ("error", f"{type(exc).__name__}: {exc}".strip().splitlines()[0], time.time())
    if rank == 0 or result[0] == "error":
        path = os.path.join(out, f"rank{rank}.pickle")
        with open(path + ".part", "wb") as handle:
            pickle.dump(result, handle)
        os.replace(path + ".part", path)  # whole or absent: the launcher may end this process any time
    if result[0] == "ok":
        dist.barrier()  # every rank done before any leaves
    # Leave without tearing the group down or running the interpreter's exit: rank 0's result is
    # on disk, and gloo's teardown at exit now and then aborted a rank of a finished job
    # ("terminate called without an active exception"). After an error the other ranks may be
    # blocked in a collective: the launcher ends them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if result[0] == "ok" else 1)


def rendezvous(folder: str) -> str:
    """Where the ranks meet: a file in ``folder`` (a store that lives as long as the folder). A
    free TCP port would be picked here and bound later by rank 0: another process may take it
    in between (seen in a parallel test run)."""
    return "file://" + os.path.join(folder, "rendezvous")


def launch(job: Any, world: int, device_type: str = "cpu", args: tuple = ()) -> Any:
    """Run ``job(rank, world, device_type, *args)`` in ``world`` spawned processes joined in one
    group; return rank 0's result (the others' are dropped). ``job`` must be picklable (a module-
    level function). A failing rank raises RuntimeError here with its one-line error."""
    import pickle

    import torch
    import torch.multiprocessing as mp

    if device_type == "cuda" and torch.cuda.device_count() < world:
        raise UsageError(f"--devices {world} needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory(prefix="ddtree-tp-") as out:
        init_method = rendezvous(out)
        failure = None
        try:
            mp.start_processes(_worker, args=(world, device_type, init_method, job, args, out), nprocs=world,
                               join=True, start_method="spawn")
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as exc:
            failure = str(exc).strip().splitlines()[-1]
        results = {}
        for rank in range(world):
            path = os.path.join(out, f"rank{rank}.pickle")
            if os.path.exists(path):
                with open(path, "rb") as handle:
                    results[rank] = pickle.load(handle)
    errors = sorted((when, rank, value) for rank, (status, value, when) in results.items() if status == "error")
    if errors:  # the first to fail; the others mostly report the connection it dropped
        raise RuntimeError(f"rank {errors[0][1]}: {errors[0][2]}")
    if 0 not in results:
        raise RuntimeError(f"a rank ended without a result ({failure or 'no error reported'})")
    # Rank 0 wrote its result once every collective of the job had run, so a rank that dies after
    # that (on its way out) cannot have changed it.
    return results[0][1]


def generate_job(rank: int, world: int, device_type: str, target: str, draft: str | None, dtype: str | None,
                 requests: list[dict[str, Any]]) -> list[list[int]]:
    """A ``launch`` job: load sharded, decode each request (``generate_ids`` keyword arguments),
    return the output token ids (every rank decodes; rank 0's list is what ``launch`` returns)."""
    engine = load_sharded(rank, world, device_type, target, draft, dtype=dtype)
    return [list(engine.generate_ids(**request).token_ids) for request in requests]


# ----------------------------------------------------------------------------------------------
# The split of a target over N devices, from its config alone (``engine-info --devices N``)

PLAN_TOKENS = 8192  # the sequence the per-device fit assumes (KV cache and draft cache)
PLAN_BUDGET = 64  # the tree budget it assumes (per-node Gated DeltaNet state)
HEADROOM = 0.9  # the share of a device's memory the plan may fill (activations, allocator, CUDA context)


def _is_sharded(name: str) -> bool:
    """Decoder-layer weights are split (norms excepted); embeddings, final norm, lm_head are not."""
    return ".layers." in name and "norm" not in name


def split_plan(target: str, gguf_file: str | None, draft: str | None, device: str | None, dtype: str | None,
               world: int) -> dict[str, Any]:
    """How the target would split over ``world`` devices and the memory each would hold,
    computed from the configs (the models are built on the meta device: nothing is loaded).
    Refuses in one line (UsageError) a split that does not divide or does not fit."""
    import torch
    from transformers import AutoModelForCausalLM

    from ddtree_diag.engine import arch as arch_
    from ddtree_diag.engine.gdn import per_node_state_bytes
    from ddtree_diag.engine.load import _target_location, resolve_device, resolve_dtype, target_config

    config = target_config(*_target_location(target, gguf_file))
    arch_.check_supported(config)
    plan = plan_shards(config, world)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    size = torch.empty(0, dtype=torch_dtype).element_size()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    sharded = replicated = 0
    for name, param in model.named_parameters():
        if _is_sharded(name):
            sharded += param.numel() * size
        else:
            replicated += param.numel() * size
    draft_bytes = draft_kv = 0
    if draft is not None:
        draft_bytes, draft_kv = _draft_bytes(draft, size)
    cfg = arch_.text_config(config)
    layer_types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)
    attention_layers = sum(1 for kind in layer_types if kind != "linear_attention")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * attention_layers * plan.kv_heads * head_dim * size
    tree_state = per_node_state_bytes(config, PLAN_BUDGET, torch_dtype) // world if arch_.is_hybrid(config) else 0
    per_device = sharded // world + replicated + draft_bytes + (kv_per_token + draft_kv) * PLAN_TOKENS + tree_state
    data: dict[str, Any] = {
        "devices": world,
        "device_type": torch_device.type,
        "backend": "nccl" if torch_device.type == "cuda" else "gloo",
        "dtype": str(torch_dtype).removeprefix("torch."),
        "plan": plan.as_dict(),
        "target_weights_bytes": sharded + replicated,
        "sharded_weights_bytes_per_device": sharded // world,
        "replicated_weights_bytes": replicated,  # embeddings, final norm, lm_head, layer norms
        "draft_weights_bytes": draft_bytes,  # replicated on every device
        "kv_cache_bytes_per_token_per_device": kv_per_token,
        "draft_kv_cache_bytes_per_token": draft_kv,
        "tree_state_bytes_per_device": tree_state,
        "assumed_tokens": PLAN_TOKENS,
        "assumed_tree_budget": PLAN_BUDGET,
        "estimated_bytes_per_device": per_device,
    }
    capacity = _device_capacity(torch_device, world)
    data["device_memory_bytes"] = capacity
    if capacity is not None and per_device > HEADROOM * capacity:
        where = "per GPU" if torch_device.type == "cuda" else f"each (the available RAM shared by {world} processes)"
        have = capacity / 2**30
        raise UsageError(
            f"the split does not fit: {world} devices need an estimated {per_device / 2**30:.1f} GiB each "
            f"({PLAN_TOKENS} tokens of KV, {HEADROOM:.0%} of memory usable), {have:.1f} GiB {where}: use more devices"
        )
    return data


def _draft_bytes(draft: str, size: int) -> tuple[int, int]:
    """(weights, KV cache bytes per token) of a draft, from its config.json."""
    import json
    from pathlib import Path

    import torch

    from ddtree_diag.engine.draft import DFlashDraft, DraftConfig

    path = Path(draft).expanduser() / "config.json"
    try:
        config = DraftConfig.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:
        raise UsageError(f"draft config.json unreadable: {path}") from exc
    with torch.device("meta"):
        model = DFlashDraft(config)
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * config.dim_per_head * size
    return sum(p.numel() for p in model.parameters()) * size, kv


def _device_capacity(device: Any, world: int) -> int | None:
    """Memory per device: the smallest of the first ``world`` GPUs (refused in one line when there
    are fewer), or on the CPU the available RAM divided among the ``world`` processes."""
    import torch

    if device.type == "cuda":
        count = torch.cuda.device_count()
        if count < world:
            raise UsageError(f"--devices {world} needs {world} GPUs, this machine has {count}")
        return min(torch.cuda.get_device_properties(i).total_memory for i in range(world))
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) // world
    except (ValueError, OSError, AttributeError):
        return None


# ----------------------------------------------------------------------------------------------
# One process drives: rank 0 is the caller (serve, probe --engine), ranks 1..N-1 follow


def _follower(rank: int, world: int, device_type: str, init_method: str, load_args: tuple, conn: Any) -> None:
    """Ranks 1..N-1 of a ``ParallelEngine``: load the shard, then decode every request rank 0
    sends down ``conn`` (None: stop), following rank 0's stop decision after every round. The pipe,
    not a collective, carries the requests: when rank 0's process ends, this one ends too (EOF)."""
    import torch
    import torch.distributed as dist

    if device_type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    init_group(rank, world, device_type, init_method)
    try:
        engine = load_sharded(rank, world, device_type, *load_args)
    except Exception as exc:
        conn.send(("error", f"rank {rank}: {type(exc).__name__}: {exc}".splitlines()[0]))
        os._exit(1)
    engine.check_tree_fits = lambda budget: None  # rank 0 decides for every rank
    conn.send(("ready", None))
    decision = torch.zeros(1, dtype=torch.int64, device=engine.device)

    def follow(_ids: list[int], _text: str) -> bool:
        dist.broadcast(decision, src=0)
        return int(decision.item()) == 0

    while True:
        try:
            request = conn.recv()
        except EOFError:
            break
        if request is None:
            break
        try:
            engine.generate_ids(**request, on_token=follow)
        except Exception:  # rank 0 raises the same error (same inputs) and reports it
            continue
    dist.destroy_process_group()


class ParallelEngine:
    """Rank 0 of a target split over ``world`` devices, in the calling process: an ``Engine``
    (everything but ``generate_ids`` is the local rank-0 engine's) whose every request is also
    decoded by the followers. Close with ``close()`` (also at exit: the followers are daemons)."""

    def __init__(self, world: int, device_type: str, target: str, draft: str | None = None,
                 gguf_file: str | None = None, dtype: str | None = None, model_name: str | None = None) -> None:
        import torch
        import torch.multiprocessing as mp

        if device_type == "cuda" and torch.cuda.device_count() < world:
            raise UsageError(f"--devices {world} needs {world} GPUs, this machine has {torch.cuda.device_count()}")
        plan_args = (target, draft, gguf_file, dtype, model_name)
        self._folder = tempfile.TemporaryDirectory(prefix="ddtree-tp-")  # the ranks' store, until close()
        init_method = rendezvous(self._folder.name)
        ctx = mp.get_context("spawn")
        self._pipes = []
        self._processes = []
        for rank in range(1, world):
            parent, child = ctx.Pipe()
            process = ctx.Process(target=_follower, args=(rank, world, device_type, init_method, plan_args, child),
                                  daemon=True)
            process.start()
            child.close()
            self._pipes.append(parent)
            self._processes.append(process)
        init_group(0, world, device_type, init_method)
        self.engine = load_sharded(0, world, device_type, target, draft, gguf_file, dtype, model_name)
        for pipe in self._pipes:
            status, message = pipe.recv()
            if status != "ready":
                self.close()
                raise RuntimeError(message)
        self.world = world
        self._local_generate = self.engine.generate_ids
        # The one check that may differ between ranks (free memory) runs here, before any rank starts.
        self._check_tree_fits = self.engine.check_tree_fits
        self.engine.check_tree_fits = lambda budget: None
        self.engine.generate_ids = self.generate_ids  # Engine.generate goes through the followers too

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine.generate(*args, **kwargs)

    def generate_ids(self, prompt_ids: list[int], on_token: Any = None, deadline: float | None = None,
                     seed: int | None = None, **kwargs: Any) -> Any:
        """``Engine.generate_ids`` on every rank. Rank 0 alone streams, cancels and watches the
        deadline; after every round it broadcasts whether to stop, so all ranks end together."""
        import pickle
        import random
        import time

        import torch
        import torch.distributed as dist

        if seed is None and kwargs.get("temperature", 0.0) > 0:
            seed = random.randrange(2**63)  # one seed for every rank: the same samples
        request = dict(prompt_ids=list(prompt_ids), seed=seed, **kwargs)
        if self.engine.target.hybrid:
            from ddtree_diag.budget import resolve as resolve_budget

            tree_budget = kwargs.get("tree_budget")
            budget = resolve_budget(None if tree_budget is None else int(tree_budget), self.engine.default_tree_budget)
            if budget > 0 and self.engine._resolve_mode(kwargs.get("mode", "auto"), budget) != "ar":
                self._check_tree_fits(budget)
        try:
            pickle.dumps(request)
        except Exception as exc:
            raise UsageError(f"this request cannot be sent to the other devices ({type(exc).__name__}): "
                             "structured output is not supported with --devices > 1 yet") from None
        for pipe in self._pipes:
            pipe.send(request)
        timed_out = False
        decision = torch.zeros(1, dtype=torch.int64, device=self.engine.device)

        def lead(ids: list[int], text: str) -> bool:
            nonlocal timed_out
            try:
                stop = on_token is not None and on_token(ids, text) is False
            except BaseException:  # the caller's callback failed: stop every rank, then let it raise
                decision.fill_(1)
                dist.broadcast(decision, src=0)
                raise
            if not stop and deadline is not None and time.perf_counter() >= deadline:
                stop = timed_out = True
            decision.fill_(1 if stop else 0)
            dist.broadcast(decision, src=0)
            return not stop

        generation = self._local_generate(**request, on_token=lead)
        if timed_out and generation.finish_reason == "cancelled":
            generation.finish_reason = "timeout"
        return generation

    def close(self) -> None:
        import torch.distributed as dist

        for pipe in self._pipes:
            with contextlib.suppress(OSError):
                pipe.send(None)
        for process in self._processes:
            process.join(timeout=30)
            if process.is_alive():
                process.terminate()
        self._pipes, self._processes = [], []
        if dist.is_initialized():
            dist.destroy_process_group()
        self._folder.cleanup()
