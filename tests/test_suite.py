"""The test suite cleans up what it writes under the temporary directory (before, a run left about
1 GB under /tmp/pytest-of-USER, then torch's compile cache and an empty pytest-of-USER)."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path


def test_temporary_files_of_the_code_and_its_children_land_in_the_sessions_base(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    assert base in Path(tempfile.gettempdir()).parents
    child = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.mkdtemp())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    assert base in Path(child.stdout.strip()).parents


def test_a_passing_session_removes_its_base_directory(pytestconfig):
    assert pytestconfig.getini("tmp_path_retention_policy") == "failed"
    assert int(pytestconfig.getini("tmp_path_retention_count")) <= 1


# ---- a whole session, in a child pytest, leaves the temporary directory as it found it ----

ROOT = Path(__file__).resolve().parent.parent
INNER_TEST = """
import os
import os
import subprocess
import sys


def test_uses_tmp_path_and_the_compile_cache(tmp_path):
    (tmp_path / "written").write_text("x")
    code = "from torch._inductor.runtime.cache_dir_utils import cache_dir; print(cache_dir())"
    cache = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert os.path.isdir(cache)
"""


def run_session(tmp: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """A pytest session with this suite's conftest, its temporary directory `tmp`, one passing test."""
    test = tmp / "inner" / "test_inner.py"
    test.parent.mkdir(exist_ok=True)
    test.write_text(INNER_TEST)
    child_env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "PYTEST_ADDOPTS")}
    child_env |= {"TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", "-c",
         str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT), str(test)],
        capture_output=True, text=True, env=child_env, timeout=300,
    )  # fmt: skip


def test_a_passing_session_leaves_no_compile_cache_and_no_empty_pytest_of_dir(tmp_path):
    """Before: TMPDIR/torchinductor_USER (torch's compile cache) and an empty TMPDIR/pytest-of-USER remained."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = run_session(tmp)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in tmp.iterdir()) == ["inner"]


def test_what_existed_before_the_session_stays(tmp_path):
    """An earlier pytest-of-USER (another session's, however empty) and a compile cache the user chose."""
    import getpass

    tmp = tmp_path / "tmp"
    (tmp / f"pytest-of-{getpass.getuser()}").mkdir(parents=True)
    mine = tmp / "my-inductor-cache"
    r = run_session(tmp, env={"TORCHINDUCTOR_CACHE_DIR": str(mine)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in tmp.iterdir()) == ["inner", "my-inductor-cache", f"pytest-of-{getpass.getuser()}"]
    assert mine.is_dir()
