"""The one pytree namespace of the library and thin optree wrappers.

Policy (decided once): ``None`` is *not* a leaf (optree's default), so optional fields such as
``grads=None`` contribute no leaves. Records are registered in :data:`NAMESPACE`; flatten with
these wrappers (or pass ``namespace=NAMESPACE`` to optree) to see their tensors.
"""

from __future__ import annotations

from typing import Any

import optree
from optree.integrations import attrs as _optree_attrs

__all__ = ["NAMESPACE", "field", "frozen", "tree_flatten", "tree_leaves", "tree_map", "tree_unflatten"]

NAMESPACE = "functional_fsdp"


def frozen(cls: Any = None, **kwargs: Any) -> Any:
    """``attrs`` frozen class registered as a pytree in :data:`NAMESPACE`.

    Tensor fields are children; ``field(pytree_node=False)`` fields are static metadata.
    """
    kwargs.setdefault("namespace", NAMESPACE)
    return _optree_attrs.frozen(cls, **kwargs) if cls is not None else _optree_attrs.frozen(**kwargs)


field = _optree_attrs.field


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
