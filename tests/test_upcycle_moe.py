"""tools/upcycle_moe.py: the built-in model sparse-upcycled keeps its text and metadata, routes each token to its own
experts, and speculates losslessly as a mixture."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import needs_native
from gguf import GGUFReader

from specdec import LLM, SamplingParams
from specdec.models.blocks.moe import MoE
from specdec.models.loader import resolve

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import upcycle_moe  # noqa: E402

pytestmark = needs_native
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def upcycled(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("moe") / "moe.gguf"
    return upcycle_moe.upcycle(resolve("smollm2-135m").gguf_file, out, experts=3, top_k=2, noise=0.02,
                               router_scale=4.0)


def test_the_file_keeps_the_models_metadata_and_blocks_and_adds_experts(upcycled):
    source, ours = GGUFReader(resolve("smollm2-135m").gguf_file), GGUFReader(upcycled)
    assert ours.fields["tokenizer.chat_template"].contents() == source.fields["tokenizer.chat_template"].contents()
    assert ours.fields["llama.expert_count"].contents() == 3 and ours.fields["llama.expert_used_count"].contents() == 2
    theirs = {t.name: t for t in source.tensors}
    for t in ours.tensors:
        if t.name in theirs:  # attention, norms, embedding: the same bytes
            assert t.tensor_type == theirs[t.name].tensor_type and (t.data == theirs[t.name].data).all(), t.name
        else:
            kind = t.name.split(".")[2]
            assert kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_inp"), t.name
            if kind != "ffn_gate_inp":
                dense = theirs[t.name.replace("_exps", "")]
                assert t.tensor_type == dense.tensor_type and int(t.shape[-1]) == 3  # stacked, same block format


@pytest.fixture(scope="module")
def plain(upcycled) -> LLM:
    return LLM(str(upcycled), speculative_config="off")


def test_it_writes_the_dense_models_text_and_routes_tokens_over_every_expert(plain):
    dense = LLM("smollm2-135m", speculative_config="off")
    want = dense.chat(PROMPT, GREEDY)[0].token_ids
    del dense
    llm = plain
    model = llm.engine.model
    assert all(layer.moe is not None and len(layer.moe.gate_up) == 3 for layer in model.layers)
    assert llm.chat(PROMPT, GREEDY)[0].token_ids == want  # each expert is nearly the MLP: the same greedy text
    hidden = model.embed(torch.tensor(llm.tokenizer.encode("The quick brown fox jumps over the lazy dog, twice.")))
    experts, _ = MoE.route(model.layers[0].moe, model.layers[0].post_attention_layernorm(hidden))
    assert set(experts.reshape(-1).tolist()) == {0, 1, 2}  # the router spreads the tokens


def test_speculation_on_the_mixture_equals_plain(upcycled, plain):
    prompts = [PROMPT, [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]]
    want = [o.token_ids for o in plain.chat(prompts, GREEDY)]
    llm = LLM(str(upcycled), speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    outs = llm.chat(prompts, GREEDY)
    assert [o.token_ids for o in outs] == want
    assert sum(o.metrics["num_draft_tokens"] for o in outs) > 0
