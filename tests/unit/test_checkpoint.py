"""Checkpoint directories on one process: commit, discovery, verification, fallback, rotation, RNG,
world-size arithmetic. Real files, no DeepSpeed (the launcher tests cover DeepSpeed's shards)."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
import yaml

from trainer import checkpoint as ckpt
from trainer.args import RunConfig
from trainer.cli import train as run_module
from trainer.cli import train_job
from trainer.config.errors import ConfigError
from trainer.runtime.distributed import DistInfo
from trainer.runtime.mesh import Mesh, Sizes

ONE = DistInfo(rank=0, local_rank=0, world_size=1)


def make_checkpoint(root: Path, step: int, *, world: int = 2, batch: int = 8, complete: bool = True) -> Path:
    """A committed checkpoint-<step> with small DeepSpeed-like files (or an unmarked one)."""
    staging = ckpt.staging_dir(root, step)
    (staging / "ds").mkdir(parents=True)
    for rank in range(world):
        (staging / "ds" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(bytes([rank]) * 1000)
    (staging / "ds" / "mp_rank_00_model_states.pt").write_bytes(b"model" * 200)
    (staging / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    final = ckpt.final_dir(root, step)
    meta = {"step": step, "world_size": world, "data_parallel_size": world, "train_batch_size": batch}
    ckpt.commit(staging, final, meta)
    if not complete:
        (final / ckpt.MARKER).unlink()
    return final


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# ---- commit and discovery ------------------------------------------------------------------------


def test_commit_writes_manifest_then_marker(tmp_path):
    path = make_checkpoint(tmp_path, 5)
    assert not ckpt.staging_dir(tmp_path, 5).exists()
    assert ckpt.is_complete(path)
    manifest = ckpt.read_manifest(path)
    assert manifest["step"] == 5 and manifest["world_size"] == 2
    shard = path / "ds" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    entry = manifest["files"]["ds/zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert entry == {"size": 1000, "xxh3_128": xxhash.xxh3_128(shard.read_bytes()).hexdigest()}
    assert sorted(manifest["files"]) == [
        "ds/mp_rank_00_model_states.pt",
        "ds/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "ds/zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "trainer_state.json",
    ]
    assert shard.is_file() and (path / "COMPLETE").read_text() == "ok\n"


def test_commit_replaces_an_existing_directory_of_the_same_step(tmp_path):
    old = make_checkpoint(tmp_path, 5, batch=8)
    (old / "stale.bin").write_bytes(b"x")
    new = make_checkpoint(tmp_path, 5, batch=16)
    assert new == old and not (new / "stale.bin").exists()
    assert ckpt.read_manifest(new)["train_batch_size"] == 16 and ckpt.is_complete(new)


def test_only_marked_checkpoints_are_listed_in_step_order(tmp_path):
    for step in (9, 10, 100):
        make_checkpoint(tmp_path, step)
    make_checkpoint(tmp_path, 200, complete=False)  # renamed but never marked
    (tmp_path / ".staging-checkpoint-300").mkdir()  # a save that died before its rename
    (tmp_path / "checkpoint-abc").mkdir()
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == [
        "checkpoint-9",
        "checkpoint-10",
        "checkpoint-100",
    ]
    assert ckpt.complete_checkpoints(tmp_path / "missing") == []


def test_stale_staging_directories_are_removed(tmp_path):
    make_checkpoint(tmp_path, 5)
    (tmp_path / ".staging-checkpoint-7" / "ds").mkdir(parents=True)
    ckpt.remove_stale_staging(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-5"]


# ---- verification --------------------------------------------------------------------------------


def test_intact_checkpoint_verifies(tmp_path):
    assert ckpt.verify(make_checkpoint(tmp_path, 5)) == []


def test_truncated_flipped_and_missing_files_are_named(tmp_path):
    path = make_checkpoint(tmp_path, 5)
    shard = path / "ds" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:400])
    flip_byte(path / "ds" / "mp_rank_00_model_states.pt")
    (path / "trainer_state.json").unlink()
    assert ckpt.verify(path) == [
        f"{path}/ds/mp_rank_00_model_states.pt: checksum does not match the manifest",
        f"{path}/ds/zero_pp_rank_1_mp_rank_00_optim_states.pt: size 400 bytes, the manifest says 1000",
        f"{path}/trainer_state.json: missing",
    ]


def test_ranks_share_the_files_and_cover_them_all(tmp_path):
    path = make_checkpoint(tmp_path, 5)
    for name in ckpt.read_manifest(path)["files"]:
        flip_byte(path / name)
    shares = [ckpt.verify(path, rank, 3) for rank in range(3)]
    assert [len(s) for s in shares] == [2, 1, 1]
    assert sorted(p for s in shares for p in s) == ckpt.verify(path)


def test_a_checkpoint_with_sha256_sums_still_verifies(tmp_path):
    """Manifests written before xxh3-128 hold sha256 sums: those are checked, a bad file named."""
    path = make_checkpoint(tmp_path, 5)
    manifest = ckpt.read_manifest(path)
    for name, entry in manifest["files"].items():
        entry.pop("xxh3_128")
        entry["sha256"] = hashlib.sha256((path / name).read_bytes()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert ckpt.verify(path) == []
    flip_byte(path / "trainer_state.json")
    assert ckpt.verify(path) == [f"{path}/trainer_state.json: checksum does not match the manifest"]


def test_an_entry_without_a_known_checksum_is_refused_by_name(tmp_path):
    path = make_checkpoint(tmp_path, 5)
    manifest = ckpt.read_manifest(path)
    size = (path / "trainer_state.json").stat().st_size
    manifest["files"]["trainer_state.json"] = {"size": size, "md5": "0" * 32}
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert ckpt.verify(path) == [
        f"{path}/trainer_state.json: the manifest has no checksum for it (expected one of: xxh3_128, sha256)"
    ]


def test_unreadable_manifest_is_a_problem_not_a_crash(tmp_path):
    path = make_checkpoint(tmp_path, 5)
    (path / "manifest.json").write_text('{"files": ')
    (problem,) = ckpt.verify(path)
    assert problem.startswith(f"{path}/manifest.json: unreadable manifest")


# ---- what to resume from -------------------------------------------------------------------------


def test_auto_picks_the_newest_complete_checkpoint(tmp_path):
    make_checkpoint(tmp_path, 5)
    newest = make_checkpoint(tmp_path, 10)
    make_checkpoint(tmp_path, 15, complete=False)
    assert ckpt.find_resumable("auto", tmp_path, ONE) == newest
    assert ckpt.find_resumable(True, tmp_path, ONE) == newest


def test_auto_falls_back_past_a_corrupt_checkpoint_with_warnings(tmp_path, capsys):
    older = make_checkpoint(tmp_path, 5)
    newest = make_checkpoint(tmp_path, 10)
    flip_byte(newest / "ds" / "mp_rank_00_model_states.pt")
    assert ckpt.find_resumable("auto", tmp_path, ONE) == older
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"[rank 0] warning: {newest}/ds/mp_rank_00_model_states.pt: checksum does not match the manifest",
        f"[rank 0] warning: {newest}: failed verification; falling back to {older}",
    ]


def test_auto_with_every_checkpoint_corrupt_is_an_error_not_a_fresh_start(tmp_path):
    for step in (5, 10):
        flip_byte(make_checkpoint(tmp_path, step) / "trainer_state.json")
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.find_resumable("auto", tmp_path, ONE)
    assert str(err.value).startswith(
        f"resume_from_checkpoint: {tmp_path}: no complete checkpoint passes verification "
        "(tried checkpoint-10, checkpoint-5)"
    )


def test_auto_without_checkpoints_starts_from_scratch(tmp_path, capsys):
    assert ckpt.find_resumable("auto", tmp_path, ONE) is None
    assert capsys.readouterr().out == f"No complete checkpoint in {tmp_path}; starting from scratch.\n"
    assert ckpt.find_resumable(None, tmp_path, ONE) is None
    assert ckpt.find_resumable(False, tmp_path, ONE) is None


def test_explicit_corrupt_path_is_one_error_naming_the_file(tmp_path):
    path = make_checkpoint(tmp_path, 10)
    make_checkpoint(tmp_path, 5)
    flip_byte(path / "ds" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.find_resumable(str(path), tmp_path, ONE)  # no fallback for an explicit path
    assert str(err.value) == (
        f"resume_from_checkpoint: {path}/ds/zero_pp_rank_0_mp_rank_00_optim_states.pt: "
        "checksum does not match the manifest"
    )
    assert not isinstance(err.value, ConfigError)  # a checkpoint problem, not a config one


def test_the_entry_point_reports_a_checkpoint_error_as_bad_input(tmp_path, monkeypatch, capsys):
    def refuse(run_config):
        raise ckpt.CheckpointError(f"{tmp_path}: not a complete checkpoint")

    monkeypatch.setattr(train_job, "run", refuse)
    assert run_module.main(["--output_dir", str(tmp_path)]) == run_module.EXIT_BAD_INPUT == 2
    message = f"error: resume_from_checkpoint: {tmp_path}: not a complete checkpoint\n"
    assert capsys.readouterr().err == message  # as before CheckpointError stopped being a ConfigError


def test_explicit_path_without_marker_is_refused(tmp_path):
    path = make_checkpoint(tmp_path, 10, complete=False)
    with pytest.raises(ckpt.CheckpointError, match="not a complete checkpoint"):
        ckpt.find_resumable(str(path), tmp_path, ONE)
    assert ckpt.find_resumable(str(make_checkpoint(tmp_path, 5)), tmp_path, ONE) == tmp_path / "checkpoint-5"


# ---- rotation ------------------------------------------------------------------------------------


def names(root: Path) -> list[str]:
    return sorted((p.name for p in root.iterdir()), key=lambda n: (len(n), n))


def test_rotation_keeps_the_newest_limit(tmp_path):
    for step in (1, 2, 3, 4, 5):
        make_checkpoint(tmp_path, step)
    deleted = ckpt.rotate(tmp_path, 2, keep=set())
    assert [p.name for p in deleted] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert names(tmp_path) == ["checkpoint-4", "checkpoint-5"]


def test_rotation_never_deletes_the_best_checkpoint(tmp_path):
    for step in (1, 2, 3, 4):
        make_checkpoint(tmp_path, step)
    ckpt.rotate(tmp_path, 2, keep={tmp_path / "checkpoint-1"})
    assert names(tmp_path) == ["checkpoint-1", "checkpoint-4"]


def test_rotation_with_limit_one_keeps_best_and_newest(tmp_path):
    for step in (1, 2, 3):
        make_checkpoint(tmp_path, step)
    ckpt.rotate(tmp_path, 1, keep={tmp_path / "checkpoint-2"})
    assert names(tmp_path) == ["checkpoint-2", "checkpoint-3"]
    ckpt.rotate(tmp_path, 1, keep={tmp_path / "checkpoint-3"})  # the best is the newest
    assert names(tmp_path) == ["checkpoint-3"]


def test_rotation_ignores_incomplete_directories(tmp_path):
    """An unmarked newer directory is not the newest checkpoint and does not count."""
    for step in (1, 2, 3):
        make_checkpoint(tmp_path, step)
    make_checkpoint(tmp_path, 4, complete=False)
    ckpt.rotate(tmp_path, 1, keep=set())
    assert names(tmp_path) == ["checkpoint-3", "checkpoint-4"]


def test_no_limit_deletes_nothing(tmp_path):
    for step in (1, 2):
        make_checkpoint(tmp_path, step)
    assert ckpt.rotate(tmp_path, None, keep=set()) == []
    assert names(tmp_path) == ["checkpoint-1", "checkpoint-2"]


# ---- RNG -----------------------------------------------------------------------------------------


def test_rng_state_round_trips_through_a_weights_only_load(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    ckpt.save_rng(tmp_path, rank=1)
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    torch.load(tmp_path / "rng_state_1.pt", weights_only=True)  # only tensors and plain lists inside
    ckpt.load_rng(tmp_path, rank=1)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want


def test_a_rank_the_checkpoint_did_not_have_keeps_its_state(tmp_path):
    torch.manual_seed(4)
    want = torch.rand(1).item()
    torch.manual_seed(4)
    ckpt.load_rng(tmp_path, rank=2)
    assert torch.rand(1).item() == want


# ---- world-size change ---------------------------------------------------------------------------


def test_accumulation_keeps_the_global_batch(tmp_path):
    path = make_checkpoint(tmp_path, 5, world=2, batch=12)
    assert ckpt.accumulation_for(path, data_parallel=2, micro_batch=2) is None  # unchanged world
    assert ckpt.accumulation_for(path, data_parallel=1, micro_batch=2) == 6
    assert ckpt.accumulation_for(path, data_parallel=3, micro_batch=2) == 2
    assert ckpt.accumulation_for(path, data_parallel=4, micro_batch=1) == 3


def test_indivisible_global_batch_is_an_error_with_the_numbers(tmp_path):
    path = make_checkpoint(tmp_path, 5, world=2, batch=8)
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.accumulation_for(path, data_parallel=3, micro_batch=2)
    assert str(err.value) == (
        f"resume_from_checkpoint: {path}: saved with a global batch of 8 samples on 2 ranks; 3 ranks × "
        "per_device_train_batch_size 2 do not divide it. Choose a micro-batch that divides 8/3, "
        "or a world size that divides 4"
    )


def test_sharded_optimizer_states_need_the_universal_form_on_another_world(tmp_path):
    path = make_checkpoint(tmp_path, 5, world=2)
    assert not ckpt.needs_universal(path, Mesh(2))
    assert ckpt.needs_universal(path, Mesh(1)) and ckpt.needs_universal(path, Mesh(3))
    assert ckpt.needs_universal(path, Mesh(4, sequence=2))  # ZeRO shards over the 4 ranks of 2 groups
    for shard in (path / "ds").glob("*optim_states.pt"):  # ZeRO-0 in fp32: nothing sharded
        shard.unlink()
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"] = {k: v for k, v in manifest["files"].items() if "optim_states" not in k}
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert not ckpt.needs_universal(path, Mesh(1))


def test_a_committed_universal_copy_is_reused(tmp_path):
    path = make_checkpoint(tmp_path, 5)
    staging = path / ".staging-universal"
    (staging / "ds" / "zero").mkdir(parents=True)
    (staging / "ds" / "zero" / "optimizer_state.pt").write_bytes(b"converted")
    ckpt.commit(staging, path / "universal", {"kind": "universal"})
    assert ckpt.universal_copy(path, ONE) == path / "universal"  # no conversion: DeepSpeed not called
    assert (path / "universal" / "ds" / "zero" / "optimizer_state.pt").read_bytes() == b"converted"
    assert ckpt.verify(path) == []  # the checkpoint's own manifest is unaffected


def saved_with(path: Path, **meta) -> Path:
    """``path`` with ``meta`` in its manifest, as the run that wrote it would have recorded it."""
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, **meta}))
    return path


def test_what_a_resume_carries_and_what_it_refuses(tmp_path):
    """Measured through scripts/train.py (docs/checkpoints.md): ZeRO 1 and 2 load each other's
    checkpoints, and a ZeRO 1-2 checkpoint takes another tensor-parallel size; DeepSpeed loads ZeRO-0
    and ZeRO-3 ones at their own stage only, and a pipeline's on its own stages only."""
    path = make_checkpoint(tmp_path, 5)

    def refused(
        stage_then: int, stage_now: int, objective: str = "dpo", expert_then: int = 1, **now
    ) -> str | None:
        saved_with(path, zero_stage=stage_then, objective="dpo", tensor_parallel_size=1, pipeline_parallel_size=1,
                   expert_parallel_size=expert_then)  # fmt: skip
        found = ckpt.uncarried(path, objective, stage_now, Sizes(**now))
        return found and found[0]

    carried = {(a, b) for a in range(4) for b in range(4) if a == b or {a, b} <= {1, 2}}
    for then in range(4):
        for now in range(4):
            assert refused(then, now) == (None if (then, now) in carried else "zero_stage"), (then, now)
    assert refused(2, 2, "orpo") == refused(3, 0, "orpo") == "objective"  # the objective is named first
    assert refused(1, 1, tensor=2) is None and refused(2, 1, tensor=2) is None
    assert refused(0, 0, tensor=2) == refused(3, 3, tensor=2) == "tensor_parallel_size"
    assert refused(1, 1, pipeline=2) == "pipeline_parallel_size"
    assert refused(2, 2, expert=2) == refused(3, 3, expert_then=2) == "expert_parallel_size"
    assert refused(2, 2, expert_then=2, expert=2) is None
    assert ckpt.uncarried(path, "orpo", 3, Sizes()) == (
        "objective",
        f"{path} was saved with objective dpo and this run asks for orpo; another objective is another run: "
        "resume with objective dpo, or use a new --output_dir, or --resume_from_checkpoint false to start over",
    )


def test_an_older_manifest_without_the_objective_is_read_from_the_run_config(tmp_path):
    path = make_checkpoint(tmp_path, 5)  # no objective, tensor or pipeline size recorded
    assert ckpt.uncarried(path, "orpo", 0, Sizes()) is None  # nothing to compare with
    (path / "run_config.yaml").write_text(yaml.safe_dump({"objective": "causal_lm"}))
    assert ckpt.uncarried(path, "causal_lm", 0, Sizes()) is None
    assert ckpt.uncarried(path, "dpo", 0, Sizes())[0] == "objective"


def test_a_field_added_since_the_checkpoint_counts_as_its_default(tmp_path):
    path = make_checkpoint(tmp_path, 5)
    run = RunConfig.from_flat({"output_dir": str(tmp_path), "data_format": "sharegpt"})
    older = {k: v for k, v in run.to_flat().items() if k not in ("long_rows", "validation_file")}
    (path / "run_config.yaml").write_text(yaml.safe_dump(older))
    assert ckpt.run_config_changes(path, run) == ([], [])
    changed = RunConfig.from_flat(
        {"output_dir": str(tmp_path), "data_format": "sharegpt", "long_rows": "drop"}
    )
    assert ckpt.run_config_changes(path, changed) == (["long_rows"], [])
