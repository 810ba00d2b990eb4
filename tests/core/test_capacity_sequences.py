"""n sequences from one prompt: the capacity function counts the prompt's shared pages once and,
n times, the pages each sequence writes itself; the peak shape bounds the n rows growing at once;
a group the pool can never hold names `n` when fewer sequences would fit."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbank.capacity import (
    CapacityModel,
    RequestShape,
    count_pages,
    group_tokens,
    label_growth,
    pages_for,
    refusal,
    shared_prompt_pages,
)
from kvbank.ledger import peak_shape
from kvbank.modelpool import KvSlot

TEXT = {"main": KvSlot(prompt=1, output=1)}


def make_model(slots=None, page_size=16, max_seq_len=8192, max_tokens=2048, spec=1):
    return CapacityModel(slots or TEXT, page_size, max_seq_len, max_tokens, spec)


class TestCount:
    def test_one_sequence_counts_as_before(self) -> None:
        model = make_model(max_seq_len=4096)
        assert count_pages(model, RequestShape(944, 160, sequences=1)).total == 70
        assert shared_prompt_pages(model, RequestShape(944, 160)) == 0

    def test_the_full_prompt_pages_are_counted_once(self) -> None:
        # 100 prompt tokens at page 16: 6 full pages, the 7th holds tokens 96..99. One sequence
        # writes 100 + 50 + 1 = 151 tokens = 10 pages; the 6 full prompt pages are shared, each
        # of the 4 sequences writes the other 4 itself: 6 + 4 x 4 = 22, not 4 x 10 = 40.
        model = make_model()
        shape = RequestShape(100, 50, sequences=4)
        assert shared_prompt_pages(model, shape) == 6
        count = count_pages(model, shape)
        assert count.per_label == {"main": 22}
        assert count.tokens_per_label == {"main": 151}  # what one sequence writes
        assert count.output_tokens == 50

    def test_a_page_aligned_prompt_shares_all_but_its_last_page(self) -> None:
        # 64 tokens = 4 full pages; each sequence computes the last prompt token itself (its
        # logits give its first token), so the page holding it is each sequence's own copy:
        # 3 shared + 3 x (ceil((64 + 10 + 1) / 16) - 3) = 3 + 3 x 2 = 9.
        model = make_model()
        shape = RequestShape(64, 10, sequences=3)
        assert shared_prompt_pages(model, shape) == 3
        assert count_pages(model, shape).total == 9

    def test_a_prompt_within_one_page_shares_nothing(self) -> None:
        count = count_pages(make_model(), RequestShape(10, 5, sequences=3))
        assert count.total == 3  # ceil(16 / 16) = 1 page each

    def test_labels_not_keyed_by_the_prompt_are_never_shared(self) -> None:
        slots = {"main": KvSlot(1, 1), "audio": KvSlot(2, 1)}
        model = make_model(slots)
        shape = RequestShape(100, 50, sequences=2)
        assert shared_prompt_pages(model, shape) == 0
        one = count_pages(model, replace(shape, sequences=1))
        assert one.per_label == {"main": 10, "audio": 16}
        assert count_pages(model, shape).per_label == {"main": 20, "audio": 32}

    def test_image_tokens_make_a_group_count_whole_copies(self) -> None:
        shape = RequestShape(100, 50, extra_tokens={"main": 64}, sequences=2)
        assert shared_prompt_pages(make_model(), shape) == 0
        assert count_pages(make_model(), shape).total == 2 * pages_for(100 + 64 + 51, 16)


class TestPeakShape:
    def test_a_group_shape_ends_exactly_at_the_reservation(self) -> None:
        model = make_model()
        shape = RequestShape(100, 50, sequences=4)
        peak = peak_shape(model, shape)
        assert peak.pages == 22
        assert peak.worst == (22 * 16,)
        assert peak.per_output == (4,)  # four rows grow at once
        # 6 shared pages + 4 x (own prompt tokens 4 + 15 padding), at least the 6 + 4 pages held
        assert peak.base == (6 * 16 + 4 * (4 + 15),)
        assert peak.output_budget == 50

    def test_one_sequence_keeps_its_shape(self) -> None:
        model = make_model()
        growth, _ = label_growth(model, RequestShape(100, 50))
        assert (growth["main"].base, growth["main"].per_output, growth["main"].worst) == (
            100,
            1,
            151,
        )

    @settings(max_examples=300, deadline=None)
    @given(
        prompt=st.integers(1, 200),
        output=st.integers(1, 80),
        sequences=st.integers(2, 8),
        page=st.sampled_from([1, 2, 4, 16]),
        spec=st.integers(0, 2),
        data=st.data(),
    )
    def test_the_group_curve_bounds_its_sequences_pages_at_every_progress(
        self, prompt: int, output: int, sequences: int, page: int, spec: int, data: st.DataObject
    ) -> None:
        """Whatever each sequence wrote (some finished, with the pages they had), the pages of
        the group's tokens grown by n x rate are at least what its sequences hold then."""
        model = make_model(page_size=page, spec=spec, max_tokens=output)
        shape = RequestShape(prompt, output, sequences=sequences)
        count = count_pages(model, shape)
        shared = shared_prompt_pages(model, shape)
        worst = count.per_label["main"] * page
        per_seq_worst = count.tokens_per_label["main"]
        written = data.draw(
            st.lists(st.integers(prompt, per_seq_worst), min_size=sequences, max_size=sequences)
        )
        finished = data.draw(st.lists(st.booleans(), min_size=sequences, max_size=sequences))
        grow = data.draw(st.integers(0, output + spec))
        live = [w - shared * page for w, f in zip(written, finished, strict=True) if not f]
        done_pages = sum(
            pages_for(w, page) - shared for w, f in zip(written, finished, strict=True) if f
        )
        told = group_tokens(page, shared, worst, live, done_pages)
        base = peak_shape(model, shape).base[0]
        tokens = min(worst, max(told, base) + sequences * grow)
        held = shared + done_pages
        held += sum(pages_for(min(own + grow, per_seq_worst - shared * page), page) for own in live)
        assert pages_for(tokens, page) >= held
        assert pages_for(worst, page) == count.total


class TestRefusal:
    def test_a_group_that_fits_with_fewer_sequences_names_n(self) -> None:
        model = make_model()
        # 22 pages for 4 sequences (above); 6 + 3 x 4 = 18 for three fit a 20-page pool.
        refused = refusal(model, RequestShape(100, 50, sequences=4), 21)
        assert refused is not None
        assert refused.param == "n"
        assert refused.n_fit == 3
        assert "lower n to at most 3" in refused.message
        assert "4 sequences of 100 prompt tokens" in refused.message
        assert refusal(model, RequestShape(100, 50, sequences=3), 21) is None

    def test_a_sequence_that_never_fits_names_what_it_did_before(self) -> None:
        model = make_model()
        refused = refusal(model, RequestShape(400, 50, sequences=2), 21)
        assert refused is not None
        assert refused.param == "prompt"
        assert refused.n_fit is None

    @pytest.mark.parametrize("sequences", [2, 5])
    def test_the_refusal_pages_are_the_counts(self, sequences: int) -> None:
        model = make_model()
        shape = RequestShape(100, 50, sequences=sequences)
        refused = refusal(model, shape, 10)
        assert refused is not None
        assert refused.pages == count_pages(model, shape).total
