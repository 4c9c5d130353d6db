"""The one error type for input a user can fix: a config field, a data, model or checkpoint file.

`InputError` is a `ValueError`, so library callers that catch ValueError keep working. Its
message names what to change (the dotted config field or the file) and how; the CLIs
(train.py, plan.py) print that message alone and exit non-zero, where any other exception is a
crash and keeps its traceback.
"""


class InputError(ValueError):
    """Bad input a user can fix; the message names the field or file and what to do."""
