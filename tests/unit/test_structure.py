"""The house rules of the package structure, checked on the source: the map of the code
(docs/explanation/architecture.md, "How it is built") names every room and module, rooms are small,
imports have no cycles, no module reads another object's private attributes, and no comment cites an
issue number."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("infinity", "tiers")
MAX_LINES = 600
MAX_METHODS = 20
MAX_TOP_MODULES = 12


def _sources():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path, path.read_text()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _readme_map() -> str:
    text = (ROOT / "docs" / "explanation" / "architecture.md").read_text()
    start = text.index("## How it is built")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_the_readme_map_names_every_room_and_module():
    section = _readme_map()
    missing = []
    for room in sorted(p for p in (ROOT / "infinity").iterdir() if (p / "__init__.py").is_file()):
        if f"`{room.name}/`" not in section:
            missing.append(f"infinity/{room.name}/")
        if room.name in ("checkpoint", "plan", "cli", "examples"):
            continue   # described as a whole
        for module in sorted(room.glob("*.py")):
            if module.stem != "__init__" and f"`{module.stem}`" not in section:
                missing.append(f"infinity/{room.name}/{module.name}")
    for module in sorted((ROOT / "infinity").glob("*.py")):
        if module.stem != "__init__" and f"`{module.name}`" not in section:
            missing.append(f"infinity/{module.name}")
    assert not missing, f"docs/explanation/architecture.md 'How it is built' does not name: {missing}"


def test_few_modules_directly_in_infinity():
    top = [p.name for p in (ROOT / "infinity").glob("*.py")]
    assert len(top) <= MAX_TOP_MODULES, top


def test_no_file_too_long_and_no_class_with_too_many_methods():
    found = []
    for path, text in _sources():
        lines = len(text.splitlines())
        if lines > MAX_LINES:
            found.append(f"{path.relative_to(ROOT)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                methods = [f for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
                if len(methods) > MAX_METHODS:
                    found.append(f"{path.relative_to(ROOT)}: class {node.name} has {len(methods)} methods")
    assert not found, found


def _imports(path: Path, text: str, known: set[str]) -> set[str]:
    """The project modules ``path`` imports, anywhere in it (lazy imports inside functions too)."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def test_no_import_cycles():
    sources = dict(_sources())
    known = {_module_name(p) for p in sources}
    graph = {_module_name(p): _imports(p, t, known) - {_module_name(p)} for p, t in sources.items()}
    # A package's __init__ re-exporting its modules is not a cycle with them.
    for name, deps in graph.items():
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


# Private names of other libraries the code must touch, each with no public equivalent.
_FOREIGN_PRIVATE = {
    "_pytree",                      # torch.utils._pytree.tree_flatten
    "_C", "_execution_engine", "_current_graph_task_id", "_fused_adam_", "_fused_adamw_",
    "_version",                     # a tensor's version counter (in-place edits of a joined tiled weight)
    "_load_from_state_dict",        # nn.Module's hook for loading, overridden by the tiled layers
    "_non_persistent_buffers_set",  # the only record of a buffer's persistence in nn.Module
    "_save_to_state_dict",          # a module's own state alone (infinity.state_dict of a module too big to gather)
    "_keys_to_ignore_on_save",      # what transformers' save_pretrained leaves out (infinity/runtime/hf_save.py)
    "_parameters",                  # a parameter put back in its place where a refused torch tool took it (placeholder.py)
    "_aio",                         # the C extension module of tiers
    "_functorch",                   # torch._C._functorch: which torch.func transform runs (refused when it differentiates)
    "_amp_foreach_non_finite_check_and_unscale_",   # GradScaler's unscale, refused on gradient tokens by name
    "_orig_mod",                    # the model inside torch.compile's wrapper (infinity/registry.py)
    # Lending reused memory to a storage autograd holds (infinity/runtime/gather_memory.py); with a
    # torch that lacks them the engine resizes storages instead.
    "_swap_data_ptr_", "_construct_storage_from_data_pointer",
    # A tensor with a parameter's shape and no memory: the .grad token of infinity/optim/grad_face.py
    # (torch's documented way to write a wrapper tensor subclass).
    "_make_wrapper_subclass",
    # What nn.Module._apply (model.to(device)) asks of each parameter: a released placeholder lets it
    # through (infinity/runtime/placeholder.py).
    "_has_compatible_shallow_copy_type",
    # One multi-tensor copy of a group's gradients into its flat bucket (infinity/runtime/grads.py): the
    # foreach ops torch.optim itself runs on, with no public name.
    "_foreach_copy_",
    # What clip_grad_norm_ / clip_grad_value_ with foreach=True call on the .grad tokens, answered one token
    # at a time (infinity/optim/grad_face.py).
    "_foreach_norm", "_foreach_mul_", "_foreach_clamp_min_", "_foreach_clamp_max_", "_foreach_zero_",
    # Whether torch.compile's tracer is at work where torch before 2.13 says is_compiling() is False:
    # its tracing context (infinity/runtime/placeholder.py).
    "_guards",
    # accelerate's record that an optimizer's step was skipped (AcceleratedOptimizer.step_was_skipped), which it
    # sets only from its own GradScaler: set from infinity's own skips (infinity/checkpoint/trainer.py).
    "_is_overflow",
    # How many tensors share a gathered group's storage, so that those made inside infinity.gathered keep
    # their memory at its exit (infinity/param_group.py): no public equivalent.
    "_storage_Use_Count", "_cdata",
}


def test_no_module_reads_another_objects_private_attributes():
    found = []
    for path, text in _sources():
        for node in ast.walk(ast.parse(text)):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue
            if node.attr in _FOREIGN_PRIVATE:
                continue
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    assert not found, found


@pytest.mark.parametrize("folder", ["infinity", "tiers", "tests", "benchmarks", "aio_csrc"])
def test_no_comment_cites_an_issue_number(folder):
    cites = re.compile(r"\bissues?\s*#?\d+\b|\(#\d+\)", re.IGNORECASE)
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / folder).rglob("*"))
             if p.suffix in (".py", ".c", ".h") for i, line in enumerate(p.read_text().splitlines(), 1)
             if cites.search(line)]
    assert not found, f"a reader of the code has no issues to look these up in: {found}"
