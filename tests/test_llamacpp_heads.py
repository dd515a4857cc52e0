"""Draft heads written by llama.cpp's own converter (convert_hf_to_gguf.py of the llama-cpp-python sdist we pin, run by
`tools/llamacpp_convert.py`): the independent writer that checks our reading of its GGUF, where the other GGUF tests
read what our own writer wrote.

- EAGLE-3: a random head in a Hugging Face layout the converter takes (SpecForge's, which names no target layers,
  and speculators', which does, in vLLM's sense) is converted with the target's directory beside it; the GGUF must
  load as the same head (its target layers, d2t and logits) and draft the same chains in the engine.
- MTP: of the architectures specdec reads, the converter writes `nextn` layers only for deepseek2 models converted
  as GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`, DeepSeek-V3's architecture; for DeepSeek-V2/V3 themselves it drops
  them, `skip_mtp`). A DeepSeek-V3 model with an MTP layer, converted under that name, must give the same head and
  the same drafts as its directory.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import MISSING, every_step
from gguf import GGUFReader
from test_eagle import (  # noqa: F401  module fixtures of its own here
    PROMPTS,
    deepseek_with_mtp,
    recorded_chains,
    target,
    target_dir,
    tiny_engines,
)
from test_eagle3 import random_head

from specdec import LLM
from specdec.models.heads import gguf as heads_gguf
from specdec.models.heads.eagle3 import Eagle3Head
from specdec.models.heads.formats import read_head, write_head

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import llamacpp_convert  # noqa: E402

# The tool's driver, with the converter's --target-model-dir passed on (an EAGLE-3 head's GGUF needs the target's
# layer count and vocabulary).
DRIVER = llamacpp_convert._DRIVER.replace("sys.argv[4]]", "sys.argv[4], *sys.argv[5:]]")


def convert(model: Path, out: Path, *args: str) -> Path:
    """llama.cpp's GGUF of the directory `model` (float32, no vocabulary); `args`: the converter's own."""
    try:
        root = llamacpp_convert.converter_dir()
    except subprocess.CalledProcessError as e:  # only where pip cannot fetch the sdist
        pytest.skip(f"{MISSING} llama.cpp's converter: pip could not download llama-cpp-python=="
                    f"{llamacpp_convert.VERSION}'s sdist ({e})")
    assert DRIVER != llamacpp_convert._DRIVER
    result = subprocess.run([sys.executable, "-c", DRIVER, str(root), str(model), str(out), "f32", *args],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module", params=["specforge", "speculators"])
def converted(request, target_dir, target, tmp_path_factory):  # noqa: F811
    """(the head's directory, llama.cpp's GGUF of it). SpecForge's names no target layers (both sides then take the
    published default: the inputs of layers 2, N / 2, N - 3); speculators' names layers 1, 2, 3 (their inputs, the
    outputs of our layers 0, 1, 2)."""
    tmp = tmp_path_factory.mktemp(f"llamacpp-{request.param}")
    if request.param == "specforge":
        random_head(target.config, seed=5).save(tmp / "head")
        hf = json.loads((tmp / "head" / "config.json").read_text())
        del hf["eagle_config"]  # as SpecForge and the EAGLE reference publish their heads
        (tmp / "head" / "config.json").write_text(json.dumps(hf))
    else:
        random_head(target.config, seed=6).save(tmp / "ours")
        write_head(read_head(tmp / "ours", "eagle3"), "speculators", tmp / "head")
    return tmp / "head", convert(tmp / "head", tmp / "llamacpp.gguf", "--target-model-dir", str(target_dir))


def same_heads(target_dir, config, directory: Path, gguf: Path) -> bool:  # noqa: F811
    """The head from the GGUF is the directory's: the target layers it reads, its d2t, its logits over random rows
    within float32 rounding, and the chains it drafts in the engine."""
    a, b = Eagle3Head.load(directory, config), Eagle3Head.load(gguf, config)
    if a.aux_layers != b.aux_layers or not torch.equal(a.d2t, b.d2t):
        return False
    g = torch.Generator().manual_seed(8)
    embeds, features = torch.randn(9, config.hidden_size, generator=g), torch.randn(9, 3 * config.hidden_size,
                                                                                   generator=g)
    with torch.no_grad():
        logits = [h.compute_logits(h.unroll(embeds, features, 1)[0]) for h in (a, b)]
    if not torch.allclose(*logits, atol=1e-5, rtol=1e-5):
        return False
    chains = [recorded_chains(LLM(str(target_dir), speculative_config=every_step(
        {"method": "eagle3", "model": str(path), "num_speculative_tokens": 3})), PROMPTS)
        for path in (directory, gguf)]
    assert len(chains[0]) > 20
    return chains[0] == chains[1]


@pytest.mark.parametrize("planted", [None, "q/k rows left permuted", "d2t read as offsets",
                                     "target layers read as outputs"])
def test_llama_cpps_gguf_of_a_head_drafts_as_its_directory(target_dir, target, converted, monkeypatch,  # noqa: F811
                                                          tiny_engines, planted):
    """Planted, each in our GGUF reader: the Q/K rows left in llama.cpp's rotary order; llama.cpp's absolute d2t
    taken for our offsets; its target layers (inputs) taken for our outputs. Made in our writer as well, such a bug
    would pass every round trip through our own files; a file llama.cpp wrote shows it."""
    directory, gguf = converted
    if planted == "q/k rows left permuted":
        monkeypatch.setattr(heads_gguf, "unpermute_qk", lambda w, heads: w)
    elif planted == "d2t read as offsets":
        monkeypatch.setattr(heads_gguf, "_offsets", lambda ids, path: torch.from_numpy(ids))
    elif planted:
        field = heads_gguf._field
        monkeypatch.setattr(heads_gguf, "_field", lambda r, key, *default: [i + 1 for i in field(r, key, *default)]
                            if key == "eagle3.target_layers" else field(r, key, *default))
    assert same_heads(target_dir, target.config, directory, gguf) != bool(planted)


@pytest.fixture(scope="module")
def converted_mtp(deepseek_with_mtp, tmp_path_factory):  # noqa: F811
    """(the DeepSeek-V3 directory with an MTP layer, llama.cpp's GGUF of it: deepseek2 with a nextn block)."""
    path, _ = deepseek_with_mtp
    tmp = tmp_path_factory.mktemp("llamacpp-mtp")
    shutil.copytree(path, tmp / "glm")
    config = json.loads((tmp / "glm" / "config.json").read_text())
    (tmp / "glm" / "config.json").write_text(json.dumps({**config, "architectures": ["Glm4MoeLiteForCausalLM"]}))
    gguf = convert(tmp / "glm", tmp / "llamacpp.gguf")
    fields = GGUFReader(gguf).fields
    assert fields["general.architecture"].contents() == "deepseek2"
    assert fields["deepseek2.nextn_predict_layers"].contents() == 1
    return path, gguf


@pytest.mark.parametrize("planted", [None, "enorm and hnorm swapped"])
def test_llama_cpps_gguf_of_a_model_with_an_mtp_layer_drafts_as_its_directory(converted_mtp, monkeypatch,
                                                                              tiny_engines, planted):  # noqa: F811
    """The MTP head from the GGUF's nextn block is the directory's, tensor for tensor, and the chains it drafts for
    the GGUF's target are the ones drafted from the directory (the block's latent attention, experts and routing
    read from llama.cpp's keys). Planted in our nextn reader: the two input norms' names swapped."""
    from transformers import AutoTokenizer

    from specdec.models.heads.eagle import EagleHead
    from specdec.models.loader import load_model

    path, gguf = converted_mtp
    if planted:
        monkeypatch.setitem(heads_gguf._NEXTN, "enorm", "hnorm")
        monkeypatch.setitem(heads_gguf._NEXTN, "hnorm", "enorm")
    a = EagleHead.load(path, load_model(path)[0], "mtp").state_dict()
    b = EagleHead.load(gguf, load_model(gguf)[0], "mtp").state_dict()
    same = a.keys() == b.keys() and all(torch.allclose(t, b[k], atol=1e-6) for k, t in a.items())
    if same:  # the converter writes no vocabulary: the directory's tokenizer serves the GGUF's engine
        monkeypatch.setattr("specdec.llm.load_tokenizer", lambda src: AutoTokenizer.from_pretrained(path))
        chains = [recorded_chains(LLM(str(model), speculative_config=every_step(
            {"method": "mtp", "num_speculative_tokens": 3})), PROMPTS) for model in (path, gguf)]
        assert len(chains[0]) > 20
        same = chains[0] == chains[1]
    assert same != bool(planted)
