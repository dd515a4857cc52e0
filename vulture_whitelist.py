"""What `make lint`'s unused-code check (vulture, configured in pyproject.toml) must not call dead: names that a
framework, a file format or a caller outside the package reaches by name. Never run, only read by vulture; each
name says who uses it. Anything else it reports is deleted, not added here (tests do not count as users)."""
# ruff: noqa
_ = object()

# FastAPI / pydantic: response bodies' fields are serialized by name; model_config is pydantic's own
model_config, completion_tokens, total_tokens, acceptance_length, function, text_offset, owned_by

# Request fields the serving layer reads by name (getattr) from its tables of fields it refuses or checks:
# plans.UNSUPPORTED_FIELDS and STRUCTURED_FIELDS, and the REFUSED of responses_api, messages_api and tokenize_api
skip_special_tokens, guided_json, guided_regex, guided_grammar, guided_choice, structured_outputs, function_call
thinking, mcp_servers, container, output_format, output_config, background, truncation, reasoning, max_tool_calls
include, chat_template_kwargs, continue_final_message, mm_processor_kwargs

# Ray Serve: the router's and the deployment's hooks, and the application builder `serve run` names
_.initialize_state, _.choose_replicas, _.on_request_routed, _.record_routing_stats, _.check_health
build_app

# prometheus_client: custom collectors are asked for `collect()`
_.collect

# uvicorn: a server stops when `should_exit` is set; llama.cpp's quantize parameters (tools/synth_gguf.py)
_.should_exit, _.ftype

# `specdec soak`: each request kind is the method named in its MIX table (getattr)
_.cancelled, _.no_auth

# Result and config fields, filled for callers: the GGUF/HF config's bos id, verification's recovered/bonus tokens
bos_token_id, extra_tokens

# Public helpers: the path to the head shipped for the built-in model (for users and the tests), the distinct
# instruction sets the native kernels build for (their tests run each; models/cpu/native.py)
shipped_head, distinct_isas

# Public API read by users and tests only: a speculative config as the flat dict `parse` reads back (registry.py);
# llama.cpp's own attribute that tools/verify_cost.py sets to drop a step's K/V (bench/verify_cost.py)
to_dict, n_tokens
