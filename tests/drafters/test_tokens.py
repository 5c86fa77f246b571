from drafters.common.tokens import cut_at_end


def test_cut_at_first_end_token_inclusive() -> None:
    assert cut_at_end([5, 7, 2, 9, 2], {2}) == ([5, 7, 2], True)
    assert cut_at_end([5, 7, 3, 9], {2, 3}) == ([5, 7, 3], True)
    assert cut_at_end([5, 7], {2}) == ([5, 7], False)
    assert cut_at_end([], {2}) == ([], False)
    assert cut_at_end([2], ()) == ([2], False)
