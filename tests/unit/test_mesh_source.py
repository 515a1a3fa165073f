"""One source for every parallel size, checked from the package's source: outside the mesh's
construction (``trainer/runtime/mesh.py``), the DeepSpeed schema and resolution that write the sizes
into the dict (``trainer/config/``) and the argument models that declare them and check them at the
door (``trainer/args/``), no module reads a parallel size from the arguments, from a DeepSpeed dict
or from DeepSpeed itself. Everything else asks the ``Mesh`` it was handed."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "trainer"

# Where a size may be read at its source, and why (a checkpoint's manifest is read back through
# ``saved_mesh``, beside the mesh).
ALLOWED = {
    "trainer/runtime/mesh.py": "the mesh is built here, from the arguments and the DeepSpeed file",
    "trainer/config": "the DeepSpeed schema, and the resolution that writes the sizes into the dict",
    "trainer/args": "the argument models that declare the sizes and check them at the door",
    "trainer/bench": "the benchmarks set sizes as arguments, and read the other systems' (HF's, DeepSpeed's)",
}
# A run's sizes as arguments, DeepSpeed dict keys and DeepSpeed's own accessors.
ARGUMENTS = {
    "tensor_parallel_size",
    "sequence_parallel_size",
    "pipeline_parallel_size",
    "expert_parallel_size",
}
DICT_KEYS = ARGUMENTS | {"stages", "autotp_size", "pipeline.stages", "tensor_parallel.autotp_size"}
DICT_KEYS |= {"data_parallel_size", "optimizer_partitions"}  # a checkpoint manifest's record of its mesh
DEEPSPEED = {
    "dp_world_size",
    "seq_dp_world_size",
    "autotp_size",
    "get_data_parallel_world_size",
    "get_data_parallel_rank",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_model_parallel_world_size",
    "get_sequence_parallel_world_size",
    "get_sequence_parallel_rank",
    "get_expert_parallel_world_size",
}
READERS = {"parallel_sizes", "tensor_size_of"}  # the config helpers the mesh is built with


def reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for each read of a parallel size in a module's syntax tree."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ARGUMENTS | DEEPSPEED:
            found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            if node.slice.value in DICT_KEYS:
                found.append((node.lineno, f"[{node.slice.value!r}]"))
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            keys = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if name in {"get", "get_path", "getattr", "pop", "setdefault"} and DICT_KEYS & set(keys):
                found.append((node.lineno, f"{name}({', '.join(sorted(DICT_KEYS & set(keys)))})"))
            elif name in READERS:
                found.append((node.lineno, f"{name}()"))
    return sorted(found)


def outside_the_mesh() -> dict[str, list[tuple[int, str]]]:
    result = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if any(rel == allowed or rel.startswith(allowed + "/") for allowed in ALLOWED):
            continue
        found = reads(ast.parse(path.read_text()))
        if found:
            result[rel] = found
    return result


def test_no_parallel_size_is_read_outside_the_mesh():
    found = outside_the_mesh()
    assert not found, "parallel sizes read outside the mesh:\n" + "\n".join(
        f"  {path}:{line}: {what}" for path, lines in found.items() for line, what in lines
    )


def test_the_check_finds_each_kind_of_read():
    source = """
sp = args.sequence_parallel_size
tp = ds.autotp_size()
dp = engine.ds.dp_world_size
stages = config["pipeline"]["stages"]
tensor = get_path(data, "tensor_parallel.autotp_size")
pp = config.get("pipeline_parallel_size")
sizes = parallel_sizes(run)
raise ConfigError([("sequence_parallel_size", "a key named in a message is not a read")])
"""
    assert [what for _, what in reads(ast.parse(source))] == [
        ".sequence_parallel_size",
        ".autotp_size",
        ".dp_world_size",
        "['stages']",
        "get_path(tensor_parallel.autotp_size)",
        "get(pipeline_parallel_size)",
        "parallel_sizes()",
    ]
