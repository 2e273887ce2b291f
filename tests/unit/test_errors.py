"""What a cell shows when a run fails survives a pickle: a node's agent raises these, and Ray carries them
to the kernel as pickles."""

from __future__ import annotations

import pickle

import cloudpickle
from hypothesis import given
from hypothesis import strategies as st

from taas_magic import errors

TEXT = st.text(max_size=40)
LINES = st.lists(TEXT, max_size=4)
MADE = st.one_of(
    st.builds(errors.TaasRunError, TEXT, LINES),
    st.builds(errors.RankFailed, TEXT, LINES, st.none() | st.dictionaries(st.integers(0, 64), TEXT, max_size=3)),
    st.builds(errors.RunTimedOut, TEXT, LINES),
    st.builds(errors.RunLost, TEXT),
    st.builds(errors.ForkServerDied, TEXT),
    st.builds(errors.DeliveryLost, TEXT),
    st.builds(errors.SessionEnded, TEXT, LINES, TEXT),
    st.builds(errors.RunInterrupted, LINES),
)


@given(error=MADE, dumps=st.sampled_from([pickle.dumps, cloudpickle.dumps]))
def test_every_run_error_comes_back_from_a_pickle_as_it_was_raised(error, dumps) -> None:
    back = pickle.loads(dumps(error))
    assert type(back) is type(error)
    assert str(back) == str(error) and back.args == error.args
    assert vars(back) == vars(error)
    assert back._render_traceback_() == error._render_traceback_()
