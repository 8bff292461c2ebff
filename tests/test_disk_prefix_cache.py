"""The prefix cache's disk tier (``engine.disk_prefix_cache``): a prompt's blocks written once are
read back by a later engine (a restart) with the tokens an engine without any cache gives; a
file that is torn, corrupt or another model's is never used; the directory stays within its
budget; the files are named by a hash any process computes the same way."""

import hashlib
import os
import struct
import zlib
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
BLOCK = 8
SIZES = dict(block_size=BLOCK, num_blocks=64, max_batch_tokens=64, max_model_len=256)


def prompt_of(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (length,), generator=g).tolist()


def reusable(prompt: list[int]) -> int:
    """Blocks a cache can serve: every full block but the one holding the last token (its
    logits are needed, so it is always computed)."""
    return (len(prompt) - 1) // BLOCK


def entries(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.kv"))


def fresh(model, directory, **options) -> LLM:
    """An engine as a restarted process makes one: nothing in its pool, only the directory."""
    return LLM(model, prefix_cache_dir=str(directory), **{**SIZES, **options})


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return tiny_checkpoints["qwen3"][0]


@pytest.fixture(scope="module")
def plain(model):
    return LLM(model, enable_prefix_caching=False, **SIZES)


def run_and_close(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    """Each prompt's tokens; then ``llm`` is closed: its queued blocks are on disk, as at a
    process's exit."""
    out = [o.token_ids for o in llm.generate(prompts, params)]
    llm.close()
    return out


def test_a_restarted_engine_reads_the_prompt_back_and_gives_the_same_tokens(model, plain, tmp_path):
    prompts = [prompt_of(61, seed=1), prompt_of(45, seed=2)]
    expected = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    assert run_and_close(fresh(model, tmp_path), prompts) == expected
    # every full block of prompt and output is written (the outputs' blocks serve the next turn)
    assert len(entries(tmp_path)) == sum((len(p) + GREEDY.max_tokens - 1) // BLOCK for p in prompts)
    second = fresh(model, tmp_path)
    got = [o.token_ids for o in second.generate(prompts, GREEDY)]
    assert got == expected
    hit = sum(reusable(p) for p in prompts)
    assert second.stats.prefix_disk_hit_blocks == hit
    assert second.stats.prefix_cache_hit_tokens == hit * BLOCK
    assert second.stats.prompt_tokens_computed == sum(len(p) for p in prompts) - hit * BLOCK


def test_seeded_sampling_and_several_samples_are_the_same_after_a_restart(model, plain, tmp_path):
    prompt = prompt_of(50, seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=7, n=3)
    expected = [o.token_ids for o in plain.generate([prompt], params)[0].outputs]
    run_and_close(fresh(model, tmp_path), [prompt])
    second = fresh(model, tmp_path)
    got = [o.token_ids for o in second.generate([prompt], params)[0].outputs]
    assert got == expected and second.stats.prefix_disk_hit_blocks == reusable(prompt)


def test_a_partial_hit_reads_only_the_shared_blocks(model, plain, tmp_path):
    shared = prompt_of(3 * BLOCK + 5, seed=4)
    run_and_close(fresh(model, tmp_path), [shared])
    other = shared[: 3 * BLOCK] + prompt_of(20, seed=5)  # diverges at the 4th block
    second = fresh(model, tmp_path)
    assert second.generate([other], GREEDY)[0].token_ids == plain.generate([other], GREEDY)[0].token_ids
    assert second.stats.prefix_disk_hit_blocks == 3


def test_blocks_evicted_from_the_pool_come_back_from_disk_in_the_same_process(model, plain, tmp_path):
    prompts = [prompt_of(60, seed=10 + i) for i in range(6)]  # 42 blocks: more than a 24-block pool keeps
    expected = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    llm = fresh(model, tmp_path, num_blocks=24, max_model_len=128)
    assert [llm.generate([p], GREEDY)[0].token_ids for p in prompts] == expected
    llm.engine.blocks.disk.flush()
    assert [llm.generate([p], GREEDY)[0].token_ids for p in prompts] == expected
    assert llm.stats.prefix_cache_evictions > 0 and llm.stats.prefix_disk_hit_blocks >= reusable(prompts[0])


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_an_8_bit_cache_is_kept_with_its_scales(model, tmp_path, kv):
    prompt = prompt_of(57, seed=6)
    expected = LLM(model, enable_prefix_caching=False, kv_cache_dtype=kv, **SIZES).generate([prompt], GREEDY)
    run_and_close(fresh(model, tmp_path, kv_cache_dtype=kv), [prompt])
    second = fresh(model, tmp_path, kv_cache_dtype=kv)
    assert second.generate([prompt], GREEDY)[0].token_ids == expected[0].token_ids
    assert second.stats.prefix_disk_hit_blocks == reusable(prompt)


def block_files(directory: Path, prompt: list[int]) -> list[Path]:
    """The files of the prompt's blocks, in order: named by the chain hash, computed here."""
    parent, files = b"", []
    for i in range(reusable(prompt)):
        chunk = prompt[i * BLOCK : (i + 1) * BLOCK]
        parent = hashlib.blake2b(parent + struct.pack(f"<{BLOCK}q", *chunk), digest_size=16).digest()
        found = list(directory.rglob(parent.hex() + ".kv"))
        assert len(found) == 1, f"block {i}: no file named by its chain hash"
        files.append(found[0])
    return files


def test_files_are_named_by_a_hash_of_the_tokens_that_any_process_computes(model, tmp_path):
    prompt = prompt_of(40, seed=8)
    run_and_close(fresh(model, tmp_path), [prompt])
    assert len(block_files(tmp_path, prompt)) == reusable(prompt)


def test_a_queued_request_has_its_chain_read_ahead_up_to_the_first_missing_file(model, tmp_path, monkeypatch):
    prompt = prompt_of(60, seed=15)
    run_and_close(fresh(model, tmp_path), [prompt])
    files = block_files(tmp_path, prompt)
    files[4].unlink()
    advised = []
    real = os.posix_fadvise

    def advise(fd, offset, length, advice):
        advised.append((Path(os.readlink(f"/proc/self/fd/{fd}")), advice))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", advise)
    second = fresh(model, tmp_path)
    second.generate([prompt], GREEDY)
    second.engine.blocks.disk.flush()
    assert advised[:4] == [(f, os.POSIX_FADV_WILLNEED) for f in files[:4]] and len(advised) == 4
    assert second.stats.prefix_disk_hit_blocks == 4


@pytest.mark.parametrize("damage", ["flip a payload byte", "truncate", "empty", "another block's bytes"])
def test_a_damaged_file_is_deleted_and_recomputed_never_used(model, plain, tmp_path, damage):
    prompt = prompt_of(60, seed=9)
    run_and_close(fresh(model, tmp_path), [prompt])
    files = block_files(tmp_path, prompt)
    bad = files[2]
    data = bytearray(bad.read_bytes())
    if damage == "flip a payload byte":
        data[-100] ^= 0x40
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(files[3].read_bytes())  # checksummed, but the entry of another hash
    bad.write_bytes(bytes(data))
    second = fresh(model, tmp_path)
    assert second.generate([prompt], GREEDY)[0].token_ids == plain.generate([prompt], GREEDY)[0].token_ids
    assert second.stats.prefix_disk_hit_blocks == 2 and second.stats.prefix_disk_corrupt == 1
    assert second.stats.prompt_tokens_computed == len(prompt) - 2 * BLOCK
    second.close()
    assert bad.is_file()  # deleted, then written again when computed again
    assert zlib.crc32(bad.read_bytes()[36:]) == struct.unpack_from("<4sIQI", bad.read_bytes())[3]


def test_a_write_cut_short_leaves_no_entry_that_is_read(model, plain, tmp_path):
    prompt = prompt_of(33, seed=11)
    run_and_close(fresh(model, tmp_path), [prompt])
    for f in block_files(tmp_path, prompt):  # as if each had died mid-write: the temporary left
        os.replace(f, f.with_name(f.name + ".123.tmp"))
    second = fresh(model, tmp_path)
    assert second.generate([prompt], GREEDY)[0].token_ids == plain.generate([prompt], GREEDY)[0].token_ids
    assert second.stats.prefix_disk_hit_blocks == 0


@pytest.mark.parametrize(
    "first, then",
    [
        ({}, dict(dtype="bfloat16")),
        (dict(kv_cache_dtype="int8"), dict(kv_cache_dtype="fp8")),  # blocks of the same bytes
        ({}, dict(block_size=16)),
        ({}, dict(quantization="int8")),
    ],
)
def test_another_setting_never_reads_the_blocks(model, tmp_path, first, then):
    prompt = prompt_of(60, seed=12)
    run_and_close(fresh(model, tmp_path, **first), [prompt])
    other = fresh(model, tmp_path, **then)
    other.generate([prompt], GREEDY)
    assert other.stats.prefix_disk_hit_blocks == 0


def test_another_model_never_reads_the_blocks(tiny_checkpoints, model, tmp_path):
    prompt = prompt_of(60, seed=13)
    run_and_close(fresh(model, tmp_path), [prompt])
    other = fresh(tiny_checkpoints["llama"][0], tmp_path)
    other.generate([prompt], GREEDY)
    assert other.stats.prefix_disk_hit_blocks == 0


def test_the_directory_stays_within_its_budget_least_recently_used_out(model, tmp_path):
    llm = fresh(model, tmp_path)
    entry = llm.engine.blocks.disk.entry_bytes
    llm.close()
    budget = 20 * entry  # 20 blocks; the stream below writes 8 per prompt
    llm = fresh(model, tmp_path, prefix_cache_disk=budget)
    keep = prompt_of(57, seed=100)  # 7 reusable blocks, used again between the others
    for i in range(12):
        llm.generate([prompt_of(57, seed=200 + i)], GREEDY)
        llm.generate([keep], GREEDY)
        llm.engine.blocks.disk.flush()
        assert sum(f.stat().st_size for f in entries(tmp_path)) <= budget
    llm.close()
    assert llm.engine.blocks.disk.stats.evicted > 0
    assert sum(f.stat().st_size for f in entries(tmp_path)) == fresh(model, tmp_path).stats.prefix_disk_bytes
    second = fresh(model, tmp_path, prefix_cache_disk=budget)
    second.generate([keep], GREEDY)
    assert second.stats.prefix_disk_hit_blocks == reusable(keep)  # the one kept in use stayed


def test_eviction_takes_a_chain_from_its_tail_so_its_head_still_hits(model, tmp_path):
    llm = fresh(model, tmp_path)
    entry = llm.engine.blocks.disk.entry_bytes
    llm.close()
    older, newer = prompt_of(57, seed=300), prompt_of(57, seed=301)  # 8 blocks written each
    llm = fresh(model, tmp_path, prefix_cache_disk=12 * entry)  # 16 > 12: down to 10 (90%)
    llm.generate([older], GREEDY)
    llm.engine.blocks.disk.flush()
    run_and_close(llm, [newer])
    assert llm.engine.blocks.disk.stats.evicted == 6 and len(entries(tmp_path)) == 10  # (the writer's own count)
    again = fresh(model, tmp_path, prefix_cache_disk=12 * entry)
    again.generate([older], GREEDY)
    assert again.stats.prefix_disk_hit_blocks == 2  # its first two blocks: the last of it evicted


def test_two_engines_sharing_a_directory_count_each_file_once(model, plain, tmp_path):
    prompt = prompt_of(49, seed=14)
    a, b = fresh(model, tmp_path), fresh(model, tmp_path)
    a.generate([prompt], GREEDY)
    b.generate([prompt], GREEDY)
    a.close()
    b.close()
    files = entries(tmp_path)
    assert len(files) == (len(prompt) + GREEDY.max_tokens - 1) // BLOCK
    c = fresh(model, tmp_path)
    assert c.stats.prefix_disk_bytes == sum(f.stat().st_size for f in files)
    assert c.generate([prompt], GREEDY)[0].token_ids == plain.generate([prompt], GREEDY)[0].token_ids


def test_a_model_with_window_layers_is_refused_with_the_reason(tiny_checkpoints, tmp_path):
    from pagedllm.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="full attention only"):
        LLM(tiny_checkpoints["gemma3"][0], prefix_cache_dir=str(tmp_path), **SIZES)


@pytest.mark.parametrize(
    "options, field",
    [
        (dict(prefix_cache_dir="d", prefix_cache_disk="lots"), "prefix_cache_disk"),
        (dict(prefix_cache_dir="d", enable_prefix_caching=False), "prefix_cache_dir"),
        (dict(prefix_cache_dir="d", tensor_parallel_size=2), "prefix_cache_dir"),
    ],
)
def test_settings_that_cannot_work_are_refused_by_name(options, field):
    from pagedllm.engine_config import ConfigError, EngineConfig

    with pytest.raises(ConfigError) as e:
        EngineConfig(**options)
    assert e.value.field == field
