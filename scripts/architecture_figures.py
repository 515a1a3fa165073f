"""The figures docs/architecture.md gives, counted from a checkout rather than by hand.

    python scripts/architecture_figures.py [--root CHECKOUT] [--steps] [--json FILE]

From the source of ``CHECKOUT/trainer`` (default: this one):
- for each parallel size, the places that read it at a source (an argument, a DeepSpeed dict key,
  DeepSpeed's own accessors; the patterns of tests/unit/test_mesh_source.py) outside the mesh's
  construction, the DeepSpeed schema and resolution (``trainer/config``) and the argument models
  (``trainer/args``); and the modules that read it from a ``Mesh`` (or, before it, a ``ParallelLayout``);
- for each objective name, the places it is written as a string outside ``trainer/objectives``;
- the reads, in ``trainer/engine`` and ``trainer/loop``, of an objective's attributes that once
  decided how a run goes (``OBJECTIVE_FLAGS``), and the loop's private methods its Trainers override;
- the lines of ``trainer/loop/trainer.py``.

``--steps`` also counts, with scripts/step_files.py, the files of ``trainer/`` whose code one step
of a tiny Llama runs: a plain step, a logging step with the tiled loss and MLP, and plain steps of
DPOTrainer and KTOTrainer.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Per size: (attributes that read it: an argument's or DeepSpeed's accessor, dict keys that read it)
SIZES = {
    "tensor": ({"tensor_parallel_size", "autotp_size", "get_tensor_model_parallel_rank",
                "get_tensor_model_parallel_world_size", "get_model_parallel_world_size"},
               {"tensor_parallel_size", "autotp_size", "tensor_parallel.autotp_size"}),
    "sequence": ({"sequence_parallel_size", "get_sequence_parallel_world_size", "get_sequence_parallel_rank",
                  "seq_dp_world_size"}, {"sequence_parallel_size"}),
    "pipeline": ({"pipeline_parallel_size"}, {"stages", "pipeline.stages", "pipeline_parallel_size"}),
    "expert": ({"expert_parallel_size", "get_expert_parallel_world_size"}, {"expert_parallel_size"}),
    "data": ({"dp_world_size", "get_data_parallel_world_size"}, {"data_parallel_size", "optimizer_partitions"}),
}  # fmt: skip
HELPERS = {"parallel_sizes": ("tensor", "sequence", "pipeline"), "tensor_size_of": ("tensor",)}
MESH_FIELDS = {"tensor": {"tensor"}, "sequence": {"sequence", "sequence_rank"}, "pipeline": {"pipeline"},
               "expert": {"expert"}, "data": {"data_parallel_size", "data", "readers", "data_ranks", "zero_shards"}}  # fmt: skip
EXEMPT = (
    "trainer/config/",
    "trainer/args/",
    "trainer/bench/",
    "trainer/runtime/mesh.py",
    "trainer/runtime/layout.py",
)
OBJECTIVES = ("causal_lm", "dpo", "orpo", "cpo", "simpo", "kto")
LOSS_TYPES = {"simpo", "kto"}  # TRL's loss types of the same names, in the preference configs and losses
OBJECTIVE_FLAGS = {
    "token_exact_causal",
    "per_token_nll",
    "loss_tiles",
    "sequence_parallel",
    "sequences_per_row",
}
HOOKS = {
    "_objective",
    "_model_columns",
    "_flops_per_token",
    "_generation",
    "_prepare_training",
    "_eval_per_batch",
}
TRAINERS = ("sft.py", "preference.py", "dpo.py", "kto.py", "seq2seq.py")


def _modules(root: Path) -> dict[str, ast.AST]:
    return {
        path.relative_to(root).as_posix(): ast.parse(path.read_text())
        for path in sorted((root / "trainer").rglob("*.py"))
    }


def _size_reads(tree: ast.AST) -> dict[str, int]:
    """Reads of each size at a source in one module: attributes, dict keys and the config helpers."""
    found: dict[str, int] = defaultdict(int)
    for node in ast.walk(tree):
        attrs: list[str] = []
        keys: list[str] = []
        if isinstance(node, ast.Attribute):
            attrs = [node.attr]
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            keys = [node.slice.value] if isinstance(node.slice.value, str) else []
        elif isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if func in HELPERS:
                for size in HELPERS[func]:
                    found[size] += 1
                continue
            if func in {"get", "get_path", "getattr", "pop"}:
                keys = [
                    a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                ]
        for size, (attributes, dict_keys) in SIZES.items():
            found[size] += sum(name in attributes for name in attrs) + sum(name in dict_keys for name in keys)
    return found


def _mesh_reads(tree: ast.AST) -> set[str]:
    """Sizes a module reads from a mesh or layout object (``mesh.tensor``, ``layout.sequence``, ...)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Name, ast.Attribute)):
            owner = node.value.id if isinstance(node.value, ast.Name) else node.value.attr
            if owner in {"mesh", "layout"}:
                found |= {size for size, fields in MESH_FIELDS.items() if node.attr in fields}
    return found


def _defined(node: ast.AST) -> set[str]:
    """The names a method definition or an assignment defines."""
    if isinstance(node, ast.FunctionDef):
        return {node.name}
    return {t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)}


def source_figures(root: Path) -> dict:
    modules = _modules(root)
    sources: dict[str, dict[str, int]] = {size: {} for size in SIZES}
    readers: dict[str, list[str]] = {size: [] for size in SIZES}
    written: dict[str, int] = dict.fromkeys(OBJECTIVES, 0)
    flag_reads, overrides = 0, 0
    for rel, tree in modules.items():
        for node in ast.walk(tree):
            if rel.startswith(("trainer/engine/", "trainer/loop/")) and isinstance(node, ast.Attribute):
                owner = getattr(node.value, "id", None) or getattr(node.value, "attr", None)
                flag_reads += owner == "objective" and node.attr in OBJECTIVE_FLAGS
            if rel.startswith("trainer/loop/") and rel.endswith(TRAINERS):
                overrides += bool(_defined(node) & HOOKS)
        if not rel.startswith(EXEMPT):
            for size, count in _size_reads(tree).items():
                if count:
                    sources[size][rel] = count
        for size in _mesh_reads(tree):
            readers[size].append(rel)
        if not rel.startswith("trainer/objectives/"):
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and node.value in OBJECTIVES:
                    loss_type = node.value in LOSS_TYPES and rel.endswith("/preference.py")
                    written[node.value] += 0 if loss_type else 1
    return {
        "size_reads_at_a_source": {
            s: {"places": sum(v.values()), "files": sorted(v)} for s, v in sources.items()
        },
        "modules_reading_the_mesh": {s: len(v) for s, v in readers.items()},
        "objective_names_written_outside_the_registry": written,
        "objective_attribute_reads_in_engine_and_loop": flag_reads,
        "private_loop_methods_overridden_by_trainers": overrides,
        "trainer_py_lines": len((root / "trainer" / "loop" / "trainer.py").read_text().splitlines()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to count (default: this one)")
    parser.add_argument("--steps", action="store_true", help="also count the files one step runs")
    parser.add_argument("--json", type=Path, help="write the figures as one JSON object")
    args = parser.parse_args(argv)
    figures = source_figures(args.root)
    if args.steps:
        from step_files import measured  # scripts/step_files.py, beside this script

        figures["files_run_by_one_step"] = {name: len(files) for name, files in measured().items()}
    text = json.dumps(figures, indent=1)
    if args.json:
        args.json.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
