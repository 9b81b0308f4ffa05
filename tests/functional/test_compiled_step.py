"""The compiled training step (``make_train_step(..., compile=...)``) on 2 gloo ranks.

Compiled with ``aot_eager`` (AOTAutograd's graphs run op by op, no code generation: inductor
takes minutes a model on this machine), so the comparison with the eager step is exact: the
same aten ops in the same order, the all-gathers and reduce-scatters as graph nodes. A compile
is most of a case's time (a few seconds a rank, about the model's number of ops): every case
compiles the GPT's structure with MLP blocks (:func:`_model`: embeddings and a vocabulary of
101 rows that does not split evenly, so padding is traced too; the same three groups and
buckets as the GPT, half the ops, half the compile). The GPT itself, attention included, is
compiled against eager by ``examples/09_compiled_step.py``, whose test asserts bit-identity.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from _dist import World, shared_mesh
from _full import full_list, full_tensors
from _functional_helpers import _full, _functional_opt, _loss, _rank
from _helpers import MLPGPT

pytestmark = pytest.mark.multiprocess


@pytest.fixture
def world(world2: World) -> World:
    return world2


def _model() -> nn.Module:
    """The GPT's structure and batches (token embeddings of 101 rows, two residual blocks, a
    vocabulary head, ``loss``) with MLP blocks, which every case compiles: half the ops of
    the GPT's blocks to trace (a compile 2.5 s of a rank's CPU instead of 4.8 s). The GPT
    compiled against eager is ``examples/09_compiled_step.py``'s run."""
    torch.manual_seed(0)
    return MLPGPT(lambda: nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)), vocab=101)


def _small(**kw: Any) -> nn.Module:
    from functional_fsdp import fully_shard

    model = _model()
    for block in model.blocks:
        fully_shard(block, **kw)
    return fully_shard(model, **kw)


def _batch(step: int, rank: int, n: int = 2) -> Any:
    from functional_fsdp.testing.models import GPTConfig, synthetic_batch

    return synthetic_batch(
        GPTConfig(vocab=101, dim=32, n_layers=2, n_heads=2, seq=8), n, seed=100 * step + rank
    )


def _fresh_dynamo() -> None:
    """Each case compiles from a clean dynamo: in one process a later compile slows down with
    the ones before it (a 2-block GPT: 4.5 s alone, 23 s after two others), and the session's
    ranks run every case."""
    torch._dynamo.reset()


def _train(
    model: nn.Module,
    compile: Any,
    steps: int,
    state: Any = None,
    start: int = 0,
    step: Any = None,
    **kw: Any,
) -> Any:
    from functional_fsdp.functional import init, make_train_step

    opt = _functional_opt("adamw")
    if step is None:
        step = make_train_step(model, _loss, opt, compile=compile, **kw)
    state = init(model, opt) if state is None else state
    losses = []
    for s in range(start, start + steps):
        state, metrics = step(state, _batch(s, _rank(), n=2 * kw.get("grad_accum", 1)))
        losses.append(metrics["loss"].item())
    return state, losses, step


def _diff(a: Any, b: Any) -> float:
    from functional_fsdp.core._tree import tree_leaves

    return max(
        (x.float() - y.float()).abs().max().item()
        for x, y in zip(full_list(tree_leaves(a)), full_list(tree_leaves(b)))
    )


def _case_fp32(path: str) -> dict[str, Any]:
    """Compiled against eager (4 steps), against one process on the global batch, and resumed
    from a checkpoint the eager step wrote. The GPT's structure with MLP blocks: the GPT itself
    (attention, padding) compiled against eager is ``examples/09_compiled_step.py``'s run,
    which the examples' tests assert bit-identical."""
    _fresh_dynamo()
    import torch.distributed.checkpoint as dcp

    from functional_fsdp.functional import from_state_dict, init, to_state_dict

    eager, eager_losses, _ = _train(_small(), False, 4)
    compiled, losses, step = _train(_small(), "aot_eager", 4)
    ref_losses, ref_params = _reference(4)
    # Resume: 2 eager steps, a DCP checkpoint, 2 compiled steps from it (the same step: its
    # graph is compiled for the model, not for a state).
    half, _, _ = _train(_small(), False, 2)
    dcp.save(to_state_dict(half), checkpoint_id=path)
    template = init(_small(), _functional_opt("adamw"))
    sd = to_state_dict(template)
    dcp.load(sd, checkpoint_id=path)
    resumed, _, _ = _train(_small(), "", 2, from_state_dict(template, sd), start=2, step=step)
    return {
        "params": _diff(compiled.params, eager.params),
        "opt": _diff(compiled.opt_state, eager.opt_state),
        "losses": (losses, eager_losses),
        "resumed": _diff(resumed.params, eager.params),
        # Per tensor in the 2-norm: AdamW turns last-bit differences of near-zero gradient
        # entries into lr-sized steps of single entries (see test_functional_step.py).
        "reference": max(
            ((full[n] - p).norm() / p.norm()).item()
            for full in [full_tensors(compiled.params)]
            for n, p in ref_params.items()
        ),
        "reference_losses": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "report": step.compile_report(),
    }


def test_compiled_step_is_bit_identical_to_the_eager_step_and_resumes_from_its_checkpoint(
    world: World, tmp_path: Any
) -> None:
    for r in world.run(_case_fp32, str(tmp_path / "ckpt")):
        assert r["params"] == 0.0 and r["opt"] == 0.0
        assert r["losses"][0] == r["losses"][1]
        assert r["resumed"] == 0.0
        # One process on the global batch sums in another order: float rounding only. (The
        # global loss is the ranks' mean; the reference's is the global batch's: equal sizes.)
        assert r["reference"] < 1e-5 and r["reference_losses"] < 1e-5
        rep = r["report"]
        assert rep.graphs == 1 and rep.recompiles == 0  # 6 steps from 2 states, one graph
        # 3 groups, 2 buckets (the two blocks travel together; the root, kept after forward,
        # alone): every all-gather and reduce-scatter is a graph node, the blocks' bucket is
        # gathered again in the backward graph, the root's is not.
        assert rep.forward_collectives == {"all_gather_into_tensor": 2}
        assert rep.backward_collectives == {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 2}
        # Reordered for overlap (the default), and still bit-identical to the eager step.
        assert rep.overlap and len(rep.moved_nodes) == 2 and min(rep.moved_nodes) > 0


def _reference(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the plain model, the global batch (both ranks'), torch's AdamW."""
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    out = []
    for s in range(steps):
        (x0, y0), (x1, y1) = _batch(s, 0), _batch(s, 1)
        loss = ref.loss(torch.cat([x0, x1]), torch.cat([y0, y1]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out, {n: p.detach() for n, p in ref.named_parameters()}


def _case_bf16_hsdp() -> dict[str, Any]:
    """HSDP on a (2 replicas, 1 shard) mesh, bf16 parameters with fp32 reduction, 2
    micro-batches with has_aux, the blocks kept unsharded after forward: one compile covers
    them all (compiling is most of a case's time)."""
    _fresh_dynamo()
    from torch.distributed.device_mesh import init_device_mesh

    from functional_fsdp import MixedPrecisionPolicy
    from functional_fsdp.functional import init, make_train_step

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def build() -> nn.Module:
        from functional_fsdp import fully_shard

        model = _model()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
        return fully_shard(model, mesh=mesh, mp_policy=mp)

    def loss_aux(model: nn.Module, batch: Any) -> Any:
        loss = model.loss(*batch)
        return loss, loss.detach() * 2

    out = {}
    for mode in (False, "aot_eager"):
        model = build()
        opt = _functional_opt("adamw")
        step = make_train_step(model, loss_aux, opt, compile=mode, grad_accum=2, has_aux=True)
        state = init(model, opt)
        for s in range(3):
            state, metrics = step(state, _batch(s, _rank(), n=4))
        out[mode] = (state, metrics["aux"], step)
    (eager, eager_aux, _), (compiled, aux, step) = out[False], out["aot_eager"]
    return {
        "params": _diff(compiled.params, eager.params),
        "dtypes": sorted({str(_full(p).dtype) for p in compiled.params.values()}),
        "aux": [a.item() for a in aux] == [a.item() for a in eager_aux],
        "report": step.compile_report(),
    }


def test_compiled_step_runs_hsdp_in_bf16_with_accumulation_as_the_eager_step(world: World) -> None:
    for r in world.run(_case_bf16_hsdp):
        assert r["params"] == 0.0 and r["aux"]
        assert r["dtypes"] == ["torch.float32"]  # the sharded parameters stay fp32
        rep = r["report"]
        assert rep.graphs == 1 and rep.recompiles == 0  # 6 micro-batches, one graph
        # The replicas' all-reduce is in the backward graph; with reshard_after_forward=False
        # (and the root's default) no group is gathered again, so all 3 share one bucket.
        assert rep.backward_collectives == {"reduce_scatter_tensor": 1, "all_reduce": 1}
        assert rep.forward_collectives == {"all_gather_into_tensor": 1}
        assert rep.overlap and len(rep.moved_nodes) == 2  # reordered (the default)


def _case_reproducible() -> dict[str, Any]:
    """ReproduciblePolicy on 2 ranks, compiled against the eager step. V=2 (one micro-batch
    each): the backward graph reduces in the canonical tree (an all-to-all, the pieces added
    pairwise in rank order). V=4 (two each): each micro-batch's graph hands out its full
    gradients, summed in the tree and reduced once after the last, as the eager step does."""
    from functional_fsdp import ReproduciblePolicy
    from functional_fsdp.functional import init, make_train_step

    out: dict[str, Any] = {}
    for v, accum in ((2, 1), (4, 2)):
        _fresh_dynamo()
        policy = ReproduciblePolicy(v)
        eager, eager_losses, _ = _train(_small(reproducible=policy), False, 3, grad_accum=accum)
        compiled, losses, step = _train(
            _small(reproducible=policy), "aot_eager", 3, grad_accum=accum
        )
        out[v] = {
            "params": _diff(compiled.params, eager.params),
            "opt": _diff(compiled.opt_state, eager.opt_state),
            "losses": losses == eager_losses,
            "report": step.compile_report(),
        }
    # The policy's promise across world sizes: V=4 compiled on one rank (each rank alone, its
    # 4 micro-batches the 2-rank run's in virtual order) gives the 2-rank run's bits.
    _fresh_dynamo()
    one = shared_mesh((2, 1), ("copies", "dp"))["dp"]
    alone = _small(reproducible=ReproduciblePolicy(4), mesh=one)
    opt = _functional_opt("adamw")
    step = make_train_step(alone, _loss, opt, compile="aot_eager", grad_accum=4)
    state = init(alone, opt)
    for s in range(3):
        (x0, y0), (x1, y1) = _batch(s, 0, n=4), _batch(s, 1, n=4)
        state, _ = step(state, (torch.cat([x0, x1]), torch.cat([y0, y1])))
    out["one_rank"] = _diff(state.params, compiled.params)
    return out


def test_compiled_step_reduces_in_the_reproducible_tree_as_the_eager_step(world: World) -> None:
    for res in world.run(_case_reproducible):
        assert res.pop("one_rank") == 0.0  # V=4 on 1 rank: the same bits as on 2
        for v, r in res.items():
            assert r["params"] == 0.0 and r["opt"] == 0.0 and r["losses"], v
            rep = r["report"]
            assert rep.graphs == 1 and rep.recompiles == 0, v
            assert rep.overlap and min(rep.moved_nodes) > 0, v
        # V=2: the tree's all-to-alls are graph nodes; V=4: the backward graph reduces nothing
        # (the eager engine's tree does, once per step).
        assert res[2]["report"].backward_collectives == {
            "all_gather_into_tensor": 1,
            "all_to_all_single": 2,
        }
        assert res[4]["report"].backward_collectives == {"all_gather_into_tensor": 1}


def _case_module_api() -> dict[str, Any]:
    """fully_shard + torch.optim.AdamW: loss.backward() through the hooks against
    compile_backward (its graphs as traced: compile_overlap=False), 3 steps each, one
    collective per group (bucket_bytes 0)."""
    _fresh_dynamo()
    from functional_fsdp.functional import compile_backward

    out = {}
    for mode in (False, "aot_eager"):
        model = _small()
        model.set_bucket_bytes(0)  # type: ignore[operator]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        backward = (
            compile_backward(model, _loss, compile=mode, compile_overlap=False) if mode else None
        )
        losses = []
        for s in range(3):
            batch = _batch(s, _rank())
            if backward is None:
                loss = _loss(model, batch)
                loss.backward()
            else:
                loss = backward(batch)
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        out[mode] = ({n: p.detach().full_tensor() for n, p in model.named_parameters()}, losses)
        report = None if backward is None else backward.compile_report()  # type: ignore[attr-defined]
    (eager, eager_losses), (compiled, losses) = out[False], out["aot_eager"]
    _, ref = _reference(3)  # one process, the global batch, the same torch AdamW
    return {
        "params": max((eager[n] - compiled[n]).abs().max().item() for n in eager),
        "losses": losses == eager_losses,
        "reference": max(((compiled[n] - p).norm() / p.norm()).item() for n, p in ref.items()),
        "report": report,
    }


def test_compile_backward_trains_a_fully_shard_module_with_a_torch_optimizer(world: World) -> None:
    for r in world.run(_case_module_api):
        assert r["params"] == 0.0 and r["losses"]
        assert r["reference"] < 1e-5  # float rounding: two ranks' sums against one batch's
        assert r["report"].graphs == 1
        assert not r["report"].overlap and r["report"].moved_nodes == ()  # compile_overlap=False
        assert r["report"].backward_collectives == {
            "all_gather_into_tensor": 2,
            "reduce_scatter_tensor": 3,
        }


def _case_refusals() -> list[str]:
    from functional_fsdp.core.errors import ArgumentTypeError, UnsupportedError
    from functional_fsdp.functional import make_train_step

    opt = _functional_opt("adamw")
    out = []
    for model, compile, err in [
        (_small(), 3, ArgumentTypeError),
        (_small(), "no_such_backend", ArgumentTypeError),
        (
            _small(shard_placement_fn=lambda p: None if p.dim() < 2 else _shard1()),
            "aot_eager",
            UnsupportedError,
        ),
    ]:
        with pytest.raises(err) as info:
            make_train_step(model, _loss, opt, compile=compile)
        out.append(str(info.value))
    return out


def _shard1() -> Any:
    from torch.distributed.tensor import Shard

    return Shard(1)


def test_what_the_compiled_step_does_not_trace_is_refused_by_name(world: World) -> None:
    for messages in world.run(_case_refusals):
        assert "compile must be True, False or a torch.compile backend name" in messages[0]
        assert "'no_such_backend' is not a torch.compile backend" in messages[1]
        assert "sharded on a dim other than 0" in messages[2]


def _mismatch(backward: Any, x: torch.Tensor) -> str | None:
    """``backward(x)``'s ``CollectiveMismatchError`` message (``None``: it ran)."""
    from functional_fsdp.core.errors import CollectiveMismatchError

    try:
        backward(x)
    except CollectiveMismatchError as e:
        return str(e)
    return None


def _case_module_on_some_ranks_only() -> dict[str, Any]:
    """A group whose module runs on rank 1 only (``Routed.extra``, one collective per group):
    the ranks' first graphs differ, and running them raises on both ranks before any of their
    collectives ran; the same world then runs a collective, and the eager step once every
    rank runs ``extra``; then a step compiled where every rank runs ``extra``, whose second
    call rank 1 makes without it (recompiling alone)."""
    _fresh_dynamo()
    import torch.distributed as dist
    from _helpers import Routed

    from functional_fsdp import fully_shard
    from functional_fsdp.functional import compile_backward

    torch.manual_seed(0)
    model = Routed(8)
    for m in (*model.blocks, model.extra):
        fully_shard(m)
    fully_shard(model)
    model.set_bucket_bytes(0)  # type: ignore[operator]
    model.use_extra = _rank() == 1
    backward = compile_backward(model, lambda m, x: m(x).square().mean(), compile="aot_eager")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(_rank()))
    message = _mismatch(backward, x)
    probe = torch.ones(1)
    dist.all_reduce(probe)  # the world is still in step
    model.use_extra = True  # and the model trains once every rank runs every module
    model(x).square().mean().backward()
    # Every rank's first graph runs extra; at the second call rank 1 skips it: a guard fails
    # there only, and rank 1 alone recompiles a graph with one all-gather fewer.
    later = compile_backward(model, lambda m, x: m(x).square().mean(), compile="aot_eager")
    later(x)
    model.use_extra = _rank() == 0
    recompiled = _mismatch(later, x)
    after = torch.ones(1)
    dist.all_reduce(after)
    return {
        "message": message,
        "probe": probe.item(),
        "probe_after": after.item(),
        "grad": model.extra.weight.grad is not None,
        "recompiled": recompiled,
        "graphs": later.compile_report().graphs,  # type: ignore[attr-defined]
    }


def test_a_module_run_on_some_ranks_only_is_refused_when_compiled(world: World) -> None:
    """Where gloo aborted the process (the graphs' all-gathers paired with different sizes),
    every rank raises CollectiveMismatchError naming the first collective that differs, also
    for a graph one rank recompiled alone."""
    for r, res in enumerate(world.run(_case_module_on_some_ranks_only)):
        assert res["probe"] == 2.0 and res["grad"], (r, res)
        msg = res["message"]
        assert msg is not None, f"rank {r} compiled and ran mismatched graphs"
        assert "compile_backward" in msg and "different collectives" in msg, msg
        assert "all_gather_into_tensor of" in msg and "some ranks only" in msg, msg
        # A graph that rank 1 recompiled alone later: checked before it runs, as the first
        # graphs are (it ran unchecked before, and the ranks waited out the timeout).
        assert res["graphs"] == 1 + r, res
        assert res["recompiled"] is not None, f"rank {r} ran a graph its peer did not"
        assert "different collectives" in res["recompiled"], res["recompiled"]
        assert res["probe_after"] == 2.0


class _InPlace(nn.Module):
    """``Routed``'s parameters, ``extra``'s output reaching the loss only through an in-place
    write (``y.add_(...)``: dynamo's later reads of ``y`` read the node before it)."""

    def __init__(self) -> None:
        super().__init__()
        from _helpers import Routed

        self.__dict__.update(Routed(8).__dict__)
        self.use_extra = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.blocks[0](x))
        y = torch.zeros_like(x)
        if self.use_extra:
            y.add_(torch.tanh(self.extra(x)))
        return self.blocks[1](x + y)


def _case_parameter_no_rank_uses(uses: str) -> dict[str, Any]:
    """``Routed.extra`` (in the root's group) run where ``uses`` says, compile_backward against
    loss.backward() through the hooks, 3 AdamW steps with weight decay each: the parameters
    and, each step, which ones got a gradient."""
    _fresh_dynamo()
    from _helpers import Routed

    from functional_fsdp import fully_shard
    from functional_fsdp.functional import compile_backward

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x).square().mean()

    def used(step: int) -> bool:
        return {
            "no-rank": False,
            "rank-1": _rank() == 1,
            "rank-1-from-step-1": _rank() == 1 and step >= 1,  # a recompile on rank 1 only
            "rank-1-at-step-1": _rank() == 1 and step == 1,  # then the first graph again
            "every-rank-at-step-0": step == 0,  # a branch switched off: a later graph only
            "in-place": True,
        }[uses]

    out = {}
    for mode in (False, "aot_eager"):
        torch.manual_seed(0)
        model = _InPlace() if uses == "in-place" else Routed(8)
        fully_shard(model.blocks[1])
        fully_shard(model)  # extra in the root's group with blocks[0] (alone in a group it
        # would reduce on some ranks only: refused on both paths)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        backward = compile_backward(model, loss_fn, compile=mode) if mode else None
        graded = []
        for s in range(3):
            model.use_extra = used(s)
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * s + _rank()))
            if backward is None:
                loss_fn(model, x).backward()
            else:
                backward(x)
            graded.append(sorted(n for n, p in model.named_parameters() if p.grad is not None))
            opt.step()
            opt.zero_grad()
        out[mode] = ({n: p.detach().full_tensor() for n, p in model.named_parameters()}, graded)
    (eager, eager_graded), (compiled, graded) = out[False], out["aot_eager"]
    return {
        "params": max((eager[n] - compiled[n]).abs().max().item() for n in eager),
        "graded": graded,
        "eager_graded": eager_graded,
    }


@pytest.mark.parametrize(
    "uses",
    [
        "no-rank",
        "rank-1",
        "rank-1-from-step-1",
        "rank-1-at-step-1",
        "every-rank-at-step-0",
        "in-place",
    ],
)
def test_compile_backward_gives_no_gradient_where_no_rank_used_a_parameter(
    world: World, uses: str
) -> None:
    """As loss.backward(): a parameter no rank used gets no gradient (so AdamW's weight decay
    and moments leave it alone); one that some rank used, also only through an in-place write
    or only in a graph one rank compiled later, gets the reduced gradient on every rank, in
    the steps where it was used (``rank-1-at-step-1``: none again in the third step, whose
    graphs are the first ones; it got zeros there before each step asked which graphs ran;
    ``every-rank-at-step-0``: every rank's first graph reads it, the later steps' graphs do
    not, and it got zeros in them before every parameter was asked about, not only those
    no first graph reads)."""
    for r in world.run(_case_parameter_no_rank_uses, uses):
        assert r["graded"] == r["eager_graded"], r
        first = ("rank-1", "every-rank-at-step-0", "in-place")
        assert ("extra.weight" in r["graded"][0]) == (uses in first), r
        assert r["params"] == 0.0, r


def _scaled_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The loss times ``model.loss_scale`` (an attribute the caller may change between steps)."""
    return model(x).square().mean() * getattr(model, "loss_scale", 1.0)


def _case_settings_changed_after_build() -> dict[str, Any]:
    """3 steps, ``model.loss_scale = 4.0`` set on the module between the first and the
    second, after the step was built: compiled against eager, and against a run that never
    changed it. (Two linear blocks and the root's: the setting, not the model, is under test,
    and each graph dynamo compiles for the GPT costs about 5 s a rank.)"""
    _fresh_dynamo()
    from _helpers import Routed

    from functional_fsdp import fully_shard
    from functional_fsdp.functional import init, make_train_step

    out = {}
    for name, compile, change in (
        ("eager", False, True),
        ("compiled", "aot_eager", True),
        ("unchanged", False, False),
    ):
        torch.manual_seed(0)
        model = Routed(8)
        model.use_extra = True
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = _functional_opt("adamw")
        step = make_train_step(model, _scaled_loss, opt, compile=compile)
        state = init(model, opt)
        for s in range(3):
            if s == 1 and change:
                model.loss_scale = 4.0
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * s + _rank()))
            state, _ = step(state, x)
        out[name] = state.params
    return {
        "compiled": _diff(out["compiled"], out["eager"]),
        "changed": _diff(out["eager"], out["unchanged"]),
    }


def test_compiled_step_sees_a_setting_changed_after_it_was_built(world: World) -> None:
    """The traced forward runs a copy of the modules (FSDP's hooks undone): it reads their
    attributes again before every call, so a setting changed on the model after
    ``make_train_step`` (a flag the forward or the loss reads, ``train()``/``eval()``) reaches
    it. It was copied once, at build: 0.017 from the eager step after 3 steps."""
    for res in world.run(_case_settings_changed_after_build):
        assert res["compiled"] == 0.0 and res["changed"] > 1e-4, res
