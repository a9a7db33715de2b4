"""docs/checkpoints.md is generated from the records the tool uses, and those records name real
demo members whose configs declare what the page says."""

import importlib.util
from pathlib import Path

from mla_convert.demo.specs import FAMILY
from mla_convert.source import members

MEMBERS, SUPPORTED = members.demo_members(), members.supported()

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("checkpoints_doc", ROOT / "scripts" / "checkpoints_doc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_page_is_what_the_records_say():
    assert (ROOT / "docs" / "checkpoints.md").read_text() == _script().render()


def test_every_member_has_a_row_and_every_row_names_members():
    named = [d for c in SUPPORTED for d in c.demos]
    assert sorted(named) == sorted(MEMBERS), "each demo member in exactly one row"


def test_each_rows_demo_declares_what_the_row_says():
    from mla_convert.demo.layouts import config_file

    for row in SUPPORTED:
        for member in row.demos:
            name, config = config_file(FAMILY[member])
            if name == "params.json":  # Mistral's layout: no architectures, vLLM picks the class
                assert row.declares.startswith("Mistral's own layout"), member
                continue
            assert name == "config.json", member
            assert row.declares.startswith(f"`{config['architectures'][0]}`"), (member, row.declares)
            if "(`" in row.declares and ", any)" not in row.declares:  # the row names one model_type
                assert f"(`{config['model_type']}`" in row.declares, (member, row.declares)
