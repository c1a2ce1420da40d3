"""The optimizer and loss as users write them, in a world of one: instances with parameter
groups, factories checked, what a strategy cannot honour refused in one line, the model's own
loss (equivalence at worlds 2 and 3: tests/multiproc/test_user_optimizer.py)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import phalanx as px
from phalanx.errors import ConfigError
from tests.helpers.models import batch

pytestmark = pytest.mark.usefixtures("fresh_world")  # no world of one before or after


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3))


def _groups(model: nn.Module) -> list[dict]:
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": 0.02},
    ]


@pytest.mark.parametrize("strategy", ["allreduce", "tree", "partitioned", "ps"])
def test_an_instance_keeps_its_object_and_groups(strategy: str) -> None:
    model = _model()
    optimizer = torch.optim.AdamW(_groups(model), lr=0.01)
    engine = px.Engine(model, nn.functional.cross_entropy, optimizer, exchange=strategy)
    engine.step(*batch(6))
    assert engine.optimizer is optimizer
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert [g["lr"] for g in optimizer.param_groups] == [0.01, 0.02]


def test_a_factory_that_ignores_its_parameters_is_refused() -> None:
    other = _model()
    with pytest.raises(ConfigError, match="does not hold exactly the parameters"):
        px.Engine(_model(), nn.functional.cross_entropy, lambda params: torch.optim.SGD(
            other.parameters(), lr=0.1))  # fmt: skip


def test_a_factory_over_the_same_parameters_is_accepted() -> None:
    model = _model()  # the GPT script's `lambda params: model.configure_optimizers(...)`
    engine = px.Engine(model, nn.functional.cross_entropy,
                       lambda params: torch.optim.AdamW(_groups(model), lr=0.01),
                       exchange="partitioned")  # fmt: skip
    engine.step(*batch(6))
    assert len(engine.optimizer.param_groups) == 2


@pytest.mark.parametrize(
    ("spec", "strategy", "message"),
    [
        (42, "allreduce", "pass a torch.optim.Optimizer built over the model's parameters"),
        (lambda params: None, "allreduce", "returned NoneType, not a torch.optim.Optimizer"),
        ("foreign", "allreduce", "not trainable parameters of the model"),
        ("lbfgs", "allreduce", "LBFGS needs a closure"),
        ("adafactor", "partitioned", "Adafactor is not known to be elementwise"),
    ],
)
def test_what_cannot_be_honoured_is_refused_in_one_line(spec, strategy, message) -> None:
    model = _model()
    if spec == "foreign":
        spec = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
    elif spec == "lbfgs":
        spec = torch.optim.LBFGS(model.parameters())
    elif spec == "adafactor":
        spec = torch.optim.Adafactor(model.parameters())
    with pytest.raises(ConfigError, match=message) as caught:
        px.Engine(model, nn.functional.cross_entropy, spec, exchange=strategy)
    assert "\n" not in str(caught.value)


def test_adafactor_under_allreduce_is_stepped_as_it_is() -> None:
    model = _model()
    optimizer = torch.optim.Adafactor(model.parameters(), lr=0.01)
    engine = px.Engine(model, nn.functional.cross_entropy, optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    engine.step(*batch(6))
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


class OwnLoss(nn.Module):
    def __init__(self, output: str) -> None:
        super().__init__()
        self.net, self.output = _model(), output

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, targets) if targets is not None else None
        if self.output == "tuple":
            return logits, loss
        if self.output == "dict":
            return {"logits": logits, "loss": loss}
        return logits


@pytest.mark.parametrize("output", ["tuple", "dict"])
def test_the_models_own_loss(output: str) -> None:
    model = OwnLoss(output)
    engine = px.Engine(model, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                       accumulate_steps=2)  # fmt: skip
    x, y = batch(6)
    loss = engine.step(x, targets=y)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert "net.0.weight" in engine.module.state_dict()  # the model's own key names


def test_an_output_without_a_loss_is_refused_in_one_line() -> None:
    engine = px.Engine(OwnLoss("logits"), optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(ConfigError, match="the model's output must be its loss"):
        engine.step(batch(6)[0])


def test_step_arguments_must_fit_the_loss() -> None:
    engine = px.Engine(_model(), nn.functional.cross_entropy, torch.optim.SGD, exchange="tree")
    x, y = batch(6)
    with pytest.raises(ConfigError, match=r"call step\(inputs, targets\)"):
        engine.step(x, y, x)
    with pytest.raises(ConfigError, match="optimizer: required"):
        px.Engine(_model(), nn.functional.cross_entropy)


@pytest.mark.parametrize("strategy", ["allreduce", "partitioned", "ps"])
def test_the_optimizer_state_round_trips_in_torchs_format(strategy: str) -> None:
    """``engine.optimizer_state_dict()`` equals a plain optimizer's ``state_dict()`` after the
    same steps, and ``engine.load_optimizer_state_dict`` puts it back; a state of another
    optimizer is one line (multi-process and resuming: tests/multiproc/test_user_optimizer.py)."""
    from phalanx.errors import CheckpointError

    model = _model()
    plain = torch.optim.AdamW(_groups(model), lr=0.01)
    for _ in range(2):
        plain.zero_grad()
        nn.functional.cross_entropy(model(batch(6)[0]), batch(6)[1]).backward()
        plain.step()
    model = _model()
    optimizer = torch.optim.AdamW(_groups(model), lr=0.01)
    engine = px.Engine(model, nn.functional.cross_entropy, optimizer, exchange=strategy)
    engine.step(*batch(6))
    engine.step(*batch(6))
    state = copy.deepcopy(engine.optimizer_state_dict())  # torch's: the live tensors
    expected = plain.state_dict()
    assert state["param_groups"] == expected["param_groups"]
    for n, entry in expected["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(state["state"][n][key], value)
    engine.step(*batch(6))
    engine.load_optimizer_state_dict(state)  # back to the state after two steps
    again = engine.optimizer_state_dict()
    torch.testing.assert_close(again["state"][0]["exp_avg"], expected["state"][0]["exp_avg"])
    with pytest.raises((CheckpointError, ValueError)) as caught:
        engine.load_optimizer_state_dict(torch.optim.AdamW(model.parameters()).state_dict())
    assert "\n" not in str(caught.value)


def test_frozen_parameters_left_in_a_group_keep_torchs_numbering() -> None:
    """Fine-tuning: an optimizer over ``model.parameters()`` with some frozen; under
    ``partitioned`` its state dict numbers them as one process does (they have no state)."""
    states = []
    for strategy in (None, "partitioned"):
        model = _model()
        model[1].requires_grad_(False)  # two frozen in the first group, numbered before others
        optimizer = torch.optim.AdamW(_groups(model)[::-1], lr=0.01)
        if strategy is None:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(batch(6)[0]), batch(6)[1]).backward()
            optimizer.step()
            states.append(optimizer.state_dict())
            continue
        engine = px.Engine(model, nn.functional.cross_entropy, optimizer, exchange=strategy)
        engine.step(*batch(6))
        states.append(engine.optimizer_state_dict())
        engine.load_optimizer_state_dict(states[0])  # and one process's loads back
    plain, sharded = states
    assert sharded["param_groups"] == plain["param_groups"]
    assert sharded["state"].keys() == plain["state"].keys()
    torch.testing.assert_close(sharded["state"][0]["exp_avg"], plain["state"][0]["exp_avg"])


@pytest.mark.parametrize("strategy", ["allreduce", "partitioned", "ps"])
def test_a_parameter_no_rank_used_is_not_stepped(strategy: str, caplog) -> None:
    """One process skips a parameter without a gradient (AdamW's decay does not move it, it
    gets no state); every strategy does the same, silently (worlds 2 and 3:
    tests/multiproc/test_owner_updates.py)."""

    class WithUnused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.unused = _model(), nn.Linear(3, 3)  # never called

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

    model = WithUnused()
    before = [p.detach().clone() for p in model.unused.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    engine = px.Engine(model, nn.functional.cross_entropy, optimizer, exchange=strategy)
    with caplog.at_level("WARNING", logger="phalanx"):
        engine.step(*batch(6))
        engine.step(*batch(6))
    engine.sync()
    assert all(torch.equal(a, b) for a, b in zip(before, model.unused.parameters()))
    assert sorted(engine.optimizer_state_dict()["state"]) == [0, 1, 2, 3, 4, 5]
    assert caplog.records == []


@pytest.mark.parametrize("strategy", ["allreduce", "partitioned", "ps"])
def test_unfreezing_after_the_engine_was_built_is_refused_in_one_line(strategy: str) -> None:
    """Progressive unfreezing: a parameter made trainable, or a group added to the optimizer,
    after the Engine was built would be stepped with each rank's own gradient (its exchange
    was fixed at construction); the next step refuses it. Freezing later is fine (it is then
    an unused parameter)."""
    model = _model()
    frozen = model[0].weight
    frozen.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    engine = px.Engine(model, nn.functional.cross_entropy, torch.optim.SGD(params, lr=0.1),
                       exchange=strategy)  # fmt: skip
    engine.step(*batch(6))
    model[2].bias.requires_grad_(False)  # freezing later: allowed
    engine.step(*batch(6))
    frozen.requires_grad_(True)
    with pytest.raises(ConfigError, match=r"step 3: parameter '0.weight' became trainable after"):
        engine.step(*batch(6))
    frozen.requires_grad_(False)
    engine.optimizer.add_param_group({"params": [frozen], "lr": 0.01})
    with pytest.raises(ConfigError, match="step 3: a parameter group was added to the optimizer"):
        engine.step(*batch(6))
    engine.close()


@pytest.mark.parametrize("strategy", ["allreduce", "partitioned"])
def test_a_submodule_the_script_keeps_in_eval_mode_stays_so(strategy: str) -> None:
    """Fine-tuning scripts freeze BatchNorm with ``bn.eval()`` once, before the loop: the Engine
    leaves the modes as the script set them (it used to call ``train()`` every step: 3.0 off
    one process), as a plain loop and DDP do."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
        model[1].eval()
        return model

    reference = build()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        nn.functional.cross_entropy(reference(batch(6)[0]), batch(6)[1]).backward()
        optimizer.step()
    model = build()
    engine = px.Engine(model, nn.functional.cross_entropy,
                       torch.optim.SGD(model.parameters(), lr=0.1), exchange=strategy)  # fmt: skip
    for _ in range(3):
        engine.step(*batch(6))
    assert not model[1].training and model[0].training
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(engine.module.state_dict()[name], value, msg=name)
    engine.close()
