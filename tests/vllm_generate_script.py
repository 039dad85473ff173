"""Run by tests/test_vllm_engine.py in a fresh process (vLLM needs a __main__ guard)."""

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=128, enforce_eager=True, seed=0)
    outs = llm.generate(["rev abc=", "12+7="], SamplingParams(max_tokens=6, temperature=0.0, logprobs=0))
    print("RESULT " + json.dumps([{"ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text,
                                   "lp": [next(iter(d.values())).logprob for d in o.outputs[0].logprobs]}
                                  for o in outs]))
