"""`ProgramState` (the `s` a program writes to) and `ProgramStateGroup` (what `s.fork(n)` returns)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, List, Optional

from srt.lang.interpreter import StreamExecutor
from srt.lang.ir import SglCommitLazy, SglConstantText, SglExprList, SglRoleBegin, SglRoleEnd, SglVarScopeBegin, \
    SglVarScopeEnd


class ProgramState:
    def __init__(self, stream_executor: StreamExecutor):
        self.stream_executor = stream_executor
        self.ret_value: Any = None

    # --------------------------------------------------------------- writing
    def __iadd__(self, other) -> "ProgramState":
        self.stream_executor.submit(other)
        return self

    def _role(self, role: str, expr=None):
        if expr is not None:
            self.stream_executor.submit(SglExprList([SglRoleBegin(role), expr, SglRoleEnd(role)]))
            return None
        return self._role_scope(role)

    @contextmanager
    def _role_scope(self, role: str):
        self.stream_executor.submit(SglRoleBegin(role))
        yield
        self.stream_executor.submit(SglRoleEnd(role))

    def system(self, expr=None):
        return self._role("system", expr)

    def user(self, expr=None):
        return self._role("user", expr)

    def assistant(self, expr=None):
        return self._role("assistant", expr)

    @contextmanager
    def var_scope(self, name: str):
        """`with s.var_scope("x"): ...` sets variable x to the text written inside the block."""
        self.stream_executor.submit(SglVarScopeBegin(name))
        yield
        self.stream_executor.submit(SglVarScopeEnd(name))

    def fork(self, size: int = 1) -> "ProgramStateGroup":
        return self._fork(size, ProgramState)

    def _fork(self, size: int, state_cls: type) -> "ProgramStateGroup":
        """`size` branches that start from the text so far. With more than one, the shared text is
        prefilled once first (a prefill-only request), so every branch finds it in the cache."""
        parent = self.stream_executor
        size = int(size)
        if size < 1:
            raise ValueError(f"fork(size={size}): size must be at least 1")
        if size > 1:
            parent.submit(SglCommitLazy())
        parent.sync()
        if parent.error_ is not None:
            raise parent.error_
        children = []
        for _ in range(size):
            child = StreamExecutor(parent.backend, parent.arguments, parent.defaults, parent.stream, parent.use_thread)
            parent.clone_into(child)
            children.append(state_cls(child))
        return ProgramStateGroup(children, self)

    def copy(self) -> "ProgramState":
        """A one-branch fork. As in SGLang, `with s.copy() as c:` joins c's new variables back into
        `s` (as one-element lists) when the block ends; `c = s.copy()` works as a plain branch."""
        group = self._fork(1, _CopiedState)
        group[0]._group = group
        return group[0]

    # --------------------------------------------------------------- reading
    def text(self) -> str:
        self.stream_executor.sync()
        return self.stream_executor.text_

    def messages(self) -> List[dict]:
        self.stream_executor.sync()
        return self.stream_executor.messages_

    def sync(self) -> None:
        self.stream_executor.sync()

    def error(self) -> Optional[BaseException]:
        self.stream_executor.sync()
        return self.stream_executor.error_

    def get_var(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        return self.stream_executor.get_meta_info(name)

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        return name in self.stream_executor.variables

    def text_iter(self, var_name: Optional[str] = None) -> Iterator[str]:
        """The program's text (or one variable's) as it is written: each item is the new text since
        the previous one, so their concatenation is the whole. Without `stream=True`, one item."""
        exe = self.stream_executor
        if not exe.stream:
            yield self.text() if var_name is None else self.get_var(var_name)
            return
        sent = 0
        while True:
            with exe.changed:
                while not exe.is_finished and len(self._current(var_name)) == sent:
                    exe.changed.wait(0.5)
                current, done = self._current(var_name), exe.is_finished
            if len(current) > sent:
                yield current[sent:]
                sent = len(current)
            elif done:
                if exe.error_ is not None and var_name is not None and var_name not in exe.variables:
                    raise exe.error_
                return

    def _current(self, var_name: Optional[str]) -> str:
        exe = self.stream_executor
        if var_name is None:
            return exe.text_
        value = exe.variables.get(var_name)
        return value if isinstance(value, str) else ""

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"

    def __del__(self):
        try:
            self.stream_executor.end()
        except Exception:  # interpreter shutdown
            pass


class _CopiedState(ProgramState):
    _group: "ProgramStateGroup"

    def __enter__(self) -> "ProgramState":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self._group.join()


class ProgramStateGroup:
    def __init__(self, states: List[ProgramState], src_state: ProgramState):
        self.states = states
        self.src_state = src_state

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self):
        return iter(self.states)

    def __iadd__(self, other) -> "ProgramStateGroup":
        """One expression for every branch, or a list with one per branch."""
        if isinstance(other, list):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} expressions for {len(self.states)} branches")
            for state, expr in zip(self.states, other):
                state += expr
        else:
            for state in self.states:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch. `gather_variable`: a variable the parent does not have becomes the list
        of the values of the branches that set it (their meta infos likewise). `concate_and_append`: the
        branches' new text is appended to the parent in order."""
        for state in self.states:
            state.sync()
        parent = self.src_state.stream_executor
        failed = [s.stream_executor.error_ for s in self.states if s.stream_executor.error_ is not None]
        if failed:
            parent.error_ = failed[0]
            raise failed[0]
        if mode == "gather_variable":
            existing = set(parent.variables)  # SGLang's rule: only variables the parent lacks come back
            for state in self.states:
                exe = state.stream_executor
                for name in [n for n in exe.variables if n not in existing]:
                    values = parent.variables.get(name)
                    if name in parent.variables and isinstance(values, list):
                        values.append(exe.variables[name])
                        parent.meta_info[name].append(exe.meta_info.get(name))
                    else:
                        parent.set_var(name, [exe.variables[name]])
                        parent.meta_info[name] = [exe.meta_info.get(name)]
        elif mode == "concate_and_append":
            pieces = [s.stream_executor.text_[s.stream_executor.fork_start_text_pos:] for s in self.states]
            parent.submit(SglConstantText("".join(pieces)))
        else:
            raise ValueError(f"join(mode={mode!r}): use 'gather_variable' or 'concate_and_append'")
        for state in self.states:
            state.stream_executor.end()
