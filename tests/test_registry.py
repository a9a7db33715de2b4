"""mla_convert.registry, the one shape of the registries (formats, transforms, value checks,
comparisons): a name taken is refused, a built-in item is never removed, a scope removes what it
added (also where one of its items is refused), and an order is kept in the dict readers hold."""

import pytest

from mla_convert import formats
from mla_convert.kernels import transforms
from mla_convert.registry import Registry
from mla_convert.verification import comparisons, values


def test_a_name_taken_is_refused_and_a_built_in_item_is_never_removed():
    items = {"a": "A"}
    r = Registry("thing", items, name_of=str.lower)
    with pytest.raises(ValueError, match="a thing named 'a' is registered already"):
        r.add("A")
    r.remove("a")
    r.add("B")
    assert items == {"a": "A", "b": "B"}
    r.remove("b")
    assert items == {"a": "A"}


def test_an_order_is_kept_in_the_dict_readers_hold():
    items: dict[str, str] = {}
    r = Registry("thing", items, name_of=lambda s: s, order=len)
    for s in ("ccc", "a", "bb"):
        r.add(s)
    assert list(items) == ["a", "bb", "ccc"] and r.items is items


def test_a_scope_removes_what_it_added_even_where_one_is_refused():
    items = {"a": "a"}
    r = Registry("thing", items, name_of=lambda s: s)
    with pytest.raises(ValueError, match="'a'"), r.scoped(["x", "y", "a"]):
        pass
    assert items == {"a": "a"}
    with r.scoped(["x"]):
        assert "x" in items
    assert items == {"a": "a"}


@pytest.mark.parametrize(
    "register, unregister, table, name",
    [
        (values.register, values.unregister, values.CHECKS.checks, "nan-inf"),
        (comparisons.register, comparisons.unregister, comparisons.COMPARISONS.by_name, "channel_fp8"),
        (formats.register, formats.unregister, None, "bf16"),
    ],
    ids=["value checks", "comparisons", "formats"],
)
def test_each_registry_refuses_a_built_in_name_and_keeps_its_built_ins(register, unregister, table, name):
    built_in = table[name] if table is not None else formats.get(name)
    with pytest.raises(ValueError, match=f"named {name!r} is registered already"):
        register(built_in)
    unregister(name)
    assert (table[name] if table is not None else formats.find(name)) is built_in


def test_a_built_in_transform_is_never_unregistered():
    op, t = next(iter(transforms.PLAN_TRANSFORMS.items()))
    transforms.unregister(op)
    assert transforms.PLAN_TRANSFORMS[op] is t
