"""`StreamExecutor`: one program state's text, messages and variables, and the thread that runs it.

`s += expr` only queues the expression, so a program runs ahead of its model calls: branches
of a fork, and the programs of a `run_batch`, all have requests in flight at once and the
scheduler batches them. Reading a variable (`s["x"]`), `text()` or `sync()` waits for the
queue. An error stops the program: later expressions are skipped, every waiting reader is
released, and reading a variable that was never set raises the error.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Dict, List, Optional

from srt.lang.ir import (SglCommitLazy, SglConstantText, SglExpr, SglExprList, SglGen, SglRoleBegin, SglRoleEnd,
                         SglSamplingParams, SglSelect, SglVarScopeBegin, SglVarScopeEnd, as_expr)

_STOP = object()


class StreamExecutor:
    def __init__(self, backend, arguments: Dict[str, Any], defaults: SglSamplingParams, stream: bool = False,
                 use_thread: bool = True):
        self.backend = backend
        self.arguments = arguments
        self.defaults = defaults
        self.stream = stream
        self.text_ = ""
        self.messages_: List[Dict[str, str]] = []
        self.variables: Dict[str, Any] = {}
        self.meta_info: Dict[str, Any] = {}
        self.variable_event: Dict[str, threading.Event] = {}
        self.cur_role: Optional[str] = None
        self.cur_role_begin_pos = 0
        self.fork_start_text_pos = 0
        self._scope_start: Dict[str, int] = {}
        self.error_: Optional[BaseException] = None
        self.is_finished = False
        self.changed = threading.Condition()  # text or a variable grew, or the program ended
        self.use_thread = use_thread
        self._ended = False
        if use_thread:
            self.queue: "queue.Queue" = queue.Queue()
            self.worker = threading.Thread(target=self._worker, name="sgl-program", daemon=True)
            self.worker.start()

    # --------------------------------------------------------------- queueing
    def submit(self, expr) -> None:
        expr = as_expr(expr)
        if self._ended:
            raise RuntimeError("This program state has finished (its program returned); start a new run "
                               "or use s.copy() inside the program.")
        self._init_events(expr)
        if self.use_thread:
            self.queue.put(expr)
        else:
            self._execute(expr)

    def sync(self) -> None:
        if self.use_thread:
            self.queue.join()

    def end(self) -> None:
        """No more expressions; the worker exits once the queue is done. Idempotent."""
        if self._ended:
            return
        self._ended = True
        if self.use_thread:
            self.queue.put(_STOP)
        else:
            self._finish()

    def _worker(self) -> None:
        while True:
            expr = self.queue.get()
            try:
                if expr is _STOP:
                    self._finish()
                    return
                if self.error_ is None:
                    try:
                        self._execute(expr)
                    except Exception as exc:  # the program's error; readers get it
                        self.error_ = exc
                        self._release_all()
                else:
                    self._release(expr)
            finally:
                self.queue.task_done()

    def _finish(self) -> None:
        with self.changed:
            self.is_finished = True
            self.changed.notify_all()

    def _release_all(self) -> None:
        for event in list(self.variable_event.values()):
            event.set()
        self._notify()

    def _notify(self) -> None:
        with self.changed:
            self.changed.notify_all()

    def _init_events(self, expr: SglExpr) -> None:
        """Readers of a variable that a queued expression sets wait for that expression."""
        for name in _names(expr):
            self.variable_event[name] = threading.Event()

    def _release(self, expr: SglExpr) -> None:
        for name in _names(expr):
            self.variable_event[name].set()

    # --------------------------------------------------------------- reading
    def get_var(self, name: str) -> Any:
        event = self.variable_event.get(name)
        if event is not None:
            event.wait()
        if name in self.variables and not isinstance(self.variables[name], _ScopeStart):
            return self.variables[name]
        if self.error_ is not None:
            raise self.error_
        raise KeyError(f"The program has no variable {name!r}; it has {sorted(self.variables)}")

    def set_var(self, name: str, value: Any) -> None:
        self.variables[name] = value
        self.variable_event.setdefault(name, threading.Event()).set()

    def get_meta_info(self, name: str) -> Any:
        self.get_var(name)
        return self.meta_info.get(name)

    # --------------------------------------------------------------- executing
    def _execute(self, expr: SglExpr) -> None:
        if isinstance(expr, SglConstantText):
            self._fill(expr.value)
        elif isinstance(expr, SglExprList):
            for e in expr.exprs:
                self._execute(e)
        elif isinstance(expr, SglGen):
            self._gen(expr)
        elif isinstance(expr, SglSelect):
            decision = self.backend.select(self.text_, expr.choices, expr.temperature, expr.choices_method)
            self._fill(decision.decision)
            self._set(expr.name, decision.decision, decision.meta_info)
        elif isinstance(expr, SglRoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, SglRoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, SglVarScopeBegin):
            self._scope_start[expr.name] = len(self.text_)
            self.variables.setdefault(expr.name, _ScopeStart())
        elif isinstance(expr, SglVarScopeEnd):
            if expr.name not in self._scope_start:
                raise ValueError(f"var_scope({expr.name!r}) ended without beginning")
            self._set(expr.name, self.text_[self._scope_start.pop(expr.name):], None)
        elif isinstance(expr, SglCommitLazy):
            if self.text_:
                self.backend.cache_prefix(self.text_)
        else:
            raise TypeError(f"cannot execute {type(expr).__name__}")

    def _fill(self, text: str) -> None:
        self.text_ += str(text)
        self._notify()

    def _set(self, name: Optional[str], value: Any, meta: Any) -> None:
        if name is None:
            return
        self.variables[name] = value
        self.meta_info[name] = meta
        self.variable_event.setdefault(name, threading.Event()).set()
        self._notify()

    def _gen(self, expr: SglGen) -> None:
        params = expr.sampling_params.merged_over(self.defaults)
        # Inside an assistant turn the end of the turn stops the gen too (the chat template's marker).
        in_turn = self.cur_role == "assistant"
        body = params.to_request(self._template().stop_str if in_turn else [])
        if not self.stream:
            text, meta = self.backend.generate(self.text_, body)
            self._fill(text[0] if isinstance(text, list) else text)
            self._set(expr.name, text, meta)
            return
        pieces: List[str] = []
        meta = None
        for delta, meta in self.backend.generate_stream(self.text_, body):
            pieces.append(delta)
            if expr.name is not None:
                self.variables[expr.name] = "".join(pieces)
            self._fill(delta)
        self._set(expr.name, "".join(pieces), meta)

    def _template(self):
        template = self.backend.get_chat_template()
        if template is None:
            raise ValueError("This backend has no chat template, so roles (system/user/assistant) cannot be "
                             "rendered: start the server with --chat-template, or pass chat_template_name= "
                             "to RuntimeEndpoint.")
        return template

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"Nested roles are not allowed: {role!r} begins inside {self.cur_role!r}")
        prefix, _ = self._template().affixes(tuple(m["role"] for m in self.messages_), role)
        self._fill(prefix)
        self.cur_role, self.cur_role_begin_pos = role, len(self.text_)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"Role {role!r} ends, but the open role is {self.cur_role!r}")
        content = self.text_[self.cur_role_begin_pos:]
        _, suffix = self._template().affixes(tuple(m["role"] for m in self.messages_), role)
        self._fill(suffix)
        self.messages_.append({"role": role, "content": content.lstrip()})
        self.cur_role = None

    def clone_into(self, child: "StreamExecutor") -> None:
        """The state a fork branch starts from."""
        child.text_ = self.text_
        child.messages_ = list(self.messages_)
        child.variables = {k: v for k, v in self.variables.items() if not isinstance(v, _ScopeStart)}
        child.meta_info = dict(self.meta_info)
        for name in child.variables:
            child.variable_event.setdefault(name, threading.Event()).set()
        child.cur_role, child.cur_role_begin_pos = self.cur_role, self.cur_role_begin_pos
        child.fork_start_text_pos = len(self.text_)


class _ScopeStart:
    """Placeholder for a var_scope that has begun and not ended."""


def _names(expr: SglExpr):
    if isinstance(expr, SglExprList):
        for e in expr.exprs:
            yield from _names(e)
    elif isinstance(expr, (SglGen, SglSelect, SglVarScopeBegin)) and expr.name is not None:
        yield expr.name
