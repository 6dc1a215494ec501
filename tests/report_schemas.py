"""The JSON Schemas of ``tyingspec/schemas/`` and a strict validator for real reports, shared by
``tests/front/test_report_schema.py`` (which checks the schemas themselves) and every test that
validates a ``--json`` report it wrote (tests in several folders import it from here).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
from referencing import Registry, Resource

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = ROOT / "tyingspec" / "schemas"
DOC = ROOT / "docs" / "json-report.md"
DRAFT = "https://json-schema.org/draft/2020-12/schema"
#: schema file -> the string its reports carry in "schema"
FILES = {"check-1.json": "tyingspec.check/1", "demo-1.json": "tyingspec.demo/1",
         "ckpt-1.json": "tyingspec.ckpt/1", "mutants-1.json": "tyingspec.mutants/1"}
#: schema strings in tyingspec's code that are no ``--json`` report
NOT_REPORTS = {"tyingspec.baseline/1": "the --baseline / --tyingspec-baseline file"}
#: a schema file's ``$id``: an identifier, not a download address (the file is installed with
#: the package)
ID = "urn:tyingspec:schemas/{}"

Validator = jsonschema.Draft202012Validator
#: every keyword draft 2020-12 defines: its validators and its annotations and identifiers
KEYWORDS = set(Validator.VALIDATORS) | {
    "$schema", "$id", "$anchor", "$dynamicAnchor", "$vocabulary", "$comment", "$defs", "title",
    "description", "default", "examples", "deprecated", "readOnly", "writeOnly"}
TYPES = {"object", "array", "string", "integer", "number", "boolean", "null"}
#: keywords whose value is a map of name -> schema, a schema, a list of schemas
MAPS, SUBSCHEMAS, LISTS = (("properties", "$defs", "patternProperties"),
                           ("items", "additionalProperties", "not", "contains"),
                           ("anyOf", "oneOf", "allOf", "prefixItems"))


def load_schema(name: str) -> dict[str, Any]:
    schema = json.loads((SCHEMAS / name).read_text(encoding="utf-8"))
    assert isinstance(schema, dict)
    return schema


def registry() -> Registry[Any]:
    """Every schema file, each under its ``$id``."""
    resources = [Resource.from_contents(load_schema(name)) for name in FILES]
    return Registry().with_resources((r.id(), r) for r in resources)


def strict(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` added wherever it lists ``properties`` and
    says nothing of other keys, in it and in every schema it holds."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in MAPS:
        if key in out:
            out[key] = {name: strict(sub) for name, sub in out[key].items()}
    for key in SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = strict(out[key])
    for key in LISTS:
        if key in out:
            out[key] = [strict(sub) for sub in out[key]]
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def errors(value: Any, schema: dict[str, Any], *, strictly: bool = True) -> list[str]:
    """Where ``value`` breaks ``schema`` (``strictly``: an object key the schema does not
    declare is an error too), as ``jsonschema`` words it: ``$.path: message``."""
    validator = Validator(strict(schema) if strictly else schema)
    return [f"{e.json_path}: {e.message}"
            for e in sorted(validator.iter_errors(value), key=lambda e: e.json_path)]


def assert_valid(report: dict[str, Any], name: str) -> None:
    problems = errors(report, load_schema(name))
    assert not problems, "\n".join(problems[:20])
    Validator(load_schema(name)).validate(report)  # and as a consumer validates it


# --- the schema files ------------------------------------------------------------------------
