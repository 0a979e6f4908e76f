"""Backend that runs probe cases in-process on the DDTree engine (no server in between).

Imports torch/transformers only when the engine is loaded (``prepare`` or the first ``run``).
``--timeout S`` bounds each case's generation (prefill and decode, not the model load): the
deadline is checked between decode rounds, so a case past it stops after the round in flight and
is ``timeout``, with the text so far kept.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ddtree_diag.backends import TRANSPORT_IN_PROCESS, HttpTarget, Target
from ddtree_diag.backends.dialects.base import tool_calls_of
from ddtree_diag.errors import DiagError, UsageError
from ddtree_diag.records import STATUS_ENGINE_ERROR, STATUS_TIMEOUT, ProbeCase, ProbeResult, SpecMetrics, Timings


def split_reasoning(text: str, *, prefilled: bool = False) -> tuple[str, str | None]:
    """(answer, reasoning) as the reference server reads a thinking answer (``server.parsing``):
    reasoning up to ``</think>`` when the prompt opened the block or the text opens one."""
    from ddtree_diag.server.parsing import ReasoningSplitter

    splitter = ReasoningSplitter(prefilled)
    pieces = [splitter.feed(text), splitter.finish()]
    reasoning = "".join(r for r, _ in pieces).strip("\n")
    return "".join(c for _, c in pieces), reasoning or None


class EngineBackend:
    name = "engine"

    def __init__(
        self,
        target: str | Path,
        draft: str | Path | None = None,
        gguf_file: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        model_name: str | None = None,
        timeout: float | None = None,
        devices: int = 1,
    ) -> None:
        if timeout is not None and not 0 < timeout < float("inf"):  # NaN fails this too
            raise UsageError("--timeout must be a number of seconds > 0")
        if devices < 1:
            raise UsageError(f"--devices must be >= 1, got {devices}")
        self.devices = devices  # > 1: tensor parallel (engine.parallel), this process rank 0
        self.timeout = timeout  # seconds of generation per case (None: no limit)
        self.target = target
        self.model = model_name  # the id results and the report show (None: the engine's own)
        self.draft = draft
        self.gguf_file = gguf_file
        self.device = device
        self.dtype = dtype
        self.engine: Any = None
        self.load_seconds: float | None = None
        # The load sweep's ITL: each round's end (seconds from the case's start) and the tokens it
        # committed, in extras["stream_chunks"]; off for the main run
        self.keep_chunk_times = False

    # -- capabilities (see backends.Backend) ----------------------------------------------------

    dialect_name = "engine"
    sends_budget = True  # the case's budget goes straight to the decoder (0: autoregressive)
    budget_knob = "tree_budget per case"
    transport_kind = TRANSPORT_IN_PROCESS
    openai_logprobs = False  # its top-k log-probs are extras, not the OpenAI shape

    def baseline_target(self, mode: str, url: str | None, *, http: HttpTarget, weights: Any) -> Target | None:
        """budget0 and engine: this engine at budget 0 (None); url: that server."""
        if mode in ("budget0", "engine"):
            return None
        return http.baseline(url)

    def shared_transport(self) -> None:
        return None

    def count_tokens(self, messages: list[dict[str, Any]], thinking: bool | None) -> int | None:
        return len(self.load().render_prompt(messages, thinking))

    def context_limit(self) -> int | None:
        return int(self.load().context_length)

    def load(self) -> Any:
        """Load the engine once; configuration problems raise UsageError (exit code 2)."""
        if self.engine is None:
            from ddtree_diag.engine import load_engine

            started = time.perf_counter()
            if self.devices > 1:
                from ddtree_diag.engine.models import ModelChoice, load_chosen

                choice = ModelChoice(str(self.target), None if self.draft is None else str(self.draft),
                                     self.gguf_file, self.model or str(self.target), False)
                self.engine = load_chosen(choice, device=self.device, dtype=self.dtype, devices=self.devices)
            else:
                self.engine = load_engine(
                    self.target, draft=self.draft, gguf_file=self.gguf_file, device=self.device, dtype=self.dtype,
                    model_name=self.model,
                )
            self.load_seconds = time.perf_counter() - started
        return self.engine

    def prepare(self, cases: list[ProbeCase]) -> list[str]:
        engine = self.load()
        info = engine.info()
        loaded = f"loaded in {self.load_seconds:.1f}s"
        split = f" × {self.devices} (tensor parallel)" if self.devices > 1 else ""
        notes = [f"engine: {info['model']} on {info['device']}{split} ({info['dtype']}), {loaded}"]
        if engine.draft is None:
            notes.append("engine: no draft loaded, every case decodes autoregressively (tree_budget 0)")
        return notes

    def run(self, case: ProbeCase) -> ProbeResult:
        engine = self.load()
        extra = case.extra or {}
        started = time.perf_counter()
        deadline = None if self.timeout is None else started + self.timeout
        chunks: list[list[Any]] = []
        streaming: dict[str, Any] = {}
        if self.keep_chunk_times:
            def arrived(ids: list[int], _text: str) -> None:
                chunks.append([round(time.perf_counter() - started, 6), len(ids)])

            streaming["on_token"] = arrived
        try:
            workload = self._workload(case)  # a grammar for JSON / tool calls, a prompt with tools
            gen = engine.generate(
                messages=case.messages,
                prompt_ids=workload.get("prompt_ids"),
                enable_thinking=case.enable_thinking,
                tree_budget=case.tree_budget,
                temperature=case.temperature,
                max_tokens=case.max_tokens,
                seed=extra.get("seed"),
                stop=extra.get("stop"),
                top_logprobs=int(extra.get("top_logprobs", 0) or 0),
                mode=str(extra.get("mode", "auto")),  # "auto" | "ar" | "chain" | "tree"
                deadline=deadline,
                **streaming,
                **({"constraint": workload["constraint"]} if workload.get("constraint") is not None else {}),
            )
        except (DiagError, RuntimeError, ValueError, IndexError, TypeError) as exc:
            message = str(exc).strip().splitlines()
            line = message[0] if message else type(exc).__name__
            return ProbeResult(
                case=case, status=STATUS_ENGINE_ERROR, error=f"{type(exc).__name__}: {line}", dialect="engine"
            )
        from ddtree_diag.server.prompting import think_prefilled

        answer, reasoning = gen.text, None
        if case.enable_thinking is not False or engine.harmony:  # gpt-oss always reasons
            answer, reasoning = split_reasoning(gen.text, prefilled=think_prefilled(engine.tokenizer,
                                                                                   case.enable_thinking))
        tool_calls, finish = None, gen.finish_reason
        if workload.get("tool_mode", "none") != "none":
            # the reference server's reading of the same text: forced calls, or <tool_call> blocks
            parser = workload["parser"]
            message = parser.message(gen.text)
            answer = message.get("content") or ""
            reasoning = message.get("reasoning_content") or reasoning
            tool_calls = tool_calls_of(message)  # the same OpenAI shape a server's answer has
            finish = parser.finish_reason(gen.finish_reason)
        spec = SpecMetrics(
            decode_rounds=gen.decode_rounds,
            mean_acceptance_length=gen.mean_acceptance_length,
            acceptance_lengths=list(gen.acceptance_lengths),
            draft_tokens=sum(gen.tree_sizes),
            accepted_tokens=sum(n - 1 for n in gen.acceptance_lengths),
            server_tokens_per_second=None,
            tree_budget=gen.tree_budget,
            source="engine",
        )
        timings = Timings(
            e2e_s=gen.e2e_s,
            ttft_s=gen.ttft_s,
            decode_tokens_per_second=gen.decode_tokens_per_second,
            stages=dict(gen.stage_times),
        )
        extras: dict[str, Any] = {
            "tree_sizes": list(gen.tree_sizes),
            "mode": gen.mode,
            "token_ids": list(gen.token_ids),
            "raw_text": gen.text,
        }
        if chunks:
            extras["stream_chunks"] = chunks
        if gen.top_logprobs is not None:
            extras["top_logprobs"] = [[list(pair) for pair in row] for row in gen.top_logprobs]
        result = ProbeResult(
            case=case,
            dialect="engine",
            model=self.model or engine.info().get("model"),
            output=answer,
            reasoning=reasoning,
            tool_calls=tool_calls,
            finish_reason=finish,
            prompt_tokens=gen.prompt_tokens,
            completion_tokens=gen.completion_tokens,
            timings=timings,
            spec=spec,
            extras=extras,
        )
        if gen.finish_reason == "timeout":
            # as over HTTP: the answer did not finish, so it has no finish_reason; its text is kept
            result.status, result.finish_reason = STATUS_TIMEOUT, None
            result.error = (f"generation ran past {self.timeout:g} s (--timeout): stopped after "
                            f"{gen.completion_tokens} tokens, {gen.decode_rounds} decode rounds")
        return result

    def _workload(self, case: ProbeCase) -> dict[str, Any]:
        """What a structured case needs beyond the messages, as the reference server does it: the
        grammar (JSON, a schema, a forced tool call), the prompt rendered with the tools, and the
        parser that reads tool calls out of the text. {} for a plain case."""
        fmt = case.response_format if (case.response_format or {}).get("type") not in (None, "text") else None
        tools = case.tools if case.tools and case.tool_choice != "none" else None
        if fmt is None and tools is None:
            return {}
        from ddtree_diag.engine.grammar import compile_constraint
        from ddtree_diag.server import parsing, prompting

        engine = self.load()
        thinking = case.enable_thinking is True
        constraint = compile_constraint(engine.tokenizer, response_format=fmt, tools=tools,
                                        tool_choice=case.tool_choice if tools else None, thinking=thinking)
        tool_mode = parsing.tool_mode(tools is not None, case.tool_choice)
        named = (case.tool_choice.get("function") or {}).get("name") if isinstance(case.tool_choice, dict) else None
        splits = case.enable_thinking is not False or engine.harmony
        parser = parsing.AnswerParser(thinking=splits,
                              prefilled=prompting.think_prefilled(engine.tokenizer, case.enable_thinking),
                              tool_mode=tool_mode,
                              tool_names=[t["function"]["name"] for t in tools or ()], named=named)
        return {
            "constraint": constraint,
            "prompt_ids": prompting.render(engine.tokenizer, case.messages, thinking=case.enable_thinking, tools=tools)
            if tools else None,
            "tool_mode": tool_mode,
            "parser": parser,
        }

    def target_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "backend": "engine",
            "target": str(self.target),
            "draft": str(self.draft) if self.draft is not None else None,
            "gguf_file": self.gguf_file,
            "dialect": "engine",
        }
        if self.engine is not None:
            engine_info = self.engine.info()
            info.update(
                model=self.model or engine_info.get("model"),
                device=engine_info.get("device"),
                dtype=engine_info.get("dtype"),
                block_size=(engine_info.get("draft") or {}).get("block_size"),
                default_tree_budget=engine_info.get("default_tree_budget"),
                model_type=engine_info.get("model_type"),
            )
            if engine_info.get("experts"):
                info["experts"] = engine_info["experts"]
        return info

    def close(self) -> None:
        if self.engine is not None:
            on_cuda = self.engine.device.type == "cuda"
            self.engine = None
            if on_cuda:
                import torch

                torch.cuda.empty_cache()
