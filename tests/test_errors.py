"""Messages that name long lists stay short."""

from ckptstore.errors import REASONS_SHOWN, listing, with_reasons


def test_a_warning_over_hundreds_of_unquantizable_tensors_names_a_few_and_counts_the_rest():
    reasons = {f"model/layer{i:03d}.weight": "too wide" for i in range(300)}
    text = with_reasons(reasons)
    assert text.count("too wide") == REASONS_SHOWN
    assert text.startswith("model/layer000.weight: too wide; model/layer001.weight")
    assert text.endswith(f" and {300 - REASONS_SHOWN} more")


def test_a_short_list_is_named_whole_without_a_count():
    assert with_reasons({"b": "y", "a": "x"}) == "a: x; b: y"
    assert listing(["a", "b"], 2) == "a, b"
