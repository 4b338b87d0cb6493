"""ModelRunner hands a plain decode step's logits back as they are only when every row is
picked in order; any other pick goes through index_select."""

import numpy as np

from tpserve.engine.runner import every_row


def test_every_row_only_for_the_identity_pick() -> None:
    assert every_row(np.arange(16), 16)
    assert every_row([], 0)
    assert not every_row(np.arange(3), 4)  # a padded batch: rows past the requests
    assert not every_row(np.array([1, 0]), 2)  # out of order
    assert not every_row(np.array([0, 0]), 2)  # repeated
    assert not every_row(np.arange(4).reshape(2, 2), 4)
