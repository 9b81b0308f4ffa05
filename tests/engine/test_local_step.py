"""The optimizer step on local shards (``shell/engine/local_step.py``), on a real 2-rank world.

Every allowlisted elementwise optimizer gives the same parameters and the same ``DTensor``
state as torch's FSDP2 (whose parameters keep the ``DTensor`` path in the same process), bit
for bit, and each recipe also those of our own ``DTensor`` path
(``set_local_optimizer_step(False)``), while dispatching no ``DTensor`` op in its step; the
cases where the swap could be seen (a per-optimizer hook, a closure) take the ``DTensor``
path, and a step that raises leaves nothing swapped behind, and a first group that registers a
step hook of its own keeps the local step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from _dist import World
from _fully_shard_helpers import CFG, _build, _full_params
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from functional_fsdp.testing.models import GPT, synthetic_batch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "sgd_nesterov": (
        torch.optim.SGD,
        {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    ),
    "adam_amsgrad": (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "adamw_foreach": (torch.optim.AdamW, {"lr": 1e-2, "foreach": True}),
    "adagrad": (torch.optim.Adagrad, {"lr": 1e-2}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 1e-3, "momentum": 0.5, "centered": True}),
    "nadam": (torch.optim.NAdam, {"lr": 1e-2}),
    "radam": (torch.optim.RAdam, {"lr": 1e-2}),
    "adamax": (torch.optim.Adamax, {"lr": 1e-2}),
}


@contextlib.contextmanager
def _local_step(enabled: bool) -> Iterator[None]:
    from functional_fsdp.shell.engine.local_step import set_local_optimizer_step

    set_local_optimizer_step(enabled)
    try:
        yield
    finally:
        set_local_optimizer_step(True)


class _CountDTensorOps(TorchDispatchMode):
    """Count the ops dispatched with a ``DTensor`` argument inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(isinstance(t, DTensor) for t in pytree.tree_leaves((args, kwargs))):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _run(
    which: str,
    recipe: str,
    opt_name: str,
    *,
    steps: int = 3,
    hook: bool = False,
    copies: bool = False,
) -> dict:
    model = _build(which, recipe)
    cls, kw = OPTIMIZERS[opt_name]
    opt = cls(model.parameters(), **kw)
    kept = None
    if copies:
        from functional_fsdp import keep_neighbour_copies

        kept = keep_neighbour_copies(model, opt)
    seen: list[bool] = []
    if hook:
        opt.register_step_pre_hook(
            lambda o, a, k: seen.append(
                all(isinstance(p, DTensor) for p in o.param_groups[0]["params"])
            )
        )
    ops = _train_counting_ops(model, opt, steps)
    held = kept.held() if kept is not None else {}
    if kept is not None:
        kept.remove()
    return {"params": _full_params(model), "opt": opt, "ops": ops, "seen": seen, "held": held}


def _train_counting_ops(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> list:
    """``steps`` training steps of the GPT on this rank's batches: the ``DTensor`` ops each
    optimizer step dispatched."""
    ops = []
    for s in range(steps):
        x, y = synthetic_batch(CFG, 2, seed=1000 * s + dist.get_rank())
        model.loss(x, y).backward()
        with _CountDTensorOps() as counter:
            opt.step()
        ops.append(counter.count)
        opt.zero_grad()
    return ops


def _same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    if sa["state"].keys() != sb["state"].keys():
        return False
    for i, st in sa["state"].items():
        other = sb["state"][i]
        if st.keys() != other.keys():
            return False
        for k, v in st.items():
            w = other[k]
            if type(v) is not type(w):
                return False
            if isinstance(v, DTensor):
                if v.placements != w.placements or not torch.equal(v.to_local(), w.to_local()):
                    return False
            elif isinstance(v, torch.Tensor) and not torch.equal(v, w):
                return False
    return True


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def case_matches_fsdp2(recipe: str, opt_name: str, dtensor_path: bool = True) -> dict:
    """The local step against torch's FSDP2 (whose parameters take the ``DTensor`` path), 2
    steps: the first makes the state, the second is a steady one. With ``dtensor_path``, also
    against our own ``DTensor`` path, for the recipes that change what the step sees (an
    optimizer alone changes only the step, which both FSDP2 and our ``DTensor`` path run on
    the same parameters and gradients)."""
    fast = _run("ours", recipe, opt_name, steps=2)
    fsdp2 = _run("torch", recipe, opt_name, steps=2)
    out = {}
    if dtensor_path:
        with _local_step(False):
            slow = _run("ours", recipe, opt_name, steps=2)
        out = {
            "vs_dtensor_path": _equal(fast["params"], slow["params"]),
            "state_vs_dtensor_path": _same_state(fast["opt"], slow["opt"]),
            "slow_ops": slow["ops"],
        }
    return {
        **out,
        "vs_fsdp2": _equal(fast["params"], fsdp2["params"]),
        "state_vs_fsdp2": _same_state(fast["opt"], fsdp2["opt"]),
        "params_are_dtensors": all(
            isinstance(p, DTensor) and p.grad is None
            for g in fast["opt"].param_groups
            for p in g["params"]
        ),
        "fast_ops": fast["ops"],
        "fsdp2_ops": fsdp2["ops"],
    }


def case_hooked_optimizer_sees_dtensors() -> dict:
    hooked = _run("ours", "fp32", "adamw", hook=True)
    plain = _run("ours", "fp32", "adamw")
    return {
        "seen": hooked["seen"],
        "ops": hooked["ops"],
        "equal": _equal(hooked["params"], plain["params"]),
    }


def case_neighbour_copies() -> dict:
    """keep_neighbour_copies' hooks read the state through param_state: the step still runs
    on local shards, and the copies hold what they hold on the DTensor path."""
    fast = _run("ours", "fp32", "adamw", copies=True)
    with _local_step(False):
        slow = _run("ours", "fp32", "adamw", copies=True)

    def same(a, b) -> bool:
        return (
            torch.equal(a.params.flat, b.params.flat)
            and a.moments.keys() == b.moments.keys()
            and all(torch.equal(a.moments[k].flat, b.moments[k].flat) for k in a.moments)
            and all(torch.equal(a.scalars[k], b.scalars[k]) for k in a.scalars)
        )

    return {
        "ops": fast["ops"],
        "params": _equal(fast["params"], slow["params"]),
        "state": _same_state(fast["opt"], slow["opt"]),
        "held": fast["held"].keys() == slow["held"].keys()
        and all(same(fast["held"][n], slow["held"][n]) for n in fast["held"]),
        "moments": sorted(next(iter(fast["held"].values())).moments),
    }


def case_group_with_a_foreign_parameter(foreach: bool) -> dict:
    """A param group holding a DTensor parameter that is not ours (here made with
    ``distribute_tensor``) beside ours keeps the DTensor path whole (foreach ops refuse DTensors
    beside tensors); a group of ours alone still steps on local shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def run() -> tuple[dict, torch.Tensor, list[int]]:
        model = _build("ours", "fp32")
        torch.manual_seed(1)
        extra = torch.nn.Parameter(distribute_tensor(torch.randn(6), mesh, [Shard(0)]))
        blocks = [p for n, p in model.named_parameters() if n.startswith("blocks.")]
        rest = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
        opt = torch.optim.AdamW(
            [{"params": blocks}, {"params": [*rest, extra]}], lr=1e-2, foreach=foreach
        )
        ops = []
        for s in range(3):
            x, y = synthetic_batch(CFG, 2, seed=1000 * s + dist.get_rank())
            model.loss(x, y).backward()
            extra.grad = distribute_tensor(torch.full((6,), 0.5 + s), mesh, [Shard(0)])
            with _CountDTensorOps() as counter:
                opt.step()
            ops.append(counter.count)
            opt.zero_grad()
        return _full_params(model), extra.full_tensor().detach(), ops

    fast, fast_extra, ops = run()
    with _local_step(False):
        slow, slow_extra, slow_ops = run()
    return {
        "equal": _equal(fast, slow) and torch.equal(fast_extra, slow_extra),
        "ops": ops,
        "slow_ops": slow_ops,
    }


def case_closure_and_raising_step() -> dict:
    model = _build("ours", "fp32")
    ref = _build("ours", "fp32")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x, y = synthetic_batch(CFG, 2, seed=dist.get_rank())

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        return loss

    opt.step(closure)  # a closure runs backward inside the step: the DTensor path
    ref.loss(x, y).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    opt.zero_grad()
    model.loss(x, y).backward()
    opt.param_groups[0]["betas"] = None  # raises in step(), before any write
    raised = False
    try:
        opt.step()
    except TypeError:
        raised = True
    left_swapped = hasattr(opt, "_ffsdp_local_swap")
    opt.param_groups[0]["betas"] = ref_opt.param_groups[0]["betas"]
    opt.step()  # restores what the raising step left, then steps on the local shards
    ref.loss(x, y).backward()
    ref_opt.step()
    return {
        "raised": raised,
        "left_swapped": left_swapped,
        "restored": not hasattr(opt, "_ffsdp_local_swap")
        and all(isinstance(p, DTensor) for p in opt.param_groups[0]["params"])
        and all(
            isinstance(v, DTensor)
            for st in opt.state.values()
            for k, v in st.items()
            if k != "step"
        ),
        "equal": _equal(_full_params(model), _full_params(ref)),
        "same_state": _same_state(opt, ref_opt),
    }


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_elementwise_optimizers_bit_identical(world2: World, opt_name: str) -> None:
    for res in world2.run(case_matches_fsdp2, "fp32", opt_name, False):
        assert res["vs_fsdp2"] and res["state_vs_fsdp2"], res
        assert res["params_are_dtensors"]
        # the first step creates state through DTensor ops (zeros_like on the parameter) only
        # on the DTensor path; on local shards the later steps dispatch no DTensor op at all
        assert res["fast_ops"][1:] == [0], res["fast_ops"]
        assert min(res["fsdp2_ops"]) > 0  # torch's FSDP2 parameters keep the DTensor path


@pytest.mark.parametrize("recipe", ["shard1", "offload", "list", "mp"])
def test_recipes_bit_identical(world2: World, recipe: str) -> None:
    for res in world2.run(case_matches_fsdp2, recipe, "adamw"):
        assert res["vs_dtensor_path"] and res["state_vs_dtensor_path"], res
        assert res["vs_fsdp2"] and res["state_vs_fsdp2"], res
        assert res["fast_ops"][1:] == [0], res["fast_ops"]
        assert min(res["slow_ops"]) > 0


def test_per_optimizer_hook_sees_dtensor_parameters(world2: World) -> None:
    for res in world2.run(case_hooked_optimizer_sees_dtensors):
        assert res["seen"] == [True, True, True]
        assert min(res["ops"]) > 0  # the DTensor path
        assert res["equal"]


@pytest.mark.parametrize("foreach", [False, True])
def test_group_with_a_foreign_parameter_keeps_the_dtensor_path(
    world2: World, foreach: bool
) -> None:
    for res in world2.run(case_group_with_a_foreign_parameter, foreach):
        assert res["equal"], res
        # the root's group stepped through DTensor dispatch, the blocks' on local shards
        assert all(0 < a < b for a, b in zip(res["ops"], res["slow_ops"])), res


def test_neighbour_copies_keep_the_local_step(world2: World) -> None:
    for res in world2.run(case_neighbour_copies):
        assert res["ops"][1:] == [0, 0], res["ops"]
        assert res["params"] and res["state"] and res["held"], res
        assert res["moments"] == ["exp_avg", "exp_avg_sq"]


def case_zero_grad_after_a_raising_step(recovery: str) -> dict:
    """A step that raises with gradients in place, then the user's recovery (``recovery``:
    ``reset_then_zero``, ``zero_then_reset`` or ``zero_only``, the next forward undoing the
    swap), then two clean steps: the same parameters and state as a run that skipped the
    failed step."""
    model = _build("ours", "fp32")
    ref = _build("ours", "fp32")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)

    def step(m: torch.nn.Module, o: torch.optim.Optimizer, seed: int) -> None:
        x, y = synthetic_batch(CFG, 2, seed=seed + dist.get_rank())
        m.loss(x, y).backward()
        o.step()
        o.zero_grad()

    step(model, opt, 0)
    step(ref, ref_opt, 0)
    x, y = synthetic_batch(CFG, 2, seed=50 + dist.get_rank())
    model.loss(x, y).backward()
    betas = opt.param_groups[0]["betas"]
    opt.param_groups[0]["betas"] = None  # raises in step(), after the swap, before any write
    with pytest.raises(TypeError):
        opt.step()
    opt.param_groups[0]["betas"] = betas
    if recovery == "reset_then_zero":
        model.reset_iter_state()
        opt.zero_grad()
    elif recovery == "zero_then_reset":
        opt.zero_grad()
        model.reset_iter_state()
    else:
        opt.zero_grad()
    grads_left = [n for n, p in model.named_parameters() if p.grad is not None]
    for seed in (100, 200):
        step(model, opt, seed)
        step(ref, ref_opt, seed)
    return {
        "grads_left": grads_left if recovery != "zero_only" else [],
        "equal": _equal(_full_params(model), _full_params(ref)),
        "same_state": _same_state(opt, ref_opt),
    }


@pytest.mark.parametrize("recovery", ["reset_then_zero", "zero_then_reset", "zero_only"])
def test_zero_grad_after_a_raising_step_clears_the_gradients(world2: World, recovery: str) -> None:
    """torch runs no post-hook after a step that raised, so the swap stays in place: a
    ``zero_grad()`` then cleared only the local tensors' ``.grad`` and the next backward added
    onto the failed step's gradients (measured: 0.028 off). ``reset_iter_state()`` and the
    next forward undo the swap, and a gradient cleared while swapped is cleared on the
    ``DTensor``."""
    for res in world2.run(case_zero_grad_after_a_raising_step, recovery):
        assert res["grads_left"] == [], res
        assert res["equal"] and res["same_state"], res


def test_closure_and_a_raising_step_leave_nothing_swapped(world2: World) -> None:
    for res in world2.run(case_closure_and_raising_step):
        assert res["raised"] and res["left_swapped"], res
        assert res["restored"] and res["equal"] and res["same_state"], res


@contextlib.contextmanager
def _fresh_step_hooks() -> Iterator[None]:
    """This rank's optimizer step hooks as in a process that never ran ``fully_shard`` (torch's
    global tables empty, the package's handles unset); everything restored after."""
    import torch.optim.optimizer as optimizer_module

    from functional_fsdp.shell.api import replaced
    from functional_fsdp.shell.engine import local_step, optimizer_access, reproducible

    tables = (
        optimizer_module._global_optimizer_pre_hooks,
        optimizer_module._global_optimizer_post_hooks,
    )
    lists = (local_step._HANDLES, reproducible._STEP_CHECK, optimizer_access._HANDLE)
    lists += (replaced._HANDLE,)
    saved = [dict(t) for t in tables], [list(x) for x in lists]
    for t in tables:
        t.clear()
    for x in lists:
        x.clear()
    try:
        yield
    finally:
        for t, was in zip(tables, saved[0]):
            t.clear()
            t.update(was)
        for x, had in zip(lists, saved[1]):
            x[:] = had


def case_first_group_reproducible() -> dict:
    """The first ``fully_shard`` of a process builds a group under ``ReproduciblePolicy``,
    whose step count is a global optimizer post-hook: the steady steps still run on the local
    shards."""
    from functional_fsdp import ReproduciblePolicy

    with _fresh_step_hooks():
        from functional_fsdp import fully_shard

        torch.manual_seed(0)
        model = GPT(CFG)
        for block in model.blocks:
            fully_shard(block, reproducible=ReproduciblePolicy(2))
        fully_shard(model, reproducible=ReproduciblePolicy(2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ops = _train_counting_ops(model, opt, 2)
        hooks = [h.__name__ for h in _step_hooks()]
    return {"ops": ops, "hooks": hooks}


def _step_hooks() -> list:
    """torch's global optimizer step hooks, pre then post."""
    import torch.optim.optimizer as optimizer_module

    return [
        *optimizer_module._global_optimizer_pre_hooks.values(),
        *optimizer_module._global_optimizer_post_hooks.values(),
    ]


def test_a_first_group_with_its_own_step_hook_keeps_the_local_step(world2: World) -> None:
    """A group registers a global post-hook of its own (``ReproduciblePolicy``'s step count, a
    checking runtime's access report): it used to be built before ``fully_shard`` installed
    the swap's hooks, so in a process whose first group did so every later optimizer step took
    the ``DTensor`` path (the swap allows no post-hook before its own restore)."""
    for res in world2.run(case_first_group_reproducible):
        assert res["ops"][1:] == [0], res
        # (Under FFSDP_RUNTIME=simulator the checking runtime's access report, _stepped, is
        # registered after these.)
        assert [h for h in res["hooks"] if h != "_stepped"] == [
            "check_replaced_params",
            "_to_local",
            "check_no_partial_trees",
            "_to_dtensor",
            "steps_taken",
        ], res
