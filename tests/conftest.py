import json
import shutil
from pathlib import Path

import pytest

from mla_convert.convert import convert
from mla_convert.plan import Options
from mla_convert.synthetic import CheckpointSpec, write_checkpoint


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


def load_json(path) -> dict:
    return json.loads(Path(path).read_text())


@pytest.fixture(autouse=True, scope="session")
def _eager_kernels_by_default():
    """Compiling costs ~15 s a process; tests run eager unless they ask for compile explicitly
    (tests/test_kernels.py proves the two bit-identical)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MLA_CONVERT_KERNELS", "eager")
    yield
    mp.undo()
