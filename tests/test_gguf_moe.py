"""Mixtures of experts from GGUF files as llama.cpp's converter writes them (Qwen3-MoE, Qwen2-MoE,
OLMoE, gpt-oss, and Mixtral as llama with experts): each layer's stacked experts split into one
weight per expert, float or kept quantized as stored, give the logits transformers gives on the
same weights."""

import copy

import gguf
import numpy as np
import pytest
import torch
from greedy import assert_greedy_matches, hf_greedy
from test_models_match_transformers import hf_logits, our_logits, prompts
from tiny_models import GGUF_ARCHS, MOE_ARCHS, save_tiny_gguf

from pagedllm import LLM, SamplingParams, UnsupportedModelError
from pagedllm.loading import gguf_convert, load

# Expert widths that are whole Q8_0 blocks of 32 values (the tiny models' 48 is not: llama.cpp
# would write such a tensor in F16), and that differ from the hidden size (64), so a tensor read
# across instead of along its rows fails on its shape.
WIDTHS = {
    "qwen3-moe": {"moe_intermediate_size": 96},
    "qwen2-moe": {"moe_intermediate_size": 96},
    "olmoe": {"intermediate_size": 96},
    "mixtral": {},  # its experts are 96 wide already
    "gpt-oss": {},  # 64 wide, as hidden is: its experts' weights are read transposed (down [width, hidden])
}


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    """(GGUF path, the transformers model holding its values) per family and experts' type,
    written once for the module; pagedllm converts each once (its cache), on first load."""
    files: dict[tuple[str, str], tuple] = {}

    def get(arch: str, experts: str = "F32"):
        if (arch, experts) not in files:
            path = tmp_path_factory.mktemp("moe-gguf") / f"tiny-{arch}-{experts}.gguf"
            files[arch, experts] = (path, save_tiny_gguf(arch, path, experts=experts, **WIDTHS[arch]))
        return files[arch, experts]

    return get


@pytest.mark.parametrize(
    "arch, experts",
    [(a, t) for a in MOE_ARCHS if a in GGUF_ARCHS for t in ("F32", "Q8_0")] + [("gpt-oss", "MXFP4")],
)
def test_moe_gguf_logits_equal_transformers(moe_gguf, arch, experts, kernels):
    """fp32 logits at every position equal transformers' (atol 1e-4, as for the safetensors
    checkpoints). Q8_0 experts (and gpt-oss's MXFP4, as OpenAI ships them) run as stored (the
    model holds them quantized), against transformers on the values gguf dequantizes them to.
    gpt-oss's file is written as llama.cpp's: the sinks, biased experts, YaRN and the window in
    its metadata, the clamp (7) acting (``tiny_models.GPT_OSS_GGUF_MLP_INPUT_SCALE``)."""
    path, hf = moe_gguf(arch, experts)
    loaded = load(path)
    assert loaded.config.moe is not None and loaded.config.architecture == type(hf).__name__
    assert loaded.model.quantized() == (experts != "F32")
    batch, logits = our_logits(path)
    exact = hf_logits_float64(hf, batch)
    # fp32 round-off grows with the activations (gpt-oss's clamp-acting file carries hidden states
    # near 200, where transformers' own fp32 run is 8e-5 from float64): within 1e-4 of the exact
    # logits, or 3x transformers' own fp32 error where that is larger.
    atol = max(1e-4, 3 * (hf_logits(hf, batch) - exact).abs().max().item())
    torch.testing.assert_close(logits, exact, atol=atol, rtol=0)


def hf_logits_float64(hf, batch) -> torch.Tensor:
    """transformers' logits computed in float64 (its experts looped, as grouped_mm has no float64
    kernel): the exact answer for these weights, as float32."""
    exact = copy.deepcopy(hf).double()
    exact.config._experts_implementation = "eager"
    with torch.no_grad():
        return torch.cat([exact(torch.tensor([p])).logits[0] for p in batch]).float()


@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral"])
def test_q8_0_experts_decode_as_transformers_greedy_alone_and_batched(moe_gguf, arch, kernels):
    """Decode steps (one token a sequence: a request alone, then several at once) through the
    experts as stored: the compiled path runs each layer's chosen experts in one call
    (kernels/csrc/moe.cpp), the PyTorch path loops; both greedy = transformers on the values gguf
    dequantizes them to."""
    path, hf = moe_gguf(arch, "Q8_0")
    llm = LLM(str(path), block_size=8, num_blocks=128)
    batch = prompts(llm.loaded.config.vocab_size, seed=3)[:3]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate(batch[:1], params)
    together = llm.generate(batch, params)
    refs = [hf_greedy(hf, p, 12) for p in batch]
    assert_greedy_matches([o.token_ids for o in alone], refs[:1])
    assert_greedy_matches([o.token_ids for o in together], refs)


@pytest.mark.parametrize("arch", [a for a in MOE_ARCHS if a in GGUF_ARCHS])
def test_moe_gguf_files_carry_their_tokenizer(moe_gguf, arch):
    """The tokenizer is built from the file's metadata for every family (OLMoE's too, whose
    GGUF config transformers does not read)."""
    tokenizer = load(moe_gguf(arch)[0]).tokenizer
    assert tokenizer.decode(tokenizer.encode("tea at ten")) == "tea at ten"


def write_refused(path, arch: str, tensors: dict[str, tuple[int, ...]]) -> None:
    """A GGUF of ``arch`` with two experts' metadata and these float tensors (zeros)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", 1), ("embedding_length", 64), ("feed_forward_length", 32)):
        writer.add_uint32(f"{arch}.{key}", value)
    for key, value in (("context_length", 64), ("attention.head_count", 4), ("expert_count", 2)):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_uint32(f"{arch}.expert_used_count", 1)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    for name, shape in {"token_embd.weight": (8, 64), **tensors}.items():
        writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    "arch, tensors, named",
    [
        ("deepseek2", {}, ["'deepseek2'", "qwen3moe", "olmoe", "gpt-oss"]),
        # experts one tensor each: the layout llama.cpp wrote before it stacked them
        (
            "llama",
            {"blk.0.ffn_gate_inp.weight": (2, 64), "blk.0.ffn_gate.0.weight": (32, 64)},
            ["llama", "'blk.0.ffn_gate.0.weight'", "ffn_gate_exps"],
        ),
    ],
    ids=["deepseek2", "per-expert-tensors"],
)
def test_a_moe_gguf_we_do_not_read_is_refused_naming_it(tmp_path, monkeypatch, arch, tensors, named):
    monkeypatch.setattr(gguf_convert, "_save_tokenizer", lambda *a: None)
    path = tmp_path / "refused.gguf"
    write_refused(path, arch, tensors)
    (tmp_path / "out").mkdir()
    with pytest.raises(UnsupportedModelError) as e:
        gguf_convert.convert(path, tmp_path / "out")
    for text in named:
        assert text in str(e.value)
