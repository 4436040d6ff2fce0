"""The frontend-language examples (scripts/examples/) run end to end against one demo-model server:
each exits 0 and prints what its program promises (answers per question, a parsed and evaluated
expression, one note per branch and a summary, records that validate against the schema)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from types import ModuleType

import jsonschema
import pytest

from server_utils import REPO_ROOT, running_server, server_env

EXAMPLES = REPO_ROOT / "scripts" / "examples"
EXAMPLE_TIMEOUT_S = 120


def load_example(name: str) -> ModuleType:
    """Import scripts/examples/NAME.py by path (scripts/ is not a package) for its constants."""
    spec = importlib.util.spec_from_file_location(f"lang_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def server():
    with running_server(REPO_ROOT / "srt" / "demo_model") as handle:
        yield handle


def run_example(name: str, url: str) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), "--url", url], cwd=REPO_ROOT,
                          env=server_env(), capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_S)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_few_shot_qa_answers_every_question_in_order(server):
    out = run_example("few_shot_qa", server.url)
    questions = re.findall(r"^Q: (.*)\nA:", out, flags=re.MULTILINE)
    assert questions == list(load_example("few_shot_qa").QUESTIONS), out


def test_tool_use_expression_matches_its_regex_and_the_result_is_its_value(server):
    example = load_example("tool_use")
    out = run_example("tool_use", server.url)
    fields = dict(re.findall(r"^(expression|result|answer): ?(.*)$", out, flags=re.MULTILINE))
    assert set(fields) == {"expression", "result", "answer"}, out
    assert re.fullmatch(example.EXPRESSION, fields["expression"]), fields["expression"]
    assert int(fields["result"]) == example.evaluate(fields["expression"])


def test_tool_use_calculator_follows_precedence_and_refuses_anything_else():
    evaluate = load_example("tool_use").evaluate
    assert evaluate("2 + 3 * 4") == 14 and evaluate("10 - 4 - 3") == 3
    for bad in ("__import__('os').getcwd()", "2 ** 64", "7 / 2", "1.5 + 1", "True + 1"):
        with pytest.raises(ValueError):
            evaluate(bad)


def test_parallel_branches_joins_one_note_per_branch_before_the_summary(server):
    example = load_example("parallel_branches")
    out = run_example("parallel_branches", server.url)
    lines = out.splitlines()
    notes = [next(i for i, line in enumerate(lines) if line.startswith(f"On {t}: ")) for t in example.TOPICS]
    summary = next(i for i, line in enumerate(lines) if line.startswith("In summary:"))
    assert notes == sorted(notes) and summary > notes[-1], out


def test_json_extraction_records_validate_against_the_schema(server):
    example = load_example("json_extraction")
    out = run_example("json_extraction", server.url)
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert len(records) == len(example.PASSAGES), out
    for record in records:
        jsonschema.validate(record, example.SCHEMA)
