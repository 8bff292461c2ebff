"""The clients people point at an OpenAI-compatible server, against one ``pagedllm serve`` (the
default model): the official ``openai`` client, LangChain (``langchain-openai``), LiteLLM and
Anthropic's SDK, each through the calls a user of it makes. Greedy answers are the oracle of one
another: the same request through two clients gives the same text."""

import json

import pytest
from pydantic import BaseModel, Field
from server_process import ServerProcess

pytestmark = pytest.mark.slow


MODEL = "smollm2"


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--max-model-len", "1024", "--served-model-name", MODEL)
    yield s
    s.stop()


def chat_model(server, **fields):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=server.url + "/v1", api_key="none", model=MODEL, **fields)


# ---- LangChain's structured output ends (bounded JSON grammars, docs/structured-output.md) -------


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_millions: float


class Product(BaseModel):
    name: str = Field(max_length=40)
    price_usd: float
    in_stock: bool
    quantity: int


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int
    height_m: float


class Planet(BaseModel):
    name: str = Field(max_length=30)
    diameter_km: float
    moons: int


class Book(BaseModel):
    title: str = Field(max_length=60)
    author: str = Field(max_length=40)
    year: int
    rating: float


class Recipe(BaseModel):
    dish: str = Field(max_length=40)
    servings: int
    minutes: float
    ingredients: list[str] = Field(max_length=6)


class Weather(BaseModel):
    city: str = Field(max_length=40)
    temperature_c: float
    humidity_percent: int


class Stock(BaseModel):
    ticker: str = Field(max_length=8)
    price: float
    change_percent: float


class Car(BaseModel):
    make: str = Field(max_length=30)
    model: str = Field(max_length=30)
    year: int
    mpg: float


class Movie(BaseModel):
    title: str = Field(max_length=60)
    year: int
    runtime_minutes: int
    score: float


SCHEMAS = [
    (City, "Describe Paris."),
    (Product, "Describe a laptop for sale."),
    (Person, "Describe a famous scientist."),
    (Planet, "Describe Mars."),
    (Book, "Describe a classic novel."),
    (Recipe, "Describe a pancake recipe."),
    (Weather, "Describe the weather in London today."),
    (Stock, "Describe Apple's stock."),
    (Car, "Describe a popular family car."),
    (Movie, "Describe a famous film."),
]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_langchain_structured_output_completes_for_ten_schemas_with_numbers(server, sampled):
    settings = {"temperature": 0.8, "seed": 3} if sampled else {"temperature": 0}
    llm = chat_model(server, max_tokens=160, **settings)
    for schema, question in SCHEMAS:
        structured = llm.with_structured_output(schema, method="json_schema", include_raw=True)
        answer = structured.invoke(question)
        raw = answer["raw"]
        assert answer["parsing_error"] is None, (schema.__name__, raw.content)
        assert raw.response_metadata["finish_reason"] == "stop", (schema.__name__, raw.content)
        assert isinstance(answer["parsed"], schema)


# ---- each feature through the client a user would use ---------------------------------------------

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def openai_client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="none")


@pytest.fixture(scope="module")
def reference(openai_client) -> str:
    """The greedy answer through the official client's chat API: the other clients' oracle."""
    answer = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=16, temperature=0
    )
    return answer.choices[0].message.content


def test_openai_echo_with_logprobs_and_prompt_logprobs(openai_client):
    prompt = "The capital of France is"
    out = openai_client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=1, temperature=0
    ).choices[0]
    assert out.text.startswith(prompt) and len(out.text) > len(prompt)
    assert out.logprobs.token_logprobs[0] is None and all(v < 0 for v in out.logprobs.token_logprobs[1:])
    assert len(out.logprobs.tokens) == len(out.logprobs.token_logprobs)
    chat = openai_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )
    entries = chat.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == chat.usage.prompt_tokens


def test_openai_responses_api_answers_as_chat_does(openai_client, reference):
    answer = openai_client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0)
    assert answer.output_text == reference


def test_anthropic_messages_api_answers_as_chat_does(server, reference):
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="none")
    # (this SDK has no temperature argument: the field is sent as the API defines it)
    answer = client.messages.create(
        model=MODEL, max_tokens=16, messages=[{"role": "user", "content": QUESTION}], extra_body={"temperature": 0}
    )
    assert "".join(b.text for b in answer.content if b.type == "text") == reference


def test_langchain_invoke_stream_and_tools(server, reference):
    llm = chat_model(server, max_tokens=16, temperature=0)
    assert llm.invoke(QUESTION).content == reference
    assert "".join(chunk.content for chunk in llm.stream(QUESTION)) == reference

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    by_function = chat_model(server, max_tokens=160, temperature=0).with_structured_output(
        City, method="function_calling"
    )
    assert isinstance(by_function.invoke("Describe Paris."), City)
    tooled = chat_model(server, max_tokens=64, temperature=0).bind_tools([get_weather], tool_choice="get_weather")
    calls = tooled.invoke("What is the weather in Paris?").tool_calls
    assert calls and calls[0]["name"] == "get_weather" and isinstance(calls[0]["args"]["city"], str)


def test_litellm_completion_and_stream(server, reference):
    import litellm

    fields = dict(
        model="openai/" + MODEL,
        api_base=server.url + "/v1",
        api_key="none",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=16,
        temperature=0,
    )
    assert litellm.completion(**fields).choices[0].message.content == reference
    streamed = "".join(c.choices[0].delta.content or "" for c in litellm.completion(stream=True, **fields))
    assert streamed == reference
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
    constrained = litellm.completion(
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}, **fields
    )
    assert isinstance(json.loads(constrained.choices[0].message.content)["city"], str)


def test_openai_embeddings_float_and_base64_agree_and_are_normalised(openai_client):
    texts = ["The capital of France is Paris.", "Bananas are yellow."]
    as_base64 = openai_client.embeddings.create(model=MODEL, input=texts)  # the client's default: base64
    as_floats = openai_client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert as_base64.usage.prompt_tokens > 0
    for a, b in zip(as_base64.data, as_floats.data):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-6)  # float32 bytes, decoded by the client
        assert sum(x * x for x in b.embedding) == pytest.approx(1.0, abs=1e-5)
    assert as_floats.data[0].embedding != pytest.approx(as_floats.data[1].embedding, abs=1e-3)
    mean = openai_client.embeddings.create(model=MODEL, input=texts[0], extra_body={"pooling": "mean"})
    assert mean.data[0].embedding != pytest.approx(as_floats.data[0].embedding, abs=1e-3)
    import openai

    with pytest.raises(openai.BadRequestError, match="dimensions"):
        openai_client.embeddings.create(model=MODEL, input=texts[0], dimensions=8)
    size = len(as_floats.data[0].embedding)
    assert len(openai_client.embeddings.create(model=MODEL, input="x", dimensions=size).data[0].embedding) == size
