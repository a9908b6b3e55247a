"""Names in the text refer to things that exist: every test module is named after the module it tests
(tests/a/b/test_x.py tests minicavs/a/b/x.py, or models/, examples/, tools/ x.py), and every module path, dotted
name, ``path/file.py``, ``module.name``, ``Class.name``, ``function()`` and config key that the docs, the
README and the docstrings and comments (the package's, and those of models/, tools/, examples/ and tests/) name
resolves in the checkout or by importing the package. A rename or a deletion that leaves its old name behind
in the text fails here; NOT_OURS lists, with a reason each, the names that are deliberately not ours."""
from __future__ import annotations

import ast
import builtins
import fnmatch
import functools
import importlib
import inspect
import io
import re
import subprocess
import textwrap
import tokenize
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
PACKAGE = ROOT / "minicavs"

# Test modules that check the project as a whole, or a feature across modules, not one module: why each.
WHOLE_PROJECT = {
    "test_docs.py": "docs/ runs as written",
    "test_install.py": "the package installs and its entry points run",
    "test_function_length.py": "functions and modules of engine/, cpu/ and cuda/ stay short",
    "test_layering.py": "every module's imports respect the layers",
    "test_public_api.py": "the package's public names (minicavs/__init__.py's __all__)",
    "test_readme.py": "the README runs as written",
    "test_references.py": "this file: names in the text and in tests refer to things that exist",
    "test_source_text.py": "no source text refers to the tracker",
    "cuda/test_crossings.py": "host/device crossings of a training step, every bundled model",
    "engine/test_fuzz_kernels.py": "every kernel that takes indices, fed bad ones",
    "ir/test_composite.py": "small models of the ops end to end (ops, autodiff, executor)",
    "models/test_models.py": "every bundled model trains, matches finite differences and serial runs",
    "models/test_naive_cells.py": "model.cell: naive in every bundled model that has it",
    "models/test_pretrained.py": "pretrained vectors in every bundled model with a word table",
    "ops/test_op_names.py": "no code outside ops/ branches on an op's name",
    "runtime/test_messages.py": "kinds with their own message shapes, vertex function to engine",
}

# Names the text uses that are deliberately not ours, why each. (Everything else must resolve.)
NOT_OURS = {
    "../": "outside the checkout: the workspace's papers and data, a user's own files in an example",
    "RUN_DIR/": "a run directory's files, written by training",
    "runs/": "run directories of the examples, written by training",
    "data/sst/": "a prepared data set (git-ignored; data/README.md)",
    "data/ptb/": "a prepared data set (git-ignored; data/README.md)",
    "minicavs/models/": "where the installed package keeps the bundled models (setup.py)",
    "minicavs/peer": "a ratio (minicavs' rate over a peer's), not a path",
    "minicavs/system": "a ratio (minicavs' rate over a peer's), not a path",
    "train/infer": "two modes, not a path",
    "train/eval": "two modes, not a path",
    "k_u": "a generated kernel's name (k_<hash>), a placeholder",
    "expr_k": "a generated kernel's name, a placeholder",
    "name_u": "a generated kernel's name, a placeholder",
    "numpy.libs/": "numpy's wheel's bundled libraries",
    "dynet/": "DyNet's source tree (a peer)",
    "closing": "contextlib's",
    "d_t": "ED-Batch's notation (its paper)",
    "near": "ED-Batch's notation (its paper)",
    **dict.fromkeys(("config.yaml", "summary.md", "targets.md", "padding.md", "control.md", "headline.md"),
                    "files a run or a benchmark writes"),
    **dict.fromkeys(("my_tree_rnn.py", "my_tree_rnn.yaml", "my_model.py", "my_model.yaml"),
                    "files docs/writing-a-model.md has the reader write"),
    **dict.fromkeys(("malloc.h", "math.h", "dlopen"), "the C library's headers and functions"),
    "cupy/": "CuPy's source tree, cited by file and line where the stand-in follows it",
    "DESIGN.md": "the design notes beside the checkout (../shared/DESIGN.md)",
    **dict.fromkeys(("ceil", "prod", "logsumexp", "onehot", "O", "NaN", "NaNs"), "arithmetic notation"),
    **dict.fromkeys(("GbE", "GiB", "KiB", "MiB", "VmHWM"), "units and the kernel's name for peak memory"),
    **dict.fromkeys(("AddressSanitizer", "CuPy", "DyNet", "GloVe", "InfiniBand", "NumPy", "OpenBLAS", "OpenMP",
                     "PyPI", "PyTorch", "PyYAML", "TensorFlow", "SplitMix64", "LazyAdam"),
                    "other projects, products and algorithms"),
    **dict.fromkeys(("CblasNoTrans", "CblasRowMajor", "CblasTrans", "RawModule", "default_rng"),
                    "CBLAS's, CuPy's and numpy's names"),
    "SkylakeX": "an OpenBLAS kernel's name (threadpoolctl's architecture)",
    **dict.fromkeys(("VanillaLSTMBuilder", "AdamTrainer", "AdagradTrainer", "SimpleSGDTrainer",
                     "MomentumSGDTrainer"), "DyNet's classes (a peer, tools/dynet_*.py)"),
    **dict.fromkeys(("Q", "m_a", "m_b"), "the equations' notation (Q-learning's Q, a kind's message)"),
}

# The repository's own folders a bare path like ``engine/passes`` or ``cpu/c_runner.py`` may start with.
FOLDERS = ("minicavs", "core", "ops", "ir", "runtime", "engine", "passes", "codegen", "cpu", "cuda", "nn",
           "data", "train", "bench", "models", "tools", "tests", "docs", "examples")
SUFFIXES = "py|md|yaml|c|h|cu|sh|cfg|toml"
PATH = re.compile(r"(?<![\w/.$~*<>-])((?:\.\./)?(?:[\w*<][\w.*<>-]*/)+[\w*<][\w.*<>-]*/?)(?![\w/-])")
EXTENSIONS = set(SUFFIXES.split("|")) | {"txt", "png", "svg", "pdf", "json", "cc", "so", "log", "csv", "npz", "pyx", "pxd"}
DOTTED = re.compile(r"(?<![\w.])((?:minicavs|[A-Za-z_]\w*)(?:\.[A-Za-z_]\w*)+)")
CALL = re.compile(r"(?<![\w.])([A-Za-z_]\w*)\(")
FILE_NAME = re.compile(r"(?<![\w/.*-])([\w-]+\.(?:%s))\b" % SUFFIXES)   # a file named without its folder
CLASS_LIKE = re.compile(r"(?<![\w.])([A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+)\b")   # BatchProgram, RowSparse
ROLE = re.compile(r"(?<![\w:]):(mod|func|class|meth|data|attr|exc):`~?([\w.]+)`")
CONFIG_SECTIONS = ("model", "data", "train")   # model.cell, train.engine.runner: config keys, not modules


@functools.cache
def config_keys() -> frozenset[str]:
    """Every config key as the text may write it: whole (``train.engine.check``) or its tail
    (``engine.check``), from every bundled model's config with the shared defaults and the MPI settings."""
    from minicavs.train.config import load_config
    from minicavs.train.distributed import SETTINGS

    def keys(section: dict, prefix: tuple = ()):
        for key, value in section.items():
            yield prefix + (key,)
            if isinstance(value, dict):
                yield from keys(value, prefix + (key,))
    found = {("train", "distributed", key) for key in SETTINGS}
    for config in sorted((ROOT / "models").glob("*.yaml")):
        found |= set(keys(load_config(config)))
    return frozenset(".".join(k[i:]) for k in found for i in range(len(k)))


def test_every_test_module_is_named_after_the_module_it_tests():
    tests = sorted(TESTS.rglob("test_*.py"))
    assert len(tests) > 90
    orphans = [str(t.relative_to(TESTS)) for t in tests
               if str(t.relative_to(TESTS)) not in WHOLE_PROJECT
               and not any(p.is_file() for p in places_of_tested_module(t))]
    assert not orphans, "test modules named after no module (rename them, or list them in WHOLE_PROJECT): " + \
        ", ".join(orphans)


def test_the_whole_project_list_names_existing_tests():
    assert not [name for name in WHOLE_PROJECT if not (TESTS / name).is_file()]


def places_of_tested_module(test: Path) -> list[Path]:
    """Where the module ``test`` is named after may live: minicavs/<dir>/<x>.py, <dir>/<x>.py at the root
    (models/, examples/, tools/; a bundled model's config too), or the package <dir> itself for
    tests/<dir>/test_<dir>.py. ``test_<x>_<aspect>.py`` is named after <x> too (one aspect of a module
    tested on its own: test_config_values.py, test_trainer_params.py)."""
    folder = test.parent.relative_to(TESTS)
    words = test.stem.removeprefix("test_").split("_")
    places = []
    for name in ("_".join(words[:k]) for k in range(len(words), 0, -1)):
        places += [PACKAGE / folder / f"{name}.py", ROOT / folder / f"{name}.py", ROOT / folder / f"{name}.yaml"]
        if folder.parts and folder.parts[-1] == name:
            places.append(PACKAGE / folder / "__init__.py")
    return places


# --- the tree and the package, as the checks below see them ------------------------------------------------

@functools.cache
def repo_paths() -> tuple[str, ...]:
    """Every file and folder of the checkout that git tracks or would track (relative, '/'-separated; folders
    with a trailing '/'): what a fresh clone has, not the run dirs and data sets of this machine."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    files = [f for f in listed if (ROOT / f).is_file()]   # (a file deleted in the work tree is gone)
    folders = {f.rsplit("/", i)[0] + "/" for f in files for i in range(1, f.count("/") + 1)}
    return tuple(files) + tuple(sorted(folders))


@functools.cache
def file_names() -> frozenset[str]:
    return frozenset(p.rstrip("/").rsplit("/", 1)[-1] for p in repo_paths())


@functools.cache
def modules() -> dict[str, ModuleType]:
    """Every module of the package, imported, by dotted name."""
    found = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        if p.name == "__main__.py":   # (importing it runs the command line)
            continue
        parts = p.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = importlib.import_module(name)
    return found


@functools.cache
def by_stem() -> dict[str, list[ModuleType]]:
    """The package's modules by their last name (``c_runner``, ``passes``)."""
    out: dict[str, list[ModuleType]] = {}
    for name, module in modules().items():
        out.setdefault(name.rsplit(".", 1)[-1], []).append(module)
    return out


@functools.cache
def classes() -> dict[str, list[type]]:
    """The package's classes by name."""
    out: dict[str, list[type]] = {}
    for module in modules().values():
        ours = [obj for obj in vars(module).values()
                if inspect.isclass(obj) and obj.__module__.startswith("minicavs")]
        for cls in ours:
            if cls not in out.setdefault(cls.__name__, []):
                out[cls.__name__].append(cls)
    return out


@functools.cache
def defined_names() -> frozenset[str]:
    """Every name the project's Python defines (functions, classes, assignments, attributes, parameters), in
    minicavs/, models/, tools/, examples/ and tests/: what a ``name()`` in the text may call."""
    names = set(dir(builtins))
    for folder in ("minicavs", "models", "tools", "examples", "tests"):
        for p in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
                elif isinstance(node, ast.arg):
                    names.add(node.arg)
    return frozenset(names)


@functools.cache
def instance_attributes(cls: type) -> frozenset[str]:
    """What an instance of ``cls`` (or of a class it derives from) has: its class attributes, annotations
    (dataclass fields) and every ``self.x`` its methods name."""
    names = set(dir(cls))
    for klass in cls.__mro__:
        names |= set(getattr(klass, "__annotations__", {}))
        if klass.__module__.startswith("minicavs"):
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
            names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                      and isinstance(n.value, ast.Name) and n.value.id == "self"}
    return frozenset(names)


def resolve_dotted(owner, rest: list[str]) -> bool:
    """Each name of ``rest`` an attribute of the one before, from ``owner``; a class's name may also be one
    of its instances' attributes (``Class.field``), past which nothing is known statically."""
    for name in rest:
        if hasattr(owner, name):
            owner = getattr(owner, name)
            continue
        return inspect.isclass(owner) and name in instance_attributes(owner)
    return True


# --- the text: pages and the package's docstrings and comments ---------------------------------------------

class Text(NamedTuple):
    where: str                  # file:line of its first line
    body: str
    module: ModuleType | None   # whose docstring or comment it is (``:mod:`.x``` is relative to it)
    fenced: tuple = ()          # (start, end) offsets of fenced code blocks (names in them are variables)

    def line_of(self, offset: int) -> str:
        path, line = self.where.rsplit(":", 1)
        return f"{path}:{int(line) + self.body.count(chr(10), 0, offset)}"


def pages() -> list[Text]:
    """README.md and docs/*.md, whole."""
    out = []
    for page in [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md")):
        body = page.read_text(encoding="utf-8")
        fenced = tuple((m.start(), m.end()) for m in re.finditer(r"^```.*?^```", body, re.S | re.M))
        out.append(Text(f"{page.relative_to(ROOT)}:1", body, None, fenced))
    return out


def package_text() -> list[Text]:
    """Every docstring and comment of the package's modules, and of the Python of models/, tools/, examples/
    and tests/ (those without a module: their Sphinx roles are not resolved)."""
    out = []
    for module in modules().values():
        out += source_text(Path(module.__file__), module)
    for folder in ("models", "tools", "examples", "tests"):
        out += [t for p in sorted((ROOT / folder).rglob("*.py")) if p != Path(__file__)
                for t in source_text(p, None)]
    return out


def source_text(path: Path, module: ModuleType | None) -> list[Text]:
    """The docstrings and comments of one Python file."""
    source = path.read_text(encoding="utf-8")
    rel = path.relative_to(ROOT)
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append(Text(f"{rel}:{node.body[0].lineno}", doc, module))
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append(Text(f"{rel}:{tok.start[0]}", tok.string, module))
    return out


# --- the checks --------------------------------------------------------------------------------------------

def not_ours(ref: str) -> bool:
    return any(ref.startswith(prefix) or (ref + "/").startswith(prefix) for prefix in NOT_OURS)


def as_pattern(ref: str) -> str:
    """``ref`` as a glob over the checkout: a placeholder in capitals (``tools/PEER.py``, ``data/NAME``), in
    angle brackets (``test_<family>.py``) or a ``*`` matches any name."""
    ref = re.sub(r"<[^>/]*>", "*", ref)
    return "/".join(re.sub(r"^[A-Z][A-Z_]+(?=\.|$)", "*", part) for part in ref.split("/"))


def path_exists(ref: str) -> bool:
    """``ref`` (``engine/passes/layout.py``, ``codegen/``, ``cpu/c_runner``) names a file or folder of the
    checkout: from its root, from docs/, or as the tail of a longer path (``passes/layout.py``)."""
    ref = as_pattern(ref.rstrip("/"))
    tails = (ref,) if is_file_name(ref) else (ref + "/", ref + ".py")
    return any(fnmatch.fnmatchcase(p, tail) or fnmatch.fnmatchcase(p, "*/" + tail)
               for p in repo_paths() for tail in tails)


def is_file_name(ref: str) -> bool:
    last = ref.rsplit("/", 1)[-1]
    return "." in last and last.rsplit(".", 1)[1] in EXTENSIONS


def module_at(path: str) -> ModuleType | None:
    """The package's module whose file ends with ``path``.py (``codegen/machine``), if there is exactly one."""
    found = [m for name, m in modules().items() if name.replace(".", "/").endswith(path)
             and not m.__file__.endswith("__init__.py")]
    return found[0] if len(found) == 1 else None


def bad_paths(text: Text):
    """Paths of the checkout that are not there, and ``path/module.name`` whose module lacks the name. A path
    without a file suffix counts only when it starts with one of the repository's folders (``cavs/depth`` is
    two policies' names, not a path)."""
    for m in PATH.finditer(text.body):
        ref = m.group(1).rstrip(".")   # (a sentence's full stop)
        if not_ours(ref) or (not is_file_name(ref) and ref.split("/")[0] not in FOLDERS):
            continue
        path, _, names = ref.rstrip("/").partition(".") if not is_file_name(ref) else (ref, "", "")
        if not path_exists(path):
            yield text.line_of(m.start()), ref, "no such file or folder"
        elif names and not (module_at(path) and resolve_dotted(module_at(path), names.split("."))):
            yield text.line_of(m.start()), ref, "no such name in that module"


def in_fence(text: Text, offset: int) -> bool:
    return any(a <= offset < b for a, b in text.fenced)


def dotted_owner(first: str):
    """What the first name of a dotted reference is, if it is one of ours: the package, a module by its last
    name (one of that name), or a class; None for anything else (a variable, numpy, a config key)."""
    if first == "minicavs":
        return importlib.import_module("minicavs")
    if first in CONFIG_SECTIONS:
        return None
    if first in by_stem() and len(by_stem()[first]) == 1:
        return by_stem()[first][0]
    if first in classes() and len(classes()[first]) == 1:
        return classes()[first][0]
    return None


def module_has(module: ModuleType, name: str) -> bool:
    """``module.name`` in the loose sense a text means it: the module's own attribute, or an attribute of a
    class the module defines (``program.dump()``: a BatchProgram's method)."""
    if resolve_dotted(module, [name]):
        return True
    return any(resolve_dotted(obj, [name]) for obj in vars(module).values()
               if inspect.isclass(obj) and obj.__module__ == module.__name__)


def bad_dotted(text: Text):
    """``minicavs.a.b``, ``module.name`` and ``Class.name`` that do not resolve."""
    for m in DOTTED.finditer(text.body):
        ref = m.group(1)
        first, *rest = ref.split(".")
        owner = dotted_owner(first)
        if owner is None or in_fence(text, m.start()) or rest[-1] in EXTENSIONS or ref in config_keys():
            continue
        if isinstance(owner, ModuleType) and first != "minicavs":
            # (past a name that is only a class's, ``program.dump().x``, nothing is known statically)
            ok = module_has(owner, rest[0]) and (resolve_dotted(owner, rest) or not hasattr(owner, rest[0]))
        else:
            ok = resolve_dotted(owner, rest)
        if not ok:
            yield text.line_of(m.start()), ref, "does not resolve"


def resolve_role(kind: str, target: str, text: Text) -> bool:
    """A Sphinx role's target: absolute (``minicavs.x.y``), relative to the text's package (``.x``), or a name
    of the text's module, of a class of it, or (``Class.meth``) dotted from one of ours."""
    module = text.module
    if target.startswith("."):
        is_package = module.__file__.endswith("__init__.py")
        package = module.__name__ if is_package else module.__name__.rpartition(".")[0]
        target = package + target
    first, *rest = target.split(".")
    if first == "minicavs":
        return resolve_dotted(importlib.import_module("minicavs"), rest)
    if kind == "mod":   # a sibling module by its bare name
        package = module.__name__.rpartition(".")[0]
        return any(m.__name__.rpartition(".")[0] == package for m in by_stem().get(first, []))
    if resolve_dotted(module, [first] + rest) or module_has(module, first) and not rest:
        return True
    owner = dotted_owner(first)
    return owner is not None and resolve_dotted(owner, rest)


def bad_roles(text: Text):
    if text.module is None:   # (a file the package does not import: nothing to resolve a role against)
        return
    for m in ROLE.finditer(text.body):
        if not resolve_role(m.group(1), m.group(2), text):
            yield text.line_of(m.start()), m.group(0), "does not resolve"


def bad_calls(text: Text):
    """``name(...)`` where the project defines no ``name`` (and neither does Python), outside code blocks."""
    for m in CALL.finditer(text.body):
        name = m.group(1)
        if name not in defined_names() and not in_fence(text, m.start()) and name not in NOT_OURS:
            yield text.line_of(m.start()), name + "()", "nothing of that name is defined"


def bad_file_names(text: Text):
    """``planner.py``, ``history.md``: a file of the checkout by that name exists."""
    for m in FILE_NAME.finditer(text.body):
        if m.group(1) not in file_names() and m.group(1) not in NOT_OURS:
            yield text.line_of(m.start()), m.group(1), "no file of that name"


def bad_class_names(text: Text):
    """``CamelCase`` words (class names, the way the project spells them) that nothing defines, outside code
    blocks; a plural (``BatchPrograms``) counts as its singular."""
    for m in CLASS_LIKE.finditer(text.body):
        name = m.group(1)
        known = {name, name.removesuffix("s")} & (defined_names() | set(NOT_OURS))
        if not known and not in_fence(text, m.start()):
            yield text.line_of(m.start()), name, "nothing of that name is defined"


CONFIG_SPAN = re.compile(r"(?<!`)`(?:[^`\n]*--set[ =]'?)?((?:%s)\.[\w.]+)(?:: |=)[^`\n]*`"
                         % "|".join(CONFIG_SECTIONS))


def bad_config_keys(text: Text):
    """``section.key: value`` and ``--set section.key=value`` in a page's code spans with a key no config has
    (a renamed key, which the loader still reads, included: the pages use the current names)."""
    for m in CONFIG_SPAN.finditer(text.body):
        if not in_fence(text, m.start()) and m.group(1) not in config_keys():
            yield text.line_of(m.start()), m.group(1), "no such config key"


def unresolved_references() -> list[str]:
    found = []
    for text in pages() + package_text():
        checks = [bad_paths, bad_file_names, bad_dotted, bad_calls, bad_class_names]
        checks.append(bad_config_keys if text.where.endswith(".md:1") else bad_roles)
        for check in checks:
            found += [f"{where}: {ref}: {why}" for where, ref, why in check(text)]
    return found


def test_the_text_names_only_what_exists():
    """Every path, dotted name, Sphinx role, call and config key in README.md, docs/ and the package's
    docstrings and comments resolves (the list above says what is deliberately not ours)."""
    found = unresolved_references()
    assert not found, f"{len(found)} names that do not exist:\n" + "\n".join(found)


@pytest.mark.parametrize("page", [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md")),
                         ids=lambda p: p.name)
def test_every_code_fence_is_closed(page):
    """A fence left open swallows the rest of the page into one code block."""
    fences = [n for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
              if line.lstrip().startswith("```")]
    assert len(fences) % 2 == 0, f"{page.name}: the fence at line {fences[-1]} (or one before it) is never closed"


@pytest.mark.parametrize("ref, found", [
    ("minicavs/engine/passes/layout.py", True), ("passes/layout.py", True), ("engine/passes/", True),
    ("cpu/c_runner", True), ("codegen/native", False), ("tools/PEER.py", True), ("minicavs/nope.py", False),
    ("tools/dynet_*.py", True), ("tests/ops/test_<family>.py", True), ("tests/ops/<x>.txt", False)])
def test_paths_resolve_as_the_text_means_them(ref, found):
    assert path_exists(ref) == found


def test_the_checks_catch_stale_names():
    """Each kind of reference, once as the text has it and once stale, through the checks themselves."""
    module = modules()["minicavs.engine.passes.gemm"]
    stale = Text("x.py:1", "(program.task_table) (program.bind_backward) (codegen/machine.matrix_shape) "
                 "(codegen/native.matrix_shape) Backend.to_host Backend.run_program :func:`merge_groups` :func:`plan` "
                 "minicavs.engine.compile.EngineOptions minicavs.explain.explain run() unknown_fn() BatchPrograms "
                 "BoundBlock native.py planner.py (see passes/layout.py.)", module)
    refs = [ref for check in (bad_paths, bad_file_names, bad_dotted, bad_roles, bad_calls, bad_class_names)
            for _, ref, _ in check(stale)]
    assert sorted(refs) == sorted(["program.bind_backward", "codegen/native.matrix_shape", "Backend.run_program",
                                   ":func:`plan`", "minicavs.explain.explain", "unknown_fn()", "BoundBlock",
                                   "native.py"])
    page = Text("p.md:1", "`train.engine.executor: native` `train.engine.runner: device` `--set train.lr=0.1`",
                None)
    assert [ref for _, ref, _ in bad_config_keys(page)] == ["train.engine.executor"]
