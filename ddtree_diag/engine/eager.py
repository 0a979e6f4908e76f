"""The readable reference loop: prefill, draft, tree, verify, accept/commit — AR, chain and tree.

Round r (``start`` = tokens in the target cache, the root = last committed token at ``start``):
1. draft: noise block [root, mask × (block_size-1)] at positions start.., with the context
   features of the tokens committed since the last round → per-depth log-probs (depths 1..D).
2. tree: best-first tree under ``tree_budget`` (chain mode: the draft's argmax path; AR: no nodes).
3. verify: one target forward over root + nodes, ancestor-only mask, positions start + depth.
4. commit: walk from the root while the target's choice (argmax, or a seeded sample at T > 0) is a
   child; commit the path plus the target's next token (the bonus); keep only the root's and the
   accepted nodes' K/V (compacted in order) and their hidden states as the next draft context.

With a grammar (``request.constraint``): after step 2 the tree's nodes get their path's mask and
the nodes the grammar forbids are pruned; after step 3 the masks are applied to the verify logits
before the target chooses; in step 4 the matcher takes the committed tokens (``grammar``).
"""

from __future__ import annotations

import time

import torch

from ddtree_diag.engine.decode import (
    STAGES,
    DecodeContext,
    DecodeRequest,
    Generation,
    GenerationRecorder,
    choose_tokens,
    make_generator,
)
from ddtree_diag.engine.grammar import GrammarState
from ddtree_diag.engine.tree import DraftTree, accept_walk, ancestor_mask, build_tree, chain_tree, prune_tree


class EagerDecoder:
    """Decodes with the context's target and draft modules as they are, one plain op at a time."""

    def __init__(self, context: DecodeContext) -> None:
        self.context = context
        self.target = context.target
        self.draft = context.draft
        self.device = context.device
        self.draft_cache = None

    def _draft_logprobs(
        self, root: int, start: int, context: torch.Tensor, context_positions: torch.Tensor, depth: int
    ) -> torch.Tensor:
        """Per-depth draft log-probs [depth, V] for positions start+1 .. start+depth."""
        draft = self.draft
        block = draft.config.block_size
        noise_ids = torch.full((1, block), draft.config.mask_token_id, device=self.device)
        noise_ids[0, 0] = root
        positions = torch.arange(start, start + block, device=self.device)
        hidden = draft(
            self.target.embed(noise_ids), context[None], positions, context_positions, kv_cache=self.draft_cache
        )
        logits = self.target.lm_head(hidden[0, 1 : 1 + depth])
        return torch.log_softmax(logits.float(), dim=-1)

    @torch.no_grad()
    def decode(self, request: DecodeRequest) -> Generation:
        target, mode = self.target, request.mode
        block = self.draft.config.block_size if self.draft is not None else 1
        feature_layers = list(self.draft.config.target_layer_ids) if mode != "ar" else None
        generator = make_generator(request.temperature, request.seed)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        prompt_len = len(request.prompt_ids)
        capacity = prompt_len + request.max_tokens + max(request.tree_budget, block) + 2
        target.reset(capacity)
        if mode != "ar":
            if self.draft_cache is None or self.draft_cache.max_len < capacity:
                self.draft_cache = self.draft.new_cache(capacity)
            self.draft_cache.reset()

        record = GenerationRecorder(request, self.context.decode_text, incremental=not self.context.harmony)
        grammar = None
        if request.constraint is not None:
            grammar = GrammarState(request.constraint, request.stop_ids, target.config.vocab_size)
        prompt = torch.tensor(request.prompt_ids, device=self.device)
        positions = torch.arange(prompt_len, device=self.device)
        logits, features = target.prefill(prompt, feature_layers)
        last_logits = logits[-1:].float()
        complete = False
        if grammar is not None:
            grammar.tree([0], [-1])  # the mask at the start of the output
            grammar.apply(last_logits)
        first = choose_tokens(last_logits, request.temperature, generator)[0]
        if grammar is not None:
            complete = grammar.advance([first])[1]
        sync()
        record.first_token(first, last_logits[0], complete)
        context, context_positions = features, positions

        while not record.done:
            start = target.length
            root = record.output[-1]
            depth = min(block - 1, record.remaining - 1)  # deeper nodes could never be committed
            t0 = time.perf_counter()
            tree: DraftTree
            if mode == "ar" or depth <= 0:
                tree = chain_tree(root, [])
                t1 = t0
            else:
                depth_logprobs = self._draft_logprobs(root, start, context, context_positions, depth)
                sync()
                t1 = time.perf_counter()
                if mode == "chain":
                    tree = chain_tree(root, depth_logprobs.argmax(dim=-1).tolist())
                else:
                    tree = build_tree(root, depth_logprobs, request.tree_budget)
            rows = None  # with pruning: the verified nodes' rows among the grammar's masks
            if grammar is not None:
                allowed = grammar.tree(tree.tokens, tree.parents)
                if not all(allowed):
                    tree, rows = prune_tree(tree, allowed)
            tokens = torch.tensor(tree.tokens, device=self.device)
            node_positions = torch.tensor(tree.depths, device=self.device) + start
            mask = ancestor_mask(tree.parents, self.device)
            t2 = time.perf_counter()
            logits, features = target.forward(tokens, node_positions, mask, feature_layers, parents=tree.parents)
            if grammar is not None:
                grammar.apply(logits, rows)
            choice = choose_tokens(logits, request.temperature, generator)
            sync()
            t3 = time.perf_counter()
            path, bonus = accept_walk(tree, choice)
            keep = [0, *path]
            target.commit(keep)
            if feature_layers is not None:
                keep_index = torch.tensor(keep, device=self.device)
                context, context_positions = features[keep_index], node_positions[keep_index]
            new_tokens = [tree.tokens[n] for n in path] + [bonus]
            complete = False
            if grammar is not None:
                count, complete = grammar.advance(new_tokens)
                new_tokens = new_tokens[:count]
            record.round(new_tokens, tree.size, logits[keep], complete)
            t4 = time.perf_counter()
            for stage, seconds in zip(STAGES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                record.add_stage_time(stage, seconds)
        return record.result(extras=grammar.extras() if grammar is not None else None)
