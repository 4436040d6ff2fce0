"""Parallel branches: fork the state into one branch per topic, let each branch write a short
note concurrently (all branches share the prompt before the fork), then join and write a summary
that sees every note.

    python scripts/examples/parallel_branches.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import srt.lang as sgl  # noqa: E402

TOPICS = ("copying", "modification", "distribution")


@sgl.function
def license_notes(s, license_name):
    s += f"Here are short notes on the {license_name}, one topic at a time.\n"
    branches = s.fork(len(TOPICS))
    for branch, topic in zip(branches, TOPICS):
        branch += f"On {topic}: " + sgl.gen("note", max_tokens=24, stop="\n", temperature=0.7)
    branches.join()
    for branch, topic in zip(branches, TOPICS):
        s += f"On {topic}: {branch['note'].strip()}\n"
    s += "In summary:" + sgl.gen("summary", max_tokens=32, stop="\n", temperature=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    args = parser.parse_args()
    state = license_notes.run(license_name="GNU General Public License", backend=sgl.RuntimeEndpoint(args.url))
    print(state.text())


if __name__ == "__main__":
    main()
