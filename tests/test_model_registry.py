"""The family registry: a family is one folder and one line, and what each spec says matches what
transformers and the ``gguf`` package (the oracles) say of the same architecture."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import transformers
from tiny_models import ARCHS, COMMON, build_hf_model

from pagedllm.config import ModelConfig
from pagedllm.errors import UnsupportedModelError
from pagedllm.models.registry import FAMILIES, family, family_of_config, family_of_gguf

MODELS = Path(__file__).resolve().parents[1] / "pagedllm" / "models"


def test_each_family_folder_is_registered_once():
    folders = sorted(p.parent.name for p in MODELS.glob("*/spec.py"))
    registered = sorted(_folder_of(f.architecture) for f in FAMILIES)
    assert folders == registered
    assert len({f.architecture for f in FAMILIES}) == len(FAMILIES)


def _folder_of(architecture: str) -> str:
    """The folder whose spec.py defines the family (the registry imported every one)."""
    import sys

    for name, module in sys.modules.items():
        spec = name.startswith("pagedllm.models.") and name.endswith(".spec")
        if spec and module.FAMILY.architecture == architecture:
            return name.split(".")[2]
    raise AssertionError(f"no spec module holds {architecture}")


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.model_type)
def test_a_spec_names_what_transformers_names(fam):
    """Its architecture is a transformers model class whose config's model_type is the spec's,
    and a config.json naming only that model_type reads as the family."""
    model_class = getattr(transformers, fam.architecture)
    assert model_class.config_class.model_type == fam.model_type
    assert family_of_config({"model_type": fam.model_type}) is fam
    if fam.gguf_architecture is not None:
        assert fam.gguf_architecture in gguf.MODEL_ARCH_NAMES.values()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_checkpoint_tensor_of_a_tiny_model_has_a_role(arch, tmp_path):
    """The spec's role names cover exactly the tensors transformers saves for the family (the
    lm_head of a tied model aside; fused experts as the spec splits them): none left unread,
    none asked for that is not there."""
    import torch
    from safetensors import safe_open

    from pagedllm.backends import get
    from pagedllm.models import DecoderLM

    model = build_hf_model(arch)
    model.save_pretrained(tmp_path)  # transformers 5 fuses experts in memory, names each on disk
    cfg = ModelConfig.from_file(tmp_path)
    with torch.device("meta"):
        ours = set(DecoderLM(cfg, get()).checkpoint_slots())
    theirs = set()
    for f in tmp_path.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for name in st.keys():  # gpt-oss's fused experts: the names they are read as, per expert
                parts = cfg.family.unfuse(name, st.get_tensor(name), cfg) if cfg.family.unfuse else None
                theirs |= {part for part, _ in parts} if parts is not None else {name}
    theirs -= {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    assert ours == theirs


def test_a_gguf_architecture_shared_by_two_families_is_told_apart_by_its_experts():
    assert family_of_gguf("llama", has_experts=False, source="f").architecture == "LlamaForCausalLM"
    assert family_of_gguf("llama", has_experts=True, source="f").architecture == "MixtralForCausalLM"
    assert family_of_gguf("qwen3moe", has_experts=True, source="f") is family("Qwen3MoeForCausalLM")


def test_an_unknown_architecture_is_refused_naming_every_supported_one():
    with pytest.raises(UnsupportedModelError) as e:
        ModelConfig.from_hf_dict({**COMMON, "architectures": ["GemmaForCausalLM"]}, source="x/config.json")
    assert "GemmaForCausalLM" in str(e.value)
    assert all(f.architecture in str(e.value) for f in FAMILIES)
    with pytest.raises(UnsupportedModelError, match="'deepseek2'.*gpt-oss.*llama"):
        family_of_gguf("deepseek2", has_experts=True, source="x.gguf")
