"""The one pytree namespace of the library and thin optree wrappers.

Policy (decided once): ``None`` is *not* a leaf (optree's default), so optional fields such as
``grads=None`` contribute no leaves. Records are registered in :data:`NAMESPACE`; flatten with
these wrappers (or pass ``namespace=NAMESPACE`` to optree) to see their tensors.
"""

from __future__ import annotations

from typing import Any, TypeVar

import attrs
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
    support.)

    Unflattening does *not* run the class's ``__init__``: no validators, no
    ``__attrs_post_init__``. A pytree must map to any leaf type: ``tree_map(lambda t: t.shape,
    state)`` builds a record of shapes, which a validator expecting tensors would refuse
    (equinox's modules skip ``__init__`` on unflatten for the same reason). Records built by the
    library's own functions, by their constructors or by ``attrs.evolve`` are still checked.
    """
    fields = attrs.fields(cls)
    children = tuple(f.name for f in fields if f.metadata.get("pytree_node", True))
    static = tuple(f.name for f in fields if not f.metadata.get("pytree_node", True))

    def flatten(obj: Any) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[str, ...]]:
        return (
            tuple(getattr(obj, n) for n in children),
            tuple(getattr(obj, n) for n in static),
            children,
        )

    def unflatten(metadata: tuple[Any, ...], values: Any) -> Any:
        # Frozen attrs classes set their fields with object.__setattr__ too (their own
        # __setattr__ refuses); every field is set, static ones from the spec's metadata.
        obj: Any = object.__new__(cls)
        for name, value in zip(children, values):
            object.__setattr__(obj, name, value)
        for name, value in zip(static, metadata):
            object.__setattr__(obj, name, value)
        return obj

    optree.register_pytree_node(
        cls,
        flatten,
        unflatten,  # type: ignore[arg-type]
        namespace=NAMESPACE,
        path_entry_type=_optree_attrs.AttrsEntry,
    )
    return cls


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
