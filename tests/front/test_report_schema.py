"""The ``--json`` reports match the JSON Schema files published in ``tyingspec/schemas/``.

Each schema is checked for form (draft 2020-12's metaschema, an ``$id`` named for its file,
only keywords the draft defines, every ``$ref`` and ``required`` name resolving, its title the
string the code writes), and real reports are validated against it with ``jsonschema`` (the
``dev`` extra): ``tyingspec check --json`` with no target (``tyingspec.demo/1``), a failing
built-in and a ``--kind linear-ce`` run (``tyingspec.check/1``), ``tyingspec ckpt inspect
--json`` and ``tyingspec mutants --json``.  A report is validated strictly: a key the schema
does not declare fails here (the schema is validated with ``additionalProperties: false``
wherever it lists ``properties`` and says nothing of other keys), though the schema itself
admits one (a new key may appear in a minor version; consumers must ignore keys they do not
know).  The snippet docs/json-report.md gives a consumer runs here as written.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from report_schemas import (  # tests/report_schemas.py: shared with tests in other folders
    DOC,
    DRAFT,
    FILES,
    ID,
    KEYWORDS,
    LISTS,
    MAPS,
    NOT_REPORTS,
    ROOT,
    SCHEMAS,
    SUBSCHEMAS,
    TYPES,
    Validator,
    assert_valid,
    errors,
    load_schema,
    registry,
)

from tyingspec._src.core.diagnosis import LABELS
from tyingspec._src.front.cli import main
from tyingspec._src.kinds.table import KIND_NAMES


def _subschemas(schema: dict[str, Any], where: str = "$") -> list[tuple[str, dict[str, Any]]]:
    out = [(where, schema)]
    for key in MAPS:
        for name, sub in schema.get(key, {}).items():
            out += _subschemas(sub, f"{where}.{key}.{name}")
    for key in SUBSCHEMAS:
        if isinstance(schema.get(key), dict):
            out += _subschemas(schema[key], f"{where}.{key}")
    for key in LISTS:
        for i, sub in enumerate(schema.get(key, ())):
            out += _subschemas(sub, f"{where}.{key}[{i}]")
    return out


def test_the_schema_files_are_the_ones_listed() -> None:
    assert sorted(p.name for p in SCHEMAS.glob("*.json")) == sorted(FILES)


@pytest.mark.parametrize("name", sorted(FILES))
def test_each_schema_file_is_well_formed(name: str) -> None:
    schema = load_schema(name)
    Validator.check_schema(schema)  # draft 2020-12's metaschema
    assert schema["$schema"] == DRAFT
    assert schema["$id"] == ID.format(name)
    assert schema["title"] == FILES[name], name
    assert schema["type"] == "object"
    assert schema["properties"]["schema"] == {"type": "string", "enum": [FILES[name]]}
    assert "schema" in schema["required"]
    resolver = registry().resolver(base_uri=schema["$id"])
    for where, sub in _subschemas(schema):
        unknown = set(sub) - KEYWORDS
        assert not unknown, f"{name} {where}: keywords draft 2020-12 does not define: {unknown}"
        kinds = sub.get("type", [])
        assert set(kinds if isinstance(kinds, list) else [kinds]) <= TYPES, (name, where)
        assert set(sub.get("required", ())) <= set(sub.get("properties", {})), (name, where)
        assert isinstance(sub.get("additionalProperties", {}), dict | bool), (name, where)
        if "enum" in sub:
            assert isinstance(sub["enum"], list) and sub["enum"], (name, where)
            assert len(set(map(json.dumps, sub["enum"]))) == len(sub["enum"]), (name, where)
        if "$ref" in sub:
            assert isinstance(resolver.lookup(sub["$ref"]).contents, dict), (name, where)


def test_each_schema_is_found_by_its_id() -> None:
    found = registry()
    for name in FILES:
        assert found[ID.format(name)].contents == load_schema(name)


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
    assert ID.format("<file>") in text or ID.format("check-1.json") in text


def test_the_validator_rejects_what_the_schema_forbids() -> None:
    schema = load_schema("check-1.json")
    good = {"schema": "tyingspec.check/1", "target": "t", "kind": "model", "seed": 0,
            "verdict": "correct", "diagnosis": "correct", "exit_code": 0, "precision": "auto",
            "load_error": None, "cases": [], "baseline": None}
    assert errors(good, schema) == []
    for change, words in [({"kind": "tensorflow"}, "is not one of"),
                          ({"seed": "0"}, "is not of type 'integer'"),
                          ({"exit_code": True}, "is not of type 'integer'"),
                          ({"surprise": 1}, "('surprise' was unexpected)"),
                          ({"cases": [{"name": "c"}]}, "'seed' is a required property")]:
        found = errors({**good, **change}, schema)
        assert any(words in e for e in found), (change, found)
    # the key the schema does not name is refused here only: the schema itself admits it
    assert errors({**good, "surprise": 1}, schema, strictly=False) == []
    del good["cases"]
    assert errors(good, schema) == ["$: 'cases' is a required property"]


def test_the_docs_validation_snippet_runs_as_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (snippet,) = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    run_json(tmp_path, ["check", "output-path-only"], 1, capsys)  # writes report.json
    done = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    (tmp_path / "report.json").write_text(json.dumps({"schema": "tyingspec.check/1"}))
    done = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and "ValidationError" in done.stderr, done.stderr[-2000:]


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
