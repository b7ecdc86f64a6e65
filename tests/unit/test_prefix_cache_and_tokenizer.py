"""The OpenVINO engine's prefix cache tally, the tokenizer requests (vLLM's /tokenize, /detokenize)
as typed and answered in the worker, and log probability entries' token texts and bytes."""

from __future__ import annotations

import json

import pytest

from inference_service.contracts.outputs import TokenLogprob
from inference_service.contracts.sampling import InvalidRequest
from inference_service.contracts.tokenizer import DetokenizeRequest, TokenizeRequest, parse_tokenizer_request
from inference_service.llm.engine_protocol import SampledLogprob
from inference_service.llm.logprobs import TokenTexts, held_messages
from inference_service.llm.prefix_cache import PrefixCacheTally
from inference_service.llm.tokenize import answer


def test_the_tally_finds_whole_blocks_then_one_part_filled_block():
    tally = PrefixCacheTally(capacity_blocks=100, block_tokens=4)
    system = list(range(100, 110))  # 2 whole blocks and 2 tokens
    assert tally.lookup(system + [1, 2]) == 0  # an empty cache
    tally.remember(system + [1, 2])  # finished: blocks [100..103], [104..107], [108, 109, 1, 2]
    assert tally.lookup(system + [7, 8, 9]) == 8  # [108, 109, 7, 8] is not [108, 109, 1, 2]
    assert tally.lookup(system[:6]) == 4  # a whole block, then nothing of the part-filled [104, 105]
    tally.remember(system[:6])  # leaves the part-filled block [104, 105]
    assert tally.lookup(system[:6] + [5]) == 6
    assert tally.lookup(system + [1, 2]) == 11  # found whole: its last token is computed all the same
    assert (tally.queries, tally.hits) == (12 + 13 + 6 + 7 + 12, 0 + 8 + 4 + 6 + 11)


def test_the_tally_forgets_the_least_recently_used_blocks_past_its_capacity():
    tally = PrefixCacheTally(capacity_blocks=3, block_tokens=2)
    tally.remember([1, 2, 3, 4])  # 2 blocks
    tally.remember([9, 9, 8, 8])  # 2 more: the oldest, [1, 2], goes
    assert len(tally) == 3
    assert tally.lookup([1, 2, 3, 4, 5]) == 0  # its first block is gone, so is the prefix
    assert tally.lookup([9, 9, 8, 8, 7]) == 4


def test_tokenizer_requests_are_typed_and_checked():
    chat = TokenizeRequest.build({"messages": [{"role": "developer", "content": "be brief"}],
                                  "return_token_strs": True})
    assert (chat.add_special_tokens, chat.add_generation_prompt, chat.return_token_strs) == (False, True, True)
    assert chat.messages == ({"role": "system", "content": "be brief"},)
    assert parse_tokenizer_request(chat.to_body()) == chat
    plain = TokenizeRequest.build({"prompt": "hi"})
    assert plain.add_special_tokens and parse_tokenizer_request(json.loads(plain.to_body())) == plain
    assert parse_tokenizer_request(DetokenizeRequest((1, 2)).to_body()) == DetokenizeRequest((1, 2))
    for other in (b'{"prompt": "tokenize"}', b"tokenize me", {"prompt": "x"}, {"tokenize": "x"}, b'{"tokenize": 1'):
        assert parse_tokenizer_request(other) is None
    for values, field, message in (
            ({"tokens": [1, -1]}, "tokens", "'tokens' entries must be token ids"),
            ({"tokens": "1 2"}, "tokens", "'tokens' must be a list"),
            ({"tokens": [True]}, "tokens", "'tokens' entries must be token ids")):
        with pytest.raises(InvalidRequest) as err:
            DetokenizeRequest.build(values)
        assert err.value.field == field and str(err.value).startswith(message)
    with pytest.raises(InvalidRequest, match="exactly one of 'prompt' and 'messages'"):
        TokenizeRequest.build({})
    with pytest.raises(InvalidRequest) as err:
        TokenizeRequest.build({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True,
                               "add_generation_prompt": True})
    assert err.value.field == "continue_final_message"
    with pytest.raises(InvalidRequest) as err:
        TokenizeRequest.build({"prompt": "x", "add_special_tokens": "yes"})
    assert err.value.field == "add_special_tokens"


@pytest.fixture(scope="module")
def byte_level():
    """A tiny byte-level BPE tokenizer (GPT-2's alphabet, no merges) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from inference_service.llm.logprobs import _byte_of_character

    vocab = {character: i for i, character in enumerate(sorted(_byte_of_character(), key=_byte_of_character().get))}
    vocab["<eos>"] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>")
    tokenizer.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}" \
                              "{% if add_generation_prompt %}<assistant>{% endif %}"
    return tokenizer


def test_token_texts_are_the_tokens_own_bytes(byte_level):
    texts = TokenTexts(byte_level)
    ids = byte_level("é!")["input_ids"]  # é is two bytes, two tokens of this vocabulary
    assert len(ids) == 3 and [texts.text(i)[1] for i in ids] == [(0xC3,), (0xA9,), (ord("!"),)]
    assert texts.text(ids[0])[0] == "\ufffd" and texts.text(ids[2]) == ("!", (33,))
    entries = texts.entries([SampledLogprob(ids[2], -0.1, ((ids[2], -0.1), (ids[0], -3.0)))])
    assert entries[0].token == "!" and [t.bytes for t in entries[0].top_logprobs] == [(33,), (0xC3,)]
    piece = texts.piece("!", [SampledLogprob(ids[2], -0.1)])
    assert piece == {"text": "!", "logprobs": [{"token": "!", "logprob": -0.1, "bytes": [33], "top_logprobs": []}]}
    assert texts.piece("", []) is None
    assert held_messages(["a", piece]) == ("a!", [TokenLogprob("!", -0.1, (33,))])


def test_the_handler_answers_tokenizer_requests_in_vllms_shapes(byte_level):
    got = answer(byte_level, TokenizeRequest.build({"prompt": "hi", "return_token_strs": True}), 2048)
    assert got == {"count": 2, "max_model_len": 2048, "tokens": byte_level("hi")["input_ids"],
                   "token_strs": ["h", "i"]}
    chat = answer(byte_level, TokenizeRequest.build({"messages": [{"role": "user", "content": "yo"}]}), None)
    assert byte_level.decode(chat["tokens"]) == "<user>yo<assistant>" and chat["token_strs"] is None
    assert answer(byte_level, DetokenizeRequest(tuple(chat["tokens"])), None) == {"prompt": "<user>yo<assistant>"}
    with pytest.raises(InvalidRequest) as err:
        answer(byte_level, DetokenizeRequest((len(byte_level) + 5,)), None)
    assert err.value.field == "tokens" and "outside the vocabulary" in str(err.value)
