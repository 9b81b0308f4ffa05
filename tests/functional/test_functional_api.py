"""The functional API as an optax user expects it, over 2 gloo ranks.

Composable optimizers on the sharded model (bit-exact with ``clip_grad_norm_`` + AdamW), the
step's metrics and ``has_aux``, errors raised up front (donated state reused, a torch optimizer
where a functional one is expected, activation checkpointing), the bridges to torch optimizers
and ``summon_state``. Module-level functions run on both ranks (``world2``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

pytestmark = pytest.mark.multiprocess


def _cfg() -> Any:
    from functional_fsdp.testing.models import GPTConfig

    return GPTConfig(vocab=101, dim=32, n_layers=2, n_heads=2, seq=8)


def _build(seed: int = 0) -> nn.Module:
    from functional_fsdp import fully_shard
    from functional_fsdp.testing.models import GPT

    torch.manual_seed(seed)
    model = GPT(_cfg())
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _batch(step: int, n: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    from functional_fsdp.testing.models import synthetic_batch

    return synthetic_batch(_cfg(), n, seed=100 * step + _rank())


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return model.loss(*batch)


def _exact(state_params: dict[str, Any], model: nn.Module) -> float:
    """Largest absolute difference between the state's and the module's parameters."""
    own = dict(model.named_parameters())
    return max(
        (t.full_tensor() - own[n].full_tensor()).abs().max().item() for n, t in state_params.items()
    )


def _shell_steps(model: nn.Module, opt: Any, steps: range, clip: float | None = None) -> list[Any]:
    norms = []
    for s in steps:
        model.loss(*_batch(s)).backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).full_tensor())
        opt.step()
        opt.zero_grad()
    return norms


# ------------------------------------------------------------- errors, raised up front


class _CheckpointedBlock(nn.Module):
    def __init__(self, reentrant: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.lin, x, use_reentrant=self.reentrant)


def _case_errors() -> str:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from functional_fsdp import fully_shard
    from functional_fsdp.core.errors import DonatedStateError, UnsupportedError
    from functional_fsdp.functional import (
        adamw,
        apply_to_module,
        init,
        make_train_step,
        to_state_dict,
        with_params,
    )
    from functional_fsdp.testing.models import GPT

    model = _build()
    torch_opt = torch.optim.AdamW(model.parameters())
    for call in (lambda: init(model, torch_opt), lambda: make_train_step(model, _loss, torch_opt)):
        with pytest.raises(TypeError, match=r"torch optimizer \(AdamW\).*adamw\(lr"):
            call()

    # Donation: the donated state is consumed; every use of it names the problem.
    opt = adamw(1e-2)
    step = make_train_step(model, _loss, opt, donate=True)
    state = init(model, opt)
    new, _ = step(state, _batch(0))
    for use in (
        lambda: step(state, _batch(1)),
        lambda: apply_to_module(state, model),
        lambda: to_state_dict(state),
        lambda: with_params(state, {}),
    ):
        with pytest.raises(DonatedStateError, match="donated to a step made with donate=True"):
            use()
    new, _ = step(new, _batch(1))  # the returned state goes on
    assert new.step.item() == 2

    # Activation checkpointing: checkpoint_wrapper is refused when the step is made ...
    torch.manual_seed(0)
    ac = GPT(_cfg())
    ac.blocks[0] = checkpoint_wrapper(ac.blocks[0])
    for block in ac.blocks:
        fully_shard(block)
    fully_shard(ac)
    with pytest.raises(UnsupportedError, match="activation checkpointing"):
        make_train_step(ac, _loss, opt)

    # ... and torch.utils.checkpoint inside a module's forward is turned into the same error,
    # reentrant too (torch's own refusal under torch.autograd.grad advises use_reentrant=False,
    # which the step does not support either).
    for reentrant in (False, True):
        torch.manual_seed(0)
        # (A first layer outside the checkpoints: a reentrant checkpoint of inputs that need no
        # gradient makes an output that needs none.)
        inner = nn.Sequential(
            nn.Linear(4, 4), _CheckpointedBlock(reentrant), _CheckpointedBlock(reentrant)
        )
        for block in inner[1:]:
            fully_shard(block)
        fully_shard(inner)
        inner_step = make_train_step(inner, lambda m, b: m(b).sum(), opt)
        with pytest.raises(UnsupportedError, match="activation checkpointing"):
            inner_step(init(inner, opt), torch.randn(2, 4))
        assert torch.isfinite(inner(torch.randn(2, 4))).all()  # the module still works
    ok, _ = make_train_step(model, _loss, opt)(init(model, opt), _batch(2))  # still usable
    with pytest.raises(ValueError, match="has_aux=True"):
        make_train_step(model, lambda m, b: (_loss(m, b), 1), opt)(ok, _batch(3))
    return "ok"


def test_errors_are_raised_up_front_and_name_the_fix(world2: Any) -> None:
    assert world2.run(_case_errors) == ["ok", "ok"]


# ----------------------------------------------- composable optimizers, metrics, has_aux


def _case_chain_and_metrics() -> dict[str, Any]:
    from functional_fsdp.functional import (
        adamw,
        chain,
        clip_by_global_norm,
        init,
        inject_hyperparams,
        make_train_step,
        schedules,
        set_hyperparams,
    )

    shell = _build()
    torch_opt = torch.optim.AdamW(shell.parameters(), lr=1e-2, weight_decay=0.1)
    sched = schedules.warmup_cosine_decay_schedule(1e-3, 1e-2, warmup_steps=2, decay_steps=4)
    lrs = [sched(i) for i in range(4)]
    torch_norms = []
    for s in range(4):
        torch_opt.param_groups[0]["lr"] = lrs[s]
        torch_norms += _shell_steps(shell, torch_opt, range(s, s + 1), clip=0.05)

    model = _build()
    opt = chain(clip_by_global_norm(0.05), adamw(sched, weight_decay=0.1))

    def loss_aux(m: nn.Module, b: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        loss = _loss(m, b)
        return loss, {"tokens": torch.tensor(b[0].numel()), "loss": loss}

    step = make_train_step(model, loss_aux, opt, has_aux=True)
    state = init(model, opt)
    metrics = []
    for s in range(4):
        state, m = step(state, _batch(s))
        metrics.append(m)
    # inject_hyperparams: the same run with the lr set in the state each step.
    model2 = _build()
    opt2 = chain(clip_by_global_norm(0.05), inject_hyperparams(adamw)(lr=1.0, weight_decay=0.1))
    step2 = make_train_step(model2, _loss, opt2)
    state2 = init(model2, opt2)
    for s in range(4):
        state2, m2 = step2(set_hyperparams(state2, lr=lrs[s]), _batch(s))
    return {
        "exact": _exact(state.params, shell),
        "exact_injected": _exact(state2.params, shell),
        "norms": [m["grad_norm"].item() for m in metrics],
        "torch_norms": [n.item() for n in torch_norms],
        "loss": [m["loss"].item() for m in metrics],
        "local": [m["local_loss"].item() for m in metrics],
        "lr": [m["lr"] for m in metrics],
        "want_lr": lrs,
        "aux": metrics[0]["aux"]["tokens"].item(),
        "aux_loss": metrics[0]["aux"]["loss"].item(),
        "lr_injected": m2["lr"],
    }


def test_chain_is_bit_exact_and_metrics_report_global_loss_lr_norm(world2: Any) -> None:
    r0, r1 = world2.run(_case_chain_and_metrics)
    for r in (r0, r1):
        # chain(clip, adamw) == clip_grad_norm_ + AdamW, bit for bit
        assert r["exact"] == 0.0 and r["exact_injected"] == 0.0, r
        assert all(abs(a - b) <= 1e-6 * b for a, b in zip(r["norms"], r["torch_norms"]))
        assert r["lr"] == r["want_lr"] and r["lr_injected"] == r["want_lr"][-1]
        assert r["aux"] == 2 * _cfg().seq and r["aux_loss"] == r["local"][0]
    for a, b, g0, g1 in zip(r0["local"], r1["local"], r0["loss"], r1["loss"]):
        assert g0 == g1 and abs(g0 - (a + b) / 2) <= 1e-6 * abs(g0)  # the global mean loss
    assert r0["local"] != r1["local"]


def _case_global_norm() -> tuple[float, float]:
    from functional_fsdp.functional import global_norm

    model = _build()
    model.loss(*_batch(0)).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    want = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).full_tensor().item()
    return global_norm(grads).item(), want


def test_public_global_norm_reduces_over_the_shards(world2: Any) -> None:
    for got, want in world2.run(_case_global_norm):
        assert abs(got - want) <= 1e-6 * want


# ----------------------------------------------------------------------------- bridges


def _case_bridges() -> dict[str, bool]:
    from functional_fsdp.functional import (
        adamw,
        from_torch_optimizer,
        init,
        make_train_step,
        to_torch_optimizer,
    )

    opt = adamw(1e-2, weight_decay=0.1)
    # torch -> functional: two module-API steps, then two functional steps from its state.
    shell = _build()
    torch_opt = torch.optim.AdamW(shell.parameters(), lr=1e-2, weight_decay=0.1)
    _shell_steps(shell, torch_opt, range(2))
    state = from_torch_optimizer(shell, torch_opt, opt)
    from_sd = from_torch_optimizer(shell, torch_opt.state_dict(), opt)
    same_sd = all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for a, b in zip(state.opt_state.mu.values(), from_sd.opt_state.mu.values())
    )
    step = make_train_step(shell, _loss, opt)
    for s in range(2, 4):
        state, _ = step(state, _batch(s))
    _shell_steps(shell, torch_opt, range(2, 4))
    resumed = _exact(state.params, shell) == 0.0 and state.step.item() == 4

    # functional -> torch: two functional steps, then two module-API steps from its state.
    model = _build()
    fstate = init(model, opt)
    fstep = make_train_step(model, _loss, opt)
    for s in range(2):
        fstate, _ = fstep(fstate, _batch(s))
    torch_opt2 = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    to_torch_optimizer(fstate, model, torch_opt2)
    _shell_steps(model, torch_opt2, range(2, 4))
    for s in range(2, 4):
        fstate, _ = fstep(fstate, _batch(s))
    return {"resumed": resumed, "same_sd": same_sd, "back": _exact(fstate.params, model) == 0.0}


def test_torch_optimizer_state_resumes_functionally_and_back(world2: Any) -> None:
    for r in world2.run(_case_bridges):
        assert r == {"resumed": True, "same_sd": True, "back": True}


def _case_bridges_keep_counts() -> dict[str, Any]:
    """torch -> functional for SGD with momentum (torch records no step count) and for AdamW
    continued under ``inject_hyperparams`` with a schedule: two module-API steps, then two
    functional steps, against four module-API steps (the same schedule there)."""
    from functional_fsdp.core.errors import OptimizerStateError
    from functional_fsdp.functional import (
        adamw,
        chain,
        from_torch_optimizer,
        inject_hyperparams,
        make_train_step,
        scale_by_adam,
        scale_by_learning_rate,
        sgd,
    )

    out: dict[str, Any] = {}
    # SGD with momentum: the momentum buffer carries on (a count of 0 replaced it).
    shell, ref = _build(), _build()
    t_opt = torch.optim.SGD(shell.parameters(), lr=0.05, momentum=0.9)
    r_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    _shell_steps(shell, t_opt, range(2))
    _shell_steps(ref, r_opt, range(4))
    opt = sgd(0.05, momentum=0.9)
    try:
        from_torch_optimizer(shell, t_opt, opt)
        out["sgd_without_step"] = None
    except OptimizerStateError as e:
        out["sgd_without_step"] = str(e)
    state = from_torch_optimizer(shell, t_opt, opt, step=2)
    step = make_train_step(shell, _loss, opt)
    for s in range(2, 4):
        state, _ = step(state, _batch(s))
    out["sgd"] = _exact(state.params, ref)

    # AdamW under a schedule: the schedule continues at step 2 (it restarted at 0).
    def lr(count: int) -> float:
        return 1e-2 * (1.0 - 0.2 * count)

    shell, ref = _build(), _build()
    t_opt = torch.optim.AdamW(shell.parameters(), lr=lr(0), weight_decay=0.1)
    r_opt = torch.optim.AdamW(ref.parameters(), lr=lr(0), weight_decay=0.1)
    for s in range(2):
        t_opt.param_groups[0]["lr"] = lr(s)
        _shell_steps(shell, t_opt, range(s, s + 1))
    for s in range(4):
        r_opt.param_groups[0]["lr"] = lr(s)
        _shell_steps(ref, r_opt, range(s, s + 1))
    opt = inject_hyperparams(adamw)(lr=lr, weight_decay=0.1)
    state = from_torch_optimizer(shell, t_opt, opt)
    step = make_train_step(shell, _loss, opt)
    for s in range(2, 4):
        state, _ = step(state, _batch(s))
    out["scheduled"] = _exact(state.params, ref)
    # An optax-style chain has no AdamWState to take torch's moments: refused, not dropped.
    try:
        from_torch_optimizer(shell, t_opt, chain(scale_by_adam(), scale_by_learning_rate(1e-2)))
        out["chain"] = None
    except OptimizerStateError as e:
        out["chain"] = str(e)
    return out


def test_torch_optimizer_state_keeps_its_step_count_functionally(world2: Any) -> None:
    """From ``torch.optim.SGD`` (no recorded count: ``step=`` is required, else the next
    functional step was taken as the first and replaced the momentum, 3.47 off) and into an
    ``inject_hyperparams`` schedule (it restarted at 0, 3.9e-2 off): bit-equal to continuing
    with torch. A chain without ``AdamWState`` is refused instead of starting fresh."""
    for r in world2.run(_case_bridges_keep_counts):
        assert r["sgd_without_step"] is not None and "step=" in r["sgd_without_step"], r
        assert r["sgd"] == 0.0 and r["scheduled"] == 0.0, r
        assert r["chain"] is not None and "AdamWState" in r["chain"], r


def _case_summon_state() -> dict[str, bool]:
    from functional_fsdp.functional import adamw, init, make_train_step, summon_state, with_params

    model = _build()
    opt = adamw(1e-2)
    state, _ = make_train_step(model, _loss, opt)(init(model, opt), _batch(0))
    module_before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    head = state.params["head.weight"].full_tensor()
    with summon_state(state, model) as s:
        full_ok = tuple(s.params["head.weight"].shape) == tuple(head.shape)
        with torch.no_grad():
            s.params["head.weight"].mul_(0.5)
        s.params["ln_f.bias"] = torch.zeros_like(s.params["ln_f.bias"])
    new = s.state
    edited = torch.equal(new.params["head.weight"].full_tensor(), head * 0.5)
    replaced = bool((new.params["ln_f.bias"].full_tensor() == 0).all())
    kept = new.opt_state is state.opt_state and torch.equal(
        state.params["head.weight"].full_tensor(), head
    )
    module_kept = all(
        torch.equal(p.full_tensor(), module_before[n]) for n, p in model.named_parameters()
    )
    local = state.params["head.weight"].to_local() * 2
    doubled = with_params(state, {"head.weight": local})
    with_ok = torch.equal(doubled.params["head.weight"].full_tensor(), head * 2)
    return {
        "full": full_ok,
        "edited": edited,
        "replaced": replaced,
        "kept": kept,
        "module_kept": module_kept,
        "with_params": with_ok,
    }


def test_summon_state_edits_full_params_and_keeps_the_optimizer_state(world2: Any) -> None:
    for r in world2.run(_case_summon_state):
        assert all(r.values()), r


def _case_fsdp2_checkpoint_resumes_functionally(path: str) -> float:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from functional_fsdp.functional import adamw, from_torch_optimizer, make_train_step

    # An FSDP2-style checkpoint: the module's and torch AdamW's state dicts, saved with DCP.
    model = _build()
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _shell_steps(model, torch_opt, range(2))
    model_sd, optim_sd = get_state_dict(model, torch_opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    # Resume: load it the FSDP2 way into a fresh module and optimizer, then go functional.
    fresh = _build(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1)
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(fresh, fresh_opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    opt = adamw(1e-2, weight_decay=0.1)
    state = from_torch_optimizer(fresh, sd["optim"], opt)  # keyed by fqn
    step = make_train_step(fresh, _loss, opt)
    for s in range(2, 4):
        state, _ = step(state, _batch(s))
    _shell_steps(model, torch_opt, range(2, 4))
    return _exact(state.params, model)


def test_fsdp2_style_checkpoint_resumes_on_the_functional_path(world2: Any, tmp_path: Any) -> None:
    path = str(tmp_path / "fsdp2_ckpt")
    assert world2.run(_case_fsdp2_checkpoint_resumes_functionally, path) == [0.0, 0.0]
