"""LARS (trainer.engine.lars): one step by hand, pytorch_optimizer's updates step for step, flat
tensors of several parameters (what ZeRO hands an optimizer) stepped as the parameters themselves,
a resume from its state dict, and the arguments and config rules around ``optim lars``."""

from __future__ import annotations

import copy
import math
import os
import socket
import subprocess
import sys
import textwrap
from dataclasses import astuple

import pytest
import torch
from pytorch_optimizer import LARS as ReferenceLARS

from tests.helpers.launch import ROOT
from trainer.args import TrainingArguments
from trainer.config import ConfigError, Hardware, resolve
from trainer.engine import weight_decay_groups
from trainer.engine.lars import LARS
from trainer.engine.partitions import Layout, Piece


def test_one_step_by_hand():
    """w = [[3, 4]] (|w| = 5), g = [[0.6, 0.8]] (|g| = 1), wd 0.1, trust 0.02: the trust ratio is
    0.02 * 5 / (1 + 0.1 * 5) = 1/15; the matrix moves by lr * ratio * (g + wd w) = 0.5 * (1/15) *
    [0.9, 1.2] = [0.03, 0.04]. The bias takes a plain SGD step (no decay, no ratio): 0.5 * 2 = 1."""
    w = torch.nn.Parameter(torch.tensor([[3.0, 4.0]]))
    b = torch.nn.Parameter(torch.tensor([1.0]))
    opt = LARS([w, b], lr=0.5, weight_decay=0.1, momentum=0.9, trust_coefficient=0.02)
    w.grad, b.grad = torch.tensor([[0.6, 0.8]]), torch.tensor([2.0])
    opt.step()
    # The first momentum buffer is (1 - dampening) g: the step itself.
    assert w.detach().view(-1).tolist() == pytest.approx([2.97, 3.96], abs=1e-6)
    assert b.item() == pytest.approx(0.0, abs=1e-7)
    # The second step adds 0.9 of the first: same gradients, w now [2.97, 3.96].
    w.grad, b.grad = torch.tensor([[0.6, 0.8]]), torch.tensor([2.0])
    ratio = 0.02 * math.hypot(2.97, 3.96) / (1 + 0.1 * math.hypot(2.97, 3.96))
    update = [ratio * (g + 0.1 * x) for g, x in ((0.6, 2.97), (0.8, 3.96))]
    opt.step()
    want = [x - 0.5 * (u + 0.9 * d) for x, u, d in zip((2.97, 3.96), update, (0.06, 0.08), strict=True)]
    assert w.detach().view(-1).tolist() == pytest.approx(want, abs=1e-6)
    assert b.item() == pytest.approx(-1.0 - 0.9, abs=1e-6)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(32, 8, generator=gen)).square().mean().backward()
        opt.step()


@pytest.mark.parametrize(
    "settings",
    [
        dict(momentum=0.9, trust_coefficient=0.02),
        dict(momentum=0.9, trust_coefficient=0.02, nesterov=True),
        dict(momentum=0.5, dampening=0.3, trust_coefficient=0.1),
        dict(momentum=0.0, trust_coefficient=0.02),
    ],
)
def test_pytorch_optimizers_lars_step_for_step(settings):
    ours, theirs = _model(), _model()
    start = copy.deepcopy(ours.state_dict())
    kwargs = dict(lr=0.3, weight_decay=0.01, **settings)
    _train(ours, LARS(weight_decay_groups(ours, 0.01), **kwargs), 5)
    _train(theirs, ReferenceLARS(weight_decay_groups(theirs, 0.01), foreach=False, **kwargs), 5)
    for name, value in ours.state_dict().items():
        assert torch.equal(value, theirs.state_dict()[name]), name
        assert not torch.equal(value, start[name]), name  # every tensor moved


def _flat_twin(model: torch.nn.Module, cut: int) -> tuple[list[torch.Tensor], dict[torch.Tensor, Layout]]:
    """The model's parameters end to end in one flat tensor, cut in two at ``cut`` (as two ranks'
    ZeRO slices would be), with the layout of each slice."""
    params = list(model.parameters())
    whole = torch.cat([p.detach().reshape(-1) for p in params])
    slices = [whole[:cut].clone(), whole[cut:].clone()]
    layouts: dict[torch.Tensor, Layout] = {}
    for low, flat in ((0, slices[0]), (cut, slices[1])):
        pieces, offset = [], 0
        for key, p in enumerate(params):
            start, end = max(offset, low), min(offset + p.numel(), low + flat.numel())
            if start < end:
                pieces.append(Piece(start - low, end - start, key, p.dim() > 1))
            offset += p.numel()
        layouts[flat] = Layout(tuple(pieces), len(params))
    return slices, layouts


def test_pieces_of_one_slice_step_as_the_parameters_themselves():
    """One flat tensor holding every parameter whole takes the same steps as the parameters (one
    group, no decay: a slice mixes matrices and vectors, as a ZeRO group of one decay setting would)."""
    model = _model()
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params]).requires_grad_()
    flat_opt = LARS([flat], lr=0.3, momentum=0.9, trust_coefficient=0.02)
    flat_opt.partitioned({flat: _whole_layout(params)}, None)
    opt = LARS(params, lr=0.3, momentum=0.9, trust_coefficient=0.02)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(32, 8, generator=gen)
        opt.zero_grad()
        model(x).square().mean().backward()
        flat.grad = torch.cat([p.grad.reshape(-1) for p in params])
        opt.step()
        flat_opt.step()
    assert torch.equal(flat.detach(), torch.cat([p.detach().reshape(-1) for p in params]))


def _whole_layout(params: list[torch.Tensor]) -> Layout:
    pieces, offset = [], 0
    for key, p in enumerate(params):
        pieces.append(Piece(offset, p.numel(), key, p.dim() > 1))
        offset += p.numel()
    return Layout(tuple(pieces), len(params))


def _cut_in_two() -> tuple[list[torch.Tensor], dict[torch.Tensor, Layout], torch.Tensor, torch.Tensor, int]:
    """Two ranks' flat slices of the model's parameters, cut inside the first matrix, with their
    layouts; a gradient of the whole; the whole after one process's step on it (no momentum); the cut."""
    model = _model()
    params = list(model.parameters())
    cut = params[0].numel() // 2
    slices, layouts = _flat_twin(model, cut)
    whole = torch.cat([p.detach().reshape(-1) for p in params]).requires_grad_()
    grads = torch.randn(whole.numel(), generator=torch.Generator().manual_seed(2))
    whole.grad = grads.clone()
    one = LARS([whole], lr=0.3, momentum=0.0, trust_coefficient=0.02)
    one.partitioned({whole: _whole_layout(params)}, None)
    one.step()
    for flat, grad in zip(slices, (grads[:cut], grads[cut:]), strict=True):
        flat.requires_grad_()
        flat.grad = grad.clone()
    return slices, layouts, whole.detach(), params[0].numel(), cut


def test_a_slice_without_the_other_ranks_norms_steps_differently():
    """What the all-reduce is for: a parameter cut between two slices, each slice stepped on its
    own squares only (no group to add the other's), takes another step than the whole parameter."""
    slices, layouts, whole, first, cut = _cut_in_two()
    for flat in slices:
        alone = LARS([flat], lr=0.3, momentum=0.0, trust_coefficient=0.02)
        alone.partitioned({flat: layouts[flat]}, None)
        alone.step()
    stepped = torch.cat([s.detach() for s in slices])
    assert not torch.allclose(stepped[:cut], whole[:cut], rtol=1e-4)
    # The parameters no slice cuts take the same step.
    assert torch.equal(stepped[first:], whole[first:])


# One rank of two: its slice stepped with the group of both. lars.py (and the partitions it reads) is loaded alone, without the
# package's imports (DeepSpeed, transformers), which would take each rank about 10 s here.
RANK_SCRIPT = textwrap.dedent(
    """
    import importlib.util, sys, torch, torch.distributed as dist
    def alone(name, path):
        spec = importlib.util.spec_from_file_location(name, path)
        module = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    parts = alone("trainer.engine.partitions", "trainer/engine/partitions.py")
    lars = alone("lars", "trainer/engine/lars.py")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mine = torch.load(sys.argv[1], weights_only=True)[rank]
    flat = mine["flat"].requires_grad_()
    flat.grad = mine["grad"]
    opt = lars.LARS([flat], lr=0.3, momentum=0.0, trust_coefficient=0.02)
    layout = parts.Layout(tuple(parts.Piece(*piece) for piece in mine["pieces"]), mine["keys"])
    opt.partitioned({flat: layout}, dist.group.WORLD)
    opt.step()
    torch.save(flat.detach(), f"{sys.argv[2]}.{rank}")
    dist.destroy_process_group()
    """
)


def test_two_ranks_add_the_squares_of_a_cut_parameter_up_and_step_as_one_process(tmp_path):
    """Two gloo ranks, each holding one slice: with the squares summed over the group, the cut
    matrix takes the whole matrix's step (to fp32 rounding of the two partial sums; alone, the
    slices are more than 1e-4 off)."""
    slices, layouts, whole, _, _ = _cut_in_two()
    data = [
        {
            "flat": f.detach(),
            "grad": f.grad,
            "pieces": [astuple(p) for p in layouts[f].pieces],
            "keys": layouts[f].keys,
        }
        for f in slices
    ]
    torch.save(data, tmp_path / "slices.pt")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(tmp_path / "slices.pt"), str(tmp_path / "stepped")],
            cwd=ROOT,
            env={**env, "RANK": str(rank)},
        )
        for rank in range(2)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    stepped = torch.cat([torch.load(tmp_path / f"stepped.{rank}", weights_only=True) for rank in range(2)])
    torch.testing.assert_close(stepped, whole, rtol=1e-6, atol=0)


def test_a_resume_from_the_state_dict_continues_bitwise():
    straight, resumed = _model(), _model()
    opt = LARS(weight_decay_groups(straight, 0.01), lr=0.3, weight_decay=0.01, trust_coefficient=0.02)
    _train(straight, opt, 6)
    first = LARS(weight_decay_groups(resumed, 0.01), lr=0.3, weight_decay=0.01, trust_coefficient=0.02)
    _train(resumed, first, 3)
    saved = copy.deepcopy(first.state_dict())
    assert all("momentum_buffer" in s for s in saved["state"].values())
    again = LARS(weight_decay_groups(resumed, 0.01), lr=0.3, weight_decay=0.01, trust_coefficient=0.02)
    again.load_state_dict(saved)
    # The same batches 4-6 as the straight run: skip the generator past the first three.
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        torch.randn(32, 8, generator=gen)
    for _ in range(3):
        again.zero_grad()
        resumed(torch.randn(32, 8, generator=gen)).square().mean().backward()
        again.step()
    for name, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name


def test_optim_args_are_lars_settings_and_named_when_wrong():
    args = TrainingArguments(
        output_dir="out", optim="lars", optim_args="momentum=0.8, trust_coefficient=0.01"
    )
    assert args.optim_args == "momentum=0.8, trust_coefficient=0.01"
    with pytest.raises(ValueError, match=r"optim_args\.momentun: unknown key; did you mean momentum\?"):
        TrainingArguments(output_dir="out", optim="lars", optim_args="momentun=0.8")
    with pytest.raises(ValueError, match="optim_args: read by optim lars and muon only"):
        TrainingArguments(output_dir="out", optim="sgd", optim_args="momentum=0.8")


CPU = Hardware.cpu()


def _problems(**fields) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as err:
        resolve(TrainingArguments(output_dir="out", optim="lars", max_steps=1, **fields), 2, CPU)
    return err.value.problems


def test_lars_is_passed_to_deepspeed_which_is_told_to_accept_it():
    ds = resolve(TrainingArguments(output_dir="out", optim="lars", max_steps=1, zero_stage=2), 2, CPU)
    assert "optimizer" not in ds and ds["zero_allow_untested_optimizer"] is True


@pytest.mark.parametrize(
    "fields, path",
    [
        (
            dict(zero_stage=3, offload_optimizer="nvme", nvme_path="/nvme"),
            "zero_optimization.offload_optimizer.device, optim",
        ),
        (dict(zero_stage=1, tensor_parallel_size=2), "tensor_parallel.autotp_size, optim"),
        (dict(zero_stage=1, pipeline_parallel_size=2), "pipeline.stages, optim"),
        (dict(deepspeed={"optimizer": {"type": "SGD"}}), "optimizer, optim"),
    ],
)
def test_what_lars_cannot_run_with_is_refused_by_key(fields, path):
    assert [p for p, _ in _problems(**fields)] == [path]


def test_lamb_under_optimizer_offload_is_refused():
    ds = {"optimizer": {"type": "Lamb"}, "zero_allow_untested_optimizer": True,
          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}  # fmt: skip
    with pytest.raises(ConfigError) as err:
        resolve(TrainingArguments(output_dir="out", max_steps=1, deepspeed=ds), 1, CPU)
    assert [p for p, _ in err.value.problems] == [
        "optimizer.type, zero_optimization.offload_optimizer.device"
    ]
    assert "Adam/AdamW, Adagrad and Lion with its CPU kernels" in str(err.value)


def test_the_model_card_names_lars_and_its_settings():
    from trainer.loop.model_card import _optimizer

    args = TrainingArguments(output_dir="out", optim="lars", weight_decay=0.01, optim_args="momentum=0.8")
    assert _optimizer(args, {}, None) == "Use lars with weight_decay=0.01 and optim_args=momentum=0.8"
