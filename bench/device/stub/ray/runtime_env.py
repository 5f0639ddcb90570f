def __getattr__(name):
    from ray import _Absent

    return _Absent
