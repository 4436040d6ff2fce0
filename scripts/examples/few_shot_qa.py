"""Few-shot question answering with the frontend language: a fixed block of solved examples, then
each new question, answered up to the end of the line. The examples are one shared prefix, so the
server computes them once and every later question reuses their KV.

    python scripts/examples/few_shot_qa.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import srt.lang as sgl  # noqa: E402

EXAMPLES = (
    ("What does the GPL protect?", "The freedom to share and change free software."),
    ("Who may copy a covered work?", "Anyone who receives a copy of the Program."),
    ("What is a Python module?", "A file of definitions and statements."),
)
QUESTIONS = ("What is a license?", "What does a for statement do?", "Who holds the copyright?")


@sgl.function
def few_shot_qa(s, question):
    for q, a in EXAMPLES:
        s += f"Q: {q}\nA: {a}\n\n"
    s += f"Q: {question}\nA:" + sgl.gen("answer", max_tokens=32, stop="\n", temperature=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    args = parser.parse_args()
    sgl.set_default_backend(sgl.RuntimeEndpoint(args.url))
    states = few_shot_qa.run_batch([{"question": q} for q in QUESTIONS], num_threads=len(QUESTIONS))
    for question, state in zip(QUESTIONS, states):
        print(f"Q: {question}\nA: {state['answer'].strip()}\n")


if __name__ == "__main__":
    main()
