"""process.resources: the one owner of a run's slots, closed in reverse order, and the scope that
convert() and verify() open."""

from mla_convert.process import resources


def test_slots_are_made_once_and_closed_last_made_first():
    owner = resources.RunResources()
    closed, made = [], []
    for key in ("a", "b", "c"):
        owner.slot(key, lambda key=key: made.append(key) or key.upper(), closed.append)
    assert owner.slot("a", lambda: "again") == "A" and made == ["a", "b", "c"]
    owner.close()
    assert closed == ["C", "B", "A"] and owner.get("a") is None


def test_a_run_scope_owns_its_slots_and_a_nested_one_shares_them():
    closed = []
    outside = resources.current()
    with resources.run_scope() as run:
        assert resources.current() is run and run is not outside
        run.slot("pool", lambda: "p", closed.append)
        with resources.run_scope() as inner:
            assert inner is run
        assert closed == []
    assert closed == ["p"] and resources.current() is outside


def test_put_replaces_and_closes_the_old_value_and_reset_empties_the_default():
    closed = []
    owner = resources.current()
    owner.put("x", 1, closed.append)
    owner.put("x", 2, closed.append)
    assert closed == [1] and owner.get("x") == 2
    resources.reset()
    assert closed == [1, 2] and owner.get("x") is None


def _owner_seen_by(runs: list):
    """A progress factory that records the owner current while the run counts its bytes."""

    def factory(total: int):
        runs.append(resources.current())
        return lambda n: None

    return factory


def test_a_conversion_owns_its_staging_buffers_and_lets_them_go_when_it_returns(tiny_src, tmp_path):
    import mla_convert
    from mla_convert.io import disk_write

    resources.reset()
    outside, runs, pools = resources.current(), [], []
    for fmt in ("channel-fp8", "bf16"):
        mla_convert.convert(tiny_src, tmp_path / fmt, format=fmt, progress_factory=_owner_seen_by(runs))
        assert runs[-1] is not outside
        pools.append(runs[-1].get("io.disk_write.stages"))
        assert pools[-1] is None, "the run's staging buffers outlived it"
    assert runs[0] is not runs[1] and resources.current() is outside
    assert outside.get("io.disk_write.stages") is None, "a conversion's staging buffers went to the process"
    # Outside a run, the process default owns the pool, and reset() lets it go.
    pool = disk_write.stage_pool()
    assert outside.get("io.disk_write.stages") is pool
    resources.reset()
    assert outside.get("io.disk_write.stages") is None


def test_verify_runs_in_a_scope_of_its_own_and_closes_it(converted, tiny_src):
    import mla_convert

    outside, runs, closed = resources.current(), [], []

    def factory(total: int):
        runs.append(resources.current())
        resources.current().slot("test.marker", lambda: "made", closed.append)
        return lambda n: None

    report = mla_convert.verify(converted["bf16"], source=tiny_src, progress_factory=factory)
    assert report.ok and runs and all(r is runs[0] for r in runs)
    assert runs[0] is not outside and closed == ["made"] and resources.current() is outside


OWNED_HERE = [
    "mla_convert/api.py", "mla_convert/results.py", "mla_convert/settings.py", "mla_convert/envs.py",
    "mla_convert/cli", "mla_convert/process", "mla_convert/io",
    "mla_convert/conversion/pipeline.py", "mla_convert/conversion/schedulers.py",
    "mla_convert/verification/api.py", "mla_convert/verification/report.py",
    "mla_convert/verification/runners.py", "mla_convert/verification/tasks.py",
]  # fmt: skip


def test_no_global_statement_in_the_run_and_process_modules():
    """Their state belongs to a run's owner or to an object: nothing rebinds a module variable."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    files = [
        p for entry in OWNED_HERE for p in ((root / entry).rglob("*.py") if (root / entry).is_dir() else [root / entry])
    ]
    assert len(files) > 30
    found = [
        f"{p.relative_to(root)}:{node.lineno}"
        for p in files
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Global)
    ]
    assert found == []


def test_verifys_read_buffers_are_the_runs_and_let_go_with_it(converted):
    """The per-thread read buffers and the native checks' scratch (io.buffers.scratch) are a slot of
    the verify's owner, not module-level thread-locals that outlive it; its buffers are let go."""
    import mla_convert
    from mla_convert.io import buffers

    owners, seen = [], []

    def factory(total: int):
        owners.append(resources.current())
        return lambda n: seen.append(owners[0].get(buffers._SCRATCH))

    report = mla_convert.verify(converted["channel-fp8"], progress_factory=factory)
    slot = seen[-1]
    assert report.ok and slot is not None and slot._made, "the native checks ran in the run's buffers"
    assert all(buf.capacity == 0 for buf in slot._made), "let go when verify returned"
    assert owners[0].get(buffers._SCRATCH) is None and resources.current().get(buffers._SCRATCH) is None


def test_a_conversions_native_buffers_are_the_runs_and_let_go_with_it(tiny_src, tmp_path):
    import mla_convert
    from mla_convert.io import buffers

    owners, seen = [], []

    def factory(total: int):
        owners.append(resources.current())
        return lambda n: seen.append(owners[0].get(buffers._SCRATCH))

    mla_convert.convert(tiny_src, tmp_path / "out", kernels="native", progress_factory=factory)
    slot = seen[-1]
    assert slot is not None and {"chunk", "whole", "channel_scale"} <= set(vars(slot.mine()))
    assert all(buf.capacity == 0 for buf in slot._made), "let go when convert returned"
    assert owners[0].get(buffers._SCRATCH) is None and resources.current().get(buffers._SCRATCH) is None
