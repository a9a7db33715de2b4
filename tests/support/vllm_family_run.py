"""Run one vLLM CPU engine on a family member's converted model; record tokens AND logprobs.

    python tests/support/vllm_family_run.py MODEL_DIR OUT_DIR

Like vllm_engine_run.py (same engine settings, prompts and collected weights), plus the top
LOGPROBS log-probabilities of every generated token, so that tests/test_vllm_family.py can require
an engine with the plugin to give exactly what one without it gives. Writes OUT_DIR/result.json
({"tokens", "logprobs", "plugin"}) and OUT_DIR/mla.safetensors. Environment: MLA_TEST_DTYPE.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from vllm_engine_run import MAX_TOKENS, PROMPTS, collect

LOGPROBS = 5


def main(model_dir: str, out_dir: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # apply_model in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model_dir, dtype=os.environ.get("MLA_TEST_DTYPE", "bfloat16"), enforce_eager=True,
        max_model_len=128, max_num_seqs=4, seed=0, trust_remote_code=False,
        # As vllm_engine_run.py: the reference CPU MLA backend (it keeps W_UK_T / W_UV on the layer)
        # and the native rotary embedding.
        attention_config={"backend": "CPU_MLA"},
        compilation_config={"custom_ops": ["all", "-rotary_embedding"]},
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=LOGPROBS)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    # per prompt, per generated token: {token id: logprob} of the top LOGPROBS (and the chosen one)
    logprobs = [[{str(tok): lp.logprob for tok, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs]
    per_rank = llm.apply_model(collect)
    tensors = {f"rank{r}.{k}" if r else k: v for r, got in enumerate(per_rank) for k, v in got.items()}
    save_file(tensors, str(Path(out_dir) / "mla.safetensors"))
    from mla_runtime import plugin

    result = {"tokens": tokens, "logprobs": logprobs, "plugin": plugin.summary()}
    (Path(out_dir) / "result.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
