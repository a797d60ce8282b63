"""The architecture, read from the source with `ast` (fast, no model): issue 30's grep-level facts.

(a) no function in src/verinfer/cli/ is longer than 40 lines, none in src/verinfer/ longer than 80
    (first decorator to last line);
(b) no fitted attribute of a detector (a name ending in `_`: `provenance_`, `calibration_`,
    `warnings_`, ...) is assigned outside src/verinfer/detect/, and inside it only on `self` (a
    detector's fitted attributes are set by its own methods: fit, from_json);
(c) no module outside src/verinfer/scores.py writes Parquet (io.py may hold a generic atomic
    writer, if scores.py is what calls it), and none defines the score columns (a pyarrow schema
    or field naming one, a collection naming all of them, or one of the contract's constants);
(d) the official openai client is built (`OpenAI(...)`, `AsyncOpenAI(...)`) and the `openai`
    package imported only in src/verinfer/openai_client.py, so one factory and one error mapping
    serve every caller (issue 44).
(e) no module outside src/verinfer/scores.py reads a score column by a string literal (`t["margin"]`,
    `t.column("margin")`, `score_column(t, "margin")`, `"margin" in t.column_names`, ...): it names
    the column by the constant scores.py exports (`t[MARGIN]`); the apps the lead converts are
    allowed until then (ALLOW_UNTIL_CORE), and code reading a dict that only shares a key name with a
    column is named, with the reason, in NOT_SCORE_TABLES;
(f) the version is written once in the code (src/verinfer/_version.py, equal to pyproject.toml's
    static version) and no module imports it from the package root (an import up the layers);
(g) no module of src/verinfer/apps/ is longer than 200 lines: an app is an adapter of the audit
    core (src/verinfer/core/), never a pipeline of its own (issue 44).

A failing check lists each offence as file:line. The checks on src/ are xfail while the issue 30
refactor is in flight (the lead removes the marks once it lands); the tests of the checkers on
small snippets, at the end, are not: they keep the checks precise (no false positives)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from verinfer import scores

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "verinfer"

MAX_CLI_FUNCTION_LINES = 40
# The Token-DiFR score columns: a collection naming all four defines the column list.
SCORE_NAMES = frozenset({"margin", "likelihood", "exact_match", "cross_entropy"})
# Names of the scores contract (issue 30 plan): defined in scores.py only, imported elsewhere.
CONTRACT_NAMES = frozenset({"SCORE_SCHEMA", "SCORES", "ACTIVATION_SCORES", "ALL_SCORES",
                            "GAP_TEMPERATURE_FACTORS", "GAP_TOP_P_SLACK", "ENVELOPE_PREFIX"})
PARQUET_WRITERS = frozenset({"write_table", "ParquetWriter", "write_to_dataset"})
OPENAI_CLIENTS = frozenset({"OpenAI", "AsyncOpenAI"})
# Every column name of the scores contract, read from scores.py: the score table's (with the signed
# gaps, their envelope and a remote reference's fields) and the features table's that detectors read.
SCORE_COLUMNS = frozenset(scores.schema(gaps=True, envelope=True, extra=scores.REMOTE_FIELDS).names) | {
    scores.GAP, scores.GAP_FEATURE, scores.gap_column(scores.GAP_TOP_P_SLACK), scores.LOGIT_GAP}
# Calls that take column names: any whose name holds "column" (`column`, `score_column`,
# `append_column`, `drop_columns`, a module's `_columns` helper, ...), and these.
COLUMN_CALLS = frozenset({"divergence", "field", "get_field_index", "select", "drop", "sort_by", "group_by"})
IN_FLIGHT = lambda f: f  # noqa: E731  (the refactor has landed: the checks hold)
# The apps converted in issue 44: no file is skipped any more (kept as the place to name one, with why).
ALLOW_UNTIL_CORE: set[str] = set()
# Code whose subscripts share a key name with a score column but read no score table: "file" (all of
# it) or "file::function" -> why.
NOT_SCORE_TABLES = {
    "src/verinfer/report/probe.py": "the determinism probe's JSON: its flips' `position` and `margin` (top-2)",
    "src/verinfer/cli/render.py::probe": "the probe's flip rows (report.probe.flip_rows)",
    "src/verinfer/report/html.py::summarize": "the verdict views' `provider` (a Verdict field, VERDICT_KEYS)",
}


# --- the checkers: each takes a parsed module and returns (line, what) of every offence -------------

def _dotted(node: ast.AST) -> str | None:
    """`a.b.c` for a Name/Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def long_functions(tree: ast.AST, limit: int = MAX_CLI_FUNCTION_LINES) -> list[tuple[int, str]]:
    """Functions (methods and nested ones too) over `limit` lines, from the first decorator line."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            n = node.end_lineno - start + 1
            if n > limit:
                out.append((start, f"{node.name}() is {n} lines (at most {limit})"))
    return out


def _is_fitted(name: str) -> bool:
    return len(name) > 1 and name.endswith("_") and not (name.startswith("__") and name.endswith("__"))


def _assigned(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    else:
        return []
    flat = []
    while targets:
        t = targets.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            targets.extend(t.elts)
        elif isinstance(t, ast.Starred):
            targets.append(t.value)
        else:
            flat.append(t)
    return flat


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def fitted_attribute_assignments(tree: ast.AST, allow_self: bool = False) -> list[tuple[int, str]]:
    """`obj.name_ = ...` (also +=, annotated, tuple targets) and `setattr(obj, "name_", ...)`;
    with `allow_self`, not where obj is `self` itself (`self.null_.x_ = ...` is still flagged)."""
    out = []
    for node in ast.walk(tree):
        for t in _assigned(node):
            if isinstance(t, ast.Attribute) and _is_fitted(t.attr) and not (allow_self and _is_self(t.value)):
                out.append((t.lineno, f"{_dotted(t) or '...' + t.attr} assigned"))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str) and _is_fitted(node.args[1].value)
                and not (allow_self and _is_self(node.args[0]))):
            out.append((node.lineno, f"setattr(..., {node.args[1].value!r}, ...)"))
    return out


def _aliases(tree: ast.AST) -> tuple[set[str], set[str], set[str]]:
    """Names bound to pyarrow, to pyarrow.parquet, and to pyarrow.parquet's writers themselves."""
    pa, pq, writers = set(), set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "pyarrow":
                    pa.add(a.asname or "pyarrow")
                elif a.name == "pyarrow.parquet":
                    pq.add(a.asname or "pyarrow.parquet")
                    if not a.asname:
                        pa.add("pyarrow")
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            for a in node.names:
                if node.module == "pyarrow" and a.name == "parquet":
                    pq.add(a.asname or "parquet")
                elif node.module == "pyarrow.parquet" and a.name in PARQUET_WRITERS:
                    writers.add(a.asname or a.name)
    pq |= {f"{p}.parquet" for p in pa}
    return pa, pq, writers


def parquet_writes(tree: ast.AST, within: ast.AST | None = None) -> list[tuple[int, str]]:
    """Calls that write Parquet (in `within`, a part of the module `tree`; default all of it):
    pyarrow.parquet's writers through any import alias, and any `*write_parquet*` / `to_parquet`
    call (io's atomic helper, pandas and polars frames)."""
    _, pq, writers = _aliases(tree)
    out = []
    for node in ast.walk(within or tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func) or (node.func.attr if isinstance(node.func, ast.Attribute) else None)
        if name is None:
            continue
        head, _, last = name.rpartition(".")
        if (last in PARQUET_WRITERS and head in pq) or (not head and name in writers) \
                or "write_parquet" in last or last == "to_parquet":
            out.append((node.lineno, f"{name}(...) writes Parquet"))
    return out


def _functions_writing_parquet(tree: ast.Module) -> dict[str, list[tuple[int, str]]]:
    """Top-level functions of a module that write Parquet, with their writes."""
    return {f.name: w for f in tree.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            if (w := parquet_writes(tree, f))}


def _called_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            d = _dotted(node.func)
            if d:
                names.add(d.rpartition(".")[2])
    return names


def _strings(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def score_column_definitions(tree: ast.AST) -> list[tuple[int, str]]:
    """Where a module defines score columns: a pyarrow schema/field naming a score column; a tuple,
    list, set (a Literal[...] too) or dict keys naming all of SCORE_NAMES; a module- or class-level
    assignment of a contract name (CONTRACT_NAMES) to a value, not a re-export of another name."""
    pa, _, _ = _aliases(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name and name.rpartition(".")[0] in pa and name.rpartition(".")[2] in ("schema", "field"):
                named = sorted(_strings(node) & SCORE_NAMES)
                if named:
                    out.append((node.lineno, f"{name}(...) names score column(s) {', '.join(named)}"))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
            elts = node.keys if isinstance(node, ast.Dict) else node.elts
            consts = {e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            if SCORE_NAMES <= consts:
                out.append((node.lineno, f"a {type(node).__name__.lower()} naming every score column"))
    bodies = [tree.body] if isinstance(tree, ast.Module) else []
    bodies += [n.body for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    for body in bodies:
        for stmt in body:
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None \
                    and not isinstance(stmt.value, (ast.Name, ast.Attribute)):
                for t in _assigned(stmt):
                    if isinstance(t, ast.Name) and t.id in CONTRACT_NAMES:
                        out.append((stmt.lineno, f"{t.id} defined (the scores contract's name)"))
    return out


def openai_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """`import openai` / `from openai import ...` (any submodule, any alias), and every call of a
    name or attribute `OpenAI` / `AsyncOpenAI` (`openai.OpenAI(...)`, `OpenAI(...)`, an alias of
    either imported from openai)."""
    out, aliases = [], set(OPENAI_CLIENTS)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, f"import {a.name}") for a in node.names if a.name.split(".")[0] == "openai"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "openai" and not node.level:
            out.append((node.lineno, f"from {node.module} import ..."))
            aliases |= {a.asname for a in node.names if a.name in OPENAI_CLIENTS and a.asname}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name is not None and name.split(".")[-1] in aliases:
                out.append((node.lineno, f"{name}(...) builds an openai client"))
    return out
def _column_literals(node: ast.AST) -> list[str]:
    """Score column names written as a string literal in `node` or as an element of a literal list/tuple/set."""
    elts = node.elts if isinstance(node, (ast.List, ast.Tuple, ast.Set)) else [node]
    return [e.value for e in elts
            if isinstance(e, ast.Constant) and isinstance(e.value, str) and e.value in SCORE_COLUMNS]


def score_column_literals(tree: ast.AST, skip_functions: frozenset[str] = frozenset()) -> list[tuple[int, str]]:
    """Score columns read by a literal name: `x["margin"]` (a load, not a dict being filled),
    `x.column("margin")` and other column-taking calls (COLUMN_CALLS, any name holding "column"),
    `"margin" in x` / `not in`. Functions named in `skip_functions` are not read."""
    skipped = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
               and f.name in skip_functions for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            out += [(node.lineno, f"[{c!r}]") for c in _column_literals(node.slice)]
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if "column" in name or name in COLUMN_CALLS:
                args = [*node.args, *(k.value for k in node.keywords)]
                out += [(node.lineno, f"{name}(...{c!r}...)") for a in args for c in _column_literals(a)]
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            out += [(node.lineno, f"{c!r} in ...") for c in _column_literals(node.left)]
    return [(line, f"score column {what} by a literal (use the constant of verinfer.scores)") for line, what in out]


def version_from_the_root(tree: ast.AST) -> list[tuple[int, str]]:
    """`from verinfer import __version__` (also aliased; relative `from . import` at the root)."""
    return [(node.lineno, "__version__ imported from the package root (import it from verinfer._version)")
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and any(a.name == "__version__" for a in node.names)
            and (node.module == "verinfer" and node.level == 0 or node.module is None and node.level >= 1)]


# --- the source ---------------------------------------------------------------------------------

def _modules(under: Path = SRC):
    for path in sorted(under.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _rel(path: Path, root: Path = ROOT) -> str:
    return path.relative_to(root).as_posix()


def _where(path: Path, offences: list[tuple[int, str]], root: Path = ROOT) -> list[str]:
    rel = _rel(path, root)
    return [f"{rel}:{line}: {what}" for line, what in sorted(offences)]


def _report(found: list[str], rule: str) -> str:
    return f"{len(found)} offence(s) against: {rule}\n" + "\n".join(found)


def test_the_checks_read_the_source():
    """Guards the checks below against passing on nothing (a moved src/ or cli/)."""
    assert (SRC / "cli").is_dir() and (SRC / "detect").is_dir() and (SRC / "claims.py").is_file()
    assert sum(1 for _ in SRC.rglob("*.py")) > 50


@IN_FLIGHT
def test_cli_functions_are_at_most_40_lines():
    found = [w for path, tree in _modules(SRC / "cli") for w in _where(path, long_functions(tree))]
    assert not found, _report(found, "no function in src/verinfer/cli/ longer than "
                                     f"{MAX_CLI_FUNCTION_LINES} lines (a command parses, calls apps/, renders)")


@IN_FLIGHT
def test_detector_fitted_attributes_are_set_only_by_the_detector():
    detect = SRC / "detect"
    found = [w for path, tree in _modules() for w in _where(
        path, fitted_attribute_assignments(tree, allow_self=detect in path.parents))]
    assert not found, _report(found, "a detector's fitted attributes (`name_`) are set by its own methods "
                                     "(`self.name_ = ...` in detect/: fit, from_json), never from outside")


@IN_FLIGHT
def test_only_scores_writes_parquet():
    scores_py, io_py = SRC / "scores.py", SRC / "io.py"
    called_by_scores = _called_names(ast.parse(scores_py.read_text())) if scores_py.is_file() else set()
    found = []
    for path, tree in _modules():
        if path == scores_py:
            continue
        if path == io_py:  # a generic atomic writer is fine where scores.py is what calls it
            for fn, writes in _functions_writing_parquet(tree).items():
                if fn not in called_by_scores:
                    found += _where(path, [(line, f"{what} in {fn}(), which scores.py does not call")
                                           for line, what in writes])
            continue
        found += _where(path, parquet_writes(tree))
    assert not found, _report(found, "only src/verinfer/scores.py writes a scores Parquet")


@IN_FLIGHT
def test_only_scores_defines_the_score_columns():
    scores_py = SRC / "scores.py"
    found = [w for path, tree in _modules() if path != scores_py
             for w in _where(path, score_column_definitions(tree))]
    assert not found, _report(found, "only src/verinfer/scores.py defines score column names and the schema")


@IN_FLIGHT
def test_only_openai_client_builds_the_openai_client():
    factory = SRC / "openai_client.py"
    assert _lines(openai_uses, factory.read_text()) != []  # the factory itself is seen: the check reads it
    found = [w for path, tree in _modules() if path != factory for w in _where(path, openai_uses(tree))]
    assert not found, _report(found, "only src/verinfer/openai_client.py imports openai and builds its client "
                                     "(`new_client`; openai errors become EndpointError in `endpoint_errors`)")


def test_openai_client_sits_below_every_layer_that_uses_it():
    """openai_client.py is not in pyproject's import-linter layers (providers and audit, both its
    callers, are independent siblings of one layer): of verinfer it may import errors only."""
    tree = ast.parse((SRC / "openai_client.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | \
               {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in imported if m.split(".")[0] == "verinfer"} == {"verinfer.errors"}
def test_score_columns_are_read_by_the_constants_of_scores():
    found = []
    for path, tree in _modules():
        rel = _rel(path)
        if path == SRC / "scores.py" or rel in ALLOW_UNTIL_CORE or rel in NOT_SCORE_TABLES:
            continue
        skip = frozenset(k.partition("::")[2] for k in NOT_SCORE_TABLES if k.partition("::")[0] == rel)
        found += _where(path, score_column_literals(tree, skip))
    assert not found, _report(found, "score columns are named by the constants of src/verinfer/scores.py")


def test_the_version_is_written_once_and_read_from_verinfer_version():
    from verinfer import __version__
    from verinfer._version import __version__ as version

    project = (ROOT / "pyproject.toml").read_text().split("[project]", 1)[1].split("\n[", 1)[0]
    assert re.search(r'^version = "([^"]+)"$', project, re.M).group(1) == version == __version__
    found = [w for path, tree in _modules() if _rel(path) not in ALLOW_UNTIL_CORE
             for w in _where(path, version_from_the_root(tree))]
    assert not found, _report(found, "modules read the version from verinfer._version, not the package root")


# --- the checkers on snippets: what they flag and what they leave alone ------------------------------

def _lines(check, code: str) -> list[int]:
    return sorted(line for line, _ in check(ast.parse(code)))


def test_long_functions_count_from_the_first_decorator():
    body = "".join(f"    x{i} = {i}\n" for i in range(37))
    code = f"@app.command()\n@other\ndef f():\n{body}    return 1\n"  # 2 + 1 + 37 + 1 = 41 lines
    assert _lines(long_functions, code) == [1]
    assert _lines(long_functions, code.replace("@other\n", "")) == []  # 40 lines
    nested = "def outer():\n    def inner():\n" + "".join(f"        y{i} = {i}\n" for i in range(40))
    assert _lines(long_functions, nested) == [1, 2]


def test_fitted_attribute_assignments_flag_attributes_not_locals():
    flagged = """
det.provenance_ = prov
a.b.calibration_ = cal
det.warnings_ += ["x"]
det.clip_, n = 1.0, 2
det.null_: list = []
setattr(det, "warnings_", [])
"""
    assert _lines(fitted_attribute_assignments, flagged) == [2, 3, 4, 5, 6, 7]
    clean = """
warnings_ = []
x_, y = 1, 2
det.__dict__ = {}
det._private = 1
det.name = "x"
v = det.provenance_
getattr(det, "warnings_", [])
setattr(det, "name", 1)
"""
    assert _lines(fitted_attribute_assignments, clean) == []
    own = """
self.clip_ = 1.0
self.warnings_ += ["x"]
setattr(self, "null_", [])
self.null_.clip_ = 2.0
det.provenance_ = prov
"""
    assert _lines(fitted_attribute_assignments, own) == [2, 3, 4, 5, 6]
    assert sorted(line for line, _ in fitted_attribute_assignments(ast.parse(own), allow_self=True)) == [5, 6]


def test_parquet_writes_through_any_alias_and_nothing_else():
    flagged = """
import pyarrow.parquet as pq
import pyarrow
from pyarrow import parquet as pqt
from pyarrow.parquet import write_table as wt
pq.write_table(t, p)
pyarrow.parquet.write_table(t, p)
with pqt.ParquetWriter(p, schema) as w:
    pass
wt(t, p)
atomic_write_parquet(t, p)
io.atomic_write_parquet(t, p)
df.to_parquet(p)
"""
    assert _lines(parquet_writes, flagged) == [6, 7, 8, 10, 11, 12, 13]
    clean = """
import pyarrow.parquet as pq
pq.read_table(p)
pq.ParquetFile(p).schema_arrow
write_table(t)
csv.write_table(t)
w.write_table(t)
"""
    assert _lines(parquet_writes, clean) == []
    io = """
import pyarrow.parquet as pq
def atomic_write_parquet(table, path):
    return atomic_write(path, lambda tmp: pq.write_table(table, tmp))
def atomic_write_text(text, path):
    return atomic_write(path, lambda tmp: tmp.write_text(text))
"""
    assert {f: [line for line, _ in w] for f, w in _functions_writing_parquet(ast.parse(io)).items()} == \
        {"atomic_write_parquet": [4]}
    assert "atomic_write_parquet" in _called_names(ast.parse("io.atomic_write_parquet(t, out)"))


def test_score_column_definitions_flag_the_list_not_its_uses():
    flagged = """
import pyarrow as pa
SCHEMA = pa.schema([("claim_id", pa.string()), ("margin", pa.float64())])
f = pa.field("likelihood", pa.float64())
Score = Literal["margin", "likelihood", "exact_match", "cross_entropy", "fp_l2"]
row = {"margin": m, "likelihood": l, "exact_match": e, "cross_entropy": c}
ENVELOPE_PREFIX = "env_"
class D:
    GAP_TOP_P_SLACK: float = 0.01
"""
    assert _lines(score_column_definitions, flagged) == [3, 4, 5, 6, 7, 9]
    clean = """
import pyarrow as pa
from verinfer.scores import ENVELOPE_PREFIX, SCORES
from verinfer import scores
ALL_SCORES = scores.ALL_SCORES
HIST_SCORES = ("margin", "cross_entropy")
t = pa.table({"claim_id": ids})
s = pa.schema([("claim_id", pa.string())])
m = table["margin"]
def f():
    SCORES = ("margin",)
"""
    assert _lines(score_column_definitions, clean) == []


def test_openai_uses_flag_every_construction_and_import_and_nothing_else(tmp_path):
    flagged = """
import openai
import openai.types as ot
from openai import OpenAI as Client, APIStatusError
client = openai.OpenAI(base_url=u)
c = OpenAI()
c = Client(api_key=k)
a = openai.AsyncOpenAI()
x = sdk.OpenAI()
"""
    assert _lines(openai_uses, flagged) == [2, 3, 4, 5, 6, 7, 8, 9]
    clean = """
from verinfer.openai_client import new_client, endpoint_errors
client = new_client(url, timeout=1.0, max_retries=2)
cmd = "python -m vllm.entrypoints.openai.api_server"
from .openai import helper
OpenAIish()
x = client.OpenAI
"""
    assert _lines(openai_uses, clean) == []
    planted = tmp_path / "pkg" / "rogue.py"  # the src/ scan finds a construction in any file under it
    planted.parent.mkdir()
    planted.write_text("def f(openai):\n    return openai.OpenAI(base_url='http://x/v1')\n")
    assert [w for path, tree in _modules(tmp_path) for w in _where(path, openai_uses(tree), tmp_path)] == \
        ["pkg/rogue.py:2: openai.OpenAI(...) builds an openai client"]
def test_version_from_the_root_flags_the_root_not_the_module():
    flagged = """
from verinfer import __version__
from verinfer import api, __version__ as v
from . import __version__
"""
    assert _lines(version_from_the_root, flagged) == [2, 3, 4]
    clean = """
from verinfer._version import __version__
from torch import __version__
import verinfer
v = verinfer.__version__
from .x import __version__
"""
    assert _lines(version_from_the_root, clean) == []


def test_score_column_literals_flag_reads_not_the_constants_or_other_keys():
    flagged = """
m = table["margin"]
ids = t.column("claim_id").to_pylist()
ce = score_column(table, "cross_entropy")
v = divergence(cols, name="exact_match")
sub = t.select(["provider", "position"])
if "fp_l2" not in t.column_names:
    pass
env = t["env_gap_s0.01"]
x = pc.field("gap_0") > 0
cols = _columns(table, ["provider", *SCORES])
"""
    assert _lines(score_column_literals, flagged) == [2, 3, 4, 5, 6, 6, 7, 9, 10, 11]
    clean = """
from verinfer.scores import MARGIN
m = table[MARGIN]
d["provider"] = name
row = {"margin": m, "provider": p}
x = f["condition"]
y = t["spec_score"]
z = options.get("margin")
"""
    assert _lines(score_column_literals, clean) == []
    skipped = "def probe(r):\n    return r['position']\ndef audit(t):\n    return t['margin']\n"
    assert sorted(line for line, _ in score_column_literals(ast.parse(skipped), frozenset({"probe"}))) == [4]


def test_committed_results_name_no_path_of_the_machine_that_made_them():
    """Results name models and files (repo-relative), never a directory of the machine that made them
    (issue 44: a settings row showed the machine's model directory; a timing command's lock in /tmp)."""
    home = re.compile(r"(^|[^A-Za-z0-9_.])/(work|root|home|Users|mnt|srv|opt|tmp|var)/")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "benchmarks" / "results").rglob("*"))
             if p.suffix in (".json", ".md", ".html") for i, line in enumerate(p.read_text().splitlines(), 1)
             if home.search(line)]
    assert not found, _report(found, "committed results name no path of the machine that made them")
    assert home.search('"src": "/work/wt-fixtures/src"') and home.search("flock /tmp/x.lock")
    assert not home.search("benchmarks/results/x.json") and not home.search("flock runs/timing.lock")


MAX_FUNCTION_LINES = 80  # issue 44: no function of src/ longer (first decorator to last line)


def test_no_function_is_longer_than_80_lines():
    found = [w for path, tree in _modules() for w in _where(path, long_functions(tree, MAX_FUNCTION_LINES))]
    assert not found, _report(found, f"no function in src/verinfer/ is longer than {MAX_FUNCTION_LINES} lines")
    body = lambda n: "".join(f"    x{i} = {i}\n" for i in range(n))  # noqa: E731
    assert _lines(lambda t: long_functions(t, MAX_FUNCTION_LINES), f"def f():\n{body(79)}") == []  # 80 lines
    assert _lines(lambda t: long_functions(t, MAX_FUNCTION_LINES), f"@dec\ndef f():\n{body(79)}") == [1]  # 81


MAX_APP_LINES = 200  # issue 44: an app is an adapter of the audit core (src/verinfer/core/), not a pipeline


def oversized_modules(folder: Path, limit: int) -> list[str]:
    """`file: N lines (at most limit)` for each module of `folder` longer than `limit` lines."""
    out = []
    for path in sorted(folder.glob("*.py")):
        n = len(path.read_text().splitlines())
        if n > limit:
            out.append(f"{path.name}: {n} lines (at most {limit})")
    return out


def test_every_app_module_is_at_most_200_lines(tmp_path):
    """(g) each module of src/verinfer/apps/ is at most MAX_APP_LINES lines: what an audit does lives
    in core/ (sources, collector, AuditCore, local runs), audit/ (replay) and detect/ (statistics)."""
    found = oversized_modules(SRC / "apps", MAX_APP_LINES)
    assert not found, _report(found, f"no module of src/verinfer/apps/ is longer than {MAX_APP_LINES} lines")
    assert len(list((SRC / "apps").glob("*.py"))) >= 8  # the check reads the apps
    (tmp_path / "a.py").write_text("x = 1\n" * 200)
    (tmp_path / "b.py").write_text("x = 1\n" * 201)
    assert oversized_modules(tmp_path, 200) == ["b.py: 201 lines (at most 200)"]
