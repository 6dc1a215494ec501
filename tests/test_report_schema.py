"""The ``--json`` reports match the JSON Schema files published in ``tyingspec/schemas/``.

Each schema is checked for form (only the keywords of the subset below, every ``$ref`` and
``required`` name resolving, its title the string the code writes), and real reports are
validated against it: ``tyingspec check --json`` with no target (``tyingspec.demo/1``), a
failing built-in and a ``--kind linear-ce`` run (``tyingspec.check/1``), ``tyingspec ckpt
inspect --json`` and ``tyingspec mutants --json``.  A report is validated strictly: a key the
schema does not declare fails here, though the schema itself admits one (a new key may appear
in a minor version; consumers must ignore keys they do not know).

The validator is this file's own, for the subset of JSON Schema the files use (``type``,
``properties``, ``required``, ``items``, ``enum``, ``additionalProperties`` and local
``$ref``), so the test needs no dependency; where ``jsonschema`` is importable the schemas are
also checked against draft 2020-12's metaschema and the reports validated by it too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tyingspec._src.core.diagnosis import LABELS
from tyingspec._src.front.cli import main
from tyingspec._src.kinds.table import KIND_NAMES

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = ROOT / "tyingspec" / "schemas"
DOC = ROOT / "docs" / "json-report.md"
DRAFT = "https://json-schema.org/draft/2020-12/schema"
#: schema file -> the string its reports carry in "schema"
FILES = {"check-1.json": "tyingspec.check/1", "demo-1.json": "tyingspec.demo/1",
         "ckpt-1.json": "tyingspec.ckpt/1", "mutants-1.json": "tyingspec.mutants/1"}
#: schema strings in tyingspec's code that are no ``--json`` report
NOT_REPORTS = {"tyingspec.baseline/1": "the --baseline / --tyingspec-baseline file"}

VALIDATING = {"type", "properties", "required", "items", "enum", "additionalProperties", "$ref"}
ANNOTATIONS = {"$schema", "title", "description", "$defs"}
TYPES = {"object", "array", "string", "integer", "number", "boolean", "null"}


def load_schema(name: str) -> dict[str, Any]:
    schema = json.loads((SCHEMAS / name).read_text(encoding="utf-8"))
    assert isinstance(schema, dict)
    return schema


# --- the validator ---------------------------------------------------------------------------

def _is(value: Any, kind: str) -> bool:
    if kind == "null":
        return value is None
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, {"object": dict, "array": list, "string": str}[kind])


def _resolve(root: dict[str, Any], ref: str) -> dict[str, Any]:
    assert ref.startswith("#/"), f"only local $ref is used: {ref}"
    node: Any = root
    for part in ref[2:].split("/"):
        node = node[part]
    assert isinstance(node, dict)
    return node


def errors(value: Any, schema: dict[str, Any], root: dict[str, Any], where: str = "$",
           *, strict: bool = True) -> list[str]:
    """Where ``value`` breaks ``schema``; ``strict``: an object key that a ``properties``
    schema without ``additionalProperties`` does not declare is an error too."""
    if "$ref" in schema:
        return errors(value, _resolve(root, schema["$ref"]), root, where, strict=strict)
    found: list[str] = []
    if "type" in schema:
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is(value, k) for k in kinds):
            return [f"{where}: {type(value).__name__} {value!r:.60} is not {' or '.join(kinds)}"]
    if "enum" in schema and value not in schema["enum"]:
        found.append(f"{where}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", ()):
            if key not in value:
                found.append(f"{where}: required key {key!r} missing")
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if key in props:
                found += errors(item, props[key], root, f"{where}.{key}", strict=strict)
            elif isinstance(extra, dict):
                found += errors(item, extra, root, f"{where}.{key}", strict=strict)
            elif extra is False or (strict and "properties" in schema):
                found.append(f"{where}: key {key!r} is not in the schema")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += errors(item, schema["items"], root, f"{where}[{i}]", strict=strict)
    return found


def assert_valid(report: dict[str, Any], name: str) -> None:
    schema = load_schema(name)
    problems = errors(report, schema, schema)
    assert not problems, "\n".join(problems[:20])
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.Draft202012Validator(schema).validate(report)


# --- the schema files ------------------------------------------------------------------------

def _subschemas(schema: dict[str, Any], where: str = "$") -> list[tuple[str, dict[str, Any]]]:
    out = [(where, schema)]
    for key in ("properties", "$defs"):
        for name, sub in schema.get(key, {}).items():
            out += _subschemas(sub, f"{where}.{key}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            out += _subschemas(schema[key], f"{where}.{key}")
    return out


def test_the_schema_files_are_the_ones_listed() -> None:
    assert sorted(p.name for p in SCHEMAS.glob("*.json")) == sorted(FILES)


@pytest.mark.parametrize("name", sorted(FILES))
def test_each_schema_file_is_well_formed(name: str) -> None:
    schema = load_schema(name)
    assert schema["$schema"] == DRAFT
    assert schema["title"] == FILES[name], name
    assert schema["type"] == "object"
    assert schema["properties"]["schema"] == {"type": "string", "enum": [FILES[name]]}
    assert "schema" in schema["required"]
    for where, sub in _subschemas(schema):
        unknown = set(sub) - VALIDATING - ANNOTATIONS
        assert not unknown, f"{name} {where}: keywords outside the subset: {unknown}"
        kinds = sub.get("type", [])
        assert set(kinds if isinstance(kinds, list) else [kinds]) <= TYPES, (name, where)
        assert set(sub.get("required", ())) <= set(sub.get("properties", {})), (name, where)
        assert isinstance(sub.get("additionalProperties", {}), dict | bool), (name, where)
        if "enum" in sub:
            assert isinstance(sub["enum"], list) and sub["enum"], (name, where)
            assert len(set(map(json.dumps, sub["enum"]))) == len(sub["enum"]), (name, where)
        if "$ref" in sub:
            _resolve(schema, sub["$ref"])
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.Draft202012Validator.check_schema(schema)


def test_every_report_schema_the_code_writes_has_a_file() -> None:
    written = set()
    for path in (ROOT / "tyingspec").rglob("*.py"):
        written |= set(re.findall(r"tyingspec\.[a-z]+/\d+", path.read_text(encoding="utf-8")))
    assert written - set(NOT_REPORTS) == set(FILES.values())
    from tyingspec._src.front.kill_matrix import SCHEMA as MUTANTS
    from tyingspec._src.front.report import SCHEMA as CHECK

    assert {CHECK, MUTANTS} <= set(FILES.values())


def test_the_schemas_are_in_step_with_the_labels_and_kinds() -> None:
    check, demo = load_schema("check-1.json"), load_schema("demo-1.json")
    assert check["$defs"]["label"]["enum"] == list(LABELS)
    assert set(check["properties"]["diagnosis"]["enum"]) == {
        *LABELS, "correct", "wrong", "no_power", "adapter_error"}
    assert check["properties"]["kind"]["enum"] == list(KIND_NAMES)
    assert load_schema("mutants-1.json")["$defs"]["row"]["properties"]["kind"]["enum"] == \
        list(KIND_NAMES)
    # the demo's results are check cases: one definition, written in both files
    assert demo["$defs"] == check["$defs"]


def test_the_json_report_doc_names_each_schema_file() -> None:
    text = DOC.read_text(encoding="utf-8")
    for name, title in FILES.items():
        assert f"tyingspec/schemas/{name}" in text, name
        assert title in text, title


def test_the_validator_rejects_what_the_schema_forbids() -> None:
    schema = load_schema("check-1.json")
    good = {"schema": "tyingspec.check/1", "target": "t", "kind": "model", "seed": 0,
            "verdict": "correct", "diagnosis": "correct", "exit_code": 0, "precision": "auto",
            "load_error": None, "cases": [], "baseline": None}
    assert errors(good, schema, schema) == []
    for change, words in [({"kind": "tensorflow"}, "is not one of"),
                          ({"seed": "0"}, "is not integer"),
                          ({"exit_code": True}, "is not integer"),
                          ({"surprise": 1}, "not in the schema"),
                          ({"cases": [{"name": "c"}]}, "required key 'seed' missing")]:
        found = errors({**good, **change}, schema, schema)
        assert any(words in e for e in found), (change, found)
    del good["cases"]
    assert errors(good, schema, schema) == ["$: required key 'cases' missing"]


# --- real reports ----------------------------------------------------------------------------

def run_json(tmp_path: Path, argv: list[str], code: int,
             capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    out = tmp_path / "report.json"
    assert main([*argv, "--json", str(out)]) == code, capsys.readouterr().out[-3000:]
    capsys.readouterr()
    report = json.loads(out.read_text(encoding="utf-8"))
    assert isinstance(report, dict)
    return report


def test_the_built_in_default_writes_a_valid_demo_report(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(tmp_path, ["check"], 0, capsys)
    assert report["schema"] == "tyingspec.demo/1" and report["as_expected"] is True
    assert_valid(report, "demo-1.json")


def test_a_failing_built_in_writes_a_valid_check_report(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(tmp_path, ["check", "output-path-only"], 1, capsys)
    assert (report["verdict"], report["diagnosis"]) == ("wrong", "input_path_missing")
    assert any("smallest_batch" in c for c in report["cases"])
    assert_valid(report, "check-1.json")


def test_a_torch_model_whose_uses_cannot_be_observed_says_its_rows_were_not_compared(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # its rows are its own gradient set against itself: "rows_wrong": 0 is no evidence, and a
    # gate reading the JSON is told so beside it
    pytest.importorskip("torch")
    report = run_json(tmp_path, ["check", "nanogpt-input-path-dropped", "--kind", "torch",
                                 "--case", "absent-tokens"], 1, capsys)
    assert report["diagnosis"] == "input_path_missing"
    (case,) = report["cases"]
    assert case["rows_compared"] is False and case["diagnosis"]["rows_compared"] is False
    assert case["rows_wrong"] == 0  # the comparison with itself: why the flag is there
    assert_valid(report, "check-1.json")
    observed = run_json(tmp_path, ["check", "nanogpt", "--kind", "torch", "--case",
                                   "absent-tokens"], 0, capsys)
    assert [c["rows_compared"] for c in observed["cases"]] == [True]
    assert_valid(observed, "check-1.json")


def test_a_linear_ce_run_writes_a_valid_check_report(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(tmp_path, ["check", "ce-numpy", "--kind", "linear-ce"], 0, capsys)
    assert (report["kind"], report["verdict"]) == ("linear-ce", "correct")
    assert_valid(report, "check-1.json")


def test_a_target_that_cannot_load_writes_a_valid_check_report(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(tmp_path, ["check", "tyingspec_no_such_module:f"], 2, capsys)
    assert report["verdict"] == "adapter_error" and report["load_error"]
    assert_valid(report, "check-1.json")


def test_ckpt_inspect_writes_a_valid_ckpt_report(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    save_file = pytest.importorskip("safetensors.torch").save_file
    torch.manual_seed(0)
    E = torch.randn(8, 4)
    save_file({"transformer.wte.weight": E, "lm_head.weight": E + 0.01,
               "lm_head.bias": torch.zeros(8)}, str(tmp_path / "m.safetensors"))
    (tmp_path / "config.json").write_text('{"tie_word_embeddings": true}')
    report = run_json(tmp_path, ["ckpt", "inspect", str(tmp_path / "m.safetensors"),
                                 "--config", str(tmp_path / "config.json")], 1, capsys)
    assert report["pairs"][0]["state"] == "different" and report["pairs"][0]["output_bias"]
    assert_valid(report, "ckpt-1.json")


def test_mutants_writes_a_valid_mutants_report(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(tmp_path, ["mutants", "--kind", "kernel", "--only", "output-path-only",
                                 "--only", "tied", "--max-examples", "2"], 0, capsys)
    assert report["total"] == 1 and len(report["styles"]) == 1
    assert_valid(report, "mutants-1.json")
