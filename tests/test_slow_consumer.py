"""A consumer slower than the engine: generation does not wait for it, and what waits for it is
bounded (one merged output per sample), while the text it finally reads is exact."""

import asyncio

import pytest

from pagedllm import SamplingParams
from pagedllm.engine_process.engine_thread import AsyncEngine
from pagedllm.outputs import RequestOutput
from pagedllm.server.mailbox import Mailbox


def test_unread_outputs_merge_into_one_per_sample():
    async def main():
        box = Mailbox()
        for step in range(1000):
            for index in range(3):
                box.put(
                    RequestOutput(
                        "r", [], f"{step}" * 1, [step], False, None, delta_text=f"{index}:{step} ", index=index
                    )
                )
        got = [await box.get() for _ in range(3)]
        return box, got

    box, got = asyncio.run(main())
    assert box.most_unread == 3 and len(box) == 0
    for out in got:
        assert out.delta_text == "".join(f"{out.index}:{s} " for s in range(1000))
        assert out.token_ids == [999]


@pytest.mark.slow  # loads the default model
def test_a_reader_that_stalls_gets_the_whole_text_in_few_pieces(default_llm):
    engine = AsyncEngine(default_llm.engine)
    engine.start()
    prompt = default_llm.apply_chat_template([{"role": "user", "content": "Tell me a long story about a fox."}])
    params = SamplingParams(max_tokens=60, temperature=0.8, seed=3, n=2, ignore_eos=True)

    async def read(rid: str, stall: bool):
        box = engine.add(rid, prompt, params, Mailbox())
        pieces = {0: [], 1: []}
        finals = {}
        first = await box.get()
        pieces[first.index].append(first.delta_text)
        if stall:  # the client stops reading; the engine goes on to the end
            while engine.num_unfinished:  # 0 once the last outputs are in the mailbox
                await asyncio.sleep(0.01)
        while len(finals) < 2:
            out = await box.get()
            pieces[out.index].append(out.delta_text)
            if out.finished:
                finals[out.index] = out
        return box, pieces, finals

    try:
        fast_box, fast_pieces, fast = asyncio.run(read("fast", stall=False))
        slow_box, slow_pieces, slow = asyncio.run(read("slow", stall=True))
    finally:
        engine.stop()
    for i in (0, 1):
        assert "".join(slow_pieces[i]) == slow[i].text == fast[i].text == "".join(fast_pieces[i])
        assert len(slow[i].token_ids) == 60
    assert fast[0].text != fast[1].text
    # the stalled reader found one merged output per sample waiting: its first piece, then one each
    assert slow_box.most_unread == 2 and sum(len(p) for p in slow_pieces.values()) == 3
    assert sum(len(p) for p in fast_pieces.values()) > 20
