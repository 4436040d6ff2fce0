"""JSON extraction: read a passage and fill a record whose shape a JSON schema fixes; the server
constrains decoding to the schema, so the output always parses and validates.

    python scripts/examples/json_extraction.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import srt.lang as sgl  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "version": {"type": "integer", "minimum": 1, "maximum": 9},
        "copyleft": {"type": "boolean"},
        "grants": {"type": "array", "items": {"enum": ["copy", "modify", "distribute", "sell"]}, "maxItems": 4},
    },
    "required": ["name", "version", "copyleft", "grants"],
    "additionalProperties": False,
}
PASSAGES = (
    "The GNU General Public License, version 3, lets anyone copy, modify and distribute the "
    "program, provided that changed versions are released under the same license.",
    "The Apache License 2.0 permits use, copying and distribution, and adds an express grant "
    "of patent rights; derived works may use other terms.",
)


@sgl.function
def extract_license(s, passage):
    s += f"Passage: {passage}\nThe license described, as JSON:\n"
    s += sgl.gen("record", max_tokens=96, json_schema=json.dumps(SCHEMA), temperature=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    args = parser.parse_args()
    sgl.set_default_backend(sgl.RuntimeEndpoint(args.url))
    for state in extract_license.run_batch([{"passage": p} for p in PASSAGES]):
        print(json.dumps(json.loads(state["record"])))


if __name__ == "__main__":
    main()
