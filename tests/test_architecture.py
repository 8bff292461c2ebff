"""The import graph points one way: the data path's stages, from facts at the bottom to the user's
entry points at the top. A module may import its own component or a lower level, never a higher
one, so a reader (and the next kernel, quantized layer or grammar) finds each stage by its place.

An import under ``if TYPE_CHECKING:`` is a name for a type, not a dependency: a layer is handed
its backend at construction and names the interface it calls, whose implementations sit above."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pagedllm"

# Lowest first. Components on one level do not import each other.
LEVELS = [
    {"env"},  # every environment variable, read in one place
    {"errors", "sizes", "paths", "host"},  # facts every stage shares (host: the CPUs this process may use)
    {"model specs"},  # models/registry.py, family.py, each family's spec.py; kinds/ (the registry, caches): torch-free
    {"kernels"},  # compiled CPU kernels: built on first use, or absent
    {"config", "engine_config", "sampling_params", "outputs", "prompts"},  # what a model, an engine, a request are
    {"distributed"},  # how a model splits over tensor-parallel ranks: arithmetic on its config
    {"structured", "limits"},  # constraints compiled to grammars that mask logits; what an engine can run
    {"layers"},  # the tensor layers: linear, quantized, norm/rotary, the sampler, the expert cache; kinds' forwards
    {"backends"},  # the device: its kernels, attention and KV cache, its workspace terms, threads
    {"models"},  # decoders stacked from the layer kinds' modules
    {"memory"},  # the footprint and the planner (pure arithmetic), the budget, the peak tracker; kinds' footprints
    {"loading"},  # checkpoints and GGUF files into models
    {"processes"},  # what crosses each process boundary (API <-> engine, driver <-> ranks): data only
    {"engine"},  # scheduler, block manager, runner, the step loop
    {"engine_process"},  # where the engine steps for a server: a thread, or a process of its own
    {"llm"},  # the Python API
    {"server", "bench"},  # the HTTP API (its tool-call protocol too), the benchmark
    {"cli"},  # the command line
]
LEVEL = {component: i for i, names in enumerate(LEVELS) for component in names}


SPEC_MODULES = ("registry", "family", "spec")
# A layer kind's folder (``pagedllm/kinds/<kind>/``) holds one file per stage of the data path,
# each at its stage's level: the registry and the caches with the specs, the forward with the layers.
KIND_PARTS = {"cache": "model specs", "forward": "layers", "footprint": "memory"}


def component(module: str) -> str:
    parts = module.split(".")
    if parts[1] == "models" and len(parts) > 2 and parts[-1] in SPEC_MODULES:
        return "model specs"  # the families' specs live beside their modules, a level below config
    if parts[1] == "kinds":
        return KIND_PARTS.get(parts[-1], "model specs")
    return parts[1]


def imports_of(path: Path) -> set[str]:
    """pagedllm modules imported by ``path`` (relative imports resolved), at any depth."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module.rpartition(".")[0]  # an __init__'s too: its own package
    found = set()
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for n in ast.walk(block)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            names = [name] if node.module else [f"{name}.{a.name}" for a in node.names]
            found.update(n for n in names if n.startswith("pagedllm."))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("pagedllm."))
    return found


def test_no_module_imports_a_stage_above_its_own():
    wrong = []
    modules = [p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py"]  # the facade
    for path in modules:
        own = component(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        assert own in LEVEL, f"{path}: component {own!r} has no level in LEVELS"
        for target in imports_of(path):
            other = component(target)
            if other != own and LEVEL[other] >= LEVEL[own]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)} imports {target}")
    assert not wrong, "imports against the data path:\n" + "\n".join(sorted(wrong))


def test_the_planner_and_the_plan_command_start_without_torch():
    import subprocess
    import sys

    code = "import sys, pagedllm.cli, pagedllm.memory.planner; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_the_servers_api_process_imports_no_torch():
    """`pagedllm serve` runs the engine in a process of its own; the API process (the server, the
    engine's client, the tokenizer) holds no torch: its ~190 MiB would come out of the budget."""
    import subprocess
    import sys

    code = (
        "import sys, pagedllm.cli, pagedllm.server.app, pagedllm.engine_process.client, pagedllm.loading.tokenizer;"
        "from pagedllm.loading import load_tokenizer, resolve_model_dir;"
        "load_tokenizer(resolve_model_dir(None)[0]);"  # what the API process runs at start: the default model's
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_only_the_backends_reach_the_compiled_kernels():
    """The compiled-or-PyTorch choice is made once, by the backend an engine is given: no layer,
    model or engine module asks the kernels package which path it is on."""
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        own = component(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        if own in ("kernels", "backends"):
            continue
        wrong += [
            f"{path.relative_to(PACKAGE.parent)} imports {t}" for t in imports_of(path) if component(t) == "kernels"
        ]
    assert not wrong, "\n".join(wrong)


DEVICES = ("cpu",)  # pagedllm/backends/<device>/: one folder per device (backends.DEVICES)
MEASURES_THE_MACHINE = {"bench"}  # the benchmark reads the CPU's flags and kernels it times


def test_nothing_outside_the_backends_names_a_device():
    """The device seam: the engine, the planner and the models speak ``backends.base``'s protocols
    and the registry (``backends.workspace``, ``backends.facts``); a device's own modules (its KV
    cache, its attention layout, its kernels' tiles and scratch) are imported by the backends
    alone, type-only names included, so a second device is one more folder."""
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        own = component(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        if own == "backends" or own in MEASURES_THE_MACHINE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                if any(
                    n.split(".")[:2] == ["backends", d] or ".backends." + d in "." + n for n in names for d in DEVICES
                ):
                    wrong.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not wrong, "imports of a device's modules outside pagedllm/backends/:\n" + "\n".join(wrong)


def test_the_footprint_never_branches_on_how_a_device_runs_a_step():
    """The model's arithmetic (memory/footprint.py) asks the device's terms (``backends.workspace``)
    how a phase runs there; it reads no kernel kind, ISA or tile flag of its own, so a device's
    new path changes its own module only."""
    device_facts = {"kernels", "gemm_isa", "amx_tiles", "quant_float_max_rows"}
    read = []
    for path in [PACKAGE / "memory" / "footprint.py", *PACKAGE.glob("kinds/*/footprint.py")]:
        read += [
            f"{path.relative_to(PACKAGE)}:{n.lineno} reads .{n.attr}"
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Attribute) and n.attr in device_facts and not isinstance(n.ctx, ast.Store)
        ]
    assert not read, "\n".join(read)


def test_a_layer_kind_is_one_folder_and_one_registry_line():
    """Each kind in the registry is a folder with a file per stage (a mixer's cache, the forward,
    the footprint), each with the one function its stage calls; a folder not in the registry is
    one no model can reach. And no module that stacks or plans layers names a kind: they ask the
    kinds' files, so a new kind changes its folder and the registry only."""
    from pagedllm import kinds

    folders = {p.name for p in (PACKAGE / "kinds").iterdir() if (p / "__init__.py").is_file()}
    registered = set(kinds.MIXERS + kinds.FEED_FORWARDS)
    assert folders == registered and len(registered) >= 3, (folders, registered)
    for name in registered:
        forward = kinds.part(name, "forward")
        assert callable(forward.build) and isinstance(forward.CHECKPOINT_NAME, str)
        assert callable(kinds.part(name, "footprint").phases)
    for name in kinds.MIXERS:
        assert callable(kinds.part(name, "cache").cache)
    with pytest.raises(KeyError, match="no layer kind"):
        kinds.part("dense_mlp", "cache")  # a feed-forward keeps nothing between steps
    stacking_and_planning = [PACKAGE / "models" / "decoder.py", *PACKAGE.glob("memory/*.py")]
    named = [
        f"{p.relative_to(PACKAGE)}:{n.lineno} names {n.value!r}"
        for p in stacking_and_planning
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.Constant) and n.value in registered
    ]
    assert not named, "\n".join(named)


def test_readme_maps_every_family_and_device_folder():
    """README's layout is the reader's map: a family or device folder it does not name is one the
    next engineer cannot find from it."""
    readme = (PACKAGE.parent / "README.md").read_text()
    layout = readme[readme.index("models/") :]
    folders = [p for p in (PACKAGE / "models").iterdir() if (p / "spec.py").is_file()]
    folders += [p for p in (PACKAGE / "backends").iterdir() if (p / "__init__.py").is_file()]
    folders += [p for p in (PACKAGE / "kinds").iterdir() if (p / "__init__.py").is_file()]
    assert len(folders) > 15, folders  # twelve families, the CPU, three kinds at least: the walk found them
    missing = [p.name for p in folders if not re.search(rf"\b{p.name}\b", layout)]
    assert not missing, f"README's layout does not name: {missing}"


MAX_FUNCTION_LINES = 60


def test_no_python_function_is_longer_than_a_screen():
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, "\n".join(long)


def cpp_function_lengths(source: str) -> dict[str, int]:
    """Top-level C++ definitions (a line at column 0 whose braces open a body) by first line: the
    lines until the brace that closes it. Enough for our kernels' plain style."""
    lengths, lines = {}, source.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        opens_body = line and not line[0].isspace() and "(" in line and not line.startswith(("#", "//", "}"))
        if opens_body and not line.rstrip().endswith(";"):
            start, depth, seen = i, 0, False
            while i < len(lines):
                code = lines[i].split("//")[0]
                depth += code.count("{") - code.count("}")
                seen |= "{" in code
                if seen and depth == 0:
                    break
                if not seen and code.rstrip().endswith(";"):
                    break  # a declaration
                i += 1
            if seen:
                lengths[f"{start + 1}: {line.strip()[:60]}"] = i - start + 1
        i += 1
    return lengths


def test_no_cpp_function_is_longer_than_a_screen():
    long = []
    for path in sorted((PACKAGE / "kernels" / "csrc").glob("*.[ch]*")):
        for where, lines in cpp_function_lengths(path.read_text()).items():
            if lines > MAX_FUNCTION_LINES and "TORCH_LIBRARY" not in where and "namespace" not in where:
                long.append(f"{path.name}:{where}: {lines} lines")
    assert not long, "\n".join(long)


def module_graph() -> dict[str, set[str]]:
    """Every pagedllm module's imports of other pagedllm modules, at any depth (lazy ones in
    functions too; ``TYPE_CHECKING`` names not). Importing ``a.b.c`` runs package ``a.b`` first,
    so it counts as an import of both."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if path.name == "__init__.py" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for target in imports_of(path):
            while target not in modules:  # a name from a module: the module
                target = target.rpartition(".")[0]
            while target.count(".") >= 1:
                targets.add(target)
                target = target.rpartition(".")[0]
        graph[name] = targets - {name}
    return graph


def folder(module: str) -> str:
    return module.rpartition(".")[0]


def cycles_within_folders(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of two or more modules of one folder (a package counts in the
    folder that holds it), by Tarjan's algorithm over the edges that stay inside a folder."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if folder(w) != folder(v):
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_inside_a_folder():
    """Two modules of one folder never import each other, directly or round a longer circle
    (the levels above only order whole components): each piece has one place, and the one it
    leans on can be read first. A name only for type checking is not an import."""
    cycles = cycles_within_folders(module_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_sees_a_circle():
    """The check above, on a graph with a planted circle (a -> b -> c -> a in one folder) and an
    edge across folders that closes no circle inside one."""
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a", "q.x"}, "q.x": {"p.a"}}
    assert cycles_within_folders(graph) == [["p.a", "p.b", "p.c"]]
    assert cycles_within_folders({"p.a": {"q.x"}, "q.x": {"p.a"}}) == []


def environment_reads(source: str) -> list[int]:
    """Lines of ``source`` that read a setting from the environment: ``os.environ.get``,
    ``os.environ[...]`` loaded, ``os.getenv``, ``... in os.environ``. Copies handed to a child
    process (``dict(os.environ)``, ``{**os.environ}``) and ``setdefault`` (a library's setting
    made for it) are not reads."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "get" or node.func.attr == "getenv":
                target = node.func.value if node.func.attr == "get" else node.func
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            target = node.value
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            target = node.comparators[0]
        if target is not None and ast.unparse(target) in ("os.environ", "os.getenv", "environ"):
            lines.append(node.lineno)
    return lines


def test_only_env_reads_the_environment():
    """Every environment variable pagedllm reads is named, typed and explained once, in
    ``pagedllm/env.py``; no other module reads one."""
    wrong = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in PACKAGE.rglob("*.py")
        if path != PACKAGE / "env.py"
        for line in environment_reads(path.read_text())
    ]
    assert not wrong, "environment read outside pagedllm/env.py:\n" + "\n".join(wrong)


def test_the_environment_check_sees_each_kind_of_read():
    planted = "import os\na = os.environ.get('X')\nb = os.environ['Y']\nc = os.getenv('Z')\nd = 'W' in os.environ\n"
    assert environment_reads(planted) == [2, 3, 4, 5]
    copies = "import os\nchild = dict(os.environ)\nmore = {**os.environ, 'A': '1'}\nos.environ.setdefault('B', '2')\n"
    assert environment_reads(copies) == []
