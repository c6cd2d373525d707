"""The one training loop's checkpoint state (python_api/finetune/loop.py), in process, no launch:
[Note: the optimizer state crosses ranks on the host] and the pp = 1 format of a pipeline's
optimizer.pt ([Note: pipelined checkpoints] in python_api/finetune/pipelined.py).

A pipeline's stages each hold some of the adapters, so optimizer.pt is gathered from every
stage (Engine.gather_states, an exchange over the pp group) and each rank takes its own
entries back by name when it resumes. The first test checks that what reaches the exchange is
on the host whatever device the optimizer state lives on: a CUDA tensor pickled by one stage
unpickles onto that stage's device on every other rank (issue 30's review finding). On a
machine without a GPU the state is made to report a CUDA device (a tensor subclass); without
the loop's copy to the host, the subclass itself would reach the exchange and the test fails
(checked by removing `.cpu()` from loop.optimizer_state, 2026-12-03).
"""

from __future__ import annotations

import io

import torch
import torch.nn as nn

from elastic_kernels.api.finetune.engine import Engine
from elastic_kernels.api.finetune.loop import adamw, local_optimizer_state, optimizer_state

ARGS = type("Args", (), {"lr": 1e-2, "weight_decay": 0.0})()


class _OnGPU(torch.Tensor):
    """A host tensor that says it lives on cuda:1, as a stage's AdamW state does on a GPU rank;
    .cpu() gives a plain host copy, as it would of a CUDA tensor."""

    @property
    def device(self):
        return torch.device("cuda", 1)

    def cpu(self, *args, **kwargs):
        return self.as_subclass(torch.Tensor).clone()


class _Stage(Engine):
    """One stage of a two-stage pipeline over the parameters p0, p1, p2: this stage holds
    `names`; `others` is what the other stage's rank contributes to the exchange."""

    def __init__(self, names: list[str], others: dict):
        self.names, self.others, self.sent = names, others, None

    def param_order(self) -> list[str]:
        return ["p0", "p1", "p2"]

    def gather_states(self, mine: dict) -> list[dict]:
        self.sent = mine  # what this rank pickles into the exchange
        return [mine, self.others]


def _params(seed: int) -> dict[str, nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return {n: nn.Parameter(torch.randn(shape, generator=g)) for n, shape in (("p0", (3, 4)), ("p1", (5,)),
                                                                             ("p2", (2, 2)))}


def _stepped(params: dict, names: list[str], steps: int = 2) -> torch.optim.AdamW:
    """AdamW over `names`, stepped on fixed gradients (so it has exp_avg, exp_avg_sq, step)."""
    opt = adamw([params[n] for n in names], ARGS)
    for k in range(steps):
        for n in names:
            params[n].grad = torch.full_like(params[n], 0.1 * (k + 1)) + params[n].detach() * 0.01
        opt.step()
    return opt


def _host_entries(opt: torch.optim.AdamW, names: list[str]) -> dict:
    return {names[i]: {k: v.clone() for k, v in e.items()} for i, e in opt.state_dict()["state"].items()}


def _through_a_file(state: dict) -> dict:
    """optimizer.pt written and read back (torch.save, then torch.load as read_checkpoint does)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, map_location="cpu", weights_only=True)


def test_the_optimizer_state_reaches_the_exchange_on_the_host():
    params = _params(0)
    mine_names, other_names = ["p0", "p2"], ["p1"]
    opt = _stepped(params, mine_names)
    other = _host_entries(_stepped(params, other_names), other_names)
    want = _host_entries(opt, mine_names)
    for p in opt.state.values():  # the state as a GPU rank holds it
        for k in ("exp_avg", "exp_avg_sq"):
            p[k] = p[k].as_subclass(_OnGPU)
    assert all(t.device.type == "cuda" for st in opt.state.values() for k, t in st.items() if k != "step")
    engine = _Stage(mine_names, other)
    state = optimizer_state(engine, opt, mine_names)
    for name, entry in engine.sent.items():
        for k, t in entry.items():
            assert type(t) is torch.Tensor and t.device.type == "cpu", (name, k, type(t), t.device)
            torch.testing.assert_close(t, want[name][k], rtol=0, atol=0)
    # optimizer.pt: every stage's state under the pp = 1 names and order, and it loads as written.
    assert state["param_names"] == ["p0", "p1", "p2"]
    sd = state["state_dict"]
    assert sorted(sd["state"]) == [0, 1, 2] and sd["param_groups"][0]["params"] == [0, 1, 2]
    for i, name in enumerate(state["param_names"]):
        ref = want[name] if name in want else other[name]
        for k in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(sd["state"][i][k], ref[k], rtol=0, atol=0)
    loaded = _through_a_file(state)
    assert all(type(t) is torch.Tensor for e in loaded["state_dict"]["state"].values() for t in e.values())


def test_a_stage_resumes_its_own_entries_bit_for_bit():
    """The gathered state mapped back onto one stage's parameters (local_optimizer_state) gives
    that stage's optimizer the state it had: the next AdamW step is bit-identical."""
    params = _params(1)
    mine_names = ["p2", "p0"]  # this stage's own order differs from the pp = 1 order
    opt = _stepped(params, mine_names)
    other = _host_entries(_stepped(params, ["p1"]), ["p1"])
    state = _through_a_file(optimizer_state(_Stage(mine_names, other), opt, mine_names))

    resumed_params = {n: nn.Parameter(params[n].detach().clone()) for n in mine_names}
    resumed = adamw([resumed_params[n] for n in mine_names], ARGS)
    resumed.load_state_dict(local_optimizer_state(state["state_dict"], state["param_names"], mine_names))
    for n in mine_names:
        g = torch.full_like(params[n], -0.3) + params[n].detach() * 0.02
        params[n].grad, resumed_params[n].grad = g.clone(), g.clone()
    opt.step()
    resumed.step()
    for n in mine_names:
        assert torch.equal(resumed_params[n], params[n]), n
