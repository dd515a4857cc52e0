"""Real clients against `specdec serve` on the default model, as a new user would run them: a LangChain agent
loop that calls a Python tool and answers with its result, LangChain's `with_structured_output` through
function calling, the openai client's Responses API (plain, streamed, a function tool and its output, text.format),
the anthropic SDK's Messages API (plain, streamed, a tool, count_tokens), and the OpenAI Agents SDK in its default
mode (the Responses API) running a function tool."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
from conftest import needs_default_model
from test_server import Served, serving

from specdec import LLM

langchain_openai = pytest.importorskip("langchain_openai", reason="missing piece: pip install langchain-openai")
from langchain_core.messages import HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

pytestmark = needs_default_model
MODEL = "smollm2"


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serving(LLM("smollm2-135m"), served_model_name=MODEL) as s:
        yield s


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


class Person(BaseModel):
    """A person mentioned in the text."""

    name: str = Field(description="the person's name")
    age: int = Field(description="the person's age in years")


def chat(served: Served, **kw) -> langchain_openai.ChatOpenAI:
    return langchain_openai.ChatOpenAI(base_url=f"{served.url}/v1", api_key="unused", model=MODEL, temperature=0,
                                       max_tokens=100, max_retries=0, **kw)


def test_a_langchain_agent_calls_a_python_tool_and_answers_with_its_result(served):
    """The loop agents run: the model asks for the tool (a 135M model needs tool_choice to do it), LangChain runs
    the Python function, sends its result back in a tool message, and the model's answer uses it."""
    messages = [HumanMessage("What is 12 times 7? Use the multiply tool.")]
    asked = chat(served).bind_tools([multiply], tool_choice="multiply", parallel_tool_calls=False).invoke(messages)
    assert [(c["name"], c["args"]) for c in asked.tool_calls] == [("multiply", {"a": 12, "b": 7})]
    assert asked.response_metadata["finish_reason"] == "tool_calls" and asked.content == ""
    messages.append(asked)
    for call in asked.tool_calls:
        messages.append(ToolMessage(str(multiply.invoke(call["args"])), tool_call_id=call["id"]))
    answer = chat(served).bind_tools([multiply]).invoke(messages)
    assert answer.tool_calls == [] and "84" in answer.content


def test_langchain_structured_output_through_function_calling(served):
    extract = chat(served).with_structured_output(Person, method="function_calling")
    assert extract.invoke("Alice is 31 years old and lives in Paris.") == Person(name="Alice", age=31)
    streamed = list(chat(served, streaming=True).bind_tools([multiply], tool_choice="required").stream(
        "What is 6 times 9? Use the multiply tool."))
    calls = sum(streamed[1:], streamed[0]).tool_calls
    assert calls and all(c["name"] == "multiply" and set(c["args"]) == {"a", "b"} for c in calls)


# -- the Responses API, the Messages API and the Agents SDK ----------------------------------------------------
MULTIPLY = {"type": "function", "name": "multiply", "description": "Multiply two integers.", "strict": True,
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "required": ["a", "b"], "additionalProperties": False}}
QUESTION = "What is 12 times 7? Use the multiply tool."


def test_openai_responses_plain_streamed_with_a_tool_and_structured(served):
    client = served.client()
    plain = client.responses.create(model=MODEL, input="Name a colour.", instructions="Answer in one word.",
                                    max_output_tokens=12, temperature=0)
    assert plain.output_text.strip() and plain.usage.output_tokens <= 12
    events = list(client.responses.create(model=MODEL, input="Name a colour.", instructions="Answer in one word.",
                                          max_output_tokens=12, temperature=0, stream=True))
    assert events[0].type == "response.created" and events[-1].response.output_text == plain.output_text
    asked = client.responses.create(model=MODEL, input=QUESTION, tools=[MULTIPLY], temperature=0,
                                    tool_choice={"type": "function", "name": "multiply"}, max_output_tokens=60)
    call = next(item for item in asked.output if item.type == "function_call")
    assert (call.name, json.loads(call.arguments)) == ("multiply", {"a": 12, "b": 7})
    answer = client.responses.create(model=MODEL, previous_response_id=asked.id, tools=[MULTIPLY], temperature=0,
                                     max_output_tokens=40, input=[{"type": "function_call_output",
                                                                   "call_id": call.call_id, "output": "84"}])
    assert "84" in answer.output_text
    person = client.responses.create(model=MODEL, input="Alice is 31 years old and lives in Paris.", temperature=0,
                                     max_output_tokens=40, text={"format": {
                                         "type": "json_schema", "name": "person", "strict": True,
                                         "schema": Person.model_json_schema() | {"additionalProperties": False}}})
    assert Person.model_validate_json(person.output_text) == Person(name="Alice", age=31)


def test_anthropic_messages_plain_streamed_with_a_tool_and_counted(served):
    anthropic = pytest.importorskip("anthropic", reason="missing piece: pip install anthropic")
    client = anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0)
    kw = dict(model=MODEL, max_tokens=12, system="Answer in one word.",
              messages=[{"role": "user", "content": "Name a colour."}], extra_body={"temperature": 0})
    msg = client.messages.create(**kw)
    assert msg.content[0].text.strip() and msg.stop_reason in ("end_turn", "max_tokens")
    with client.messages.stream(**kw) as stream:
        assert "".join(stream.text_stream) == msg.content[0].text
    assert client.messages.count_tokens(model=MODEL, system=kw["system"], messages=kw["messages"]).input_tokens == \
        msg.usage.input_tokens
    tool = {"name": "multiply", "description": MULTIPLY["description"], "input_schema": MULTIPLY["parameters"]}
    used = client.messages.create(model=MODEL, max_tokens=60, tools=[tool], tool_choice={"type": "any"},
                                  messages=[{"role": "user", "content": QUESTION}], extra_body={"temperature": 0})
    assert used.stop_reason == "tool_use" and (used.content[-1].name, used.content[-1].input) == \
        ("multiply", {"a": 12, "b": 7})


def test_an_openai_agents_sdk_agent_runs_a_function_tool(served):
    """The Agents SDK in its default mode (the Responses API): the model calls the tool (forced the first time,
    as a 135M model needs), the SDK runs it and sends its output back, and the final answer uses it."""
    agents = pytest.importorskip("agents", reason="missing piece: pip install openai-agents")
    from openai import AsyncOpenAI

    @agents.function_tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    agents.set_default_openai_client(AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0),
                                     use_for_tracing=False)
    agents.set_default_openai_api("responses")
    agents.set_tracing_disabled(True)
    agent = agents.Agent(name="calculator", instructions="You multiply numbers with the multiply tool.",
                         model=MODEL, tools=[multiply], model_settings=agents.ModelSettings(
                             temperature=0, max_tokens=60, tool_choice="multiply"))
    result = asyncio.run(agents.Runner.run(agent, QUESTION, max_turns=3))
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and result.new_items[1].output == 84
    assert "84" in result.final_output
