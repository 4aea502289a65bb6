"""Streamed text is exactly the final text, also where one character spans several byte-level tokens.

Unit level: `TextStream` on scripted token streams from the demo model's tokenizer. End to end: a tiny
model whose weights force greedy decoding to emit multi-byte characters token by token, through
`stream_text` and `mtp-jax generate --stream`.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer

from mtp_jax.checkpoints.pretrained import DEFAULT_MODEL_DIR, save_pretrained
from mtp_jax.cli import main
from mtp_jax.config import ModelConfig
from mtp_jax.decode.generation import generate
from mtp_jax.decode.text import TextStream, stream_text
from mtp_jax.model import init_model

TEXT = "héllo 日本語 ✓ 🙂 naïve €5"
FORCED = "é日✓🙂"  # what the forced model continues "h" with: 12 tokens, none of them a whole character


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))


def _feed(tokenizer, ids, sizes):
    text, pieces, start = TextStream(tokenizer), [], 0
    for size in sizes:
        pieces.append(text.push(ids[start : start + size]))
        start += size
    assert start == len(ids)
    return pieces, text.finish()


def test_one_token_at_a_time_holds_back_partial_characters(tokenizer):
    ids = tokenizer.encode(TEXT).ids
    assert len(ids) > len(TEXT.split())  # the multi-byte characters are split over several tokens
    pieces, rest = _feed(tokenizer, ids, [1] * len(ids))
    assert "".join(pieces) == TEXT and rest == ""
    assert not any("\ufffd" in p for p in pieces)
    # "日" is three byte tokens: the first two complete nothing, the third yields the character.
    first = ids.index(tokenizer.encode(" 日").ids[1])
    assert pieces[first : first + 3] == ["", "", "日"]


@pytest.mark.parametrize("sizes", [[2, 5, 1, 3, 7, 100], [4] * 30, [0, 1, 0, 2, 0, 3] * 20])
def test_uneven_blocks_give_the_same_text(tokenizer, sizes):
    ids = tokenizer.encode(TEXT).ids
    cut = np.cumsum(sizes)
    sizes = [s for s, c in zip(sizes, cut, strict=True) if c - s < len(ids)]
    sizes[-1] = len(ids) - sum(sizes[:-1])
    pieces, rest = _feed(tokenizer, ids, sizes)
    assert "".join(pieces) + rest == TEXT and rest == ""
    assert not any("\ufffd" in p for p in pieces)


def test_incomplete_character_at_the_end_is_flushed_as_decode_does(tokenizer):
    ids = tokenizer.encode("ab日").ids[:-1]  # the last byte of 日 never comes
    pieces, rest = _feed(tokenizer, ids, [1] * len(ids))
    assert "".join(pieces) == "ab" and rest == "\ufffd"
    assert "".join(pieces) + rest == tokenizer.decode(ids)


def test_special_tokens_are_skipped_as_decode_skips_them(tokenizer):
    ids = tokenizer.encode("x ✓").ids + [0] + tokenizer.encode("y").ids  # 0 = <|endoftext|>
    pieces, rest = _feed(tokenizer, ids, [1] * len(ids))
    assert "".join(pieces) + rest == tokenizer.decode(ids) == "x ✓y"


def _forced_model(tokenizer, chain):
    """Greedy decoding after chain[i] emits chain[i + 1]: every block adds nothing to the residual stream
    (zero output projections), token chain[i] embeds as unit vector i, and the head maps unit i to chain[i + 1]."""
    config = ModelConfig.from_name(
        "tiny", vocab_size=tokenizer.get_vocab_size(), num_hidden_layers=1, max_position_embeddings=64, eos_token_id=0
    )
    model = init_model(config, seed=0)
    for layer in model.layers:
        layer.self_attn.o_proj.kernel[...] = 0.0
        layer.mlp.down_proj.kernel[...] = 0.0
    embedding = np.zeros(model.embed_tokens.embedding.shape, np.float32)  # [V, E]
    head = np.zeros(model.lm_head.kernel.shape, np.float32)  # [E, V]
    for i, (token, following) in enumerate(zip(chain[:-1], chain[1:], strict=True)):
        embedding[token, i] = 1.0
        head[i, following] = 10.0
    model.embed_tokens.embedding[...] = jnp.asarray(embedding)
    model.lm_head.kernel[...] = jnp.asarray(head)
    return model


@pytest.fixture(scope="module")
def forced(tokenizer):
    prompt = tokenizer.encode("h").ids
    emitted = [tokenizer.token_to_id(t) for t in ("Ã", "©", "æ", "Ĺ", "¥", "â", "ľ", "ĵ", "ð", "Ł", "Ļ", "Ĥ")]
    assert tokenizer.decode(emitted) == FORCED
    chain = prompt + emitted + [0]  # then <|endoftext|>, the model's EOS
    assert len(set(chain)) == len(chain)
    return _forced_model(tokenizer, chain), emitted


def test_forced_model_emits_the_split_characters(forced):
    model, emitted = forced
    result = generate(model, [[72]], max_new_tokens=20, max_length=32)
    assert result.tokens == [emitted + [0]] and result.finish_reasons == ["stop"]


def test_stream_text_is_the_final_text_character_by_character(forced, tokenizer):
    model, _ = forced
    pieces = list(stream_text(model, tokenizer, "h", max_new_tokens=20, max_length=32))
    assert pieces == ["é", "日", "✓", "🙂"]  # one token per step; each character appears once it is complete
    cut = list(stream_text(model, tokenizer, "h", max_new_tokens=4, max_length=32))  # stops inside 日
    assert "".join(cut) == tokenizer.decode(forced[1][:4]) == "é\ufffd"
    with pytest.raises(TypeError, match="prompt must be a str"):
        next(stream_text(model, tokenizer, [72]))


def test_cli_stream_prints_exactly_the_final_text(forced, tokenizer, tmp_path, capsys):
    save_pretrained(forced[0], tmp_path / "forced", tokenizer=tokenizer)
    argv = [
        "generate",
        "--model",
        str(tmp_path / "forced"),
        "--prompt",
        "h",
        "--max-new-tokens",
        "20",
        "--max-length",
        "32",
        "--no-compilation-cache",
    ]
    assert main(argv + ["--stream"]) == 0
    streamed = capsys.readouterr().out
    assert streamed == "h" + FORCED + "\n"
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines()[1:] == ["h" + FORCED]
