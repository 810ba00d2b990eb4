"""The capacity function with exact numbers: what one request may need, per label."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbank.capacity import (
    CapacityModel,
    RequestShape,
    count_pages,
    output_budget,
    refusal,
    worst_case,
)
from kvbank.modelpool import KvSlot

TEXT = {"main": KvSlot(prompt=1, output=1)}


def make_model(slots=None, page_size=16, max_seq_len=8192, max_tokens=2048, spec=1):
    return CapacityModel(slots or TEXT, page_size, max_seq_len, max_tokens, spec)


class TestCountPages:
    def test_the_seed_repro_request_is_seventy_pages(self) -> None:
        # 944 prompt + 160 output + 1 speculative = 1105 tokens -> ceil(1105 / 16) = 70.
        count = count_pages(make_model(max_seq_len=4096), RequestShape(944, 160))
        assert count.per_label == {"main": 70}
        assert count.total == 70
        assert count.output_tokens == 160

    def test_no_max_tokens_gets_the_model_limit_not_zero(self) -> None:
        count = count_pages(make_model(max_tokens=1024), RequestShape(100, None))
        assert count.output_tokens == 1024
        assert count.tokens_per_label == {"main": 100 + 1024 + 1}
        assert count.total == 71  # ceil(1125 / 16)

    def test_decode_is_capped_at_max_seq_len_plus_the_speculative_step(self) -> None:
        count = count_pages(make_model(), RequestShape(8000, 2048))
        assert count.output_tokens == 192
        assert count.tokens_per_label == {"main": 8193}
        assert count.total == 513

    def test_a_models_own_count_past_max_seq_len_is_reserved_whole(self) -> None:
        model = make_model(max_seq_len=1024, max_tokens=512)
        count = count_pages(model, RequestShape(100, 512, extra_tokens={"main": 4000}))
        # output is capped by positions (1024 - 100 prompt), never by the image tokens
        assert count.output_tokens == 512
        assert count.tokens_per_label == {"main": 100 + 4000 + 512 + 1}
        assert count.total == 289

    def test_image_request_counts_every_label(self) -> None:
        slots = {
            "main": KvSlot(1, 1),
            "cfg_text": KvSlot(1, 1),
            "cfg_img": KvSlot(1, 1),
        }
        image = RequestShape(300, 1100, extra_tokens={"main": 1024, "cfg_img": 1024})
        count = count_pages(make_model(slots, max_tokens=4096), image)
        assert count.per_label == {"main": 152, "cfg_text": 88, "cfg_img": 152}
        assert count.total == 392

    def test_a_text_request_writes_only_its_labels(self) -> None:
        slots = {"main": KvSlot(1, 1), "cfg_text": KvSlot(1, 1), "cfg_img": KvSlot(1, 1)}
        chat = RequestShape(300, 512, labels=frozenset({"main"}))
        assert count_pages(make_model(slots), chat).per_label == {"main": 51}

    def test_fixed_encoder_window_and_decoder_stream(self) -> None:
        slots = {"decoder": KvSlot(prompt=1, output=1), "cross": KvSlot(fixed=1500)}
        model = make_model(slots, max_seq_len=448, max_tokens=444)
        count = count_pages(model, RequestShape(4, 440))
        assert count.per_label == {"decoder": 28, "cross": 94}  # 445 and 1500 tokens
        assert count.total == 122

    def test_cached_pages_are_subtracted_from_the_need(self) -> None:
        count = count_pages(make_model(max_seq_len=4096), RequestShape(944, 160), cached_pages=59)
        assert (count.total, count.cached, count.need) == (70, 59, 11)

    def test_cached_pages_never_exceed_the_request(self) -> None:
        count = count_pages(make_model(), RequestShape(16, 1), cached_pages=500)
        assert count.need == 0

    def test_output_budget(self) -> None:
        model = make_model(max_seq_len=100, max_tokens=50)
        assert output_budget(model, 10, None) == 50
        assert output_budget(model, 80, None) == 20
        assert output_budget(model, 100, 5) == 0


class TestWorstCase:
    def test_text_model_worst_case_fills_max_seq_len(self) -> None:
        shape, count = worst_case(make_model())
        assert count.total == 513
        assert shape.prompt_tokens + shape.max_tokens == 8192

    def test_prompt_heavy_label_puts_the_worst_case_at_the_longest_prompt(self) -> None:
        model = make_model({"main": KvSlot(prompt=3, output=1)}, max_seq_len=1000, max_tokens=500)
        _, count = worst_case(model)
        # the longest prompt, 999 tokens and one output token: 3 x 999 + 1 + 1 = 2999 tokens
        assert count.total == 188
        assert count_pages(model, RequestShape(999, 1)).total == 188

    @settings(max_examples=60, deadline=None)
    @given(
        slots=st.dictionaries(
            st.sampled_from(["a", "b", "c"]),
            st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(0, 50)).filter(any),
            min_size=1,
        ),
        page_size=st.sampled_from([1, 4, 16]),
        max_seq_len=st.integers(2, 120),
        max_tokens=st.integers(1, 130),
        spec=st.integers(0, 3),
    )
    def test_worst_case_is_the_true_maximum(self, slots, page_size, max_seq_len, max_tokens, spec):
        model = make_model(
            {k: KvSlot(*v) for k, v in slots.items()},
            page_size,
            max_seq_len,
            min(max_tokens, max_seq_len - 1),
            spec,
        )
        _, count = worst_case(model)
        brute = max(
            count_pages(model, RequestShape(p, o)).total
            for p in range(1, max_seq_len)
            for o in range(1, model.max_tokens + 1)
        )
        assert count.total == brute


class TestRefusal:
    def test_a_holdable_request_is_not_refused(self) -> None:
        assert refusal(make_model(max_seq_len=4096), RequestShape(944, 160), 96) is None

    def test_message_names_pages_pool_and_the_largest_max_tokens(self) -> None:
        refused = refusal(make_model(max_seq_len=4096), RequestShape(944, 1000), 96)
        assert refused is not None
        message = refused.message
        assert (refused.param, refused.pages, refused.usable_pages) == ("max_tokens", 122, 95)
        assert (refused.max_tokens_fit, refused.pool_pages_needed) == (575, 123)
        # 944 + 1000 + 1 = 1945 tokens = 122 pages; 95 usable pages hold 1520 tokens
        assert "needs 122 KV pages" in message
        assert "holds 95 pages" in message
        assert "lower max_tokens to at most 575" in message  # 944 + 575 + 1 = 1520
        assert "at least 123 pages" in message
        assert count_pages(make_model(), RequestShape(944, 575)).total == 95
        assert count_pages(make_model(), RequestShape(944, 576)).total == 96

    def test_a_prompt_too_big_for_the_pool_says_to_shorten_it(self) -> None:
        refused = refusal(make_model(), RequestShape(2000, 10), 96)
        assert refused is not None and "shorten the prompt" in refused.message
        assert refused.param == "prompt" and refused.max_tokens_fit is None


@pytest.mark.parametrize("pages", [0, -1])
def test_count_pages_of_nothing(pages: int) -> None:
    count = count_pages(make_model(), RequestShape(0, 1), cached_pages=max(pages, 0))
    assert count.total == 1  # one output token and one speculative token


def test_worst_case_at_page_size_one_and_a_million_positions_is_exact() -> None:
    # prompt-heavy: the longest prompt wins; 2 x 1048575 + 1 + 1 tokens at one token a page
    model = make_model({"main": KvSlot(2, 1)}, 1, 1 << 20, 1 << 19, 1)
    shape, count = worst_case(model)
    assert count.total == 2 * ((1 << 20) - 1) + 2
    assert shape.prompt_tokens == (1 << 20) - 1
