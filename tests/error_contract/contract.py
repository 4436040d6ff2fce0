"""The error contract as data: every message a user can get, the literal text to search for, and
the tests that prove it. `docs/TROUBLESHOOTING.md` has one section per entry (anchor = `key`) and
`test_troubleshooting_doc.py` checks that the texts appear in the doc and in the runtime's source,
and that every linked test exists."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

STARTUP = "tests/error_contract/test_startup_contract.py"
WARN = "tests/error_contract/test_startup_warnings_contract.py"
REQUEST = "tests/error_contract/test_request_contract.py"
RUNNING = "tests/error_contract/test_running_contract.py"
CHECK = "tests/error_contract/test_check_config.py"


@dataclass(frozen=True)
class ContractEntry:
    key: str                 # the section anchor in docs/TROUBLESHOOTING.md
    stage: str               # start-up | request | running
    texts: Tuple[str, ...]   # literal pieces of the message (searchable; each is in the source)
    tests: Tuple[str, ...]   # "path::test_name"


CONTRACT = (
    # ------------------------------------------------------------------ start-up
    ContractEntry("weights-leave-no-memory", "start-up",
                  ("Loaded weights leave no", "memory for the KV cache under --mem-fraction-static=",
                   "Raise --mem-fraction-static above"),
                  (f"{STARTUP}::test_weights_over_the_static_fraction_exit_with_the_smallest_fraction",
                   "tests/test_memory_sizing.py::test_suggested_fraction_is_the_smallest_that_leaves_room",
                   f"{CHECK}::test_failing_start_up_ends_with_the_servers_error")),
    ContractEntry("not-enough-memory", "start-up",
                  ("Not enough memory. Please try to increase --mem-fraction-static.",),
                  (f"{STARTUP}::test_pool_below_one_page_says_not_enough_memory_and_names_the_cap",
                   "tests/test_memory_sizing.py::test_pool_too_small_for_any_request_raises_not_enough_memory")),
    ContractEntry("pool-below-context", "start-up",
                  ("Requests longer than max_req_input_len=", "will be refused, below the model's context length"),
                  (f"{REQUEST}::test_limits_are_reported_where_users_look",
                   "tests/test_memory_sizing.py::test_pool_below_context_length_warns_how_to_raise_it")),
    ContractEntry("memory-measurement", "start-up",
                  ("memory grew while loading weights",),
                  ("tests/test_memory_sizing.py::test_free_memory_growing_during_load_is_clamped_and_reported",
                   "tests/test_memory_sizing.py::test_negative_free_memory_before_loading_is_clamped_to_an_error")),
    ContractEntry("tokenizer-remote-code", "start-up",
                  ("Failed to load the tokenizer. If the tokenizer is a custom tokenizer not yet available in the "
                   "HuggingFace transformers library, consider setting trust_remote_code=True",),
                  (f"{STARTUP}::test_tokenizer_needing_remote_code_names_the_flag",
                   "tests/test_tokenizer_manager.py::test_unknown_tokenizer_class_names_trust_remote_code")),
    ContractEntry("no-chat-template", "start-up",
                  ("No chat template found, defaulting to 'string' content format",
                   "This model has no chat template, so chat messages cannot be turned into a prompt."),
                  (f"{WARN}::test_no_chat_template_is_an_info_line_then_chat_requests_get_400_naming_the_flag",)),
    ContractEntry("model-path-missing", "start-up",
                  ("does not exist. --model-path must be a local Hugging Face format directory",
                   "has no config.json: it is not a Hugging Face format model directory."),
                  (f"{STARTUP}::test_missing_model_path_is_named_never_a_hub_repo_id",
                   f"{STARTUP}::test_directory_without_config_json_is_not_a_model_directory")),
    ContractEntry("demo-model-missing", "start-up",
                  ("No --model-path given and the embedded demo model is missing",),
                  ("tests/test_http_bad_inputs.py::test_no_model_path_uses_the_demo_model_or_says_how_to_build_it",)),
    ContractEntry("context-length-above-derived", "start-up",
                  ("is greater than the derived context length", "exceeds the derived"),
                  (f"{STARTUP}::test_context_length_above_the_derived_one_names_its_source_and_the_override",
                   f"{WARN}::test_context_length_override_starts_with_a_warning_naming_both_lengths")),
    ContractEntry("bad-flag-value", "start-up",
                  ("Accepted values:", "must be >= 1, got", "must be in (0, 1), got",
                   "use an integer or a suffix like 16k"),
                  (f"{STARTUP}::test_bad_choice_lists_the_accepted_values",
                   f"{STARTUP}::test_flag_out_of_range_names_the_flag_value_and_range")),
    ContractEntry("no-cuda", "start-up",
                  ("was given but CUDA is not available",),
                  (f"{STARTUP}::test_device_cuda_without_cuda_says_what_to_pass",)),
    ContractEntry("cuda-graph-capture", "start-up",
                  ("CUDA graph capture failed at batch size", "Use --disable-cuda-graph to skip the capture"),
                  ("tests/test_cuda_graph_runner.py::test_failed_capture_names_the_batch_size_and_the_flags_that_skip_it",)),
    ContractEntry("flashinfer-kv-dtype", "start-up",
                  ("KV cache under a", "its kernels take KV in the model dtype or fp8"),
                  ("tests/test_flashinfer_backend.py::test_float32_kv_under_a_half_model_is_refused_naming_the_flags",)),
    ContractEntry("port-in-use", "start-up",
                  ("Address already in use:",),
                  (f"{STARTUP}::test_port_in_use_is_one_line_before_loading_anything",)),
    ContractEntry("child-failed", "start-up",
                  ("process, pid", "are not supported. Supported architectures:"),
                  (f"{STARTUP}::test_child_failing_at_startup_shows_its_own_error_last",
                   f"{STARTUP}::test_engine_start_up_failure_raises_the_childs_error_and_leaves_no_process")),
    ContractEntry("check-config-target", "start-up",
                  ("tokens is not admitted:", "Smallest change that admits it:",
                   "only apply with --dry-run (or python -m srt.check_config)."),
                  (f"{CHECK}::test_suggested_fraction_is_the_smallest_that_admits_the_prompt",
                   f"{CHECK}::test_max_total_tokens_cap_below_the_need_names_the_needed_cap",
                   f"{CHECK}::test_prompt_at_or_over_the_context_length_names_context_length",
                   f"{CHECK}::test_launch_server_refuses_check_flags_without_dry_run")),
    # ------------------------------------------------------------------ request
    ContractEntry("input-longer-than-context", "request",
                  ("is longer than the model's context length",),
                  (f"{REQUEST}::test_input_at_the_context_length_is_refused_by_the_tokenizer_manager",
                   "tests/test_tokenizer_manager.py::test_auto_truncate_keeps_first_tokens_and_reports_it")),
    ContractEntry("requested-token-count", "request",
                  ("Requested token count exceeds the model's maximum context length of",),
                  (f"{REQUEST}::test_input_plus_explicit_max_new_tokens_over_the_context_is_refused",
                   "tests/test_tokenizer_manager.py::test_auto_truncate_clamps_explicit_max_new_tokens")),
    ContractEntry("maximum-allowed-length", "request",
                  ("exceeds the maximum allowed length", "The limit comes from the KV cache pool"),
                  (f"{REQUEST}::test_input_below_the_context_but_over_the_kv_pool_is_refused_by_the_scheduler",
                   "tests/test_scheduler_admission.py::test_auto_truncate_keeps_first_tokens_and_reports")),
    ContractEntry("kv-memory-budget", "request",
                  ("Request prompt exceeds the KV memory budget",),
                  (f"{RUNNING}::test_kv_budget_guard_refuses_a_prompt_whose_pages_cannot_fit",
                   f"{REQUEST}::test_prompt_filling_the_last_pages_of_the_pool_is_served",
                   f"{RUNNING}::test_lone_request_at_every_admitted_length_finishes")),
    ContractEntry("sampling-params", "request",
                  ("temperature must be >= 0 and finite", "top_p must be in (0, 1]",
                   "top_k must be -1 (disabled) or >= 1",
                   "min_p must be in [0, 1]", "repetition_penalty must be in (0, 2]", "max_new_tokens must be >= 0"),
                  ("tests/test_http_bad_inputs.py::test_bad_request_gets_json_error",
                   "tests/test_tokenizer_manager.py::test_bad_sampling_params_are_refused_naming_the_parameter")),
    ContractEntry("bad-request-body", "request",
                  ("The request body is not valid JSON", "Unknown field", "Request body too large"),
                  ("tests/test_http_bad_inputs.py::test_bad_request_gets_json_error",
                   "tests/test_http_bad_inputs.py::test_body_over_the_cap_is_413")),
    ContractEntry("model-not-found", "request",
                  ("does not exist. This server serves",),
                  ("tests/test_openai_api.py::test_unknown_model_is_404_model_not_found",)),
    ContractEntry("queue-full", "request",
                  ("The request queue is full.",),
                  ("tests/test_http_native.py::test_queue_full_is_503",)),
    ContractEntry("text-only-content", "request",
                  ("but this model accepts text only",),
                  (f"{REQUEST}::test_content_part_a_text_model_cannot_take_is_400",)),
    # ------------------------------------------------------------------ running
    ContractEntry("alloc-req-slots", "running",
                  ("alloc_req_slots runs out of memory",),
                  (f"{RUNNING}::test_request_slot_exhaustion_aborts_that_request_and_the_next_is_served",)),
    ContractEntry("prefill-out-of-memory", "running",
                  ("out of memory. Try to lower your batch size",),
                  (f"{RUNNING}::test_kv_exhaustion_at_prefill_aborts_that_batch_and_the_next_is_served",)),
    ContractEntry("decode-out-of-memory", "running",
                  ("Decode out of memory. Try to lower your batch size",),
                  (f"{RUNNING}::test_kv_exhaustion_at_decode_aborts_the_lone_request_and_the_next_is_served",)),
    ContractEntry("scheduler-died", "running",
                  ("died unexpectedly", "Scheduler crashed:"),
                  ("tests/test_http_native.py::test_killed_scheduler_takes_the_server_down_with_its_cause",
                   "tests/test_engine_lifecycle.py::test_killed_scheduler_is_reported_to_callers")),
    ContractEntry("scheduler-watchdog", "running",
                  ("Scheduler watchdog: the scheduler did not answer for",),
                  ("tests/test_http_native.py::test_stuck_scheduler_trips_the_watchdog",)),
)
