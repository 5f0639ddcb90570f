"""A stand-in for Ray on the GPU machine (no Ray wheel travels: too large). levanter imports
ray at module level; the single-process benches never call it. Any use raises."""


class _Absent:
    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        if len(a) == 1 and callable(a[0]) and not k:
            return a[0]  # bare @ray.remote
        return _Absent()

    def __getattr__(self, name):
        return _Absent()


def remote(*a, **k):
    if len(a) == 1 and callable(a[0]) and not k:
        return a[0]
    return lambda f: f


def is_initialized():
    return False


def __getattr__(name):
    return _Absent()
