"""The suite cleans up what its own daemons left, and nothing of anyone else's (``conftest._remove_staging_dirs``)."""

from mounting import staging_of

from aiturbofs.node._paths import default_staging_dir


def test_only_staging_named_after_a_state_dir_of_the_test_is_its_own(tmp_path):
    """A staging tmpfs another test session (or a daemon of the machine)
    mounted while a test ran was taken for a leak of the test's and
    unmounted under that daemon: its staged bytes were gone."""
    mine = tmp_path / "node0-state"
    deep = tmp_path / "a" / "b" / "state"
    too_deep = tmp_path / "a" / "b" / "c" / "d" / "state"
    for d in (mine, deep, too_deep):
        d.mkdir(parents=True)
    other = default_staging_dir("/var/lib/aiturbo/someone-elses")
    candidates = {default_staging_dir(str(mine)), default_staging_dir(str(deep)), default_staging_dir(str(too_deep)),
                  other}
    assert staging_of(candidates, [str(tmp_path)]) == {default_staging_dir(str(mine)), default_staging_dir(str(deep))}
    assert staging_of({other}, [str(tmp_path)]) == set()
    assert staging_of(set(), [str(tmp_path)]) == set()
    assert staging_of(candidates, []) == set()  # a test without a temporary directory owns none
