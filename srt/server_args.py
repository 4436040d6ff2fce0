"""`ServerArgs`: every launch flag as one dataclass; the CLI is generated from its fields."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

from srt.environ import envs

logger = logging.getLogger(__name__)

DTYPE_CHOICES = ("auto", "half", "float16", "bfloat16", "float", "float32")
KV_CACHE_DTYPE_CHOICES = ("auto", "bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
LOAD_FORMAT_CHOICES = ("auto", "safetensors", "dummy")
ATTENTION_BACKEND_CHOICES = ("auto", "torch_native", "flashinfer")
SCHEDULE_POLICY_CHOICES = ("fcfs", "lpm", "dfs-weight", "lof", "random")
LOAD_BALANCE_CHOICES = ("round_robin", "shortest_queue")
LOG_LEVEL_CHOICES = ("debug", "info", "warning", "error", "critical")

# The embedded default model (package data built by scripts/train_demo_model.py).
DEMO_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_model")
DEMO_MODEL_MISSING = ("No --model-path given and the embedded demo model is missing: "
                      "run scripts/train_demo_model.py")


def default_model_path() -> str:
    """The embedded demo model, or a `ValueError` saying how to build it."""
    if not os.path.isfile(os.path.join(DEMO_MODEL_DIR, "config.json")):
        raise ValueError(DEMO_MODEL_MISSING)
    return DEMO_MODEL_DIR


def parse_context_length(value: Any) -> Optional[int]:
    """`16k` = 16000 and `16K` = 16384 (as vLLM's --max-model-len); plain ints pass through."""
    if value is None or isinstance(value, int):
        return value
    text = str(value).strip()
    units = {"k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise ValueError(
            f"Invalid --context-length {value!r}: use an integer or a suffix like 16k (16000) or 16K (16384)."
        ) from None


def _cli_context_length(value: str) -> Optional[int]:
    """argparse prints an ArgumentTypeError's own text (a ValueError becomes "invalid ... value")."""
    try:
        return parse_context_length(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _is_host_port(text: str) -> bool:
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


# --chunked-prefill-size when not given, per device kind (what --help promises).
CHUNKED_PREFILL_DEFAULTS = {"cuda": 8192, "cpu": 1024}


def effective_chunked_prefill_size(value: Optional[int], device: str) -> Optional[int]:
    """The chunk size the scheduler uses: `value` when set (<= 0 disables chunking: None), else the
    default of `device` ("cuda", "cuda:1", "cpu")."""
    if value is None:
        return CHUNKED_PREFILL_DEFAULTS.get(device.split(":")[0], CHUNKED_PREFILL_DEFAULTS["cpu"])
    return value if value > 0 else None


def read_api_key_file(path: str) -> str:
    """The key in `path` (surrounding whitespace, e.g. the trailing newline, stripped)."""
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"Cannot read --api-key-file {path!r}: {getattr(exc, 'strerror', None) or exc}.") from None
    if not key:
        raise ValueError(f"--api-key-file {path!r} is empty: write the API key into it.")
    return key


def _opt(default: Any, help: str, choices: Optional[Sequence[str]] = None, **extra: Any):
    return field(default=default, metadata={"help": help, "choices": choices, **extra})


@dataclass
class ServerArgs:
    model_path: Optional[str] = _opt(
        None, "Path of a local Hugging Face format model directory (default: the embedded demo model "
        "in srt/demo_model/, built by scripts/train_demo_model.py).")
    tokenizer_path: Optional[str] = _opt(None, "Tokenizer directory (default: the model path).")
    dtype: str = _opt("auto", "Weight and activation dtype; auto keeps the checkpoint's.", DTYPE_CHOICES)
    kv_cache_dtype: str = _opt("auto", "KV cache storage dtype; auto = model dtype.", KV_CACHE_DTYPE_CHOICES)
    device: str = _opt("auto", "cuda when available, else cpu.", DEVICE_CHOICES)
    load_format: str = _opt("auto", "dummy = seeded random weights from config.json alone.", LOAD_FORMAT_CHOICES)
    context_length: Optional[int] = _opt(None, "Override the model's context length (16k = 16000, 16K = 16384).")
    page_size: int = _opt(1, "Tokens per KV page.")
    attention_backend: str = _opt("auto", "auto = flashinfer on CUDA when installed, else torch_native.",
                                  ATTENTION_BACKEND_CHOICES)
    # Scale-out (torch.distributed: gloo on CPU, NCCL on CUDA).
    tp_size: int = _opt(1, "Tensor-parallel size: ranks (one process each) that split every layer.",
                        aliases=("--tp",))
    dp_size: int = _opt(1, "Data-parallel size: scheduler replicas, each with its own KV pool and radix cache.",
                        aliases=("--dp",))
    load_balance_method: str = _opt("round_robin", "How the data-parallel controller picks a replica.",
                                    LOAD_BALANCE_CHOICES)
    nnodes: int = _opt(1, "Number of nodes the TP ranks span (node 0 serves HTTP).")
    node_rank: int = _opt(0, "This node's index in 0 .. --nnodes - 1.")
    dist_init_addr: Optional[str] = _opt(
        None, "host:port of the torch.distributed rendezvous (required with --nnodes > 1; default: a free "
        "local port).")
    # CUDA graphs and torch.compile (decode).
    disable_cuda_graph: bool = _opt(False, "Run decode eagerly on CUDA instead of replaying captured CUDA graphs.")
    cuda_graph_max_bs: Optional[int] = _opt(
        None, "Largest decode batch captured as a CUDA graph (default: min(160, --max-running-requests)); "
        "bigger batches run eagerly.")
    cuda_graph_bs: Optional[List[int]] = _opt(
        None, "Exact decode batch sizes to capture (default: 1 2 4 8 16 24 32 ... up to --cuda-graph-max-bs).",
        nargs="+")
    enable_torch_compile: bool = _opt(
        False, "Compile the decode forward with torch.compile (inductor): inside the CUDA graphs on CUDA; on "
        "CPU at start-up (1-2.5 minutes for a 135M model on 2 cores), with the weights frozen, so inductor "
        "keeps a packed copy of the linear weights per graph (2 graphs) and prefill runs on dense ones.")
    torch_compile_max_bs: int = _opt(32, "Largest decode batch size that uses the torch.compile'd forward.")
    random_seed: int = _opt(0, "Seed for weights of --load-format dummy and unseeded sampling.")
    trust_remote_code: bool = _opt(False, "Allow custom model/tokenizer code from the model directory.")
    # Memory and scheduling.
    mem_fraction_static: Optional[float] = _opt(
        None, "Fraction of free device memory (host RAM on CPU) for weights + KV pool; default "
        "0.88 on CUDA (less on small cards), 0.3 on CPU where RAM is shared with everything else.")
    max_total_tokens: Optional[int] = _opt(None, "Cap on the KV pool size in tokens.")
    max_running_requests: Optional[int] = _opt(None, "Cap on concurrently running requests.")
    max_prefill_tokens: int = _opt(16384, "Cap on new tokens in one prefill batch (never blocks the first request).")
    chunked_prefill_size: Optional[int] = _opt(
        None, "Split prompts longer than this into chunks (default 8192 on CUDA, 1024 on CPU; -1 disables).")
    enable_mixed_chunk: bool = _opt(
        False, "Run the running requests' decode step inside each prefill batch (one new token each, beside "
        "the new prompts' tokens), so a prefill no longer holds them back: one forward instead of two. "
        "Not mixed: steps where a request asks for logprobs.")
    schedule_policy: str = _opt("fcfs", "Order of the waiting queue.", SCHEDULE_POLICY_CHOICES)
    schedule_conservativeness: float = _opt(1.0, "Higher reserves more KV for running decodes.")
    max_queued_requests: Optional[int] = _opt(None, "Refuse requests with 503 beyond this many waiting.")
    disable_radix_cache: bool = _opt(False, "Never share KV between requests.")
    radix_eviction_policy: str = _opt("lru", "Eviction order of the radix cache.", ("lru", "lfu"))
    allow_auto_truncate: bool = _opt(False, "Truncate over-long inputs instead of refusing them.")
    grammar_backend: str = _opt("llguidance", "Library that compiles regex / json_schema / ebnf constraints.",
                                ("llguidance",))
    tool_call_parser: Optional[str] = _opt(
        None, "How tool calls are found in model text with tool_choice auto: hermes / qwen25 (<tool_call>{json}"
        "</tool_call>) or llama3 (a JSON object); default hermes.", ("hermes", "qwen25", "llama3"))
    # Front end.
    chat_template: Optional[str] = _opt(None, "Chat template: a Jinja file, or a built-in name (chatml).")
    served_model_name: Optional[str] = _opt(None, "Model name reported by the API (default: the model path).")
    tokenizer_worker_threshold: int = _opt(
        4096, "Inputs longer than this many characters are tokenized off the event loop.")
    max_batch_items: int = _opt(
        512, "Most prompts one /generate or /v1/completions request may carry, and most outputs (prompts x n) "
        "it may ask for; bigger requests get 400 before anything is tokenized.")
    max_n: int = _opt(128, "Largest n (samples per prompt) a request may ask for; larger n gets 400.")
    max_logprobs: int = _opt(
        20, "Largest top_logprobs_num (and longest token_ids_logprob list) a request may ask for, as vLLM's "
        "--max-logprobs; larger values get 400.")
    max_stop_sequences: int = _opt(
        64, "Most stop strings, and most stop_regex patterns, one request may carry; more get 400.")
    max_stop_chars: int = _opt(
        4096, "Most characters one request's stop strings (and, apart, its stop_regex patterns) may hold "
        "together; longer get 400.")
    max_chat_messages: int = _opt(4096, "Most messages one chat request may carry; more get 400.")
    max_logit_bias: int = _opt(4096, "Most logit_bias entries one request may carry; more get 400.")
    max_rid_length: int = _opt(512, "Longest request id (rid) in characters; longer get 400.")
    request_step_budget_ms: float = _opt(
        1000.0, "Milliseconds of the scheduler's own per-request work in one step (stop matching, grammar) "
        "a request may take; one that takes longer is aborted with a message and the server goes on. "
        "0 disables the check.")
    # HTTP server.
    host: str = _opt("127.0.0.1", "Address the HTTP server listens on (0.0.0.0 for every interface).")
    port: int = _opt(30000, "Port the HTTP server listens on.")
    api_key: Optional[str] = _opt(
        None, "Require 'Authorization: Bearer <key>' or 'x-api-key: <key>' on every route except /health. "
        "A key on the command line is visible to every local user (/proc/<pid>/cmdline): prefer "
        "--api-key-file or $SRT_API_KEY.")
    api_key_file: Optional[str] = _opt(None, "Read the API key from this file (one line) instead of --api-key.")
    enable_metrics: bool = _opt(False, "Serve Prometheus metrics at /metrics.")
    log_level: Optional[str] = _opt(None, "Logging level of every process (default: $SRT_LOG_LEVEL or info).",
                                    LOG_LEVEL_CHOICES)
    log_requests: bool = _opt(False, "Log every HTTP request: method, path, status, latency and a body preview.")
    stream_interval: int = _opt(1, "Send a streaming update every this many new tokens (the last one always).")
    skip_server_warmup: bool = _opt(False, "Skip the warm-up generation before the server reports ready.")
    watchdog_timeout: float = _opt(
        300.0, "Seconds the scheduler may go without answering (a stuck forward) before the server aborts "
        "with a message; 0 disables the watchdog.")
    max_request_body_mb: float = _opt(32.0, "Largest accepted request body in MiB; bigger bodies get 413.")
    max_request_json_items: int = _opt(
        262144, "Most JSON objects, arrays and object keys one request body may hold (they, not its size, set "
        "what parsing it costs); more get 400 before the body is parsed.")
    http_header_timeout: float = _opt(
        10.0, "Seconds a client may take to send a request's headers (and between requests on an idle "
        "keep-alive connection, see --http-keepalive-timeout) before its connection is closed.")
    http_keepalive_timeout: float = _opt(
        5.0, "Seconds an idle keep-alive connection stays open waiting for the next request.")
    max_connections: int = _opt(
        4096, "Most open client connections; past it new connections get 503 with Retry-After and are closed. "
        "Lowered to fit the process's open-file limit (raised at start-up as far as the OS allows).")
    graceful_shutdown_timeout: float = _opt(
        30.0, "On SIGTERM: refuse new requests (503) and let in-flight ones finish for this many seconds, then "
        "abort the rest (503); a second signal, or Ctrl-C, aborts them at once.")

    def __post_init__(self) -> None:
        self.context_length = parse_context_length(self.context_length)
        if self.model_path is None:
            self.model_path = default_model_path()
        if self.tokenizer_path is None:
            self.tokenizer_path = self.model_path
        self._resolve_api_key()
        self.check()

    def _resolve_api_key(self) -> None:
        """--api-key, else --api-key-file, else $SRT_API_KEY (giving both flags is an error unless
        they agree, so re-creating the args from their own values works)."""
        if self.api_key_file is not None:
            key = read_api_key_file(self.api_key_file)
            if self.api_key is not None and self.api_key != key:
                raise ValueError("Both --api-key and --api-key-file were given: pass only one.")
            self.api_key = key
        elif self.api_key is None:
            self.api_key = envs.API_KEY.get()

    def check(self) -> None:
        """Refuse bad values with the flag, the value and what is accepted."""
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue  # "not set": the documented default applies
            if choices and value not in choices:
                raise ValueError(
                    f"Invalid --{f.name.replace('_', '-')} {value!r}. Accepted values: {', '.join(choices)}."
                )
        for name in ("tp_size", "dp_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}.")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, --nnodes={self.nnodes}), got {self.node_rank}.")
        if self.nnodes > 1:
            if not self.dist_init_addr:
                raise ValueError("--nnodes > 1 needs --dist-init-addr host:port (the same on every node; node 0's "
                                 "address).")
            if self.tp_size % self.nnodes:
                raise ValueError(f"--tp-size {self.tp_size} must be a multiple of --nnodes {self.nnodes} "
                                 f"(every node runs the same number of ranks).")
            if self.dp_size > 1:
                raise ValueError("--dp-size > 1 with --nnodes > 1 is not supported: run one server per node "
                                 "and put sglang-router in front of them.")
        if self.dist_init_addr is not None and not _is_host_port(self.dist_init_addr):
            raise ValueError(f"--dist-init-addr must be host:port, got {self.dist_init_addr!r}.")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"--cuda-graph-max-bs must be >= 1, got {self.cuda_graph_max_bs}.")
        if self.cuda_graph_bs is not None and (not self.cuda_graph_bs or min(self.cuda_graph_bs) < 1):
            raise ValueError(f"--cuda-graph-bs must list batch sizes >= 1, got {self.cuda_graph_bs}.")
        if self.torch_compile_max_bs < 1:
            raise ValueError(f"--torch-compile-max-bs must be >= 1, got {self.torch_compile_max_bs}.")
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}.")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"--context-length must be >= 2, got {self.context_length}.")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}.")
        for name in ("max_total_tokens", "max_running_requests", "max_queued_requests", "max_batch_items", "max_n",
                     "max_logprobs", "max_stop_sequences", "max_stop_chars", "max_chat_messages", "max_logit_bias",
                     "max_rid_length", "max_connections", "max_request_json_items"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}.")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"--max-prefill-tokens must be >= 1, got {self.max_prefill_tokens}.")
        if self.schedule_conservativeness <= 0:
            raise ValueError(f"--schedule-conservativeness must be > 0, got {self.schedule_conservativeness}.")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port must be in [1, 65535], got {self.port}.")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be >= 1, got {self.stream_interval}.")
        if self.watchdog_timeout < 0:
            raise ValueError(f"--watchdog-timeout must be >= 0 seconds (0 disables it), got {self.watchdog_timeout}.")
        if not self.max_request_body_mb > 0:
            raise ValueError(f"--max-request-body-mb must be > 0, got {self.max_request_body_mb}.")
        for name in ("http_header_timeout", "http_keepalive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(self, name)}.")
        if self.request_step_budget_ms < 0:
            raise ValueError(f"--request-step-budget-ms must be >= 0 (0 disables it), got {self.request_step_budget_ms}.")
        if self.graceful_shutdown_timeout < 0:
            raise ValueError(f"--graceful-shutdown-timeout must be >= 0 seconds, got {self.graceful_shutdown_timeout}.")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty.")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            meta = f.metadata
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", help=meta.get("help"))
                continue
            kwargs = dict(default=f.default, help=meta.get("help"))
            if meta.get("choices"):
                kwargs["choices"] = meta["choices"]
            if meta.get("required"):
                kwargs["required"] = True
            if meta.get("nargs"):
                kwargs.update(nargs=meta["nargs"], type=int)
            elif f.name == "context_length":
                kwargs["type"] = _cli_context_length
            elif f.type in ("int", int, "Optional[int]"):
                kwargs["type"] = int
            elif f.type in ("float", float, "Optional[float]"):
                kwargs["type"] = float
            parser.add_argument(flag, *meta.get("aliases", ()), dest=f.name, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def flag_default(name: str) -> Any:
    """The default of the `ServerArgs` field `name`: the one place a flag's default is written."""
    return _FIELD_DEFAULTS[name]


_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServerArgs)}


def make_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Serve a model over HTTP (native /generate, OpenAI-compatible /v1/*).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ServerArgs.add_cli_args(parser)
    return parser


def prepare_server_args(argv: List[str]) -> ServerArgs:
    return ServerArgs.from_cli_args(make_parser().parse_args(argv))
