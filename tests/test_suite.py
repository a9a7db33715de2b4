"""The test suite cleans up what it writes under the temporary directory (issue 26: a run left
about 1 GB under /tmp/pytest-of-USER)."""

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
