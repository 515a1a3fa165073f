"""The per-rank checkpoint writer: host copies, background writes, file records."""

from __future__ import annotations

import zipfile
from collections import OrderedDict, defaultdict, namedtuple

import torch
import xxhash

from trainer.checkpoint.writer import FileWriter, _without_zip_crc, file_entry, host_copy


def test_host_copy_is_unaffected_by_later_updates_and_keeps_sharing():
    weight = torch.ones(4)
    state = OrderedDict(
        w=weight, again=weight, groups=[{"lr": 0.1, "params": [0, 1]}], step=(3, torch.tensor(2))
    )
    snap = host_copy(state)
    weight.add_(1)
    state["groups"][0]["lr"] = 9.0
    assert torch.equal(snap["w"], torch.ones(4)) and snap["groups"][0]["lr"] == 0.1
    assert snap["w"] is snap["again"]  # one tensor met twice stays one tensor
    assert type(snap) is OrderedDict and list(snap) == list(state)
    assert int(snap["step"][1]) == 2


def test_host_copy_rebuilds_defaultdicts_and_namedtuples():
    Pair = namedtuple("Pair", "a b")
    counts = defaultdict(list, {"x": [torch.zeros(1)]})
    snap = host_copy({"pair": Pair(torch.ones(1), 2), "counts": counts})
    assert isinstance(snap["pair"], Pair) and snap["pair"].b == 2
    assert isinstance(snap["counts"], defaultdict) and snap["counts"]["missing"] == []


def test_async_writes_the_bytes_a_sync_write_would(tmp_path):
    state = {"w": torch.arange(600_000.0), "meta": {"step": 7}}  # 2.4 MB: written in three slices
    for mode in (False, True):
        root = tmp_path / str(mode)
        root.mkdir()
        writer = FileWriter(root, asynchronous=mode)
        writer.save(state, root / "model.pt")
        state["w"].add_(0)  # the loop carries on (a no-op here keeps the expected bytes equal)
        writer.write_text(root / "state.json", '{"step": 7}')
        entries = writer.wait()
        assert writer.done()
        assert set(entries) == {"model.pt", "state.json"}
        data = (root / "model.pt").read_bytes()
        assert entries["model.pt"] == {"size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}
    assert (tmp_path / "False" / "model.pt").read_bytes() == (tmp_path / "True" / "model.pt").read_bytes()
    assert torch.equal(
        torch.load(tmp_path / "True" / "model.pt", weights_only=True)["w"], torch.arange(600_000.0)
    )


def test_torch_zip_crc_is_skipped_while_writing_and_restored_after(tmp_path):
    """The manifest's checksum covers each file, so torch's per-record CRC-32 (a second pass over
    the bytes) is not computed; torch.load does not need it. The process's setting comes back
    once the last of the overlapping writers is done."""
    writer = FileWriter(tmp_path)
    writer.save({"w": torch.arange(4096.0)}, tmp_path / "a.pt")
    writer.wait()
    assert torch.serialization.get_crc32_options() is True
    assert torch.equal(torch.load(tmp_path / "a.pt", weights_only=True)["w"], torch.arange(4096.0))
    with zipfile.ZipFile(tmp_path / "a.pt") as archive:
        assert {info.CRC for info in archive.infolist() if info.filename.endswith("/data/0")} == {0}
    with _without_zip_crc():
        with _without_zip_crc():  # a second writer thread starts
            pass
        assert torch.serialization.get_crc32_options() is False  # the first is still writing
    assert torch.serialization.get_crc32_options() is True


def test_async_write_snapshots_before_returning(tmp_path):
    w = torch.zeros(8)
    writer = FileWriter(tmp_path, asynchronous=True)
    writer.save({"w": w}, tmp_path / "a.pt")
    w.fill_(5)  # an optimizer step right after the save call
    writer.wait()
    assert torch.equal(torch.load(tmp_path / "a.pt", weights_only=True)["w"], torch.zeros(8))


def test_a_failed_background_write_is_raised_by_wait(tmp_path):
    writer = FileWriter(tmp_path, asynchronous=True)
    writer.save({"w": torch.ones(1)}, tmp_path / "missing-dir" / "a.pt")
    try:
        writer.wait()
    except (OSError, RuntimeError) as err:
        assert "missing-dir" in str(err)
    else:
        raise AssertionError("the failed write was not reported")


def test_file_entry_matches_xxhash(tmp_path):
    path = tmp_path / "f"
    data = bytes(range(256)) * 40_000  # over two 4 MiB reads
    path.write_bytes(data)
    assert file_entry(path) == {"size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}


def test_fault_plans_fire_only_where_planned(monkeypatch):
    from trainer.loop.faults import fault_due
    from trainer.runtime.resilience import fault_plan

    monkeypatch.setenv("TRAINER_FAULT", "crash:rank=1:step=8:phase=save")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    plan = fault_plan()
    assert fault_due(plan, "crash", 1, 8, phase="save")
    assert not fault_due(plan, "crash", 1, 8)  # not after the step: inside the save
    assert not fault_due(plan, "crash", 0, 8, phase="save") and not fault_due(
        plan, "crash", 1, 4, phase="save"
    )
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert fault_plan() == {}  # a restarted job gets past its crash
