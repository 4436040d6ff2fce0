"""Ten frontend-language programs written once against a frontend module (`sglang` or `srt.lang`),
so the same source runs through SGLang's own frontend and ours: `build_programs(sgl)`.

All are greedy (the harness passes `temperature=0` to `.run` / `.run_batch`) and short: the demo
model's context is 512 tokens.

Left out: `choices_method=sgl.greedy_token_selection` and `sgl.unconditional_likelihood_normalized`.
SGLang 0.4.10.post2's own client crashes on them against any server that pads the first input
logprob with null, ours and SGLang's alike. Its choice requests use `logprob_start_len =
prompt_tokens - 2`, so entry 0 of every choice's `input_token_logprobs` is `[null, id, text]`:
- the client drops that entry only when the prompt text ends with its token text ("token
  healing"), and then computes `normalized * n - None`: TypeError (any method, default included;
  so no prompt here ends with a repeated token, e.g. "is free free");
- otherwise the entry stays, and both methods put it through numpy (`np.mean`, and
  `inputs - unconditionals`): TypeError on None.
unconditional_likelihood_normalized fails earlier against our server: its third request
(`input_ids`, `return_logprob`, no `logprob_start_len`) reads `meta_info["input_token_logprobs"]`,
which our server omits for the default -1, where SGLang's server returns one `[null, id]` entry
(it treats -1 as `len(input_ids) - 1`): KeyError.
`chat_choice` (gen with choices inside an assistant turn) and `streamed` (`text_iter`) take their places.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Dict, List, Tuple

DATE_REGEX = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
RECORD_SCHEMA = {"type": "object",
                 "properties": {"name": {"enum": ["GPL", "LGPL", "MIT"]},
                                "version": {"type": "integer", "minimum": 1, "maximum": 3}},
                 "required": ["name", "version"], "additionalProperties": False}
SHOTS = [("What does the GPL protect?", "The freedom to share and change software."),
         ("Who may copy the Program?", "Anyone may copy it.")]
LICENSE_KINDS = ["free software license", "proprietary license", "hardware manual"]
ANSWERS = [" yes", " no"]
VERDICTS = ["Yes.", "No.", "It depends."]


@dataclass(frozen=True)
class LangProgram:
    """One program, the argument sets it runs on, and what the two frontends must agree on.

    `variables`: names read back with `state[name]`; `selects`: the select variables among them
    (their meta info carries `normalized_prompt_logprobs`); `metas`: gen variables whose
    finish_reason and token counts are compared; `batch`: one `run_batch` over all argument sets
    rather than one `.run` each; `stream`: `.run(stream=True)` read through `text_iter()`."""

    function: Any
    arguments: List[Dict[str, Any]]
    variables: Tuple[str, ...]
    selects: Tuple[str, ...] = ()
    metas: Tuple[str, ...] = ()
    batch: bool = False
    stream: bool = False


def build_programs(sgl: ModuleType) -> Dict[str, LangProgram]:
    """The ten programs, instantiated with the frontend module `sgl`."""

    @sgl.function
    def gen_with_stop(s, topic):
        s += f"The {topic}"
        s += sgl.gen("rest", max_tokens=40, stop=".")

    @sgl.function
    def few_shot_qa(s, shots, question1, question2):
        for question, answer in shots:
            s += f"Q: {question}\nA: {answer}\n\n"
        s += f"Q: {question1}\nA: " + sgl.gen("answer1", max_tokens=24, stop="\n") + "\n\n"
        s += f"Q: {question2}\nA: " + sgl.gen("answer2", max_tokens=24, stop="\n")

    @sgl.function
    def select_default(s, subject):
        s += f"The {subject} is a "
        s += sgl.select("kind", choices=LICENSE_KINDS)
        s += ". Is it free? Answer:" + sgl.select("free", choices=ANSWERS)

    @sgl.function
    def chat_choice(s, question):
        with s.user():
            s += question
        with s.assistant():
            s += sgl.gen("verdict", choices=VERDICTS)  # gen with choices is a select

    @sgl.function
    def streamed(s, topic):
        s += f"The {topic} says that"
        s += sgl.gen("claim", max_tokens=32, stop="\n")

    @sgl.function
    def fork_and_join(s, subject):
        s += f"Three facts about the {subject}:\n"
        forks = s.fork(3)
        for i, branch in enumerate(forks):
            branch += f"{i + 1}. The {subject}" + sgl.gen("fact", max_tokens=20, stop="\n")
        for i, branch in enumerate(forks):
            s += f"{i + 1}. The {subject}" + branch["fact"] + "\n"
        forks.join()  # gather_variable: the parent's "fact" is the list of the three branches' facts
        s += "In short, the" + sgl.gen("summary", max_tokens=20, stop="\n")

    @sgl.function
    def chat(s, question, follow_up):
        s += sgl.system("You answer questions about software licenses.")
        with s.user():
            s += question
        with s.assistant():
            s += sgl.gen("answer1", max_tokens=32)
        s += sgl.user(follow_up)
        s += sgl.assistant_begin()
        s += sgl.gen("answer2", max_tokens=32)
        s += sgl.assistant_end()

    @sgl.function
    def gen_regex(s, event):
        s += f"The {event} was published on "
        s += sgl.gen("date", regex=DATE_REGEX, max_tokens=16)

    @sgl.function
    def structured(s, name):
        s += f"License record for {name}: "
        s += sgl.gen("record", json_schema=json.dumps(RECORD_SCHEMA), max_tokens=48)
        s += "\nNumber of sections: " + sgl.gen_int("sections", max_tokens=6)

    @sgl.function
    def scoped_copy(s, item):
        with s.var_scope("intro"):
            s += f"The {item} is" + sgl.gen("what", max_tokens=16, stop=".") + "."
        with s.copy() as draft:
            draft += " In other words," + sgl.gen("draft", max_tokens=16, stop=".")
        s += " Also," + sgl.gen("also", max_tokens=16, stop=".")

    topics = [{"topic": "license"}, {"topic": "Program"}, {"topic": "Library"}]
    return {
        "gen_with_stop": LangProgram(gen_with_stop, topics, ("rest",), metas=("rest",)),
        "few_shot_qa": LangProgram(few_shot_qa.bind(shots=SHOTS), [
            {"question1": "What is free software?", "question2": "May I sell copies?"},
            {"question1": "What is a Library?", "question2": "Who may distribute it?"}],
            ("answer1", "answer2"), metas=("answer1", "answer2")),
        "select_default": LangProgram(select_default, [{"subject": "GPL"}, {"subject": "manual"}],
                                      ("kind", "free"), selects=("kind", "free")),
        "chat_choice": LangProgram(chat_choice, [{"question": "May I copy the Library? Answer yes or no."},
                                                 {"question": "Is the GPL a free software license?"}],
                                   ("verdict",), selects=("verdict",)),
        "streamed": LangProgram(streamed, topics[:2], ("claim",), stream=True),
        "fork_and_join": LangProgram(fork_and_join, [{"subject": "GPL"}, {"subject": "Library"}],
                                     ("fact", "summary")),
        "chat": LangProgram(chat, [
            {"question": "What is the GPL?", "follow_up": "Can I change the code?"},
            {"question": "Tell me about the Library.", "follow_up": "Thanks. Anything else?"}],
            ("answer1", "answer2")),
        "gen_regex": LangProgram(gen_regex, [{"event": "license"}, {"event": "first version"}],
                                 ("date",), metas=("date",)),
        "structured": LangProgram(structured, [{"name": "the Library"}, {"name": "GNU"}],
                                  ("record", "sections")),
        "scoped_copy": LangProgram(scoped_copy, [{"item": w} for w in ("license", "Program", "source code", "Library")],
                                   ("intro", "what", "draft", "also"), batch=True),
    }
