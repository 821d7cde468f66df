"""Streaming detokenization and stop words with SmolLM2's own tokenizer."""
import copy

import numpy as np
import random

import pytest

from simple_sampler.schema import InvalidRequest
from simple_sampler.serving.text import REPLACEMENT_CHARACTER, StopMatcher, TextCodec

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing spaces  ",
    "北京是中国的首都，上海是最大的城市。",
    "Emoji: 🦊🚀👩‍👩‍👧 and flags 🇫🇷🇯🇵 in a row",
    "Accented: crème brûlée, naïve café, Ærøskøbing, Dvořák, Łódź",
    "Mixed 日本語 text with ümlauts and ∑ math ∫ symbols → arrows",
    "def f(x):\n    return x ** 2  # squares\n\n\ttabbed",
]


@pytest.fixture(scope="module")
def native_codec():
    return TextCodec.from_source()


@pytest.fixture(scope="module", params=["native", "python"])
def codec(request, native_codec):
    """Both decode paths: the Rust tokenizer called directly (DecodeStream),
    and transformers' decode, which tokenizers with a space clean-up take."""
    if request.param == "native":
        return native_codec
    codec = TextCodec(native_codec.tokenizer)
    codec.backend = codec._backend_decode = None
    return codec


def stream(codec, prompt_ids, output_ids, chunk=1):
    detokenizer = codec.detokenizer(prompt_ids)
    deltas = [detokenizer.push(output_ids[i:i + chunk]) for i in range(0, len(output_ids), chunk)]
    deltas.append(detokenizer.flush())
    return deltas


@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_text_equals_one_shot_decode(codec, chunk):
    prompt_ids = codec.encode("Say something:")
    for text in TEXTS:
        output_ids = codec.tokenizer(text, add_special_tokens=False)["input_ids"]
        deltas = stream(codec, prompt_ids, output_ids, chunk)
        assert "".join(deltas) == codec.decode(output_ids) == text
        # Nothing half-decoded ever goes out: no delta carries U+FFFD.
        assert not any(REPLACEMENT_CHARACTER in delta for delta in deltas)


@pytest.mark.parametrize("chunk", [1, 3])
def test_special_tokens_text_is_streamed_only_when_asked(codec, chunk):
    """special (vLLM's skip_special_tokens false): the stream's text is the
    one-shot decode that keeps special tokens; by default both skip them."""
    ids = [*codec.tokenize("Paris.", False), codec.end_id, 1, *codec.tokenize("assistant", False)]
    prompt_ids = codec.encode("Capital?", chat=True)
    for special, expected in ((False, "Paris.assistant"), (True, "Paris.<|im_end|><|im_start|>assistant")):
        detokenizer = codec.detokenizer(prompt_ids, special)
        deltas = [detokenizer.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
        assert "".join(deltas) + detokenizer.flush() == codec.decode(ids, special) == expected


def test_a_simulated_codecs_stream_keeps_special_tokens_when_asked(native_codec):
    from simple_sampler.serving.simulated_text import SimulatedCodec

    codec = SimulatedCodec(native_codec.tokenizer)
    ids = [*codec.tokenize("Paris", False), codec.end_id, 60000]
    for special, expected in ((False, "Paris t60000"), (True, "Paris<|im_end|> t60000")):
        detokenizer = codec.detokenizer([], special)
        text = "".join(detokenizer.push_token(t) for t in ids) + detokenizer.flush()
        assert text == codec.decode(ids, special) == expected


def test_multi_byte_characters_are_held_until_complete(codec):
    ids = codec.tokenizer("🦊", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1  # the fox spans several byte tokens
    deltas = stream(codec, [], ids)
    assert deltas[:-2] == [""] * (len(ids) - 1) and deltas[-2] == "🦊"


def test_random_ids_stream_like_one_shot_decode(codec):
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.integers(0, 49152, size=40).tolist()
        assert "".join(stream(codec, [], ids)) == codec.decode(ids)


@pytest.mark.parametrize("chunk", [2, 5, 16])
def test_pushing_ids_together_gives_each_ids_text_in_turn(native_codec, chunk):
    """Detokenizer.push of several ids (the decode loop's call for a
    stream's held tokens) is push_token of each in turn: the same text, and
    the detokenizer left in the same state (the next deltas and the flush
    alike), multi-byte characters split across the chunks included."""
    rng = np.random.default_rng(1)
    samples = [native_codec.tokenizer(text, add_special_tokens=False)["input_ids"]
               for text in TEXTS] + [rng.integers(0, 49152, size=48).tolist() for _ in range(10)]
    prompt_ids = native_codec.encode("Say something:")
    for ids in samples:
        one, many = native_codec.detokenizer(prompt_ids), native_codec.detokenizer(prompt_ids)
        for start in range(0, len(ids), chunk):
            part = ids[start:start + chunk]
            assert many.push(np.asarray(part)) == "".join(map(one.push_token, part))
            assert (many.window_start, many.emitted_end) == (one.window_start, one.emitted_end)
        assert many.flush() == one.flush()


def test_decode_equals_the_tokenizers_own_decode(native_codec):
    """codec.decode calls the Rust tokenizer directly; the text must be what
    transformers' decode gives, special tokens and random ids included."""
    codec = native_codec
    assert codec.backend is not None  # SmolLM2's tokenizer takes the direct path
    rng = np.random.default_rng(1)
    special = list(codec.tokenizer.all_special_ids)
    for _ in range(50):
        ids = rng.integers(0, 49152, size=int(rng.integers(1, 30))).tolist()
        ids.insert(int(rng.integers(0, len(ids))), special[int(rng.integers(0, len(special)))])
        assert codec.decode(ids) == codec.tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_not_emitted(codec):
    ids = codec.tokenizer("Bye", add_special_tokens=False)["input_ids"] + [codec.end_id]
    assert "".join(stream(codec, [], ids)) == "Bye"


def test_chat_template_is_applied(codec):
    plain, chat = codec.encode("Hi"), codec.encode("Hi", chat=True)
    assert len(chat) > len(plain)
    assert codec.tokenizer.decode(chat).rstrip().endswith("assistant")
    with pytest.raises(ValueError, match="text_input must be a non-empty string"):
        codec.encode("")


def test_a_template_failing_on_a_variable_is_the_clients(native_codec):
    """A chat template variable the template cannot use (an int where it
    iterates: a TypeError) is InvalidRequest led by chat_template_kwargs;
    the names transformers gives the template itself are no variables
    (read once per codec)."""
    tokenizer = copy.deepcopy(native_codec.tokenizer)
    tokenizer.chat_template = "{% for tag in tags %}#{{ tag }}{% endfor %}{{ messages[0].content }}"
    codec, turns = TextCodec(tokenizer), [{"role": "user", "content": "hi"}]
    assert codec.tokenizer.decode(codec.encode_chat(turns, variables={"tags": ["a"]})) == "#ahi"
    with pytest.raises(InvalidRequest, match=r"^chat_template_kwargs: .*TypeError.*not iterable"):
        codec.encode_chat(turns, variables={"tags": 1})
    assert codec.template_arguments is codec.template_arguments
    assert {"messages", "raise_exception", "strftime_now", "tools", "tokenize"} <= \
        codec.template_arguments


def test_tokenize_keeps_the_last_tokens_and_the_added_special_ones(native_codec):
    """keep: transformers' truncation from the left (vLLM's): the tokens the
    tokenizer adds (here a BOS and an EOS) stay, the text's first go; a
    keep under the added tokens' count, the last keep ids."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = copy.deepcopy(native_codec.tokenizer)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A <|im_end|>", special_tokens=[("<|endoftext|>", 0), ("<|im_end|>", 2)])
    codec = TextCodec(tokenizer)
    text = codec.tokenize("<|im_start|>The capital of France", add_special_tokens=False)
    assert text[0] == 1 and codec.tokenize("<|im_start|>The capital of France") == [0, *text, 2]
    for keep, expected in ((100, [0, *text, 2]), (len(text) + 2, [0, *text, 2]),
                           (4, [0, *text[-2:], 2]), (2, [0, 2]), (1, [2])):
        assert codec.tokenize("<|im_start|>The capital of France", keep=keep) == expected, keep
    # a special token written in the text is text: it goes first
    assert codec.tokenize("<|im_start|>The capital of France", False, keep=3) == text[-3:]


def stop_stream(codec, text, stop_words):
    """Feed `text` token by token through detokenizer and stop matcher."""
    matcher = StopMatcher(stop_words)
    detokenizer = codec.detokenizer()
    emitted, stopped = [], False
    for token in codec.tokenizer(text, add_special_tokens=False)["input_ids"]:
        delta, stopped = matcher.feed(detokenizer.push([token]))
        emitted.append(delta)
        if stopped:
            break
    if not stopped:
        emitted.append(matcher.feed(detokenizer.flush())[0] + matcher.flush())
    return emitted, stopped


def test_stop_word_split_across_tokens(codec):
    text = "The answer is 42.\n###Instruction: more"
    ids = codec.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert not any("###Instruction" in codec.decode([t]) for t in ids)  # split over tokens
    emitted, stopped = stop_stream(codec, text, ["###Instruction"])
    assert stopped and "".join(emitted) == "The answer is 42.\n"
    # The '#' characters were held back, never emitted ahead of the decision.
    assert all("#" not in delta for delta in emitted)


def test_stop_word_prefix_is_released_when_it_does_not_complete(codec):
    emitted, stopped = stop_stream(codec, "one ## two ###three", ["###x"])
    assert not stopped and "".join(emitted) == "one ## two ###three"


def test_earliest_stop_word_wins():
    matcher = StopMatcher(["cd", "b"])
    assert matcher.feed("abcd") == ("a", True)
    assert matcher.feed("more") == ("", True)


@pytest.mark.parametrize("include", [False, True])
def test_the_stop_word_met_first_wins_however_the_text_is_split(include):
    """The word that ends first (then begins first) wins: what a stream fed a
    character at a time meets first, so the answer does not depend on how
    tokens split the text; with include (vLLM's include_stop_str_in_output)
    the text keeps it."""
    matcher = StopMatcher(["cd", "bcx", "bc"], include=include)
    assert matcher.feed("ab") == ("a", False)  # "b" may still begin one
    assert matcher.matched is None
    assert matcher.feed("cd") == ("bc" if include else "", True)  # "bc" ends first
    assert matcher.feed("more") == ("", True) and matcher.matched == "bc"  # vLLM's stop_reason
    assert StopMatcher(["abcd", "c"], include=include).feed("abcd") == \
        ("abc" if include else "ab", True)
    rng = random.Random(3)
    for _ in range(300):
        words = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 3)))
                 for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("abcd") for _ in range(12))

        def run(pieces):
            stream = StopMatcher(words, include=include)
            out = []
            for piece in pieces:
                emitted, stopped = stream.feed(piece)
                out.append(emitted)
                if stopped:
                    return "".join(out), True
            return "".join(out) + stream.flush(), False

        cuts = sorted(rng.sample(range(1, len(text)), 3))
        split = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        assert run([text]) == run(list(text)) == run(split), (words, text)


def test_stop_matcher_holds_only_possible_prefixes():
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("aS") == ("a", False)
    assert matcher.feed("T") == ("", False)
    assert matcher.feed("x") == ("STx", False)
    assert matcher.flush() == ""


def test_text_fed_unarmed_ends_no_stop_word_but_may_begin_one():
    """min_tokens' text (fed unarmed) ends no stop string; one that begins
    there and ends in later text stops the stream, as vLLM checks only the
    text past min_tokens for a stop string's end."""
    whole = StopMatcher(["ab"])
    assert whole.feed("ab", armed=False) == ("ab", False)
    assert whole.feed("xab") == ("x", True)
    spanning = StopMatcher(["abc"])
    assert spanning.feed("ab", armed=False) == ("", False)  # a possible prefix: held
    assert spanning.feed("c") == ("", True)
    held = StopMatcher(["bc"], include=True)
    assert held.feed("abc", armed=False) == ("abc", False)
    assert held.feed("dbc") == ("dbc", True)


def test_bad_words_ids(codec):
    ids = codec.words_ids(["Paris", " Paris"])
    assert [codec.decode(i) for i in ids] == ["Paris", " Paris"]
    with pytest.raises(ValueError, match="bad_words must be non-empty strings"):
        codec.words_ids([""])
    with pytest.raises(ValueError, match="stop_words must be non-empty strings"):
        StopMatcher([3])


def test_vllms_bad_words_are_also_banned_after_a_space(native_codec):
    """vLLM's rule (SamplingParams.update_from_tokenizer): the word with its
    leading spaces stripped, and after one space where that form is as many
    tokens and starts with another one; each word once."""
    words = lambda *given: [native_codec.decode(ids)  # noqa: E731
                            for ids in native_codec.words_ids(given, spaced=True)]
    assert words("Paris") == words("  Paris") == ["Paris", " Paris"]
    assert words("hello world") == ["hello world", " hello world"]
    assert words("Paris", "Paris", "London") == ["Paris", " Paris", "London", " London"]
    alone, after_space = (native_codec.words_ids([text]) for text in ("123", " 123"))
    assert len(alone[0]) != len(after_space[0]) and words("123") == ["123"]
    assert native_codec.words_ids(["  Paris"]) != native_codec.words_ids(["Paris"])  # TRT-LLM's
    with pytest.raises(ValueError, match="bad_words must each be at least one token"):
        native_codec.words_ids(["\n"], spaced=True)
    with pytest.raises(ValueError, match="at most 128 words once encoded"):
        native_codec.words_ids([f"w{i}" for i in range(65)], spaced=True)
    assert len(native_codec.words_ids([f"w{i}" for i in range(64)], spaced=True)) == 128


def test_tensorrt_llms_stop_words_match_the_ids_the_prompt_included():
    """Each word encoded alone; the sequence's ids, prompt included, ending
    with a word's end the generation (TensorRT-LLM's stop criterion reads
    the sequence's ids: a word may begin in the prompt)."""
    from fakes import FakeTokenizer

    codec = TextCodec(FakeTokenizer())
    ids = lambda text: codec.words_ids([text])[0]  # noqa: E731 - one letter, one id
    begun = StopMatcher.of(codec, ["bc", "xyz"], as_tokens=True, prompt_ids=ids("ab"))
    assert begun.feed_token(ids("c")[0]) == "bc"
    later = StopMatcher.of(codec, ["xyz"], as_tokens=True, prompt_ids=ids("ab"))
    assert [later.feed_token(i) for i in ids("axyz")] == [None, None, None, "xyz"]
    short = StopMatcher.of(codec, ["fgh"], as_tokens=True, prompt_ids=ids("a"))
    assert [short.feed_token(i) for i in ids("fgh")] == [None, None, "fgh"]  # a short tail
    assert len(later.tail) == 3  # only the longest word's length is kept
    assert StopMatcher.of(codec, ["xyz"]).stop_words == ["xyz"]  # vLLM's: text


def test_documents_reach_a_retrieval_augmented_template(native_codec):
    """vLLM's documents are the template's ``documents`` (transformers'
    apply_chat_template argument); a template without them ignores them."""
    rag = copy.copy(native_codec)
    rag.tokenizer = copy.copy(native_codec.tokenizer)
    rag.tokenizer.chat_template = ("{% for d in documents %}[{{ d.title }}: {{ d.text }}]"
                                   "{% endfor %}{{ messages[0].content }}")
    turns = [{"role": "user", "content": "Hi"}]
    documents = [{"title": "a", "text": "x"}, {"title": "b", "text": "y"}]
    assert rag.render_chat(turns, False, documents=documents) == "[a: x][b: y]Hi"
    assert native_codec.render_chat(turns, documents=documents) == native_codec.render_chat(turns)
