"""The one pytree namespace of the library and thin optree wrappers.

Policy (decided once): ``None`` is *not* a leaf (optree's default), so optional fields such as
``grads=None`` contribute no leaves. Records are registered in :data:`NAMESPACE`; flatten with
these wrappers (or pass ``namespace=NAMESPACE`` to optree) to see their tensors.
"""

from __future__ import annotations

from typing import Any, TypeVar

import optree
from optree.integrations import attrs as _optree_attrs

__all__ = [
    "NAMESPACE",
    "STATIC",
    "register",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
]

NAMESPACE = "functional_fsdp"


_T = TypeVar("_T", bound=type)

#: ``attrs.field(metadata=STATIC)`` marks a field as static pytree metadata (not a child).
STATIC: dict[str, Any] = {"pytree_node": False}


def register(cls: _T) -> _T:
    """Register an ``attrs`` class as a pytree node in :data:`NAMESPACE`.

    Use it on top of ``@attrs.frozen``: fields are children unless declared with
    ``attrs.field(metadata=STATIC)``. (Plain ``attrs`` decorators keep type checkers' attrs
    support; this is what ``optree.integrations.attrs.frozen`` does in one step.)
    """
    return _optree_attrs.register_node(cls, namespace=NAMESPACE)  # type: ignore[return-value]


def tree_flatten(tree: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    """Flatten ``tree`` (records included) into leaves and a spec."""
    return optree.tree_flatten(tree, namespace=NAMESPACE)


def tree_unflatten(spec: optree.PyTreeSpec, leaves: Any) -> Any:
    """Inverse of :func:`tree_flatten`."""
    return optree.tree_unflatten(spec, leaves)


def tree_leaves(tree: Any) -> list[Any]:
    """Leaves of ``tree`` (records included)."""
    return optree.tree_leaves(tree, namespace=NAMESPACE)


def tree_map(fn: Any, tree: Any, *rest: Any) -> Any:
    """Map ``fn`` over the leaves of ``tree`` (records included)."""
    return optree.tree_map(fn, tree, *rest, namespace=NAMESPACE)
