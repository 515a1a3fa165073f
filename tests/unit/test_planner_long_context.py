"""The planner's long-context model: activations and logits measured on a CPU against the prediction,
the saved tensors counted on HF's Llama, sequence parallelism, tiling, activation offload, and
`trainer plan`'s long-context flags."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.bench.activation_memory import CASES, measure_all
from trainer.cli.main import main
from trainer.planner import (
    GB,
    LOSS_TILE_BYTES,
    Cluster,
    LongContext,
    Setup,
    activation_bytes,
    candidate_setups,
    estimate,
    head_bytes,
    layer_saved_bytes,
    load_model_spec,
    loss_tile_tokens,
    plan,
    setups,
    spec_from_hf_config,
    tiled_loss_auto,
)

LLAMA_8B = load_model_spec("llama-8b")


@pytest.fixture(scope="module")
def measured() -> dict[str, dict]:
    """Every case of the helper, two interpreters at a time (about 20 s on two cores)."""
    return {r["case"]["name"]: r for r in measure_all(list(CASES.values()), workers=2)}


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak from Linux's /proc")
@pytest.mark.parametrize("name", sorted(CASES))
def test_measured_peak_matches_the_prediction(measured, name):
    r = measured[name]
    assert r["measured"] > 100 * 2**20, r  # large enough that a few stray MiB do not matter
    assert r["predicted"] == pytest.approx(r["measured"], rel=0.15), r


def _saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Bytes of the distinct tensors autograd keeps for backward after one forward, weights left out."""
    out = model(input_ids=ids).logits
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes: dict[int, int] = {}
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            value = getattr(node, name) if name.startswith("_saved_") else None
            for t in value if isinstance(value, tuple) else [value]:
                if isinstance(t, torch.Tensor) and t.numel() > 1:
                    storage = t.untyped_storage()
                    if storage.data_ptr() not in weights:
                        sizes[storage.data_ptr()] = storage.nbytes()
        stack += [fn for fn, _ in node.next_functions]
    return sum(sizes.values())


@pytest.mark.parametrize("dtype, kv_heads", [(torch.float32, 4), (torch.float32, 2), (torch.bfloat16, 2)])
def test_saved_tensors_are_the_counted_ones(dtype, kv_heads):
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": kv_heads, "vocab_size": 300}  # fmt: skip
    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"}, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(dtype).train()
    tokens, precision = 96, "fp32" if dtype == torch.float32 else "bf16"
    got = _saved_bytes(model, torch.randint(0, 300, (1, tokens)))
    spec = spec_from_hf_config(cfg)
    per_layer = sum(layer_saved_bytes(spec, precision, tokens).values())
    final_norm = head_bytes(spec, precision, tokens, tiled_loss=False)["final_norm"]
    rope = 2 * (2 if dtype == torch.bfloat16 else 4) * 16 * tokens
    # The token ids the embedding keeps (8 bytes each) belong to the batch, resident anyway.
    assert got - 8 * tokens == 2 * per_layer * tokens + final_norm + rope


def test_sequence_parallel_divides_the_activations_of_a_rank():
    ckpt = Setup(0, "none", "none", True, tiled_loss=True)
    one = activation_bytes(LLAMA_8B, 131072, 1, "bf16", ckpt)["gpu"]
    for n in (2, 4, 8):
        split = activation_bytes(LLAMA_8B, 131072, 1, "bf16", Setup(0, "none", "none", True, n, True))["gpu"]
        # Not quite 1/N: under Ulysses o_proj's input is a tensor of its own, and the all-to-all stages copies.
        assert 0.85 * n < one / split <= n
    plain = Setup(0, "none", "none", False)
    for n in (2, 8):
        split = activation_bytes(LLAMA_8B, 8192, 1, "bf16", Setup(0, "none", "none", False, n))["gpu"]
        assert 0.85 * n < activation_bytes(LLAMA_8B, 8192, 1, "bf16", plain)["gpu"] / split <= n


def test_tiled_loss_keeps_one_tile_of_logits():
    vocab, tokens = LLAMA_8B.vocab_size, 16384
    tile = loss_tile_tokens(vocab)
    assert tile == 2**28 // (4 * vocab) == 523
    whole = head_bytes(LLAMA_8B, "bf16", tokens, tiled_loss=False)["logits"]
    tiled = head_bytes(LLAMA_8B, "bf16", tokens, tiled_loss=True)["logits"]
    assert whole == 12 * vocab * tokens  # ~25 GB: three fp32 [tokens x vocab] tensors
    hidden_grads = 2 * 2 * 4096 * tokens  # the hidden states' gradient, in tiles and joined
    assert tiled == 12 * vocab * tile + hidden_grads
    assert tiled < whole / 10
    # A sequence shorter than one tile is one tile.
    assert (
        head_bytes(LLAMA_8B, "bf16", 100, tiled_loss=True)["logits"] == 12 * vocab * 100 + 2 * 2 * 4096 * 100
    )


def test_auto_rule_tiles_above_256_mib_of_fp32_logits():
    assert not tiled_loss_auto(32000, 2048)  # 262 MB, just under 2**28 bytes
    assert tiled_loss_auto(32000, 4096)
    assert not tiled_loss_auto(1, LOSS_TILE_BYTES // 4) and tiled_loss_auto(1, LOSS_TILE_BYTES // 4 + 1)
    # The rule reads the tokens a rank holds: sequence parallelism can bring them under a tile.
    setups_ = candidate_setups(load_model_spec("llama-7b"), Cluster(), 4096, 1, LongContext(2))
    assert {(s.sequence_parallel, s.tiled_loss) for s in setups_} == {(1, True), (2, False)}


def test_offload_moves_checkpointed_inputs_to_the_host_column():
    cluster = Cluster(gpus_per_node=8)
    kept = Setup(3, "none", "none", True, 8, True)
    moved = Setup(3, "none", "none", True, 8, True, offload_activations=True)
    a = estimate(LLAMA_8B, kept, cluster, 131072, 1)
    b = estimate(LLAMA_8B, moved, cluster, 131072, 1)
    inputs = 32 * 2 * 4096 * 131072 / 8  # every layer's bf16 input for the rank's 16384 tokens
    assert b["activations_cpu_gb_per_rank"] == pytest.approx(inputs / GB)
    # The GPU keeps one layer's input, fetched back for its recompute.
    assert a["activations_gb_per_gpu"] - b["activations_gb_per_gpu"] == pytest.approx(31 / 32 * inputs / GB)
    # The node's host memory is the larger of the load peak (ZeRO-3: 2Ψ/8 per rank) and the steady state.
    assert a["cpu_gb_per_node"] == pytest.approx(2 * LLAMA_8B.n_params / GB)
    assert b["cpu_gb_per_node"] == pytest.approx(8 * inputs / GB)
    # Without checkpointing there is nothing checkpointed to move.
    plain = activation_bytes(
        LLAMA_8B, 8192, 1, "bf16", Setup(3, "none", "none", False, offload_activations=True)
    )
    assert plain["cpu"] == 0


def test_without_long_context_options_the_setups_are_the_old_ones():
    assert candidate_setups(load_model_spec("llama-7b"), Cluster(), 2048, 1) == setups()
    result = plan(load_model_spec("llama-7b"), Cluster(), 2048, 1)
    assert result["long_context"]["sequence_parallel_sizes"] == [1]


def test_recommendation_takes_the_fewest_features_then_the_smallest_size(capsys):
    argv = ["plan", "--model", "llama-8b", "--seq-len", "131072", "--sequence-parallel", "8", "--json"]
    assert main([*argv, "--tiled-mlp", "--offload-activations"]) == 0
    result = json.loads(capsys.readouterr().out)
    best = result["recommended"]
    assert result["long_context"]["sequence_parallel_sizes"] == [1, 2, 4, 8]
    # Checkpointing alone (with the loss tiled by the auto rule) fits at SP 2; SP 1 needs more features.
    assert (best["activation_checkpointing"], best["tiled_mlp"], best["offload_activations"]) == (
        True,
        False,
        False,
    )
    assert (best["sequence_parallel"], best["tiled_loss"], best["zero_stage"]) == (2, True, 2)
    assert best["training_flags"] == ["--gradient_checkpointing true", "--sequence_parallel_size 2"]
    assert best["deepspeed_config"]["train_batch_size"] == 4  # 8 GPUs, 2 a sequence: 4 sequences a step
    fitting = [r for r in result["configurations"] if r["fits"]]
    assert all(r["sequence_parallel"] >= 2 or r["offload_optimizer"] != "none" or r["tiled_mlp"]
               or r["offload_activations"] for r in fitting)  # fmt: skip


def test_text_report_shows_the_activation_table(capsys):
    argv = ["plan", "--model", "llama-8b", "--seq-len", "131072", "--sequence-parallel", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    table = out.split("loss tiles of 523 tokens):\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert table[0].split() == ["ckpt", "loss", "mlp", "offload", "|", "SP=1", "SP=2", "SP=4", "SP=8"]
    assert len(table) == 2 + 12 + 3  # 12 combinations, logits whole and tiled, offload's host memory
    assert "fastest configuration first, with sequence parallel 2, tiled loss:" in out
    assert "\ntrain with --gradient_checkpointing true --sequence_parallel_size 2\n" in out


def test_no_tiled_loss_is_spelled_out(capsys):
    argv = [
        "plan",
        "--model",
        "llama-8b",
        "--seq-len",
        "131072",
        "--sequence-parallel",
        "8",
        "--no-tiled-loss",
    ]
    assert main([*argv, "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["recommended"]
    assert best["tiled_loss"] is False and best["sequence_parallel"] == 8
    assert best["training_flags"][-1] == "--tiled_loss false"


@pytest.fixture
def odd_model(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 768, "num_hidden_layers": 2, "num_attention_heads": 48,
           "num_key_value_heads": 8, "intermediate_size": 2048, "vocab_size": 1000}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "llama-8b", "--sequence-parallel", "3"],
         "--sequence-parallel: 3 cannot be used: the 32 attention heads do not split 3 ways; the 8 key/value "
         "heads neither split 3 ways nor divide 3; --seq-len 2048 does not split 3 ways; the world of 8 GPUs "
         "does not split into groups of 3"),
        (["--model", "llama-8b", "--sequence-parallel", "16", "--nodes", "2"], None),
        (["--model", "llama-8b", "--sequence-parallel", "8", "--gpus-per-node", "4"],
         "--sequence-parallel: 8 cannot be used: the world of 4 GPUs does not split into groups of 8"),
        (["--model", "llama-8b", "--sequence-parallel", "8", "--seq-len", "1004"],
         "--sequence-parallel: 8 cannot be used: --seq-len 1004 does not split 8 ways"),
        (["--model", "llama-8b", "--sequence-parallel", "0"], "--sequence-parallel: must be > 0, got 0"),
    ],
)  # fmt: skip
def test_sequence_parallel_is_checked_naming_the_flag(capsys, argv, message):
    code = main(["plan", *argv])
    captured = capsys.readouterr()
    if message is None:  # 16 ways with 8 kv heads: DeepSpeed replicates them, so this is allowed
        assert code == 0, captured.err
        return
    assert code == 2 and captured.out == ""
    assert captured.err == f"trainer plan: {message}\n"


def test_kv_heads_must_split_or_divide(capsys, odd_model):
    # 48 heads split 12 ways, but 8 kv heads neither split 12 ways nor divide 12.
    argv = [
        "plan",
        "--model",
        odd_model,
        "--sequence-parallel",
        "12",
        "--gpus-per-node",
        "12",
        "--seq-len",
        "3072",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == ("trainer plan: --sequence-parallel: 12 cannot be used: the 8 key/value heads neither "
                   "split 12 ways nor divide 12\n")  # fmt: skip


def test_sizes_are_the_usable_divisors(odd_model):
    spec = load_model_spec(odd_model)
    options = LongContext(sequence_parallel=8)
    sizes = {s.sequence_parallel for s in candidate_setups(spec, Cluster(), 4096, 1, options)}
    assert sizes == {1, 2, 4, 8}
    per_size = defaultdict(set)
    for s in candidate_setups(spec, Cluster(gpus_per_node=16), 4096, 1, LongContext(16)):
        per_size[s.sequence_parallel].add(s.zero_stage)
    assert sorted(per_size) == [1, 2, 4, 8, 16]  # 48 heads split 16 ways; 16 replicates the 8 kv heads
