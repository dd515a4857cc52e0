"""Real clients against `specdec serve` on the default model, as a new user would run them: a LangChain agent
loop that calls a Python tool and answers with its result, and LangChain's `with_structured_output` through
function calling."""
from __future__ import annotations

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
