"""Every field of SGLang's CompletionRequest and ChatCompletionRequest (0.5.23) and of OpenAI's own
chat API, and how this server takes each: IMPLEMENTED, Inert (well-typed, changes nothing here) or
DefaultOnly (refused by name at any other value). A field in neither table is unknown: a 400."""

from __future__ import annotations

from typing import Any, Dict

from managers.generate_input import Inert
from srt.sampling.sampling_params import IMPLEMENTED, DefaultOnly

_NULL, _FALSE, _TRUE = DefaultOnly(), DefaultOnly(False), DefaultOnly(True)
_TOOLS = "tool calling"
_CALLER_ID = Inert((str,), "a caller-side id; SGLang passes it through without changing the output")
_NO_REASONING_PARSER = Inert((bool,), "without a reasoning parser the output is the same either way")

# Fields of both SGLang request types.
_COMMON: Dict[str, Any] = {
    # OpenAI's sampling and streaming fields
    "model": IMPLEMENTED,  # any name; responses report the served model name, as SGLang does
    "stream": IMPLEMENTED, "stream_options": IMPLEMENTED, "n": IMPLEMENTED, "stop": IMPLEMENTED,
    "max_tokens": IMPLEMENTED, "temperature": IMPLEMENTED, "top_p": IMPLEMENTED, "seed": IMPLEMENTED,
    "frequency_penalty": IMPLEMENTED, "presence_penalty": IMPLEMENTED, "logit_bias": IMPLEMENTED,
    "user": _CALLER_ID,
    # SGLang's sampling extensions
    "top_k": IMPLEMENTED, "min_p": IMPLEMENTED, "min_tokens": IMPLEMENTED, "repetition_penalty": IMPLEMENTED,
    "stop_token_ids": IMPLEMENTED, "stop_regex": IMPLEMENTED, "no_stop_trim": IMPLEMENTED,
    "ignore_eos": IMPLEMENTED, "skip_special_tokens": IMPLEMENTED,
    "spaces_between_special_tokens": IMPLEMENTED,  # ours: SGLang's /generate name, kept on both endpoints
    # request identity and the prefix cache
    "rid": IMPLEMENTED, "extra_key": IMPLEMENTED, "cache_salt": IMPLEMENTED, "session_id": _CALLER_ID,
    # structured output
    "regex": IMPLEMENTED, "ebnf": IMPLEMENTED, "response_format": IMPLEMENTED,
    # outputs beyond text and logprobs
    "return_hidden_states": _FALSE, "return_routed_experts": _FALSE, "routed_experts_start_len": DefaultOnly(0),
    "return_cached_tokens_details": _FALSE, "return_spec_tokens_details": _FALSE, "return_token_ids": _FALSE,
    # adapters, custom processors, sessions, multimodal processing
    "lora_path": _NULL, "session_params": _NULL, "custom_params": _NULL, "custom_logit_processor": _NULL,
    "watermark": _NULL, "images_config": _NULL, "mm_processor_kwargs": _NULL, "priority": _NULL,
    # routing: PD disaggregation and data parallelism
    "bootstrap_host": _NULL, "bootstrap_port": _NULL, "bootstrap_room": _NULL, "disagg_prefill_dp_rank": _NULL,
    "routed_dp_rank": _NULL, "data_parallel_rank": IMPLEMENTED,  # pins a replica (sglang-router --dp-aware)
}

COMPLETION_FIELDS: Dict[str, Any] = {
    **_COMMON,
    "prompt": IMPLEMENTED, "echo": IMPLEMENTED, "logprobs": IMPLEMENTED,
    "best_of": DefaultOnly(None, (1,)), "suffix": DefaultOnly(None, ("",)), "json_schema": IMPLEMENTED,
    "custom_labels": Inert((dict,), "metric labels of the caller; this server's metrics have none"),
}

CHAT_FIELDS: Dict[str, Any] = {
    **_COMMON,
    "messages": IMPLEMENTED, "max_completion_tokens": IMPLEMENTED, "logprobs": IMPLEMENTED,
    "top_logprobs": IMPLEMENTED, "chat_template_kwargs": IMPLEMENTED, "continue_final_message": IMPLEMENTED,
    "input_ids": IMPLEMENTED,  # the prompt's token ids: the chat template is not applied
    "separate_reasoning": _NO_REASONING_PARSER, "stream_reasoning": _NO_REASONING_PARSER,
    # tool calling (SGLang's tool_choice default is "auto", which means "none" without tools)
    "tools": IMPLEMENTED, "tool_choice": IMPLEMENTED, "parallel_tool_calls": IMPLEMENTED,
    # reasoning controls
    "reasoning_effort": _NULL, "reasoning": _NULL, "thinking": _NULL, "task": _NULL,
    # outputs beyond text and logprobs
    "return_prompt_token_ids": _FALSE, "return_meta_info": _FALSE, "return_input_ids_in_sglext": _FALSE,
    "return_output_ids_in_sglext": _FALSE, "return_sampling_mask": _FALSE, "sampling_logprobs_mode": _NULL,
    "return_flat_raw_output_top_logprobs": _FALSE, "return_flat_raw_top_logprobs_b64": _TRUE,
    # multimodal processing
    "max_dynamic_patch": _NULL, "min_dynamic_patch": _NULL, "use_audio_in_video": _FALSE, "video_config": _NULL,
    # OpenAI chat fields outside SGLang's protocol
    "functions": DefaultOnly(None, ([],), feature=_TOOLS),
    "function_call": DefaultOnly(None, ("none",), feature=_TOOLS),
    "audio": _NULL, "modalities": DefaultOnly(None, (["text"],)), "prediction": _NULL, "store": _FALSE,
    "metadata": DefaultOnly(None, ({},)), "service_tier": DefaultOnly("auto", ("default",)),
    "web_search_options": _NULL, "verbosity": _NULL,
}

# Inside `stream_options`.
STREAM_OPTIONS_FIELDS: Dict[str, Any] = {"include_usage": IMPLEMENTED, "continuous_usage_stats": _FALSE}
