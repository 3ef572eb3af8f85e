"""One way to wait for saves that name no key: the store's key count grows, then goes quiet."""

from kvtool.store.admin import wait_for_quiet_key_count


class CountingAdmin:
    """A store whose key count follows a script, one value per call, then stays at the last."""

    def __init__(self, counts):
        self._counts = list(counts)

    def key_count(self):
        return self._counts.pop(0) if len(self._counts) > 1 else self._counts[0]


def test_it_waits_for_growth_then_quiet():
    admin = CountingAdmin([5, 5, 5, 7, 9, 9])
    assert wait_for_quiet_key_count(admin, timeout_s=30, quiet_s=0.05, above=5, poll_s=0.001) == (9, True)


def test_without_growth_it_gives_up_with_the_last_count():
    admin = CountingAdmin([5])
    assert wait_for_quiet_key_count(admin, timeout_s=0.05, quiet_s=0.01, above=5, poll_s=0.001) == (5, False)


def test_without_a_floor_quiet_is_enough():
    admin = CountingAdmin([3, 4, 4])
    assert wait_for_quiet_key_count(admin, timeout_s=30, quiet_s=0.02, poll_s=0.001) == (4, True)
