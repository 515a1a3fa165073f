"""Muon (trainer.engine.muon): torch.optim.Muon's and AdamW's steps bit for bit, an update whose
singular values are pushed together, flat slices stepped as the parameters, and the arguments and
config rules around ``optim muon``. The 2-rank runs under ZeRO 1-3 are tests/e2e/test_muon.py."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.args import TrainingArguments
from trainer.config import ConfigError, Hardware, resolve
from trainer.engine.muon import Muon, muon_groups
from trainer.engine.partitions import Layout, Piece
from trainer.loop.steps import optimizer_for

CPU = Hardware.cpu()


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def _train(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], steps: int) -> None:
    for step in range(steps):
        ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(step))
        ids = ids.to(next(model.parameters()).device)
        for opt in optimizers:
            opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        for opt in optimizers:
            opt.step()


def test_the_split_is_hidden_matrices_against_embeddings_head_norms():
    model = _model()
    muon, decay, no_decay = muon_groups(model, 0.1, 0.02, 0.003)
    names = {id(p): n for n, p in model.named_parameters()}
    assert muon["muon"] and muon["lr"] == 0.02 and muon["weight_decay"] == 0.1
    assert len(muon["params"]) == 14 and all(p.dim() == 2 for p in muon["params"])  # 7 per layer
    assert sorted(names[id(p)] for p in decay["params"]) == ["lm_head.weight", "model.embed_tokens.weight"]
    assert (decay["lr"], decay["weight_decay"]) == (0.003, 0.1)
    assert all("norm" in names[id(p)] for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0


@pytest.mark.parametrize("scale", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_torch_muon_and_adamw_step_for_step(scale, nesterov):
    """With the iteration in bf16 (torch's), five steps equal torch.optim.Muon on the matrices and
    torch.optim.AdamW on the rest, bit for bit."""
    ours, theirs = _model(), _model()
    groups = muon_groups(ours, 0.1, 0.02, 0.003)
    opt = Muon(groups, nesterov=nesterov, update_scale=scale, ns_precision="bf16", betas=(0.9, 0.95))
    matrices, *rest = muon_groups(theirs, 0.1, 0.02, 0.003)
    reference = [
        torch.optim.Muon(
            matrices["params"], lr=0.02, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=scale
        ),
        torch.optim.AdamW(
            [dict(params=g["params"], weight_decay=g["weight_decay"]) for g in rest],
            lr=0.003,
            betas=(0.9, 0.95),
            foreach=False,
        ),
    ]
    _train(ours, [opt], 5)
    _train(theirs, reference, 5)
    start = _model()
    for (name, a), b, c in zip(ours.named_parameters(), theirs.parameters(), start.parameters(), strict=True):
        assert torch.equal(a, b), name
        assert not torch.equal(a, c), name  # every parameter moved


def _singular_values(matrix: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(matrix.double())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_update_is_orthogonalised(precision):
    """A gradient whose singular values spread over 100x moves the weight by a matrix whose singular
    values all lie in Newton-Schulz's band (about 0.7-1.2 after five steps) times the rate: a Muon
    left out (the update as the gradient, DeepSpeed PR #8438) keeps the spread."""
    gen = torch.Generator().manual_seed(3)
    u, _ = torch.linalg.qr(torch.randn(48, 48, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(32, 32, generator=gen))
    grad = u[:, :32] @ torch.diag(torch.logspace(0, -2, 32)) @ v.T
    weight = torch.nn.Parameter(torch.randn(48, 32, generator=gen))
    before = weight.detach().clone()
    opt = Muon(
        [dict(params=[weight], muon=True)], lr=0.1, momentum=0.0, nesterov=False, ns_precision=precision
    )
    weight.grad = grad.clone()
    opt.step()
    update = (before - weight.detach()) / (0.1 * (48 / 32) ** 0.5)
    values = _singular_values(update)
    assert values.min() > 0.6 and values.max() < 1.25, values
    spread = _singular_values(grad)
    assert spread.max() / spread.min() > 50  # what a gradient step would have kept


def test_a_flat_tensor_of_whole_matrices_steps_as_the_matrices():
    """One flat tensor holding the Muon half's matrices end to end (ZeRO's form on one rank), told
    where each lies, takes the same steps as the matrices themselves."""
    model = _model()
    matrices = muon_groups(model, 0.0, 0.02, 0.003)[0]["params"]
    flat = torch.cat([p.detach().reshape(-1) for p in matrices]).requires_grad_()
    pieces, start = [], 0
    for key, p in enumerate(matrices):
        pieces.append(Piece(start, p.numel(), key, True))
        start += p.numel()
    flat_opt = Muon(
        [dict(params=[p.detach().clone() for p in matrices], muon=True)], lr=0.02, ns_precision="fp32"
    )
    flat_opt.param_groups[0]["params"] = [flat]  # as DeepSpeed hands its flat partition over
    flat_opt.partitioned({flat: Layout(tuple(pieces), len(matrices), tuple(p.shape for p in matrices))}, None)
    opt = Muon([dict(params=matrices, muon=True)], lr=0.02, ns_precision="fp32")
    for step in range(3):
        ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        flat.grad = torch.cat([p.grad.reshape(-1) for p in matrices])
        opt.step()
        flat_opt.step()
    assert torch.equal(flat.detach(), torch.cat([p.detach().reshape(-1) for p in matrices]))


def test_a_resume_from_the_state_dict_continues_bitwise():
    model = _model()
    opt = Muon(muon_groups(model, 0.1, 0.02, 0.003), ns_precision="fp32")
    _train(model, [opt], 2)
    twin = copy.deepcopy(model)
    again = Muon(muon_groups(twin, 0.1, 0.02, 0.003), ns_precision="fp32")
    again.load_state_dict(copy.deepcopy(opt.state_dict()))
    _train(model, [opt], 2)
    _train(twin, [again], 2)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


# ---- arguments and config ------------------------------------------------------------------------


def test_optim_args_are_muon_settings_and_named_when_wrong():
    TrainingArguments(output_dir="out", optim="muon", optim_args="muon_lr=0.02,adam_lr=3e-4,ns_steps=6")
    with pytest.raises(ValueError, match=r"optim_args\.muon_rl: unknown key; did you mean muon_lr\?"):
        TrainingArguments(output_dir="out", optim="muon", optim_args="muon_rl=0.02")
    with pytest.raises(ValueError, match=r"optim_args\.update_scale"):
        TrainingArguments(output_dir="out", optim="muon", optim_args="update_scale=rms")


def test_optim_muon_resolves_to_a_muon_section_the_engine_builds():
    args = TrainingArguments(
        output_dir="out", optim="muon", max_steps=1, zero_stage=3, learning_rate=1e-3, weight_decay=0.1,
        optim_args="muon_lr=0.02,update_scale=match_rms_adamw",
    )  # fmt: skip
    ds = resolve(args, 2, CPU)
    assert ds["optimizer"] == {
        "type": "Muon",
        "params": {
            "lr": 1e-3,
            "muon_lr": 0.02,
            "update_scale": "match_rms_adamw",
            "betas": [0.9, 0.999],
            "eps": 1e-8,
            "weight_decay": 0.1,
        },
    }
    assert ds["zero_allow_untested_optimizer"] is True
    opt = optimizer_for(args, _model(), None, ds)
    assert isinstance(opt, Muon) and [g["lr"] for g in opt.param_groups] == [0.02, 1e-3, 1e-3]
    assert opt.param_groups[0]["update_scale"] == "match_rms_adamw"


def test_a_deepspeed_files_muon_section_builds_ours():
    ds = {"optimizer": {"type": "muon", "params": {"lr": 0.01, "adam_lr": 2e-3, "momentum": 0.9}}}
    args = TrainingArguments(output_dir="out", max_steps=1, zero_stage=2, deepspeed=ds)
    resolved = resolve(args, 2, CPU)
    assert resolved["optimizer"]["type"] == "Muon"
    opt = optimizer_for(args, _model(), None, resolved)
    assert [g["lr"] for g in opt.param_groups] == [0.01, 2e-3, 2e-3]  # the file's lr, learning_rate unset
    assert opt.param_groups[0]["momentum"] == 0.9
    bad = {"optimizer": {"type": "Muon", "params": {"ns_method": "gram"}}}
    with pytest.raises(ConfigError, match="ns_method.*torch.optim.Muon's quintic Newton-Schulz"):
        resolve(TrainingArguments(output_dir="out", max_steps=1, deepspeed=bad), 1, CPU)


@pytest.mark.parametrize(
    "fields, path",
    [
        (
            dict(zero_stage=3, offload_optimizer="nvme", nvme_path="/nvme"),
            "zero_optimization.offload_optimizer.device, optimizer.type",
        ),
        (
            dict(zero_stage=2, offload_optimizer="cpu", deepspeed={"zero_force_ds_cpu_optimizer": True}),
            "zero_force_ds_cpu_optimizer, optimizer.type",
        ),
        (dict(zero_stage=1, tensor_parallel_size=2), "tensor_parallel.autotp_size, optimizer.type"),
        (dict(zero_stage=1, pipeline_parallel_size=2), "pipeline.stages, optimizer.type"),
        (
            dict(zero_stage=1, bf16=True, deepspeed={"data_types": {"grad_accum_dtype": "float32"}}),
            "data_types.grad_accum_dtype, optimizer.type",
        ),
    ],
)
def test_what_muon_cannot_run_with_is_refused_by_key(fields, path):
    with pytest.raises(ConfigError) as err:
        resolve(TrainingArguments(output_dir="out", optim="muon", max_steps=1, **fields), 2, CPU)
    assert [p for p, _ in err.value.problems] == [path]


def test_muon_steps_on_the_host_under_cpu_offload():
    """ZeRO-Offload steps a client optimizer on the host once DeepSpeed is told not to insist on its
    CPU Adam (the launch matrix's offload cases train with it)."""
    args = TrainingArguments(
        output_dir="out", optim="muon", max_steps=1, zero_stage=3, offload_optimizer="cpu"
    )
    ds = resolve(args, 2, CPU)
    assert ds["optimizer"]["type"] == "Muon" and ds["zero_force_ds_cpu_optimizer"] is False


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_muon_runs_behind_zero0s_mixed_precision_wrapper(precision):
    """bf16/fp16 at ZeRO-0 hand Muon an fp32 copy of each whole parameter (tests/e2e/test_muon.py)."""
    fields = dict(output_dir="out", optim="muon", max_steps=1, zero_stage=0, **{precision: True})
    ds = resolve(TrainingArguments(**fields), 2, Hardware.cuda("H100", (9, 0)))
    assert ds["optimizer"]["type"] == "Muon" and ds[precision]["enabled"] is True


def test_a_constant_rate_keeps_the_two_halves_rates():
    """DeepSpeed's WarmupLR would set one rate for every group: under Muon the constant schedule is
    transformers' (each group's own rate), and a file's WarmupLR is refused by key."""
    args = TrainingArguments(output_dir="out", optim="muon", max_steps=1, lr_scheduler_type="constant")
    assert "scheduler" not in resolve(args, 1, CPU)
    ds = {"scheduler": {"type": "WarmupLR"}}
    with pytest.raises(ConfigError) as err:
        resolve(TrainingArguments(output_dir="out", optim="muon", max_steps=1, deepspeed=ds), 1, CPU)
    assert [p for p, _ in err.value.problems] == ["scheduler.type, optimizer.type"]


def test_the_planner_counts_one_moment_for_muons_matrices(capsys):
    """Llama-7B on 8 GPUs under ZeRO-3: Muon's matrices keep 4 bytes fewer a parameter than Adam's
    two moments (on the host under offload), and the setups the run would refuse (NVMe offload,
    tensor parallelism) are not offered."""
    from trainer.cli.main import main

    rows = {}
    for optim in ("adamw", "muon"):
        assert main(["plan", "--model", "llama-7b", "--optim", optim, "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        rows[optim] = result["configurations"]
        spec = result["model"]
    matrices = spec["n_params"] - spec["embedding_params"] - spec["small_params"]

    def zero3(optim: str) -> dict:
        return next(
            r
            for r in rows[optim]
            if (r["zero_stage"], r["offload_optimizer"], r["tensor_parallel"]) == (3, "none", 1)
        )

    saved = zero3("adamw")["optimizer_gb_per_gpu"] - zero3("muon")["optimizer_gb_per_gpu"]
    assert saved == pytest.approx(4 * matrices / 8 / 1e9)
    assert all(r["offload_optimizer"] != "nvme" and r["tensor_parallel"] == 1 for r in rows["muon"])
    offloaded = {o: next(r for r in rows[o] if (r["zero_stage"], r["offload_optimizer"]) == (3, "cpu"))
                 for o in rows}  # fmt: skip
    host = offloaded["adamw"]["cpu_gb_per_rank"] - offloaded["muon"]["cpu_gb_per_rank"]
    assert host == pytest.approx(4 * matrices / 8 / 1e9)


def test_the_model_card_names_muon_and_its_settings():
    from trainer.loop.model_card import _optimizer

    args = TrainingArguments(output_dir="out", optim="muon", max_steps=1, optim_args="muon_lr=0.02")
    assert _optimizer(args, resolve(args, 1, CPU), None) == (
        "Use Muon on the hidden matrices and AdamW on the rest (muon_lr=0.02, lr=5e-05, weight_decay=0.0, "
        "betas=[0.9, 0.999], eps=1e-08)"
    )


def test_lora_adapters_matrices_take_muon():
    """Under LoRA the trainable matrices are the adapters' (A: r x in, B: out x r): Muon's half."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    groups = muon_groups(model, 0.0, 0.02, 0.003)
    assert [g["muon"] for g in groups] == [True]
    names = {id(p): n for n, p in model.named_parameters()}
    assert len(groups[0]["params"]) == 8
    assert all("lora_A" in names[id(p)] or "lora_B" in names[id(p)] for p in groups[0]["params"])
    opt = Muon(groups, ns_precision="fp32")
    _train(model, [opt], 2)  # LoRA's B starts at zero: its first update is an orthogonalised gradient
    assert all(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)


# ---- the default job's Muon on the command line -----------------------------------------------------


def _parsed(recipe: dict, *flags: str, tmp_path) -> tuple:
    import yaml

    from trainer.args.recipe import parse_run_config

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"output_dir": "out", "max_steps": 10, **recipe}))
    run = parse_run_config(["--config", str(path), *flags])
    return run.training.optim, getattr(run.training, "optim_args", None)


MUON_RECIPE = {"optim": "muon", "optim_args": "muon_lr=0.01,adam_lr=0.003"}


@pytest.mark.parametrize(
    "flags, reason",
    [
        (
            ("--offload_optimizer", "nvme", "--nvme_path", "/nvme", "--zero_stage", "3"),
            "offload_optimizer nvme",
        ),
        (("--tensor_parallel_size", "2"), "tensor_parallel_size 2"),
        (("--pipeline_parallel_size", "2"), "pipeline_parallel_size 2"),
        (
            ("--deepspeed", '{"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}'),
            "the DeepSpeed config's AdamW optimizer",
        ),
    ],
)
def test_the_recipes_muon_gives_way_where_it_cannot_run(tmp_path, caplog, flags, reason):
    """The default job's Muon yields to AdamW (with a warning naming why) where a flag asks for what
    Muon does not run with; the user's own --optim muon there is refused instead (the resolver's)."""
    with caplog.at_level("WARNING"):
        assert _parsed(MUON_RECIPE, *flags, tmp_path=tmp_path) == ("adamw_torch", None)
    assert (
        f"optim: the recipe's muon gives way to adamw_torch (Muon does not run with {reason})" in caplog.text
    )


def test_the_recipes_muon_runs_elsewhere_and_an_optim_flag_drops_its_settings(tmp_path):
    assert _parsed(MUON_RECIPE, "--zero_stage", "3", tmp_path=tmp_path) == ("muon", MUON_RECIPE["optim_args"])
    assert _parsed(MUON_RECIPE, "--bf16", "--zero_stage", "1", tmp_path=tmp_path)[0] == "muon"
    assert _parsed(MUON_RECIPE, "--bf16", "--zero_stage", "0", tmp_path=tmp_path)[0] == "muon"
    assert (
        _parsed(MUON_RECIPE, "--offload_optimizer", "cpu", "--zero_stage", "2", tmp_path=tmp_path)[0]
        == "muon"
    )
    assert _parsed(MUON_RECIPE, "--optim", "lion", tmp_path=tmp_path) == ("lion", None)
    assert _parsed(MUON_RECIPE, "--optim", "muon", tmp_path=tmp_path) == ("muon", MUON_RECIPE["optim_args"])
    lars = ("--optim", "lars", "--optim_args", "momentum=0.8")
    assert _parsed(MUON_RECIPE, *lars, tmp_path=tmp_path) == ("lars", "momentum=0.8")
