"""Tool use: the model writes an arithmetic expression (constrained by a regex, so it always
parses), the script evaluates it with a small AST walker (never `eval`) and feeds the result back
for the model to finish its answer.

    python scripts/examples/tool_use.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import ast
import operator
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import srt.lang as sgl  # noqa: E402

NUMBER = r"[1-9][0-9]{0,2}"
EXPRESSION = rf"{NUMBER}( [-+*] {NUMBER}){{1,3}}"  # "12 + 7 * 3": integers and + - * only
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expression: str) -> int:
    """The calculator tool: integer literals and + - * with Python's precedence, nothing else."""
    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        raise ValueError(f"not a calculator expression: {expression!r}")
    return walk(ast.parse(expression, mode="eval").body)


@sgl.function
def calculator_agent(s, question):
    s += "Use the calculator for arithmetic. Write the expression, then read its result.\n\n"
    s += f"Question: {question}\nExpression: " + sgl.gen("expression", max_tokens=24, regex=EXPRESSION)
    s += f"\nResult: {evaluate(s['expression'])}\n"  # the tool's output, fed back to the model
    s += "Answer:" + sgl.gen("answer", max_tokens=24, stop="\n", temperature=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    args = parser.parse_args()
    state = calculator_agent.run(question="A shop sells 12 boxes of 7 pens and 5 loose pens. How many pens?",
                                 backend=sgl.RuntimeEndpoint(args.url))
    print(f"expression: {state['expression']}")
    print(f"result: {evaluate(state['expression'])}")
    print(f"answer: {state['answer'].strip()}")


if __name__ == "__main__":
    main()
