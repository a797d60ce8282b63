"""n-gram prompt lookup (speculative/ngram.py), the baseline with no draft model: what it proposes.
The decoder with it (greedy equality, lossless sampling): tests/speculative/test_decoder.py."""

import pytest


def test_ngram_propose_follows_vllms_longest_suffix_earliest_match():
    from verinfer.speculative.ngram import NgramDraft, propose

    assert propose([1, 2, 3, 4, 2, 3], 2, 3, 4) == [4, 2, 3]  # vLLM's docstring example
    assert propose([1, 2, 3, 1, 2, 3, 1, 2], 1, 3, 3) == [3, 1, 2]  # longest (3), earliest occurrence
    assert propose([9, 1, 2, 8, 1, 2, 7, 2], 1, 3, 2) == [8, 1]  # only n = 1 matches: its earliest one
    assert propose([5, 6, 7], 1, 2, 2) == [] and propose([5, 6, 5, 6], 3, 3, 2) == []
    with pytest.raises(ValueError, match="min_n"):
        NgramDraft(3, 2)
