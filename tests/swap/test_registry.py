"""The converter registry: lookup by class along the MRO, `replace=False`, and `when` limiting a converter to the
instances it accepts."""

from __future__ import annotations

from torch import nn

from etblocks.swap.registry import Registry


class Parent(nn.Module):
    pass


class Child(Parent):
    def __init__(self, readable: bool = True) -> None:
        super().__init__()
        self.readable = readable


def parent_converter(module, ctx):
    return nn.Identity()


def child_converter(module, ctx):
    return nn.Identity()


def test_lookup_walks_the_mro_and_keeps_a_users_converter():
    registry = Registry()
    registry.register(Parent)(parent_converter)
    assert registry.lookup(Child()) is parent_converter
    registry.register(f"{__name__}.Child")(child_converter)  # by qualified name, as etblocks' families register
    assert registry.lookup(Child()) is child_converter
    registry.register(f"{__name__}.Child", replace=False)(parent_converter)
    assert registry.lookup(Child()) is child_converter


def test_when_passes_over_the_instances_a_converter_does_not_take():
    registry = Registry()
    registry.register(Child, when=lambda module: module.readable)(child_converter)
    assert registry.lookup(Child(readable=True)) is child_converter
    assert registry.lookup(Child(readable=False)) is None
    registry.register(Parent)(parent_converter)
    assert registry.lookup(Child(readable=False)) is parent_converter  # the next class of the MRO
    registry.register(Child)(child_converter)  # registered again without `when`: it takes every instance
    assert registry.lookup(Child(readable=False)) is child_converter


def test_same_output_is_the_flag_of_the_registration_lookup_picks():
    registry = Registry()
    registry.register(Parent, same_output=False)(parent_converter)
    registry.register(Child, when=lambda module: module.readable)(child_converter)
    assert registry.same_output(Child(readable=True))  # the child's own registration applies
    assert not registry.same_output(Child(readable=False))  # passed over: the parent's applies
