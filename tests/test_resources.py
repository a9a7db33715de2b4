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
