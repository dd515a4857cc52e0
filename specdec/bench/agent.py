"""`specdec bench --agent`: an agent's workload. The same system instructions and tools in every conversation,
many tasks, each two turns as agent loops run them: a tool-calling turn (the framework asks for a call,
tool_choice "required": the arguments follow the function's schema) and, after the tool's result, the answer turn
(tool_choice "auto"). Every turn runs plain and speculative in turn on one engine's weights (which goes first
alternates); decode speed per turn kind, acceptance, and token identity with plain decoding.

The speculative side is suffix decoding with jump-forward: a call's forced text (the tag, `{"name": "`, the keys)
is drafted from the grammar, and what calls repeat across turns (a city, a date format) from the suffix tree of
earlier answers."""
from __future__ import annotations

import json
import time

from specdec.bench.config import BenchConfig
from specdec.bench.report import format_table, output_path, ratio
from specdec.config import SamplingParams
from specdec.serving.tool_calls import Tools, constraint, default_conversation, parse, parse_tools

SYSTEM = ("You are a travel assistant. Use the tools to look things up; never guess prices, times or weather. "
          "Answer in one or two sentences.")
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "search_flights", "description": "Flights between two cities on a date",
                                      "parameters": {"type": "object", "properties": {
                                          "origin": {"type": "string"}, "destination": {"type": "string"},
                                          "date": {"type": "string", "pattern": "^2026-[0-9]{2}-[0-9]{2}$"}},
                                          "required": ["origin", "destination", "date"]}}},
    {"type": "function", "function": {"name": "convert_currency", "description": "Convert an amount of money",
                                      "parameters": {"type": "object", "properties": {
                                          "amount": {"type": "number"}, "from_currency": {"type": "string"},
                                          "to_currency": {"type": "string"}},
                                          "required": ["amount", "from_currency", "to_currency"]}}},
    {"type": "function", "function": {"name": "book_hotel", "description": "Book a hotel room", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "check_in": {"type": "string"},
                                         "nights": {"type": "integer", "minimum": 1, "maximum": 30}},
        "required": ["city", "check_in", "nights"]}}},
]
CITIES = ["Paris", "Tokyo", "Lisbon", "Berlin", "Madrid", "Rome", "Oslo", "Vienna", "Prague", "Dublin"]
TEMPLATES = [
    ("What is the weather in {a} right now?", '{{"city": "{a}", "temperature": 18, "sky": "sunny"}}'),
    ("Find me a flight from {a} to {b} on 2026-06-{d:02d}.",
     '{{"flights": [{{"number": "XY{d}12", "departs": "08:40", "price_eur": 129}}]}}'),
    ("How much is {n} US dollars in euros?", '{{"amount": {n}, "converted": {m}, "currency": "EUR"}}'),
    ("Book a hotel in {a} from 2026-07-{d:02d} for {k} nights.",
     '{{"confirmation": "H{d}{k}9", "city": "{a}", "nights": {k}}}'),
]


def tasks(count: int) -> list[tuple[str, str]]:
    """(user message, the tool's result) for `count` tasks, cycling through the templates and cities."""
    out = []
    for i in range(count):
        ask, result = TEMPLATES[i % len(TEMPLATES)]
        values = {"a": CITIES[i % len(CITIES)], "b": CITIES[(i + 3) % len(CITIES)], "d": 1 + i % 28,
                  "n": 20 * (i + 1), "m": round(18.4 * (i + 1), 2), "k": 1 + i % 5}
        out.append((ask.format(**values), result.format(**values)))
    return out


def run_agent_bench(cfg: BenchConfig) -> dict:
    from specdec.llm import LLM

    llm = LLM(cfg.model, dtype=cfg.dtype, device=cfg.device, quantization=cfg.quantization,
              speculative_config="off")
    # a call's forced runs are long
    spec_cfg = cfg.speculative_dict({"method": "suffix", "num_speculative_tokens": 12, "jump_forward": 15})
    engines = {"plain": llm, "speculative": llm.with_speculative_config({"jump_forward": True, **spec_cfg})}
    call_tools, answer_tools = parse_tools(TOOLS, "required", False), parse_tools(TOOLS, "auto", False)
    names = {t["function"]["name"] for t in TOOLS}
    turns: dict[str, dict[str, list[dict]]] = {"call": {n: [] for n in engines}, "answer": {n: [] for n in engines}}

    def run(name: str, kind: str, messages: list[dict], tools: Tools | None) -> dict:
        ids = llm.apply_chat_template(default_conversation(messages, tools))
        params = SamplingParams(temperature=0, max_tokens=cfg.max_tokens if kind == "answer" else 128,
                                structured_output=constraint(tools))
        begin = time.perf_counter()
        out = engines[name].generate({"prompt_token_ids": ids}, params)[0]
        wall = time.perf_counter() - begin
        m = out.metrics
        record = {"tokens": len(out.token_ids), "decode_s": m["decode_s"], "e2e_s": wall, "steps": m["num_steps"],
                  "token_ids": out.token_ids, "text": out.text}
        turns[kind][name].append(record)
        return record

    for name in engines:  # warm-up: kernels and the grammar compiler (its call is none of the tasks')
        run(name, "call", [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"}], call_tools)
        turns["call"][name].clear()
    for i, (ask, result) in enumerate(tasks(cfg.num_prompts)):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask}]
        order = list(engines) if i % 2 == 0 else list(reversed(engines))
        calls = {name: run(name, "call", messages, call_tools) for name in order}
        _, parsed = parse(calls["plain"]["text"], names)
        tool_calls = [{"id": c.id, "type": "function",
                       "function": {"name": c.name, "arguments": json.loads(c.arguments)}} for c in parsed]
        history = messages + [{"role": "assistant", "content": "", "tool_calls": tool_calls}] + \
            [{"role": "tool", "tool_call_id": c["id"], "content": result} for c in tool_calls]
        for name in order:
            run(name, "answer", history, answer_tools)
    result = {"config": spec_cfg, "num_tasks": cfg.num_prompts, "turns": {kind: _summary(recs) for kind, recs in
                                                                            turns.items()}}
    print(format_agent(result))
    path = output_path(cfg.out)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return result


def _summary(recs: dict[str, list[dict]]) -> dict:
    plain = recs["plain"]
    out = {}
    for name, rs in recs.items():
        decode_s = sum(r["decode_s"] for r in rs)
        out[name] = {"turns": len(rs), "tokens": sum(r["tokens"] for r in rs),
                     "decode_tokens_per_s": sum(r["tokens"] - 1 for r in rs) / decode_s if decode_s else None,
                     "e2e_s": sum(r["e2e_s"] for r in rs),
                     "acceptance_length": sum(r["tokens"] for r in rs) / max(1, sum(r["steps"] for r in rs)),
                     "identical_to_plain": sum(r["token_ids"] == p["token_ids"] for r, p in zip(rs, plain))}
    return out


def format_agent(result: dict) -> str:
    rows = []
    for kind, s in result["turns"].items():
        base = s["plain"]
        for name, v in s.items():
            rows.append([f"{kind} turns", name, f"{v['turns']}", f"{v['tokens']}", f"{v['decode_tokens_per_s']:.1f}",
                         f"{ratio(v['decode_tokens_per_s'], base['decode_tokens_per_s']):.2f}x",
                         f"{ratio(base['e2e_s'], v['e2e_s']):.2f}x", f"{v['acceptance_length']:.2f}",
                         f"{v['identical_to_plain']}/{v['turns']}"])
    head = (f"agent workload: {result['num_tasks']} tasks, each a tool-calling turn (tool_choice required) and an "
            f"answer turn (auto), greedy; speculative config {json.dumps(result['config'])} + jump-forward")
    return "\n".join([head, format_table(["turn", "decoding", "turns", "tokens", "decode tok/s", "decode vs plain",
                                          "e2e vs plain", "acceptance length", "ids = plain"], rows)])
