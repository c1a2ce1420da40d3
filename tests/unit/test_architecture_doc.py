"""docs/architecture.md names only what exists in src/phalanx.

The page is read, not imported: every backticked span outside code blocks is checked by its
shape, against the source's syntax trees (no module is imported, so nothing runs).

- a path (``exchange/buckets.py``, ``phalanx/__init__.py``, ``planner/``, ``tests/...``): the
  file or folder exists under src/phalanx (or the repository, for tests/ and tools/);
- ``path.name`` (``models/layers.run_layers``) and dotted names (``runtime.launch.launch``,
  ``phalanx.runtime.context.on_shutdown``): the module exists and defines or imports the name;
- ``Class.attr`` (``GradientBuckets.written``, ``Strategy.compile_model``): the class exists in
  src/phalanx and it or a base class defines the attribute (methods, class or dataclass fields,
  ``self.attr = ...`` in its methods);
- ``instance.attr`` for the names the page uses for objects (``engine.module``,
  ``strategy.finish()``, ``stats.exchange_s``): the same, on that object's class or a subclass;
- a bare name (``run_ranks(fn, world_size, *args)``, ``LayerCost``, ``spill_file``): defined
  in src/phalanx (a function, class, method, field or assignment) or, as grep would find it,
  a word of its source (torch's names it calls, string values, environment variables);
- a dotted config key (``data.path``): listed in docs/configs.md.

Spans that are not names (commands, TOML, ``[train] compile = true``, file names of a run's
outputs) are skipped, and so are dotted names of torch's and a user's objects (``torch.``,
``nn.``, ``model.``).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "phalanx"
DOC = ROOT / "docs" / "architecture.md"

# what the page calls the objects it describes -> their class
INSTANCES = {
    "engine": "Engine",
    "strategy": "Strategy",
    "stats": "StepStats",
    "ctx": "Context",
    "buckets": "GradientBuckets",
    "pipeline": "PipelineParallel",
    "trainer": "Trainer",
}
# first segments of dotted names that are not phalanx's (torch, the standard library, a
# user's objects in examples)
FOREIGN = {
    "torch", "dist", "nn", "np", "os", "sys", "atexit", "ctypes", "contextvars", "c10",
    "c10d", "model", "module", "submodule", "param", "p", "x", "y", "optimizer", "loss",
    "self",
}  # fmt: skip
# names of files a run writes or reads (config.json, metrics.jsonl, ...), not source
NOT_SOURCE = re.compile(r"\.(json|jsonl|md|toml|txt|png|safetensors)$")


@dataclass
class ClassInfo:
    module: str
    bases: list[str]
    attrs: set[str] = field(default_factory=set)


@dataclass
class Index:
    modules: dict[str, set[str]]  # "exchange.buckets" -> names defined or imported there
    classes: dict[str, list[ClassInfo]]  # "Engine" -> its definitions (one, usually)
    everything: set[str]  # every name defined anywhere (functions, classes, attrs, fields)


def _class_attrs(node: ast.ClassDef) -> set[str]:
    attrs: set[str] = set()
    for item in ast.walk(node):
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            attrs.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            attrs.add(item.target.id)
        elif isinstance(item, ast.Assign):
            attrs.update(t.id for t in item.targets if isinstance(t, ast.Name))
        if isinstance(item, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target]
            for target in targets:
                for sub in ast.walk(target):
                    if (
                        isinstance(sub, ast.Attribute)
                        and isinstance(sub.value, ast.Name)
                        and sub.value.id == "self"
                    ):
                        attrs.add(sub.attr)
    return attrs


def _base_name(node: ast.expr) -> str:
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


@cache
def index() -> Index:
    modules: dict[str, set[str]] = {}
    classes: dict[str, list[ClassInfo]] = {}
    everything: set[str] = set()
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        name = ".".join(parts)
        tree = ast.parse(path.read_text(), filename=str(path))
        top: set[str] = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                top.add(node.name)
            elif isinstance(node, ast.Assign):
                top.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                top.add(node.target.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                top.update((a.asname or a.name).split(".")[0] for a in node.names)
        modules[name] = top
        for item in ast.walk(tree):
            if isinstance(item, ast.ClassDef):
                info = ClassInfo(name, [_base_name(b) for b in item.bases], _class_attrs(item))
                classes.setdefault(item.name, []).append(info)
                everything.update(info.attrs)
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                everything.add(item.name)
            elif isinstance(item, ast.Name) and isinstance(item.ctx, ast.Store):
                everything.add(item.id)
            elif isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store):
                everything.add(item.attr)
            elif isinstance(item, ast.keyword) and item.arg:
                everything.add(item.arg)
    return Index(modules, classes, everything)


def class_has(cls: str, attr: str, subclasses: bool = False, seen: frozenset = frozenset()) -> bool:
    """Whether class ``cls`` (any definition of that name), a base or (``subclasses``) a
    subclass defines ``attr``."""
    idx = index()
    if cls in seen or cls not in idx.classes:
        return False
    seen = seen | {cls}
    for info in idx.classes[cls]:
        if attr in info.attrs or any(class_has(b, attr, False, seen) for b in info.bases):
            return True
    if subclasses:
        for name, infos in idx.classes.items():
            if any(cls in info.bases for info in infos) and class_has(name, attr, True, seen):
                return True
    return False


def module_has(module: str, rest: list[str]) -> bool:
    """``module`` exists and defines ``rest[0]``; a class's attribute ``rest[1]`` too."""
    idx = index()
    if module not in idx.modules:
        return False
    if not rest:
        return True
    head = rest[0]
    if head not in idx.modules[module]:
        return module + "." + head in idx.modules and module_has(module + "." + head, rest[1:])
    return len(rest) == 1 or head not in idx.classes or class_has(head, rest[1])


def spans(text: str) -> list[str]:
    """The backticked spans of ``text`` outside fenced code blocks."""
    outside = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", outside)


def config_keys() -> set[str]:
    """The config keys docs/configs.md lists (``data.path``): dotted, but not modules."""
    text = (ROOT / "docs" / "configs.md").read_text()
    return set(re.findall(r"^\| `([\w.]+)` \|", text, flags=re.M))


@cache
def source_words() -> set[str]:
    """Every word of src/phalanx's text: names phalanx uses (torch's included), string
    values (layer types, tier names), environment variables."""
    words: set[str] = set()
    for path in list(SRC.rglob("*.py")) + list(SRC.rglob("*.cpp")):
        words.update(re.findall(r"\w+", path.read_text()))
    return words


def modules_named(parts: list[str]) -> list[str]:
    """The modules whose name ends with ``parts`` (``measure`` -> ``memory.measure``), the
    page naming a module within its folder's row."""
    idx = index()
    return [m for m in idx.modules if m.split(".")[-len(parts) :] == parts]


def check_path(name: str) -> str | None:
    if name.endswith((".py", ".cpp", "/")):
        path, attr = name, ""
    elif ".py." in name:
        path, _, attr = name.partition(".py.")
        path += ".py"
    else:
        path, _, attr = name.rpartition(".")
        path += ".py"
    path = path.removeprefix("src/").removeprefix("phalanx/")
    if path.startswith(("tests/", "tools/", "configs/", "examples/")):
        return None if (ROOT / path).exists() else f"no {path} in the repository"
    found = [path] if (SRC / path).exists() else []
    if not found and "/" not in path.rstrip("/"):  # a file named in its folder's row
        found = [p.relative_to(SRC).as_posix() for p in SRC.rglob(path.rstrip("/"))]
    if not found:
        return f"no file or folder {path} in src/phalanx"
    if attr:
        modules = [f.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for f in found]
        if not any(module_has(m, attr.split(".")) for m in modules):
            return f"{path} defines no {attr}"
    return None


def problem(span: str) -> str | None:
    """Why ``span`` names nothing in src/phalanx, or None (it does, or it is not a name)."""
    name = re.sub(r"\(.*\)$", "", span.strip())  # run_ranks(fn, ...) -> run_ranks
    if not re.fullmatch(r"\w[\w./]*", name) or NOT_SOURCE.search(name) or name.endswith("."):
        return None
    if "/" in name or name.endswith((".py", ".cpp")):
        return check_path(name)
    idx = index()
    parts = name.split(".")
    if parts[0] == "phalanx":
        parts = parts[1:] or ["__init__"]
    if len(parts) == 1:
        word = parts[0]
        if word in idx.everything or word in idx.classes or word in source_words():
            return None
        return f"nothing in src/phalanx defines or uses {word}"
    if name in config_keys():
        return None
    head, attr = parts[0], parts[1]
    for cut in range(len(parts), 0, -1):  # the longest module prefix
        module = ".".join(parts[:cut])
        if module in idx.modules and module_has(module, parts[cut:]):
            return None
    for cut in range(len(parts), 0, -1):  # a module named within its folder
        if any(module_has(m, parts[cut:]) for m in modules_named(parts[:cut])):
            return None
    if head in idx.classes:
        return None if class_has(head, attr) else f"class {head} has no {attr}"
    if head in INSTANCES:
        cls = INSTANCES[head]
        return None if class_has(cls, attr, subclasses=True) else f"{cls} has no {attr}"
    if head in FOREIGN:
        return None
    if head in idx.modules or modules_named([head]):
        return f"module {head} has no {'.'.join(parts[1:])}"
    return f"no module, class or object {head} in src/phalanx"


def test_architecture_doc_names_exist() -> None:
    wrong = sorted({f"`{s}`: {why}" for s in spans(DOC.read_text()) if (why := problem(s))})
    assert not wrong, "docs/architecture.md names what src/phalanx lacks:\n" + "\n".join(wrong)


def test_the_checker_catches_drift() -> None:
    """The checker itself: names that do not exist are reported, names that do are not."""
    assert problem("models/layers.shape_error")
    assert problem("strategy.update_spans")
    assert problem("exchange/nothing.py")
    assert problem("runtime.launch.no_such_function")
    assert problem("no_such_helper()")
    assert problem("GradientBuckets.no_such_attr")
    assert not problem("models/layers.run_layers")
    assert not problem("exchange/buckets.py")
    assert not problem("strategy.finish()")
    assert not problem("runtime.context.on_shutdown")
    assert not problem("GradientBuckets.zero()")
    assert not problem("run_ranks(fn, world_size, *args)")
    assert not problem("[train] compile")
