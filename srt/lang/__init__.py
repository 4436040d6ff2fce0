"""The frontend language: Python programs that interleave prompt text, generation, selection
and parallel forks, run against a server (`RuntimeEndpoint`) or an in-process `Engine`.

Names and semantics follow SGLang's `sglang.lang`, so a program ports by changing its import:

    import srt.lang as sgl

    @sgl.function
    def qa(s, question):
        s += "Q: " + question + "\\nA:" + sgl.gen("answer", max_tokens=32, stop="\\n")

    sgl.set_default_backend(sgl.RuntimeEndpoint("http://127.0.0.1:30000"))
    print(qa.run(question="What is 2 + 2?")["answer"])
"""

from srt.lang.api import (assistant, assistant_begin, assistant_end, flush_cache, function, gen, gen_int, gen_string,
                          get_server_info, image, select, system, system_begin, system_end, user, user_begin,
                          user_end, video)
from srt.lang.backend.base_backend import BackendError, BaseBackend
from srt.lang.backend.engine_backend import EngineBackend
from srt.lang.backend.runtime_endpoint import RuntimeEndpoint
from srt.lang.choices import (ChoicesDecision, ChoicesSamplingMethod, greedy_token_selection,
                              token_length_normalized, unconditional_likelihood_normalized)
from srt.lang.program_state import ProgramState, ProgramStateGroup
from srt.lang.run import get_default_backend, set_default_backend


def Engine(*args, **kwargs):
    """The in-process runtime (`srt.entrypoints.engine.Engine`); pass it as `backend=`."""
    from srt.entrypoints.engine import Engine as _Engine

    return _Engine(*args, **kwargs)


__all__ = [
    "Engine", "RuntimeEndpoint", "EngineBackend", "BaseBackend", "BackendError", "ProgramState", "ProgramStateGroup",
    "function", "gen", "gen_int", "gen_string", "select", "image", "video", "system", "user", "assistant",
    "system_begin", "system_end", "user_begin", "user_end", "assistant_begin", "assistant_end",
    "set_default_backend", "get_default_backend", "flush_cache", "get_server_info", "ChoicesDecision",
    "ChoicesSamplingMethod", "token_length_normalized", "greedy_token_selection",
    "unconditional_likelihood_normalized",
]
